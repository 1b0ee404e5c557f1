"""The Plan of a search's decisions: specs, per-operator costs, redistributions, memory."""
from __future__ import annotations

from typing import Any, Sequence

from autopar.cost.hardware import Hardware
from autopar.cost.memory import memory_json, plan_memory
from autopar.cost.model import (op_collectives, op_signature, op_time, reshard_collectives,
                                reshard_time, shard_bytes, value_facts)
from autopar.cost.xla import CPU, BufferModel
from autopar.mesh import MeshShape
from autopar.plan import Decisions, OpDecision, Plan, Redistribution, TensorPlan
from autopar.rules.factors import Spec, replicated
from autopar.trace.analysis import recomputed_layers, recomputed_ops
from autopar.trace.ir import OpGraph


def assemble(graph: OpGraph, decisions: Decisions, mesh: MeshShape, hw: Hardware, search: str,
             stats: dict, in_tree: Any = None, out_tree: Any = None,
             pinned: dict[int, Spec] | None = None, memory_limit: int | None = None,
             buffers: BufferModel = CPU) -> Plan:
    """The Plan of `decisions`: specs, per-op costs, redistributions and totals per device.

    `pinned` (the annotated tensors) marks the redistributions at annotations; `memory_limit`
    is recorded with the memory estimate, which `buffers` (the compiler's buffer model) makes.
    """
    tensors = graph.tensors
    pinned = pinned or {}
    specs = decisions.tensor_specs(graph)
    decisions_out = []
    moves: list[Redistribution] = []
    compute = comm = 0.0
    collective_bytes: dict[str, float] = {}

    def count(kinds: dict[str, float], times: int = 1) -> None:
        for kind, nbytes in kinds.items():
            collective_bytes[kind] = collective_bytes.get(kind, 0.0) + times * nbytes

    def name(t: int) -> str:
        return tensors[t].path or f"tensor {t}"

    # The time of a resharding is charged to every operator that needs it, as the search does
    # (an edge joins one producer and one user), so that the plan's cost is the search's
    # objective. Its bytes are counted once per tensor and spec: the lowering's constraints for
    # the users are equal and XLA merges them, and the bytes are compared with the compiled HLO.
    moved: set[tuple[int, Spec]] = set()
    recomputed = recomputed_ops(graph, decisions.recompute)
    recompute_s = 0.0
    # The same operator of every block costs alike: timed and counted once.
    known: dict[tuple, tuple[tuple[float, float], dict[str, float]]] = {}
    facts = value_facts(graph)
    for op, st in zip(graph.ops, decisions.ops):
        key = (op_signature(op, tensors, facts), st)
        if key not in known:
            known[key] = (op_time(op, st, tensors, mesh, hw, facts),
                          op_collectives(op, st, tensors, mesh))
        (c, m), collectives = known[key]
        if op.id in recomputed:  # runs twice: in the forward pass and again for the backward
            recompute_s += c
            c *= 2
        count(collectives)
        for i, (t, need) in enumerate(zip(op.inputs, st.in_specs)):
            if not tensors[t].const and t in specs and specs[t] != need:
                move = op.repeat * reshard_time(tensors[t], specs[t], need, mesh, hw)
                if (t, need) not in moved:
                    moved.add((t, need))
                    count(reshard_collectives(tensors[t], specs[t], need, mesh), op.repeat)
                m += move
                at_annotation = t in pinned or bool(set(op.outputs) & pinned.keys())
                moves.append(Redistribution(
                    f"operand {i} of {op.primitive} #{op.id} ({op.source})", name(t),
                    tensors[t].shape, specs[t], need, move, at_annotation))
        compute, comm = compute + c, comm + m
        decisions_out.append(OpDecision(
            op.id, op.primitive, op.source, tuple(tensors[t].shape for t in op.inputs),
            tuple(tensors[t].shape for t in op.outputs), st.in_specs, st.out_specs,
            st.partial_axes, c, m, op.scope, op.backward))
    out_specs = output_specs(graph, decisions, specs)
    for k, (t, final) in enumerate(zip(graph.outputs, out_specs)):
        spec = specs.get(t, replicated(len(tensors[t].shape)))
        if spec != final:  # the state, returned in the sharding it arrived in
            t_in = graph.inputs[graph.state_pairs[k]]
            move = reshard_time(tensors[t], spec, final, mesh, hw)
            count(reshard_collectives(tensors[t], spec, final, mesh))
            comm += move
            moves.append(Redistribution(f"returning the state {name(t_in)}", name(t),
                                        tensors[t].shape, spec, final, move, t_in in pinned))

    def tensor_plans(ids: Sequence[int], spec_list: Sequence[Spec]) -> tuple[TensorPlan, ...]:
        return tuple(TensorPlan(tensors[t].path or f"tensor {t}", tensors[t].shape,
                                tensors[t].dtype, s, int(shard_bytes(tensors[t], s, mesh)))
                     for t, s in zip(ids, spec_list))

    memory = plan_memory(graph, decisions, mesh, buffers)
    cost = {"compute_s": compute, "communication_s": comm, "total_s": compute + comm,
            "recompute_s": recompute_s, "peak_memory_bytes": memory.peak_bytes,
            **{f"{kind}_bytes": nbytes for kind, nbytes in sorted(collective_bytes.items())}}
    return Plan(tuple(zip(mesh.names, mesh.sizes)), search, hw.name,
                tensor_plans(graph.inputs, decisions.inputs),
                tensor_plans(graph.outputs, out_specs), tuple(decisions_out), cost, stats,
                tuple(moves), in_tree, out_tree, memory_json(memory, memory_limit, buffers),
                recomputed_layers(graph, decisions.recompute))


def output_specs(graph: OpGraph, decisions: Decisions,
                 specs: dict[int, Spec] | None = None) -> list[Spec]:
    """The sharding each output is returned in: its producer's, except the state, which is
    returned in the sharding it arrived in (`specs`: decisions.tensor_specs, if at hand)."""
    specs = decisions.tensor_specs(graph) if specs is None else specs
    out = []
    for k, t in enumerate(graph.outputs):
        if k in graph.state_pairs:
            out.append(decisions.inputs[graph.state_pairs[k]])
        else:
            out.append(specs.get(t, replicated(len(graph.tensors[t].shape))))
    return out
