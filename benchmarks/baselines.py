"""Hand-written strategies, expressed as annotations on every input of the step.

What an expert writes with logical-axis rules (t5x, maxtext, levanter): a PartitionSpec per
parameter and per batch input, the rest left to the compiler. Here the rest is left to our
search under those pins, which gives each baseline the best operator strategies its input specs
allow: a baseline's estimated cost is a lower bound of what the same specs cost under XLA's own
propagation.

- data_parallel: the batch split over every mesh axis, everything else replicated.
- fsdp: the batch as above; every parameter and optimizer state split over every axis on its
  largest dimension they divide (ZeRO-3).
- megatron: tensor parallel over every axis by the model's rules (column then row parallel,
  heads, experts, vocabulary); the batch replicated.
- megatron_2d: the batch over the first axis, tensor parallel over the others.
"""
from __future__ import annotations

import math
import re
from typing import Sequence

from jax.sharding import PartitionSpec as P

from autopar.rules.factors import to_partition_spec

M = "M"  # in a rule: the tensor-parallel axes

# Per model family, (regex over the path, a role per dimension): the Megatron rules.
ATTENTION = r"(MultiHeadDotProductAttention_0|self_attention|cross_attention)"
TRANSFORMER_RULES = [
    (rf"{ATTENTION}/(query|key|value)/kernel", (None, M, None)),
    (rf"{ATTENTION}/(query|key|value)/bias", (M, None)),
    (rf"{ATTENTION}/out/kernel", (M, None, None)),
    (r"mlp_in/kernel", (None, M)),
    (r"mlp_in/bias", (M,)),
    (r"mlp_out/kernel", (M, None)),
    (r"Embed_0/embedding", (M, None)),
]
RULES = {
    "mlp": [(r"Dense_0/kernel", (None, M)), (r"Dense_0/bias", (M,)),
            (r"Dense_1/kernel", (M, None))],
    "transformer": TRANSFORMER_RULES,
    "moe": [(r"w_in", (M, None, None)), (r"w_out", (M, None, None))],
    "cnn": [(r"conv_in/kernel", (None, None, None, M)), (r"conv_in/bias", (M,)),
            (r"conv_out/kernel", (None, None, M, None))],
}
KINDS = ("data_parallel", "fsdp", "megatron", "megatron_2d")

Axes = tuple[str, ...]


def _fits(size: int, axes: Axes, sizes: dict[str, int]) -> bool:
    return bool(axes) and size % math.prod(sizes[a] for a in axes) == 0


def _batch_spec(shape: tuple[int, ...], axes: Axes, sizes: dict[str, int]) -> P:
    # The longest prefix of `axes` that divides the batch: what a data loader can produce.
    for k in range(len(axes), 0, -1):
        if shape and _fits(shape[0], axes[:k], sizes):
            return to_partition_spec((axes[:k],))
    return P()


def _rule_spec(path: str, shape: tuple[int, ...], rules: list, axes: Axes,
               sizes: dict[str, int]) -> P:
    for pattern, roles in rules:
        if re.search(pattern, path) and len(roles) == len(shape):
            dims = [axes if role == M else () for role in roles]
            if all(not d or _fits(n, d, sizes) for n, d in zip(shape, dims)):
                return to_partition_spec(tuple(dims))
            return P()  # the rule does not divide this tensor: an expert replicates it
    return P()


def _largest_dim_spec(shape: tuple[int, ...], axes: Axes, sizes: dict[str, int]) -> P:
    for k in sorted(range(len(shape)), key=lambda k: -shape[k]):
        if _fits(shape[k], axes, sizes):
            return to_partition_spec(tuple(axes if j == k else () for j in range(len(shape))))
    return P()


def baseline_annotations(kind: str, family: str, inputs: Sequence[tuple[str, tuple[int, ...]]],
                         mesh: dict[str, int]) -> list[tuple[str, P]] | None:
    """Exact-path annotations for every input under baseline `kind`; None where the baseline
    does not apply to this mesh (2D needs two axes)."""
    axes = tuple(a for a, s in mesh.items() if s > 1)
    if kind == "megatron_2d" and len(axes) < 2:
        return None
    out = []
    for path, shape in inputs:
        batch = path.startswith("batch/")
        if kind == "data_parallel":
            spec = _batch_spec(shape, axes, mesh) if batch else P()
        elif kind == "fsdp":
            spec = (_batch_spec(shape, axes, mesh) if batch
                    else _largest_dim_spec(shape, axes, mesh))
        elif kind == "megatron":
            spec = P() if batch else _rule_spec(path, shape, RULES[family], axes, mesh)
        elif kind == "megatron_2d":
            spec = (_batch_spec(shape, axes[:1], mesh) if batch
                    else _rule_spec(path, shape, RULES[family], axes[1:], mesh))
        else:
            raise ValueError(f"unknown baseline {kind!r}; known: {KINDS}")
        out.append((f"^{re.escape(path)}$", spec))
    return out
