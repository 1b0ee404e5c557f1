"""Hand-written shardings, as an expert writes them: `jax.jit` with `in_shardings`,
`out_shardings` and the state donated, the specs coming from logical-axis rules (t5x, MaxText,
Flax's gemma example), and XLA's sharding propagation deciding everything in between.

Kinds (`KINDS`):
- data_parallel: the batch split over every mesh axis, everything else replicated.
- fsdp: ZeRO-3. The batch as above; every parameter and optimizer-state leaf split over every
  axis on its largest dimension they divide.
- megatron: tensor parallel over every axis by the model family's rules (`RULES`: column then
  row parallel for MLPs, heads for attention, vocabulary for the embedding, experts for MoE);
  the batch replicated.
- megatron_dp: the batch over the first axis, tensor parallel over the others (meshes of two
  or more axes).
- expert_parallel (MoE only): the experts over the last axis; the batch over every axis, the
  expert axis included, as MaxText's rules (`activation_batch` -> data, fsdp, expert) and
  GShard do, so that the dispatch becomes an all-to-all over that axis.

Optimizer state follows its parameter (the rules match mu/nu by the parameter's path); a rule
that does not divide its dimension leaves that tensor replicated, as `jax.jit` would refuse it.
A scanned stack's leaves have one more, leading, dimension than their rule: the layers, kept
whole (MaxText's default rule for its `layers` logical axis).
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from autopar.trace.tracer import path_to_str

M = "M"  # in a rule: the tensor-parallel axes

# Per model family, (regex over the leaf's path, a role per dimension): the tensor-parallel
# rules. Optimizer moments carry their parameter's path, so they match too.
ATTENTION = r"(MultiHeadDotProductAttention_0|self_attention|cross_attention)"
TRANSFORMER_RULES = [
    (rf"{ATTENTION}/(query|key|value)/kernel", (None, M, None)),  # heads
    (rf"{ATTENTION}/(query|key|value)/bias", (M, None)),
    (rf"{ATTENTION}/out/kernel", (M, None, None)),
    (r"mlp_in/kernel", (None, M)),  # column parallel
    (r"mlp_in/bias", (M,)),
    (r"mlp_out/kernel", (M, None)),  # row parallel
    (r"Embed_0/embedding", (M, None)),  # vocabulary
]
RULES: dict[str, list[tuple[str, tuple]]] = {
    "mlp": [(r"Dense_0/kernel", (None, M)), (r"Dense_0/bias", (M,)),
            (r"Dense_1/kernel", (M, None))],
    "transformer": TRANSFORMER_RULES,
    "moe": [(r"w_in", (M, None, None)), (r"w_out", (M, None, None))],  # experts
    # Output channels of the first convolution of a block, input channels of the last; a
    # bottleneck's 3x3 convolution is column parallel too (it needs all its input channels).
    "cnn": [(r"conv_in/kernel", (None, None, None, M)), (r"conv_in/bias", (M,)),
            (r"conv_mid/kernel", (None, None, None, M)), (r"conv_mid/bias", (M,)),
            (r"conv_out/kernel", (None, None, M, None))],
}
KINDS = ("data_parallel", "fsdp", "megatron", "megatron_dp", "expert_parallel")

Axes = tuple[str, ...]


def to_spec(dims: tuple[Axes, ...]) -> P:
    """A PartitionSpec from the axes of each dimension, trailing replicated ones dropped."""
    entries = [None if not d else d[0] if len(d) == 1 else d for d in dims]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _divides(size: int, axes: Axes, sizes: dict[str, int]) -> bool:
    return bool(axes) and size % math.prod(sizes[a] for a in axes) == 0


def batch_spec(shape: tuple[int, ...], axes: Axes, sizes: dict[str, int]) -> P:
    """The leading dimension over the longest prefix of `axes` that divides it: what a data
    loader can produce."""
    for k in range(len(axes), 0, -1):
        if shape and _divides(shape[0], axes[:k], sizes):
            return to_spec((axes[:k],))
    return P()


def rule_spec(path: str, shape: tuple[int, ...], rules: list, axes: Axes,
              sizes: dict[str, int]) -> P:
    """The first rule matching `path`, on `axes`; replicated where none matches or where the
    rule does not divide the tensor."""
    for pattern, roles in rules:
        if re.search(pattern, path) and len(shape) == len(roles) + 1:
            roles = (None, *roles)  # a scanned stack's layers
        if re.search(pattern, path) and len(roles) == len(shape):
            dims = tuple(axes if role == M else () for role in roles)
            if all(not d or _divides(n, d, sizes) for n, d in zip(shape, dims)):
                return to_spec(dims)
            return P()
    return P()


def largest_dim_spec(shape: tuple[int, ...], axes: Axes, sizes: dict[str, int]) -> P:
    """Split over all of `axes` on the largest dimension they divide (ZeRO-3)."""
    for k in sorted(range(len(shape)), key=lambda k: -shape[k]):
        if _divides(shape[k], axes, sizes):
            return to_spec(tuple(axes if j == k else () for j in range(len(shape))))
    return P()


def applies(kind: str, family: str, sizes: dict[str, int]) -> bool:
    """Whether an expert would write `kind` for this model family on this mesh."""
    axes = [a for a, s in sizes.items() if s > 1]
    if kind == "megatron_dp":
        return len(axes) >= 2
    if kind == "expert_parallel":
        return family == "moe" and bool(axes)
    if kind not in KINDS:
        raise ValueError(f"unknown expert {kind!r}; known: {KINDS}")
    return True


def leaf_spec(kind: str, family: str, path: str, shape: tuple[int, ...], is_batch: bool,
              sizes: dict[str, int]) -> P:
    """The spec expert `kind` writes for one leaf (`path` inside the state or the batch)."""
    axes = tuple(a for a, s in sizes.items() if s > 1)
    rules = RULES.get(family, [])
    if kind == "data_parallel":
        return batch_spec(shape, axes, sizes) if is_batch else P()
    if kind == "fsdp":
        return (batch_spec if is_batch else largest_dim_spec)(shape, axes, sizes)
    if kind == "megatron":
        return P() if is_batch else rule_spec(path, shape, rules, axes, sizes)
    if kind == "megatron_dp":
        return (batch_spec(shape, axes[:1], sizes) if is_batch
                else rule_spec(path, shape, rules, axes[1:], sizes))
    if kind == "expert_parallel":
        return (batch_spec(shape, axes, sizes) if is_batch
                else rule_spec(path, shape, RULES["moe"], axes[-1:], sizes))
    raise ValueError(f"unknown expert {kind!r}; known: {KINDS}")


def shardings(kind: str, family: str, tree: Any, mesh: Mesh, is_batch: bool) -> Any:
    """A NamedSharding for every leaf of `tree` (the state or the batch)."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))

    def one(keypath: tuple, leaf: Any) -> NamedSharding:
        spec = leaf_spec(kind, family, path_to_str(keypath), tuple(leaf.shape), is_batch, sizes)
        return NamedSharding(mesh, spec)
    return jax.tree_util.tree_map_with_path(one, tree)


def expert_step(step: Callable, kind: str, family: str, state: Any, batch: Any,
                mesh: Mesh) -> Any:
    """`step(state, batch) -> (state, loss)` jitted as expert `kind` writes it: inputs and
    outputs sharded by the rules, the state donated, XLA propagating the rest."""
    state_shardings = shardings(kind, family, state, mesh, is_batch=False)
    batch_shardings = shardings(kind, family, batch, mesh, is_batch=True)
    return jax.jit(step, in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, NamedSharding(mesh, P())),
                   donate_argnums=0)
