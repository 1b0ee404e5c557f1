"""The programs a MaxText user writes for the `tpu_models` workloads, with plain jax.

Every kind is `jax.jit(step, in_shardings, out_shardings, donate_argnums=0)` lowered inside
`jax.set_mesh(mesh)` and `nn.logical_axis_rules(rules)`, so the models' activation
constraints apply; the state and batch shardings come from the same rules applied to their
logical axis names. The rules (`RULES`) follow MaxText's: weights' 'embed' over fsdp (and
expert), 'heads'/'kv_heads'/'mlp'/'vocab' over tensor, 'exp' over expert; activations'
batch over data, fsdp and expert, their heads/mlp/vocab/embed over tensor. A kind is a mesh
shape plus, for zero1, a different placement of the optimizer moments:

- data_parallel: mesh {'data': N}; batch over data, everything else replicated.
- zero1: mesh {'data': N}; as data_parallel, but adam's moments split over data on their
  'embed' dimension (else their largest dimension data divides).
- fsdp: mesh {'fsdp': N}; params and moments split on 'embed', batch over fsdp.
- fsdp_tp: mesh {'fsdp': N/t, 'tensor': t}: fsdp plus tensor (Megatron) parallelism.
- expert_parallel (MoE): mesh {'fsdp': N/e, 'expert': e}: experts over 'expert', the batch
  over both axes, so the dispatch becomes an all-to-all.
- expert_tp (MoE): mesh {'fsdp': N/(e t), 'expert': e, 'tensor': t}.

A mesh axis that does not divide a state or batch dimension is dropped from that dimension
(replicated there), as jit refuses uneven input shardings; activations may be uneven.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils, topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from benchmarks.tpu_models import CONFIGS, is_names

KINDS: tuple[str, ...] = ("data_parallel", "zero1", "fsdp", "fsdp_tp", "expert_parallel",
                          "expert_tp")
MESH_AXES = {"data_parallel": ("data",), "zero1": ("data",), "fsdp": ("fsdp",),
             "fsdp_tp": ("fsdp", "tensor"), "expert_parallel": ("fsdp", "expert"),
             "expert_tp": ("fsdp", "expert", "tensor")}
TENSOR_SIZES = (2, 4, 8, 16)

# flax applies rules in order, each only where its mesh axes are still free in that array's
# spec: a name's later rules are its fallbacks (an expert stack [exp, embed, mlp] takes
# expert for 'exp' first, so its 'embed' falls back to fsdp alone).
RULES: tuple[tuple[str, str | tuple[str, ...]], ...] = (
    ("activation_exp", "expert"),
    ("activation_batch", ("data", "fsdp", "expert")),
    ("activation_batch", ("data", "fsdp")),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_kv", "tensor"),
    ("activation_embed", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("exp", "expert"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("embed", ("fsdp", "expert")),
    ("embed", "fsdp"),
)


def mesh_rules(axis_names: tuple[str, ...]) -> tuple:
    """`RULES` restricted to the mesh's axes; a rule left with no axis is dropped, so that
    the name's next rule may apply."""
    rules = []
    for name, axes in RULES:
        kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes)
                     if a in axis_names)
        if kept:
            rules.append((name, kept[0] if len(kept) == 1 else kept))
    return tuple(rules)


def expert_mesh(axes: dict[str, int], devices: list) -> Mesh:
    """A mesh of the given axis sizes (in order) over the first prod(sizes) of `devices`;
    over all of them, laid out on the physical topology as MaxText's create_device_mesh."""
    shape, n = tuple(axes.values()), math.prod(axes.values())
    if n > len(devices):
        raise ValueError(f"mesh {axes} needs {n} devices; {len(devices)} given")
    if n == len(devices):
        grid = mesh_utils.create_device_mesh(shape, list(devices),
                                             allow_split_physical_axes=True)
    else:  # a sub-slice has no physical layout to follow
        grid = np.array(devices[:n]).reshape(shape)
    return Mesh(grid, tuple(axes))


def tpu_devices(topology: str) -> list:
    """The compile-only devices of a TPU topology, e.g. 'v5e:2x4' or 'v5p:4x4x4'."""
    # Other processes on this machine may hold libtpu too; compiling needs no exclusivity.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)


def _fit(entry: Any, dim: int, sizes: dict[str, int]) -> Any:
    """The longest prefix of a spec entry's mesh axes whose product divides `dim`."""
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    while axes and dim % math.prod(sizes[a] for a in axes):
        axes = axes[:-1]
    return None if not axes else axes[0] if len(axes) == 1 else axes


def leaf_spec(names: tuple, shape: tuple[int, ...], rules: tuple,
              sizes: dict[str, int]) -> P:
    """The rules' spec for a leaf of these logical names, fitted to its shape."""
    spec = tuple(nn.logical_to_mesh_axes(names, rules)) if names else ()
    spec += (None,) * (len(shape) - len(spec))
    return P(*(_fit(e, d, sizes) for e, d in zip(spec, shape)))


def zero1_spec(names: tuple, shape: tuple[int, ...], sizes: dict[str, int]) -> P:
    """An optimizer moment split over 'data' on its 'embed' dimension, else on its largest
    dimension 'data' divides; replicated when none is."""
    order = [names.index("embed")] if "embed" in names else []
    order += sorted(range(len(shape)), key=lambda k: -shape[k])
    for k in order:
        if shape[k] % sizes["data"] == 0:
            return P(*("data" if j == k else None for j in range(len(shape))))
    return P()


def _shardings(names: Any, tree: Any, mesh: Mesh, spec: Callable) -> Any:
    """NamedShardings for `tree` from its names tree, spec(names, shape) per leaf."""
    return jax.tree.map(lambda n, leaf: NamedSharding(mesh, spec(n, tuple(leaf.shape))),
                        names, tree, is_leaf=is_names)


def state_shardings(kind: str, names: Any, state: Any, mesh: Mesh) -> Any:
    """The state's (params, opt_state) shardings as expert `kind` places them."""
    sizes = dict(mesh.shape)
    rules = mesh_rules(mesh.axis_names)
    by_rules = _shardings(names, state, mesh, lambda n, s: leaf_spec(n, s, rules, sizes))
    if kind != "zero1":
        return by_rules
    # ZeRO-1: params as the rules say (replicated on a data mesh), moments split.
    moments = _shardings(names[1], state[1], mesh, lambda n, s: zero1_spec(n, s, sizes))
    return by_rules[0], moments


def _check(kind: str, axes: dict[str, int]) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; known: {KINDS}")
    if tuple(axes) != MESH_AXES[kind]:
        raise ValueError(f"{kind} takes mesh axes {MESH_AXES[kind]}; given {tuple(axes)}")


def expert_program(step: Callable, state: Any, batch: Any, logical: tuple[Any, Any],
                   kind: str, axes: dict[str, int], devices: list) -> jax.stages.Lowered:
    """The expert's program for `step(state, batch) -> (state, loss)`, lowered (compile it
    to time the compiler). logical: (state names, batch names) as in `Workload.logical`;
    axes: mesh axis sizes (`sweep`); devices: a flat device list, e.g. a TPU topology's."""
    _check(kind, axes)
    mesh = expert_mesh(axes, devices)
    rules = mesh_rules(mesh.axis_names)
    sizes = dict(mesh.shape)
    state_sh = state_shardings(kind, logical[0], state, mesh)
    batch_sh = _shardings(logical[1], batch, mesh, lambda n, s: leaf_spec(n, s, rules, sizes))
    jitted = jax.jit(step, in_shardings=(state_sh, batch_sh),
                     out_shardings=(state_sh, NamedSharding(mesh, P())), donate_argnums=0)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        return jitted.lower(state, batch)


def _tensor_ok(cfg: dict[str, Any], t: int) -> bool:
    return all(cfg[k] % t == 0 for k in ("heads", "kv_heads", "mlp"))


def sweep(model_name: str, n_devices: int) -> list[tuple[str, dict[str, int]]]:
    """The (kind, mesh axis sizes) an expert would try for this model on n_devices: the
    pure data and fsdp meshes, every tensor size of `TENSOR_SIZES` dividing the devices and
    the heads, kv_heads and mlp; for MoE, expert sizes dividing the experts, alone and with
    a tensor axis."""
    cfg, n = CONFIGS[model_name], n_devices
    out: list[tuple[str, dict[str, int]]] = [
        ("data_parallel", {"data": n}), ("zero1", {"data": n}), ("fsdp", {"fsdp": n})]
    out += [("fsdp_tp", {"fsdp": n // t, "tensor": t}) for t in TENSOR_SIZES
            if t < n and n % t == 0 and _tensor_ok(cfg, t)]
    experts = cfg.get("experts", 1)
    if experts > 1:
        sizes = [e for e in (2, 4, 8, 16, 32, 64) if e <= experts and experts % e == 0
                 and n % e == 0]
        out += [("expert_parallel", {"fsdp": n // e, "expert": e}) for e in sizes]
        out += [("expert_tp", {"fsdp": n // (e * t), "expert": e, "tensor": t})
                for e in sizes[-2:] for t in TENSOR_SIZES[:2]
                if n % (e * t) == 0 and _tensor_ok(cfg, t)]
    return out
