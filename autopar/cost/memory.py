"""Per-device memory of a plan: a liveness walk over the program as XLA will buffer it.

- `plan_memory(graph, decisions, mesh, model)`: the `MemoryEstimate` of `decisions` (with
  their recomputed steps) as `model`'s compiler buffers them: the peak, what is live then by
  kind (parameters, optimizer state, other inputs, activations kept for the backward pass,
  gradients, temporaries), and the largest buffers.
- `memory_json(m, model, limit=None)`: the estimate as the plan records it (`plan.memory`).
- `kept_bytes(graph, decisions, mesh)`: the search's additive model of memory.
- `operand_reshards`, `loop_body_collectives`, `all_reduce_steps`: the reshardings and
  all-reduces the walk charges.
- `parse_bytes(value)`: bytes from a number or a string like '2GiB'; an AutoparError for a
  number that is not positive or a string it does not understand.

Design and rationale: docs/internals-steps.md, "autopar/cost/memory.py".
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
from autopar.trace.analysis import edges, per_graph, roles
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
    produced, ops = decisions.tensor_specs(graph), decisions.ops
    out = {}
    for i, k, t, (op, operand) in _required(graph):
        spec = ops[op].in_specs[operand]
        if spec != produced.get(t):
            out[(i, k)] = spec
    return out


@per_graph  # read by every memory estimate
def _required(graph: OpGraph) -> tuple[tuple[int, int, int, tuple[int, int]], ...]:
    """(step, operand, tensor, (op, its operand)) of every program step's operand whose
    sharding a planning op's strategy fixes (Equation.requires)."""
    return tuple((i, k, t, need) for i, step in enumerate(graph.program)
                 for k, (t, need) in enumerate(zip(step.inputs, step.requires))
                 if need is not None)


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


