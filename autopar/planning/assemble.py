"""The Plan of a search's decisions: specs, per-operator costs, redistributions, memory."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from autopar.cost.estimate import MemoryEstimate
from autopar.cost.facts import signature_ids, summed_pairs, value_facts
from autopar.cost.hardware import Hardware
from autopar.cost.memory import memory_json, plan_memory
from autopar.cost.model import op_collectives, op_time, partial_sum, shard_bytes
from autopar.cost.resharding import reshard_collectives, reshard_time
from autopar.cost.xla import BufferModel, buffer_model, reassociates_sums
from autopar.decisions import Decisions
from autopar.mesh import MeshShape
from autopar.plan import OpDecision, Plan, Redistribution, TensorPlan
from autopar.plan_stats import Cost, SearchStats
from autopar.rewrite.ticks import STAGE_AXIS
from autopar.rules.factors import Spec, replicated
from autopar.rules.kinds import SHIFTING
from autopar.trace.analysis import per_graph, recomputed_layers, recomputed_ops
from autopar.trace.ir import OpGraph


@dataclass(frozen=True)
class Tally:
    """What decisions cost per device, as the search counts it: time by part and the
    collective bytes by kind, and on demand the per-operator records and the redistributions
    (the budget weighs many tallies and writes up one)."""

    out_specs: list[Spec]
    compute_s: float
    communication_s: float
    recompute_s: float
    collective_bytes: dict[str, float]
    written: Callable[[], tuple[tuple[OpDecision, ...], tuple[Redistribution, ...]]] = field(
        repr=False, compare=False)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.communication_s

    @functools.cached_property
    def _records(self) -> tuple[tuple[OpDecision, ...], tuple[Redistribution, ...]]:
        return self.written()

    @property
    def ops(self) -> tuple[OpDecision, ...]:
        return self._records[0]

    @property
    def moves(self) -> tuple[Redistribution, ...]:
        return self._records[1]


@dataclass(frozen=True)
class Candidate:
    """A search's decisions with their cost and memory estimate, before they are written up
    as a Plan: the budget weighs many, and only the one kept becomes a Plan."""

    decisions: Decisions
    # The tally, made when first read: of the candidates a budget weighs, most of those that
    # do not fit are never timed (a pass over every operator each)
    tallied: Callable[[], Tally]
    memory: MemoryEstimate
    stats: SearchStats

    @property
    def tally(self) -> Tally:
        return self.tallied()

    @property
    def peak_bytes(self) -> int:
        return self.memory.peak_bytes


def tallying(graph: OpGraph, decisions: Decisions, mesh: MeshShape, hw: Hardware,
             pinned: dict[int, Spec] | None = None) -> Callable[[], Tally]:
    """`tally` of `decisions`, made on the first call and kept."""
    return functools.cache(lambda: tally(graph, decisions, mesh, hw, pinned))


def tally(graph: OpGraph, decisions: Decisions, mesh: MeshShape, hw: Hardware,
          pinned: dict[int, Spec] | None = None) -> Tally:
    """The cost of `decisions` per device; `pinned` (the annotated tensors) marks the
    redistributions at annotations."""
    out_specs, compute, comm, recompute_s, collective_bytes = _counted(
        graph, decisions, mesh, hw, pinned, None, None)

    def written() -> tuple[tuple[OpDecision, ...], tuple[Redistribution, ...]]:
        records: list[OpDecision] = []
        moves: list[Redistribution] = []
        _counted(graph, decisions, mesh, hw, pinned, records, moves)
        return tuple(records), tuple(moves)
    return Tally(out_specs, compute, comm, recompute_s, collective_bytes, written)


def _counted(graph: OpGraph, decisions: Decisions, mesh: MeshShape, hw: Hardware,
             pinned: dict[int, Spec] | None, records: list[OpDecision] | None,
             moves: list[Redistribution] | None) -> tuple:
    """tally's sums; with `records` and `moves`, the per-operator records and the
    redistributions appended to them (made only for the plan written up)."""
    tensors = graph.tensors
    pinned = pinned or {}
    specs = decisions.tensor_specs(graph)
    compute = comm = recompute_s = 0.0
    collective_bytes: dict[str, float] = {}

    def count(kinds: dict[str, float], times: int = 1) -> None:
        for kind, nbytes in kinds.items():
            collective_bytes[kind] = collective_bytes.get(kind, 0.0) + times * nbytes

    # The time of a resharding is charged to every operator that needs it, as the search does
    # (an edge joins one producer and one user), so that the plan's cost is the search's
    # objective. Its bytes are counted once per tensor and spec: the lowering's constraints for
    # the users are equal and XLA merges them, and the bytes are compared with the compiled HLO.
    moved: set[tuple[int, Spec]] = set()
    recomputed = recomputed_ops(graph, decisions.recompute)
    # The same operator of every block costs alike: timed and counted once.
    known: dict[tuple, tuple[tuple[float, float], dict[str, float]]] = {}
    facts, signatures = value_facts(graph), signature_ids(graph)
    operands = _live_operands(graph)
    merged = _summed_alike(graph, decisions, mesh, hw)
    for op, st in zip(graph.ops, decisions.ops):
        key = (signatures[op.id], st)
        if key not in known:
            known[key] = (op_time(op, st, tensors, mesh, hw, facts),
                          op_collectives(op, st, tensors, mesh, hw))
        (c, m), collectives = known[key]
        if op.outputs and op.outputs[0] in merged:  # summed with the term before it
            _, seconds, nbytes = merged[op.outputs[0]]
            m -= seconds
            count({kind: -n for kind, n in nbytes.items()})
        if op.id in recomputed:  # runs twice: in the forward pass and again for the backward
            recompute_s += c
            c *= 2
        if collectives:
            count(collectives)
        for i, t in operands[op.id]:
            need = st.in_specs[i]
            if specs.get(t, need) != need:
                times = op.operand_repeat(i)
                move = times * reshard_time(tensors[t], specs[t], need, mesh, hw)
                if (t, need) not in moved:
                    moved.add((t, need))
                    count(reshard_collectives(tensors[t], specs[t], need, mesh, hw), times)
                m += move
                if moves is not None:
                    at_annotation = t in pinned or bool(set(op.outputs) & pinned.keys())
                    where = f"operand {i} of {op.primitive} #{op.id}" + (
                        f" ({op.source})" if op.source else "")
                    moves.append(Redistribution(where, _name(graph, t),
                        tensors[t].shape, specs[t], need, move, at_annotation))
        compute, comm = compute + c, comm + m
        if records is None:
            continue
        records.append(OpDecision(
            op.id, op.primitive, op.source, tuple(tensors[t].shape for t in op.inputs),
            tuple(tensors[t].shape for t in op.outputs), st.in_specs, st.out_specs,
            st.partial_axes, c, m, op.scope, op.backward))
    out_specs = output_specs(graph, decisions, specs)
    for t, move in _returned_state(graph, specs, out_specs, mesh, hw, pinned):
        count(reshard_collectives(tensors[t], move.from_spec, move.to_spec, mesh, hw))
        comm += move.cost_s
        if moves is not None:
            moves.append(move)
    return out_specs, compute, comm, recompute_s, collective_bytes


@per_graph  # read by every tally
def _live_operands(graph: OpGraph) -> list[tuple[tuple[int, int], ...]]:
    """Per op, (operand index, tensor) of its operands that are not constants: those a
    strategy can ask to be resharded."""
    return [tuple((i, t) for i, t in enumerate(op.inputs) if not graph.tensors[t].const)
            for op in graph.ops]


def _summed_alike(graph: OpGraph, decisions: Decisions, mesh: MeshShape, hw: Hardware
                  ) -> dict[int, tuple]:
    """The second terms of summed pairs (cost.facts.summed_pairs) that `decisions` sum as the
    term before them, where the compiler reassociates sums: their collective is the first
    term's (planning.pricing.summed_edges). Each with its cost.model.partial_sum."""
    if not reassociates_sums(graph.compiler):
        return {}
    made = {t: (op, k) for op in graph.ops for k, t in enumerate(op.outputs)}
    facts, merged = value_facts(graph), {}
    for a, b in summed_pairs(graph):
        (op_a, k_a), (op_b, k_b) = made[a], made[b]
        summed_a = partial_sum(op_a, decisions.ops[op_a.id], k_a, graph.tensors, mesh, hw,
                               facts)
        summed_b = partial_sum(op_b, decisions.ops[op_b.id], k_b, graph.tensors, mesh, hw,
                               facts)
        if summed_a and summed_b and summed_a[0] == summed_b[0]:
            merged[b] = summed_b
    return merged


def _returned_state(graph: OpGraph, specs: dict[int, Spec], out_specs: list[Spec],
                    mesh: MeshShape, hw: Hardware, pinned: dict[int, Spec]
                    ) -> list[tuple[int, Redistribution]]:
    """The state returned in another sharding than its producer's: it goes back in the
    sharding it arrived in."""
    tensors, moves = graph.tensors, []
    for k, (t, final) in enumerate(zip(graph.outputs, out_specs)):
        spec = specs.get(t, replicated(len(tensors[t].shape)))
        if spec != final:
            t_in = graph.inputs[graph.state_pairs[k]]
            move = reshard_time(tensors[t], spec, final, mesh, hw)
            moves.append((t, Redistribution(
                f"returning the state {_name(graph, t_in)}", _name(graph, t), tensors[t].shape,
                spec, final, move, t_in in pinned)))
    return moves


def _name(graph: OpGraph, t: int) -> str:
    return graph.tensors[t].path or f"tensor {t}"


def written_up(graph: OpGraph, chosen: Candidate, mesh: MeshShape, hw: Hardware, search: str,
               in_tree: Any, out_tree: Any, memory_limit: int | None, buffers: BufferModel
               ) -> Plan:
    """The Plan of `chosen`: specs, per-op costs, redistributions and totals per device;
    `memory_limit` is recorded with the memory estimate, which `buffers` made."""
    tensors, decisions, cost = graph.tensors, chosen.decisions, chosen.tally

    def tensor_plans(ids: Sequence[int], spec_list: Sequence[Spec]) -> tuple[TensorPlan, ...]:
        return tuple(TensorPlan(_name(graph, t), tensors[t].shape, tensors[t].dtype, s,
                                int(shard_bytes(tensors[t], s, mesh)))
                     for t, s in zip(ids, spec_list))

    totals = Cost(cost.compute_s, cost.communication_s, cost.total_s, cost.recompute_s,
                  chosen.peak_bytes, dict(sorted(cost.collective_bytes.items())))
    return Plan(tuple(zip(mesh.names, mesh.sizes)), search, hw.name,
                tensor_plans(graph.inputs, decisions.inputs),
                tensor_plans(graph.outputs, cost.out_specs), cost.ops, totals, chosen.stats,
                cost.moves, in_tree, out_tree, memory_json(chosen.memory, buffers, memory_limit),
                recomputed_layers(graph, decisions.recompute))


def assemble(graph: OpGraph, decisions: Decisions, mesh: MeshShape, hw: Hardware, search: str,
             stats: SearchStats, in_tree: Any = None, out_tree: Any = None,
             pinned: dict[int, Spec] | None = None, memory_limit: int | None = None,
             buffers: BufferModel | None = None) -> Plan:
    """The Plan of `decisions` (tally, memory estimate, write-up in one). `buffers` is the
    compiler's buffer model, by default the one of the profile's platform."""
    buffers = buffers or buffer_model(hw.platform)
    chosen = Candidate(decisions, tallying(graph, decisions, mesh, hw, pinned),
                       plan_memory(graph, decisions, mesh, buffers), stats)
    return written_up(graph, chosen, mesh, hw, search, in_tree, out_tree, memory_limit, buffers)


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


def pipeline_detail(graph: OpGraph, plan: Plan) -> dict[str, Any]:
    """What a pipelined plan says of its stages: the layers each holds (GPipe: L/S consecutive
    ones; circular: chunks s, s+S, ... of L/(S R)), the sub-mesh each runs on (the mesh but
    'stage'), the ticks and bubble, and the estimated seconds of the tick loops (forward and
    backward, bubble included). Every stage runs the same program on its sub-mesh, so each
    has that time and the plan's memory per device.

    The tick loops are the loops of R M + S - 1 trips that shift values between stages (a
    pad, or the circular schedule's rotation); a stage's layers run in a loop inside them, so
    the most an operator of theirs runs, over the ticks, is the layers of a chunk."""
    stages, repeats = plan.pipeline_stages, plan.pipeline_repeats
    ticks = repeats * plan.microbatches + stages - 1
    in_ticks = {i for step, ids in graph.loop_ops.items()
                if graph.program[step].eqn.params.get("length") == ticks
                and any(graph.ops[i].primitive in SHIFTING for i in ids) for i in ids}
    chunk = max((graph.ops[i].repeat for i in in_ticks), default=0) // ticks
    return {"layers": chunk * stages * repeats,
            "stage_layers": [[[c * chunk, (c + 1) * chunk - 1]
                              for c in range(s, stages * repeats, stages)]
                             for s in range(stages)],
            "sub_mesh": {n: k for n, k in plan.mesh if n != STAGE_AXIS},
            "ticks": ticks, "bubble": (stages - 1) / ticks,
            "tick_loops_s": sum(o.compute_s + o.communication_s for o in plan.ops
                                if o.index in in_ticks)}
