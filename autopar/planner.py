"""Planning: trace, build the problem, search, and assemble the Plan with its costs."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np

import search
from autopar.annotate import Annotations, resolve as resolve_annotations
from autopar.budget import plan_within
from autopar.cost.hardware import Hardware
from autopar.cost.model import (op_collectives, op_signature, op_time, reshard_collectives,
                                reshard_time, shard_bytes, value_facts)
from autopar.memory import memory_json, plan_memory, recomputed_layers, recomputed_ops
from autopar.errors import AutoparError
from autopar.ir import OpGraph
from autopar.layers import TIED_SPACE
from autopar.mesh import MeshShape
from autopar.plan import OpDecision, Plan, Redistribution, TensorPlan
from autopar.problem import (Problem, Unit, build_problem, kept_problem, main_operand,
                             make_units, untied_node_count)
from autopar.recursive import merged_within, rounds_within, solve_recursive
from autopar.rules.factors import Spec, Strategy, replicated
from autopar.trace import trace

BACKENDS = ("dynamic_programming", "recursive_programming", "sharding_propagation")
EXACT_TABLE_LIMIT = 2e7  # entries of the largest table exact elimination may build
# Table size of mini-bucket elimination. Larger tables tighten its lower bound, not its answer:
# 3e5 against 1e6 gave the same plans on the example and on 12-layer GPTs at 8 to 1,024
# devices, in a quarter of the time on the example, with bounds 0.1 to 0.6 points weaker.
BOUNDED_TABLE_LIMIT = 3e5
# Parts of the search space a proof under a kept-bytes cap explores before it settles for its
# best plan and bound: the 4-layer GPT of the memory benchmark finds its optimum within 40 and
# needs 113 to 153 (20 to 28 s) to prove it (docs/decisions.md).
PROOF_PARTS = 40
# Nodes of the untied problem up to which dynamic_programming searches it rather than the tied
# one, so that `exact` holds for the step as written; above it, the search keeps the period-2
# ties of repeated layers (docs/decisions.md, "Repeated layers tie two apart").
UNTIED_NODE_LIMIT = 400


@dataclass
class Decisions:
    """The sharding of every input and the strategy of every op: what lowering needs."""

    inputs: list[Spec]  # per graph input
    ops: list[Strategy]  # per op id
    recompute: frozenset[int] = frozenset()  # forward program steps the backward recomputes

    def tensor_specs(self, graph: OpGraph) -> dict[int, Spec]:
        """The sharding each tensor has when produced."""
        specs = {t: s for t, s in zip(graph.inputs, self.inputs)}
        for op, st in zip(graph.ops, self.ops):
            specs.update(zip(op.outputs, st.out_specs))
        return specs


def solve(graph: OpGraph, mesh: MeshShape, hw: Hardware, backend: str,
          pinned: dict[int, Spec] | None = None, memory_weight: float = 0.0,
          units: list[Unit] | None = None, problems: dict | None = None,
          kept_budget: float | None = None) -> tuple[Decisions, dict]:
    """Search the strategies of `graph` on `mesh` with `backend`, the tensors in `pinned` fixed
    (tensor id -> spec: annotated inputs and `autopar.shard` results), each byte kept per
    device charged `memory_weight` seconds (see Problem.priced).

    With `kept_budget` (dynamic_programming only), the fastest plan keeping at most that many
    bytes per device (memory.kept_bytes), proven by branch and bound (search.constrained);
    SearchTooLargeError where the full problem is too wide for exact tables.

    A caller that searches one graph, mesh and pins more than once (at several memory prices)
    passes `units` (make_units(graph)) and a `problems` dict, which keeps the problems built,
    unpriced, for the next search."""
    if backend not in BACKENDS:
        raise AutoparError(f"unknown search {backend!r}. Fix: use one of {list(BACKENDS)}.")
    t0 = time.perf_counter()
    extra: dict[str, Any] = {}
    units = make_units(graph) if units is None else units

    def full() -> Problem:  # the whole mesh's problem at this price
        return kept_problem(problems, "full", lambda: build_problem(
            graph, mesh, hw, pinned, units=units)).priced(graph, mesh, memory_weight)

    if kept_budget is not None:
        if backend != "dynamic_programming":
            raise ValueError("kept_budget is a dynamic_programming search")
        problem = full()
        if search.largest_table(problem.graph, EXACT_TABLE_LIMIT) > EXACT_TABLE_LIMIT:
            raise search.SearchTooLargeError("exact tables exceed EXACT_TABLE_LIMIT")
        solution = search.solve_constrained(problem.graph, problem.kept(graph, mesh),
                                            kept_budget, max_factor_size=EXACT_TABLE_LIMIT,
                                            max_parts=PROOF_PARTS)
        extra = {"kept_bytes": solution.stats.pop("use"),
                 "kept_budget_bytes": solution.stats.pop("budget")}
        space = "full, kept bytes within a budget"
    elif backend == "recursive_programming":
        problem, solution, extra = solve_recursive(graph, mesh, hw, pinned, units,
                                                   memory_weight, problems)
        space = extra.pop("space")
    elif backend == "sharding_propagation":
        if not pinned:
            raise AutoparError(
                "search='sharding_propagation' spreads annotations, and this step has none. "
                "Fix: pass annotations={regex: PartitionSpec} (e.g. {'batch/': P('data')}), "
                "call autopar.shard(x, P(...)) in the model, or use "
                "search='dynamic_programming'.")
        problem, solution = _propagate(full(), pinned)
        space = "propagation from the annotations"
    else:
        problem = None
        if (any(unit.tie is not None for unit in units)
                and untied_node_count(graph, units, pinned or {}) <= UNTIED_NODE_LIMIT):
            # Small enough to search without the ties, where its exact tables fit: the answer
            # is then the optimum over every plan, not only those that repeat layers. Built
            # first, so that the tied problem is built only where the untied one is too wide.
            untied = kept_problem(problems, "untied", lambda: build_problem(
                graph, mesh, hw, pinned, tie_layers=False, units=units)
                ).priced(graph, mesh, memory_weight)
            if search.largest_table(untied.graph, EXACT_TABLE_LIMIT) <= EXACT_TABLE_LIMIT:
                problem = untied
        if problem is None:
            problem = full()
        fits = search.largest_table(problem.graph, EXACT_TABLE_LIMIT) <= EXACT_TABLE_LIMIT
        if fits:
            solution, space = search.solve(problem.graph, backend,
                                           max_factor_size=EXACT_TABLE_LIMIT), "full"
        else:
            solution, space = _best_within_bound(problem, mesh)
    t1 = time.perf_counter()
    strategies = problem.decode(solution.choice)
    by_tensor = {}
    ops: list[Strategy | None] = [None] * len(graph.ops)
    for unit, st in zip(problem.units, strategies):
        if unit.op is None:
            by_tensor[unit.outputs[0]] = st.out_specs[0]
        else:
            ops[unit.op.id] = st
    inputs = [by_tensor.get(t, replicated(len(graph.tensors[t].shape))) for t in graph.inputs]
    stats = {"exact": True, **{k: _plain(v) for k, v in solution.stats.items()}}
    stats.update(extra, space=space, search_s=t1 - t0,  # search_s includes building problems
                 objective_s=float(solution.cost), ops=len(graph.ops),
                 tied_units=tied_units(problem, graph))
    return Decisions(inputs, ops), stats


def tied_units(problem: Problem, graph: OpGraph) -> int:
    """Deciding units of `problem` that took an earlier instance's strategies (repeated
    layers): each would be a node of its own without the ties. A unit that follows its
    operand's producer (as problem._group decides) shares a node whether tied or not."""
    count = 0
    for u, unit in enumerate(problem.units):
        if unit.tie is None or problem.node_of[u] != problem.node_of[unit.tie]:
            continue
        main = main_operand(unit, graph)
        source = problem.producer.get(unit.inputs[main]) if main is not None else None
        count += source is None or source[0] >= u
    return count


def exactness(stats: dict) -> dict:
    """`stats` with `exact` for the step as written, and `exact_for`: the plans among which
    the answer is proven optimal ("all plans"; with repeated layers tied, only the plans that
    repeat them; None where it is not proven). The search sets `exact` for the plans it
    covered, and a memory budget may withdraw it (budget.py); this is read once at the end."""
    tied = stats.get("tied_units", 0)
    proven = bool(stats.get("exact"))
    return {**stats, "exact": proven and not tied,
            "exact_for": (TIED_SPACE if tied else "all plans") if proven else None}


def _best_within_bound(full: Problem, mesh: MeshShape) -> tuple[search.Solution, str]:
    """The cheaper of two answers when exact tables for the full space do not fit.

    A training step's forward and backward passes share activations and parameters, which makes
    its graph too wide for exact elimination on meshes of several axes (docs/decisions.md).
    Bounded elimination of the full space gives a plan and a lower bound on the optimum; the
    axis-by-axis recursion within the same problem (`rounds_within`: no problem is built per
    round) gives a second plan, and all axes taken as one (`merged_within`) a third. The
    cheapest wins, and the bound says how far from optimal it can be.
    """
    bounded = search.solve_bounded(full.graph, max_factor_size=BOUNDED_TABLE_LIMIT)
    rounds_answer = rounds_within(full, mesh)
    merged = merged_within(full, mesh)
    candidates = [(bounded, "full"), (rounds_answer, "one axis at a time"),
                  (merged, "all axes as one")]
    best, space = min(candidates, key=lambda c: c[0].cost)
    bound = bounded.stats["lower_bound"]
    gap = 0.0 if best.cost <= bound else (best.cost - bound) / best.cost
    stats = {**best.stats, "exact": gap <= 1e-12, "lower_bound": bound, "gap": gap,
             "bounded_elimination_s": bounded.cost, "one_axis_at_a_time_s": rounds_answer.cost,
             "all_axes_as_one_s": merged.cost}
    return search.Solution(best.choice, best.cost, stats), space


def _propagate(problem: Problem, pinned: dict[int, Spec]) -> tuple[Problem, search.Solution]:
    """Sharding propagation from the pinned tensors; unreached nodes get data parallel."""
    seeds = sorted({problem.node_of[u] for u, unit in enumerate(problem.units)
                    if unit.outputs and unit.outputs[0] in pinned})
    defaults = [_data_parallel_choice(problem.choices[r]) for r in problem.roots]
    return problem, search.solve(problem.graph, "sharding_propagation", seeds=seeds,
                                 defaults=defaults)


def _data_parallel_choice(options: list[Strategy]) -> int:
    """The strategy splitting the first result dimension (the batch) over the most devices and
    nothing else; the first (replicated) one if none does."""
    best, best_ways = 0, 1
    for j, s in enumerate(options):
        spec = s.out_specs[0] if s.out_specs else ()
        batch_only = bool(spec) and bool(spec[0]) and not any(spec[1:]) and not s.partial_axes
        if batch_only and s.parallel > best_ways:
            best, best_ways = j, s.parallel
    return best


def _plain(v: Any) -> Any:
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)


def assemble(graph: OpGraph, decisions: Decisions, mesh: MeshShape, hw: Hardware, backend: str,
             stats: dict, in_tree: Any = None, out_tree: Any = None,
             pinned: dict[int, Spec] | None = None, memory_limit: int | None = None) -> Plan:
    """The Plan of `decisions`: specs, per-op costs, redistributions and totals per device.

    `pinned` (the annotated tensors) marks the redistributions at annotations; `memory_limit`
    is recorded with the memory estimate.
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

    memory = plan_memory(graph, decisions, mesh)
    cost = {"compute_s": compute, "communication_s": comm, "total_s": compute + comm,
            "recompute_s": recompute_s, "peak_memory_bytes": memory.peak_bytes,
            **{f"{kind}_bytes": nbytes for kind, nbytes in sorted(collective_bytes.items())}}
    return Plan(tuple(zip(mesh.names, mesh.sizes)), backend, hw.name,
                tensor_plans(graph.inputs, decisions.inputs),
                tensor_plans(graph.outputs, out_specs), tuple(decisions_out), cost, stats,
                tuple(moves), in_tree, out_tree, memory_json(memory, memory_limit),
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


def plan_step(fn: Callable, args: Sequence[Any], mesh: MeshShape | int, hw: Hardware,
              backend: str, annotations: Annotations = None, memory_limit: int | None = None,
              donated: frozenset[int] = frozenset()) -> tuple[OpGraph, Decisions, Plan]:
    """Trace, search and assemble: the whole planning pipeline for one call signature
    (`donated`: the flat inputs the caller donates, which the memory estimate reads).

    `mesh` given as a device count tries every mesh shape of that many devices
    (`candidate_meshes`) on which the annotations apply, and keeps the plan of least estimated
    cost. With `memory_limit` (bytes per device), only plans that fit it (`budget`).
    """
    t0 = time.perf_counter()
    graph, in_tree, out_shape = trace(fn, args, donated)
    t1 = time.perf_counter()
    out_tree = jax.tree_util.tree_structure(out_shape)
    units = make_units(graph)
    shapes = candidate_meshes(mesh) if isinstance(mesh, int) else [mesh]
    best = None
    first_error = fit_error = None
    for shape in shapes:
        try:
            pinned = resolve_annotations(graph, shape, annotations)
        except AutoparError as e:  # a candidate mesh without the annotated axes
            first_error = first_error or e
            continue

        problems: dict = {}  # built once for this mesh, searched at every memory price

        def attempt(price: float, recompute: frozenset, kept_budget: float | None,
                    shape: MeshShape = shape, pinned: dict[int, Spec] = pinned,
                    problems: dict = problems) -> tuple[Decisions, Plan]:
            decisions, stats = solve(graph, shape, hw, backend, pinned, price, units, problems,
                                     kept_budget)
            decisions = dataclasses.replace(decisions, recompute=recompute)
            stats["trace_s"] = t1 - t0
            return decisions, assemble(graph, decisions, shape, hw, backend, stats, in_tree,
                                       out_tree, pinned, memory_limit)

        try:
            decisions, plan = plan_within(attempt, graph, shape, memory_limit,
                                          exact=backend == "dynamic_programming")
        except AutoparError as e:  # nothing fits this mesh: the error to report
            fit_error = fit_error or e
            continue
        if best is None or plan.cost["total_s"] < best[1].cost["total_s"]:
            best = (decisions, plan)
    if best is None:
        raise fit_error or first_error
    return graph, best[0], dataclasses.replace(best[1], search_stats=exactness(
        best[1].search_stats))


AUTO_AXIS_NAMES = {1: ("data",), 2: ("data", "model"), 3: ("data", "model", "inner")}


def candidate_meshes(devices: int) -> list[MeshShape]:
    """Every way to arrange `devices` as a mesh of one to three axes of size > 1."""
    if devices < 1:
        raise AutoparError(f"a mesh needs at least one device, got {devices}.")
    shapes: list[tuple[int, ...]] = [(devices,)]
    for a in range(2, devices):
        if devices % a == 0:
            shapes.append((a, devices // a))
            rest = devices // a
            shapes += [(a, b, rest // b) for b in range(2, rest) if rest % b == 0]
    return [MeshShape(AUTO_AXIS_NAMES[len(s)], s) for s in shapes]


def data_parallel_pins(graph: OpGraph, mesh: MeshShape, batch_prefix: str) -> dict[int, Spec]:
    """Plain data parallel as pins: inputs under `batch_prefix` split on their first dimension
    over every mesh axis, everything else replicated."""
    everything = tuple(n for n, s in zip(mesh.names, mesh.sizes) if s > 1)
    pins = {}
    for t in graph.inputs:
        tensor = graph.tensors[t]
        spec = [()] * len(tensor.shape)
        batch = tensor.path.startswith(batch_prefix)
        if batch and tensor.shape and tensor.shape[0] % mesh.size == 0:
            spec[0] = everything
        pins[t] = tuple(spec)
    return pins


def data_parallel_plan(fn: Callable, args: Sequence[Any], mesh: MeshShape, hw: Hardware,
                       batch_prefix: str) -> Plan:
    """The baseline a person writes first: batch split over all devices, the rest replicated,
    with the operators' strategies searched under those pins."""
    graph, in_tree, out_shape = trace(fn, args)
    decisions, stats = solve(graph, mesh, hw, "dynamic_programming",
                             data_parallel_pins(graph, mesh, batch_prefix))
    stats = exactness(stats)
    return assemble(graph, decisions, mesh, hw, "data_parallel", stats, in_tree,
                    jax.tree_util.tree_structure(out_shape))
