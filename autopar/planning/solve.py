"""Planning: trace, build the problem, search, and assemble the Plan with its costs."""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

import autopar_search as search
from autopar.cost.hardware import Hardware
from autopar.decisions import Decisions
from autopar.errors import AutoparError
from autopar.mesh import MeshShape
from autopar.plan_stats import SearchStats
from autopar.planning.axes import (adjacent_pairs, merged_within, paired_within,
                                   rounds_within, solve_recursive)
from autopar.planning.plan_bound import DUAL_SWEEPS, DUAL_WORK
from autopar.planning.pricing import Unit
from autopar.planning.problem import (Problem, build_problem, kept_problem, make_units,
                                      untied_node_count)
from autopar.rules.factors import Spec, Strategy, replicated
from autopar.trace.ir import OpGraph
from autopar.trace.layers import TIED_SPACE

SEARCHES = ("dynamic_programming", "recursive_programming", "sharding_propagation")
EXACT_TABLE_LIMIT = 2e7  # entries of the largest table exact elimination may build
# Table size of mini-bucket elimination. Larger tables tighten its lower bound, not its answer:
# 3e5 against 1e6 gave the same plans on the example and on 12-layer GPTs at 8 to 1,024
# devices, in a quarter of the time on the example, with bounds 0.1 to 0.6 points weaker.
BOUNDED_TABLE_LIMIT = 3e5
# Parts of the search space a proof under a kept-bytes cap explores before it settles for its
# best plan and bound: the 4-layer GPT of the memory benchmark finds its optimum within 40 and
# needs 113 to 153 (20 to 28 s) to prove it (docs/decisions.md).
PROOF_PARTS = 40
# A proof stops where no part left can be faster than its plan by more than this (relative);
# the plan is then reported `exact` only where its gap is nil. Closing gaps below 0.1% cost a
# 2-layer GPT's memory-limited plan 18 s of 20 and found no faster plan (docs/decisions.md).
PROOF_GAP = 1e-3
# Nodes of the untied problem up to which dynamic_programming searches it rather than the tied
# one, so that `exact` holds for the step as written; above it, the search keeps the period-2
# ties of repeated layers (docs/decisions.md, "Repeated layers tie two apart").
UNTIED_NODE_LIMIT = 400
# The distance above the bounded search's bound (relative) beyond which a plan is looked for
# in the dual's shortlists too (_shortlisted_by_dual): nearer, there is little to find, and a
# memory-limited Llama-3-8B in a Python loop on 8x4x8 spent 3.5 s of 38 there.
SHORTLIST_GAP = 1e-3


@dataclass(frozen=True)
class Solved:
    """A search's answer: the strategies it chose and what it found out about them."""

    decisions: Decisions
    stats: SearchStats


def solve(graph: OpGraph, mesh: MeshShape, hw: Hardware, algorithm: str,
          pinned: dict[int, Spec] | None = None, memory_weight: float = 0.0,
          units: list[Unit] | None = None, problems: dict | None = None,
          kept_budget: float | None = None) -> Solved:
    """Search the strategies of `graph` on `mesh` with the search `algorithm`, the tensors in
    `pinned` fixed (tensor id -> spec: annotated inputs and `autopar.shard` results), each byte
    kept per device charged `memory_weight` seconds (see Problem.priced).

    With `kept_budget` (dynamic_programming only), the fastest plan keeping at most that many
    bytes per device (memory.kept_bytes), proven by branch and bound (search.constrained);
    SearchTooLargeError where the full problem is too wide for exact tables.

    A caller that searches one graph, mesh and pins more than once (at several memory prices)
    passes `units` (make_units(graph)) and a `problems` dict, which keeps the problems built,
    unpriced, for the next search."""
    if algorithm not in SEARCHES:
        raise AutoparError(f"unknown search {algorithm!r}. Fix: use one of {list(SEARCHES)}.")
    t0 = time.perf_counter()
    extra: dict[str, Any] = {}
    units = make_units(graph) if units is None else units

    def full() -> Problem:  # the whole mesh's problem at this price
        return kept_problem(problems, "full", lambda: build_problem(
            graph, mesh, hw, pinned, units=units, memo=problems)
        ).priced(graph, mesh, memory_weight)

    if kept_budget is not None:
        if algorithm != "dynamic_programming":
            raise ValueError("kept_budget is a dynamic_programming search")
        problem = full()
        solution, extra = _within_kept_budget(problem, graph, mesh, kept_budget)
        space = "full, kept bytes within a budget"
    elif algorithm == "recursive_programming":
        # In the whole space and in the narrow one (reduce-scatters for weight gradients
        # alone): the recursion commits early, and more choices can lead it astray
        # (encoder-decoder at d_model 768 on 2x4, h100: judged 5.55 ms from the whole space
        # alone, 4.07 with both; the MoE's best plan needs the whole space).
        # One exact round (a mesh of one axis) is the whole space's optimum: the narrow
        # space, a part of it, cannot beat it.
        answers = [solve_recursive(graph, mesh, hw, pinned, units, memory_weight, problems)]
        if not answers[0].exact:
            answers.append(solve_recursive(graph, mesh, hw, pinned, units, memory_weight,
                                           problems, narrow=True))
        best = min(answers, key=lambda answer: answer.solution.cost)
        problem, solution, space = best.problem, best.solution, best.space
        extra = {**best.details, "exact": best.exact}  # one exact round: the optimum
    elif algorithm == "sharding_propagation":
        if not pinned:
            raise AutoparError(
                "search='sharding_propagation' spreads annotations, and this step has none. "
                "Fix: pass annotations={regex: PartitionSpec} (e.g. {'batch/': P('data')}), "
                "call autopar.shard(x, P(...)) in the model, or use "
                "search='dynamic_programming'.")
        problem, solution = _propagate(full(), pinned)
        space = "propagation from the annotations"
    else:
        untied = _untied(graph, mesh, hw, pinned, units, problems, memory_weight)
        problem = untied or full()
        solution = _exact(problem)
        space = "full"
        if solution is None:
            tie = untied is None
            narrow = kept_problem(problems, ("narrow", tie), lambda: build_problem(
                graph, mesh, hw, pinned, tie_layers=tie, units=units, narrow=True,
                memo=problems)).priced(graph, mesh, memory_weight)
            problem, solution, space = _best_within_bound(problem, narrow, mesh, problems,
                                                          shortlist=not memory_weight)
    t1 = time.perf_counter()
    stats = SearchStats.of({"exact": True, **{k: _plain(v) for k, v in solution.stats.items()},
                            **extra, "search_s": t1 - t0})  # search_s: building problems too
    stats = dataclasses.replace(stats, space=space, objective_s=float(solution.cost),
                                ops=len(graph.ops), tied_units=tied_units(problem, graph))
    if stats.exact and stats.lower_bound is None:  # exact elimination: the optimum
        stats = dataclasses.replace(stats, lower_bound=float(solution.cost), gap=0.0)
    return Solved(_decisions(problem, solution, graph), stats)


def _kept_pairs(problem: Problem, problems: dict | None) -> dict:
    """search.pair_tables of the problem's edges, kept in `problems` for the searches of the
    same edges at other memory prices (Problem.priced shares them). Held as long as the
    problems are: the bytes of the summed tables each bounded search built anyway."""
    edges = problem.graph.edges
    kept = problems.get("pairs") if problems is not None else None
    if kept is None or kept[0] is not edges:
        kept = (edges, search.pair_tables(problem.graph))
        if problems is not None:
            problems["pairs"] = kept
    return kept[1]


def _exact(problem: Problem) -> search.Solution | None:
    """The optimum by exact elimination, None where its tables exceed EXACT_TABLE_LIMIT. The
    width is estimated before eliminating, and the elimination can still meet a wider table
    (an encoder-decoder's embedding gather needed 4.95e7 entries after the estimate allowed
    it): that too is None."""
    if search.largest_table(problem.graph, EXACT_TABLE_LIMIT) > EXACT_TABLE_LIMIT:
        return None
    try:
        return search.solve(problem.graph, "dynamic_programming",
                            max_factor_size=EXACT_TABLE_LIMIT)
    except search.SearchTooLargeError:
        return None


def _within_kept_budget(problem: Problem, graph: OpGraph, mesh: MeshShape, kept_budget: float
                        ) -> tuple[search.Solution, dict[str, Any]]:
    """The fastest plan keeping at most `kept_budget` bytes, by branch and bound."""
    if search.largest_table(problem.graph, EXACT_TABLE_LIMIT) > EXACT_TABLE_LIMIT:
        raise search.SearchTooLargeError("exact tables exceed EXACT_TABLE_LIMIT")
    solution = search.solve_constrained(problem.graph, problem.kept(graph, mesh), kept_budget,
                                        max_factor_size=EXACT_TABLE_LIMIT, max_parts=PROOF_PARTS,
                                        stop_gap=PROOF_GAP)
    return solution, {"kept_bytes": solution.stats.pop("use"),
                      "kept_budget_bytes": solution.stats.pop("budget")}


def _untied(graph: OpGraph, mesh: MeshShape, hw: Hardware, pinned: dict[int, Spec] | None,
            units: list[Unit], problems: dict | None, memory_weight: float) -> Problem | None:
    """The problem without repeated-layer ties, where the step is small enough to search that
    way: where its exact tables fit, the answer is then the optimum over every plan, not only
    those that repeat layers; where they do not, its bounded search still reaches the
    alternating plans the ties forbid, in no more time (docs/decisions.md, "The compiler's
    fusion, gathers' layout copies and reduce-scatters everywhere"). Built before the tied
    one, which is then built only where this one is too large. None where there are no ties
    or it has too many nodes."""
    if (not any(unit.tie is not None for unit in units)
            or untied_node_count(graph, units, pinned or {}) > UNTIED_NODE_LIMIT):
        return None
    return kept_problem(problems, "untied", lambda: build_problem(
        graph, mesh, hw, pinned, tie_layers=False, units=units, memo=problems)
        ).priced(graph, mesh, memory_weight)


def _decisions(problem: Problem, solution: search.Solution, graph: OpGraph) -> Decisions:
    """The solution's strategy per operator, and the specs of the inputs."""
    by_tensor = {}
    ops: list[Strategy | None] = [None] * len(graph.ops)
    for unit, st in zip(problem.units, problem.decode(solution.choice)):
        if unit.op is None:
            by_tensor[unit.outputs[0]] = st.out_specs[0]
        else:
            ops[unit.op.id] = st
    inputs = [by_tensor.get(t, replicated(len(graph.tensors[t].shape))) for t in graph.inputs]
    return Decisions(inputs, ops)


def tied_units(problem: Problem, graph: OpGraph) -> int:
    """Deciding units of `problem` that took an earlier instance's strategies (repeated
    layers): each would be a node of its own without the ties. A unit that follows its
    operand's producer (as problem._group decides) shares a node whether tied or not. Kept
    with the problem: it depends on its structure alone."""
    if "tied_units" in problem.derived:
        return problem.derived["tied_units"]
    count = 0
    for u, unit in enumerate(problem.units):
        if unit.tie is None or problem.node_of[u] != problem.node_of[unit.tie]:
            continue
        main = unit.main
        source = problem.producer.get(unit.inputs[main]) if main is not None else None
        count += source is None or source[0] >= u
    problem.derived["tied_units"] = count
    return count


def exactness(stats: SearchStats) -> SearchStats:
    """`stats` with `exact` for the step as written, and `exact_for`: the plans among which
    the answer is proven optimal ("all plans"; with repeated layers tied, only the plans that
    repeat them; None where it is not proven). The search sets `exact` for the plans it
    covered, and a memory budget may withdraw it (budget.py); this is read once at the end."""
    tied, proven = stats.tied_units or 0, bool(stats.exact)
    return dataclasses.replace(stats, exact=proven and not tied, exact_for=(
        (TIED_SPACE if tied else "all plans") if proven else None))


def _best_within_bound(full: Problem, narrow: Problem, mesh: MeshShape, problems: dict | None,
                       shortlist: bool) -> tuple[Problem, search.Solution, str]:
    """The cheapest of several answers when exact tables for the full space do not fit.

    A training step's forward and backward passes share activations and parameters, which makes
    its graph too wide for exact elimination on meshes of several axes (docs/decisions.md).
    Bounded elimination of the full space gives a plan and a lower bound on the optimum; the
    axis-by-axis recursion within the same problem (`rounds_within`: no problem is built per
    round) gives a second plan, and all axes taken as one (`merged_within`) a third. The last
    two run in the `narrow` space too (reduce-scatters for weight gradients alone): neither is
    exact, and with every product's reduce-scatters on offer the recursion's early rounds
    sometimes commit to one that the later rounds pay for (docs/decisions.md, "The compiler's
    fusion, gathers' layout copies and reduce-scatters everywhere"). On meshes of three
    axes or more, bounded elimination also runs with each pair of neighbouring axes taken as
    one (`paired_within`): the smaller space of a mesh of one axis fewer, where it loses less.
    With `shortlist`, where the cheapest of these is over SHORTLIST_GAP above the bound, the
    dual's reparametrised costs shortlist each node's strategies, and the narrowed problem is
    solved exactly (`_shortlisted_by_dual`). The cheapest wins, and the higher of the two
    bounds says how far from optimal it can be.

    Not under a memory price: the price charges the bytes a plan keeps, not its peak, and the
    shortlists find plans keeping fewer bytes with more temporaries at the peak, and can miss
    a plan that fits where the searches above find one (docs/decisions.md, "Plans from the
    dual")."""
    bounded = search.solve_bounded(full.graph, max_factor_size=BOUNDED_TABLE_LIMIT,
                                   pairs=_kept_pairs(full, problems))
    candidates = [(full, bounded, "full"), (full, rounds_within(full, mesh), "one axis at a time"),
                  (full, merged_within(full, mesh), "all axes as one"),
                  (narrow, rounds_within(narrow, mesh), "one axis at a time, weight gradients "
                   "reduce-scattered"),
                  (narrow, merged_within(narrow, mesh), "all axes as one, weight gradients "
                   "reduce-scattered")]
    paired = [(full, paired_within(full, pair, BOUNDED_TABLE_LIMIT),
               f"axes {pair[0]!r} and {pair[1]!r} as one") for pair in adjacent_pairs(mesh)]
    problem, best, space = min(candidates + paired, key=lambda c: c[1].cost)
    dual_bound, dual, guided = -math.inf, {}, None
    if shortlist and best.cost > bounded.stats["lower_bound"] * (1 + SHORTLIST_GAP):
        dual_bound, dual, guided = _shortlisted_by_dual(full, problems)
        if guided is not None and guided.cost < best.cost:
            problem, best, space = full, guided, "shortlisted by the dual"
    bound = max(bounded.stats["lower_bound"], dual_bound)
    gap = 0.0 if best.cost <= bound else (best.cost - bound) / best.cost
    stats = {**best.stats, **dual, "exact": gap <= 1e-12, "lower_bound": bound, "gap": gap,
             "bounded_elimination_s": bounded.cost, "one_axis_at_a_time_s": candidates[1][1].cost,
             "all_axes_as_one_s": candidates[2][1].cost,
             "narrow_s": min(candidates[3][1].cost, candidates[4][1].cost)}
    if paired:
        stats["axes_paired_s"] = min(c[1].cost for c in paired)
    if guided is not None:
        stats["shortlisted_s"] = guided.cost
    if dual_bound > bounded.stats["lower_bound"]:
        stats["bound"] = "dual"
    return problem, search.Solution(best.choice, best.cost, stats), space


def _shortlisted_by_dual(full: Problem, problems: dict | None
                         ) -> tuple[float, dict[str, Any], search.Solution | None]:
    """(the dual bound of `full`, its stats, the plan `search.shortlisted` finds from it).
    Min-sum diffusion starts where the last one on these edges stopped (kept in `problems`,
    as `plan_bound.with_dual_bound` keeps it, which goes on from here). On a bounded problem its
    shortlist finds plans the restrictions above miss (docs/decisions.md, "Plans from the
    dual")."""
    edges = full.graph.edges
    kept = (problems or {}).get("dual")
    start = kept[1] if kept is not None and kept[0] is edges else None
    # From an earlier memory round's reparametrisation, a few sweeps re-balance the new node
    # costs (the rounds of a memory-limited plan differ in node costs alone).
    sweeps = DUAL_SWEEPS if start is None else DUAL_SWEEPS // 6
    bound, stats, reached = search.dual_bound(full.graph, work=DUAL_WORK, max_sweeps=sweeps,
                                              start=start)
    if problems is not None:
        problems["dual"] = (edges, reached)
    return bound, stats, search.shortlisted(full.graph, reached)


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


