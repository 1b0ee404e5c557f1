"""Per-device memory of a plan: a liveness walk over the program as XLA will buffer it.

What the walk assumes of XLA (each rule checked against `memory_analysis()` of compiled plans;
the rules that the program's equations do not show are in autopar.cost.xla.cpu, and
docs/decisions.md has the measurements):
- Chains of elementwise and layout operators fuse into their reader, so their results get no
  buffer of their own, unless a reader cannot fuse them (a dot, a convolution, a loop), the
  backward pass keeps them, or several operators read them. A transpose of a dot's result is
  the dot's own buffer; a scatter into zeros that a sum alone reads scatters into the sum,
  unless the sum reads it resharded.
- Arguments stay live for the whole step. The state is donated: a returned state that keeps its
  input's sharding reuses the input's buffer, after a copy where a reader of the old value is
  not ordered before the update. The copies are made first, and the input's buffer holds other
  buffers until the update. Other results are counted whole.
- An intermediate lives from its producer to its last reader; a fused reader reads at the end of
  its own fused chain. The steps that read only inputs run first (after the copies), the
  optimizer's as soon as their inputs are ready.
- A resharded operand costs, at the operator that needs it, its collectives' results
  (cost.resharding.reshard_sequence) and the result; a slice with no collective is made as soon
  as its value is, which is then freed unless read whole, and so is an activation resharded
  and transposed for the weight gradient. A dot or convolution whose dimensions XLA reorders
  costs a transposed copy of the operands it reorders.
- A recomputed layer keeps its forward results only as long as the forward pass reads them; the
  backward pass recomputes them when it first needs them.

The estimate is what the plan records (`plan.memory`): the peak, and what is live at the peak by
kind (parameters, optimizer state, other inputs, activations kept for the backward pass,
gradients, temporaries), with the largest buffers live then.
"""
from __future__ import annotations

import re
from typing import Any

from autopar.cost.estimate import MemoryEstimate
from autopar.cost.liveness import estimate
from autopar.cost.model import group_size, partial_split, shard_bytes
from autopar.cost.xla.buffers import BufferModel
from autopar.decisions import Decisions
from autopar.errors import AutoparError
from autopar.mesh import MeshShape
from autopar.rules.factors import Spec
from autopar.trace.analysis import edges, roles
from autopar.trace.ir import OpGraph

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """Bytes from a number or a string like '2GiB', '512 MB' or '1.5e9'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise AutoparError(f"memory_limit={value!r} must be positive. Fix: pass bytes or a "
                               "string like '2GiB'.")
        return int(value)
    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = match[2].lower() if match else ""
    if not match or unit not in _UNITS:
        raise AutoparError(f"memory_limit={value!r} is not understood. Fix: pass bytes or a "
                           "string like '2GiB', '512MiB' or '80GB'.")
    return parse_bytes(float(match[1]) * _UNITS[unit])


def operand_reshards(graph: OpGraph, decisions: Decisions) -> dict[tuple[int, int], Spec]:
    """(step, operand) -> the sharding the operand is resharded to, where it is."""
    produced = decisions.tensor_specs(graph)
    out = {}
    for i, step in enumerate(graph.program):
        for k, (t, need) in enumerate(zip(step.inputs, step.requires)):
            if need is not None:
                spec = decisions.ops[need[0]].in_specs[need[1]]
                if spec != produced.get(t):
                    out[(i, k)] = spec
    return out


def loop_body_collectives(graph: OpGraph, decisions: Decisions, mesh: MeshShape
                          ) -> tuple[dict[tuple[int, int], Spec], dict[int, int]]:
    """Inside loop bodies: (op, operand) -> the sharding the operand is resharded to, and
    each result reduce-scattered -> the devices it is scattered over (its partial sums are
    held whole until then)."""
    produced = decisions.tensor_specs(graph)
    reshards, scattered = {}, {}
    for k in {k for ids in graph.loop_ops.values() for k in ids}:
        op, strategy = graph.ops[k], decisions.ops[k]
        for j, (t, spec) in enumerate(zip(op.inputs, strategy.in_specs)):
            if t in produced and spec != produced[t]:
                reshards[(k, j)] = spec
        for t, spec in zip(op.outputs, strategy.out_specs):
            n = group_size(mesh, partial_split(strategy, spec)[0])
            if n > 1:
                scattered[t] = n
    return reshards, scattered


def kept_bytes(graph: OpGraph, decisions: Decisions, mesh: MeshShape) -> int:
    """The bytes per device `decisions` keep of the step's inputs, activations and gradients:
    the search's model of memory, additive over strategies (problem.Problem.kept prices the
    same tensors strategy by strategy), which a memory budget bounds exactly."""
    specs = decisions.tensor_specs(graph)
    return sum(int(shard_bytes(graph.tensors[t], specs[t], mesh)) for t in roles(graph)
               if not graph.tensors[t].const)


def plan_memory(graph: OpGraph, decisions: Decisions, mesh: MeshShape,
                model: BufferModel) -> MemoryEstimate:
    """The memory estimate of `decisions` (with their recomputed steps) as `model`'s compiler
    buffers them."""
    return estimate(graph, decisions.tensor_specs(graph), mesh, model,
                    operand_reshards(graph, decisions), decisions.recompute,
                    all_reduce_steps(graph, decisions, mesh),
                    loop_body_collectives(graph, decisions, mesh))


def all_reduce_steps(graph: OpGraph, decisions: Decisions, mesh: MeshShape
                     ) -> dict[int, tuple[str, ...]]:
    """Program step -> the mesh axes its result's partial sums are all-reduced over."""
    producer_step = edges(graph)[0]
    out = {}
    for op, strategy in zip(graph.ops, decisions.ops):
        if not strategy.partial_axes:
            continue
        for t, spec in zip(op.outputs, strategy.out_specs):
            axes = partial_split(strategy, spec)[1]
            if group_size(mesh, axes) > 1 and t in producer_step:
                out[producer_step[t]] = tuple(sorted(axes))
    return out


def memory_json(m: MemoryEstimate, model: BufferModel, limit: int | None = None
                ) -> dict[str, Any]:
    """The estimate as the plan records it, with the buffer model that made it."""
    out: dict[str, Any] = {"peak_bytes": m.peak_bytes, "at_peak": dict(m.at_peak),
                           "where": m.where, "largest": [list(x) for x in m.largest],
                           "buffer_model": model.name,
                           "timeline": [list(x) for x in m.timeline]}
    if limit is not None:
        out["limit_bytes"] = limit
    return out


