"""The bound a plan carries on the cost model's optimum, computed once for the plan a planning
chose (at its memory price), not once a memory round: the dual of the problem its search
solved (`search.dual_bound`), or for recursive_programming on meshes of many axes the
operators' own costs alone (the problem without its edges)."""
from __future__ import annotations

import autopar_search as search
from autopar.cost.hardware import Hardware
from autopar.mesh import MeshShape
from autopar.plan_stats import SearchStats
from autopar.planning.axes import axis_order
from autopar.planning.pricing import Unit
from autopar.planning.problem import build_problem, kept_problem
from autopar.rules.factors import Spec
from autopar.trace.ir import OpGraph

# The dual bound (search.dual_bound) of a chosen plan no search proved: at most this many
# sweeps and table entries of work (about 0.25 to 0.5 s here for a step's 192 nodes), from
# where the last bound of the same problem stopped (a plan made again at a smaller memory
# estimate). Counted in work, not seconds, so that a plan's bound is the same on every
# machine. Its bound rises fast, then
# slowly: 12-layer GPTs at d_model 2048 (h100) on 64 devices converge within 0.36% of the
# plan; on 1,024 they are within 12% after 30 sweeps and 4.6% after 400, where mini-buckets
# stay 77% away.
DUAL_SWEEPS = 60
DUAL_WORK = 2e8

# Mesh axes (of more than one device) up to which recursive_programming builds the whole
# space's problem for its dual bound. With three, building it outweighs the search: Llama-3-8B
# (nn.scan) on 8x4x8 planned in 0.7 s without the bound and 6.0 s with it; on 16x16, 0.7 s
# with it. Above, the bound is the operators' own costs alone (_operators_bound).
RECURSIVE_BOUND_AXES = 2


def with_dual_bound(graph: OpGraph, mesh: MeshShape, hw: Hardware, algorithm: str,
                    pinned: dict[int, Spec] | None, units: list[Unit], problems: dict,
                    stats: SearchStats) -> SearchStats:
    """`stats` of the plan a planning chose (at its memory price), with the dual bound of the
    problem its search solved where that is higher than the search's own bound: computed
    once a plan, not once a memory round. None for a proven answer (exact elimination, a
    kept-bytes proof); for recursive_programming on meshes of more than RECURSIVE_BOUND_AXES
    axes, the operators' costs alone instead (_operators_bound; said in `bound`). `exact` is
    claimed at a nil gap without a memory price only."""
    if stats.exact or stats.kept_budget_bytes is not None:
        return stats
    if algorithm == "recursive_programming" and len(axis_order(mesh)) > RECURSIVE_BOUND_AXES:
        return _operators_bound(graph, mesh, hw, pinned, units, problems, stats)
    unpriced = problems.get("untied") if algorithm == "dynamic_programming" else None
    if unpriced is None:
        unpriced = kept_problem(problems, "full", lambda: build_problem(
            graph, mesh, hw, pinned, units=units, memo=problems))
    price = stats.memory_price_s_per_byte or 0.0
    problem = unpriced.priced(graph, mesh, price)
    cost = stats.objective_s
    kept = problems.get("dual")  # where the last bound of these edges stopped
    edges = problem.graph.edges  # shared by the problem at every price (with_node_costs)
    start = kept[1] if kept is not None and kept[0] is edges else None
    bound, dual, reached = search.dual_bound(problem.graph, target=cost, work=DUAL_WORK,
                                             max_sweeps=DUAL_SWEEPS, start=start)
    problems["dual"] = (edges, reached)
    if stats.lower_bound is not None and bound <= stats.lower_bound:
        return stats.noting(**dual)
    gap = _gap(cost, bound)
    return stats.noting(**dual, lower_bound=bound, gap=gap, bound="dual",
                        exact=gap <= search.REACHED and not price)


def _operators_bound(graph: OpGraph, mesh: MeshShape, hw: Hardware,
                     pinned: dict[int, Spec] | None, units: list[Unit], problems: dict,
                     stats: SearchStats) -> SearchStats:
    """`stats` with the bound of the whole space's problem without its edges: each node's
    cheapest strategy, at the plan's memory price. A relaxation (every edge costs at least
    nothing), so a lower bound, but a loose one: it leaves out the resharding between
    operators that any plan pays somewhere (Llama-3-8B on 8 x 4 x 8: 33%, where the dual
    bound of dynamic_programming's plan is 9%); built in about 0.3 s where the edges would
    take seconds."""
    nodes = kept_problem(problems, "operators alone", lambda: build_problem(
        graph, mesh, hw, pinned, units=units, memo=problems, edges=False))
    problem = nodes.priced(graph, mesh, stats.memory_price_s_per_byte or 0.0)
    bound = float(sum(costs.min() for costs in problem.graph.node_costs))
    gap = _gap(stats.objective_s, bound)
    return stats.noting(lower_bound=bound, gap=gap, bound=(
        f"operators alone: the whole space of {len(axis_order(mesh))} mesh axes without the "
        "resharding between operators, whose edges are slow to build (dynamic_programming "
        "bounds it by the dual)"),
        exact=gap <= search.REACHED and not stats.memory_price_s_per_byte)


def _gap(cost: float, bound: float) -> float:
    """How far above the bound the plan's objective is, relative to the objective."""
    return max(0.0, (cost - bound) / cost) if cost > 0 else 0.0
