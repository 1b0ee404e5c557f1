"""The dual bound (min-sum diffusion): never above the optimum, whatever the graph, forbidden
strategies, self-edges or warm start; equal to it where the LP relaxation is tight (trees);
the plans its shortlists find; and in the planner, a bound and gap with every plan of both
searches. No JAX in the first part."""

import numpy as np
import pytest

from autopar_search import REACHED, CostGraph, dual_bound, shortlisted, solve
from test_bounded import random_graph


def with_forbidden(rng, g):
    """`g` with some strategies forbidden (inf), never all of a node's."""
    costs = [np.where(rng.random(len(c)) < 0.2, np.inf, c) for c in g.node_costs]
    for c, old in zip(costs, g.node_costs):
        if np.isinf(c).all():
            c[0] = old[0]
    edges = [(u, v, np.where(rng.random(m.shape) < 0.1, np.inf, m)) for u, v, m in g.edges]
    edges += [(0, 0, rng.random((len(costs[0]), len(costs[0]))))]  # a self-edge: its diagonal
    return CostGraph(tuple(costs), tuple(edges))


def loopy_case(seed):
    """A random graph with cycles (with forbidden strategies for odd seeds) and its optimum
    by brute force; None where every assignment is forbidden."""
    rng = np.random.default_rng(seed)
    g = random_graph(rng, int(rng.integers(2, 8)), 5, 0.7)
    if seed % 2:
        g = with_forbidden(rng, g)
    try:
        return g, solve(g, "brute_force").cost
    except ValueError:  # every assignment forbidden
        return None


@pytest.mark.parametrize("seed", range(60))
def test_bound_never_exceeds_the_optimum(seed):
    if (case := loopy_case(seed)) is None:
        return
    g, best = case
    bound, stats, _ = dual_bound(g, work=1e12)
    assert bound <= best + 1e-9 * abs(best), (bound, best, stats)
    # a target stops it once reached: never beyond the optimum either
    stopped, stats, _ = dual_bound(g, target=best, work=1e12)
    assert stopped <= best + 1e-9 * abs(best)


@pytest.mark.parametrize("seed", range(20))
def test_bound_is_the_optimum_on_a_tree(seed):
    """On a tree the LP relaxation is tight, and diffusion reaches the optimum."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 9))
    costs = [rng.random(int(rng.integers(1, 5))) for _ in range(n)]
    edges = [(int(rng.integers(0, v)), v, None) for v in range(1, n)]
    edges = [(u, v, rng.random((len(costs[u]), len(costs[v])))) for u, v, _ in edges]
    g = CostGraph(tuple(costs), tuple(edges))
    best = solve(g, "brute_force").cost
    bound, stats, _ = dual_bound(g, target=best, work=1e12, max_sweeps=5000, stall=0)
    assert bound == pytest.approx(best, rel=1e-7), stats
    assert stats["dual_stop"] == "reached the plan's cost" or bound >= best * (1 - REACHED)


def random_tree(rng, n):
    costs = [rng.random(int(rng.integers(2, 6))) for _ in range(n)]
    edges = [(int(rng.integers(0, v)), v) for v in range(1, n)]
    return CostGraph(tuple(costs), tuple((u, v, rng.random((len(costs[u]), len(costs[v]))))
                                         for u, v in edges))


@pytest.mark.parametrize("seed", range(20))
def test_the_shortlist_finds_the_optimum_where_the_relaxation_is_tight(seed):
    """On a tree, converged diffusion leaves the optimum's strategies cheapest at every node:
    two a node are enough to find it."""
    rng = np.random.default_rng(seed)
    g = random_tree(rng, int(rng.integers(2, 9)))
    best = solve(g, "brute_force")
    _, _, reached = dual_bound(g, work=1e12, max_sweeps=5000, stall=0)
    found = shortlisted(g, reached, sizes=(2,))
    assert found.cost == pytest.approx(best.cost, rel=1e-9)
    assert found.cost == pytest.approx(g.total_cost(found.choice), rel=1e-12)


@pytest.mark.parametrize("seed", range(30))
def test_a_shortlisted_plan_is_costed_on_the_whole_graph(seed):
    """On loopy graphs, with forbidden strategies: its cost is its choice's true cost, never
    below the optimum, and its stats name the whole graph; with every strategy kept it is the
    optimum; with none fitting the table limit, None."""
    if (case := loopy_case(seed)) is None:
        return
    g, best = case
    _, _, reached = dual_bound(g, work=1e12)
    found = shortlisted(g, reached, sizes=(1, 2))
    assert found is None or found.cost >= best - 1e-9 * abs(best)
    # its stats name the graph it searched, as every search's do
    assert found is None or (found.stats["nodes"], found.stats["edges"]) == (g.num_nodes(),
                                                                            g.num_edges())
    if found is not None and np.isfinite(found.cost):
        assert found.cost == pytest.approx(g.total_cost(found.choice), rel=1e-12)
    assert shortlisted(g, reached, sizes=(5,)).cost == pytest.approx(best, rel=1e-9)
    assert shortlisted(g, reached, sizes=(5,), max_factor_size=0.5) is None


def test_warm_start_at_other_node_costs_stays_a_bound():
    """A search at another memory price starts from the last reparametrisation: still a
    bound of the new costs, and no more sweeps than from scratch."""
    rng = np.random.default_rng(7)
    g = random_graph(rng, 7, 5, 0.8)
    _, _, reached = dual_bound(g, work=1e12)
    for scale in (0.5, 3.0):
        priced = g.with_node_costs([c * scale + rng.random(len(c)) for c in g.node_costs])
        best = solve(priced, "brute_force").cost
        warm, warm_stats, _ = dual_bound(priced, work=1e12, start=reached)
        cold, cold_stats, _ = dual_bound(priced, work=1e12)
        assert warm <= best + 1e-9 and cold <= best + 1e-9
        assert warm == pytest.approx(cold, rel=1e-3, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("search, mesh", [
    ("dynamic_programming", {"data": 2, "model": 2, "inner": 2}),
    ("recursive_programming", {"data": 4, "model": 2}),
    ("recursive_programming", {"data": 2, "model": 2, "inner": 2})])
def test_every_plan_says_how_far_from_optimal_it_can_be(search, mesh):
    """A lower bound at most the plan's objective, the gap between, and exact only where the
    gap is nil, on meshes where no search is exact by itself; recursive_programming on a
    mesh of three axes bounds it by the operators' costs alone, which is at most the cost of
    any plan (dynamic_programming's too)."""
    import autopar
    import models
    step, state, batch = models.gpt_abstract(batch=64, seq=128, vocab=1024, d_model=256,
                                             heads=4, layers=1)
    plan = autopar.plan(step, state, batch, mesh=mesh, search=search, hardware="h100")
    stats = plan.search_stats
    line = next(x for x in plan.summary().splitlines() if x.startswith("search:"))
    if search == "recursive_programming" and len(mesh) == 3:
        assert stats["bound"].startswith("operators alone")
        other = autopar.plan(step, state, batch, mesh=mesh, hardware="h100")
        assert stats["lower_bound"] <= other.search_stats["objective_s"]
    assert 0 < stats["lower_bound"] <= stats["objective_s"] * (1 + 1e-9)
    assert stats["gap"] == pytest.approx(
        max(0.0, 1 - stats["lower_bound"] / stats["objective_s"]), abs=1e-12)
    assert stats["exact"] == (stats["gap"] <= REACHED and stats["exact_for"] == "all plans")
    assert ("proven optimal" in line) if stats["exact"] else (f"{stats['gap']:.2%}" in line)


def test_the_dual_shortlists_find_the_plan_the_restricted_searches_miss():
    """Llama-2-7B's 32 layers in one scan on 64 v5p chips as (32, 2): exact tables do not fit,
    the best of the other searches (bounded elimination) is 6% above the bound, and the plan
    solved exactly on the dual's shortlists is within 0.1% of it (the abstract step: nothing
    is compiled)."""
    import autopar
    from benchmarks import tpu_models
    work = tpu_models.setup("llama2-7b", batch=128, seq=2048)
    plan = autopar.plan(work.step, work.state, work.batch, mesh={"data": 32, "model": 2},
                        hardware="tpu_v5p", donate_argnums=0)
    stats = plan.search_stats
    assert stats["space"] == "shortlisted by the dual" and stats["nodes"] > 0
    others = [stats[k] for k in ("bounded_elimination_s", "one_axis_at_a_time_s",
                                 "all_axes_as_one_s", "narrow_s")]
    assert stats["objective_s"] == stats["shortlisted_s"] < 0.99 * min(others)
    assert stats["gap"] < 1e-3 and stats["lower_bound"] <= stats["objective_s"]


def test_a_plan_shortlisted_by_the_dual_writes_the_same_bytes_each_time():
    """The shortlists' wall-clock time stays out of the JSON: planned twice, one plan."""
    import autopar
    import models
    step, state, batch = models.gpt_abstract(batch=16, seq=32, vocab=256, d_model=64,
                                             heads=4, layers=1)
    made = [autopar.plan(step, state, batch, mesh={"data": 2, "model": 4}, hardware="cpu")
            for _ in range(2)]
    assert made[0].search_stats["space"] == "shortlisted by the dual"
    assert made[0].search_stats["shortlist_seconds"] != made[1].search_stats["shortlist_seconds"]
    assert made[0].to_json() == made[1].to_json() and made[0] == made[1]


def test_the_bound_is_computed_once_a_plan_not_once_a_memory_round(monkeypatch):
    import autopar
    import autopar_search
    import models
    calls = []
    real = autopar_search.dual_bound
    monkeypatch.setattr(autopar_search, "dual_bound",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    step, state, batch = models.mlp_setup()
    plan = autopar.plan(step, state, batch, mesh={"data": 2, "model": 4}, memory_limit=60_000,
                        search="recursive_programming")
    assert plan.search_stats["memory_solves"] > 1 and calls == [1]
    assert plan.search_stats["lower_bound"] <= plan.search_stats["objective_s"]
    assert not plan.search_stats["exact"]  # a memory price: not the fastest fitting, proven


def test_the_bound_is_computed_once_for_the_schedule_kept_not_for_each_weighed(monkeypatch):
    """pipeline="auto" plans each schedule worth weighing; only the plan kept is bounded,
    and it carries its bound."""
    import autopar
    import autopar_search
    import models
    import optax
    calls = []
    real = autopar_search.dual_bound
    monkeypatch.setattr(autopar_search, "dual_bound",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    config = dict(vocab=32, d_model=16, heads=2, layers=2, scan=True)
    _, state, data = models.gpt_abstract(batch=8, seq=4, **config)
    step = models.linen_step(models.GPT(**config), models.token_loss, optax.adamw(1e-3),
                             autopar.value_and_grad)
    plan = autopar.plan(step, state, data, mesh={"stage": 2, "data": 2}, pipeline="auto",
                        search="recursive_programming", hardware="h100")
    weighed = [t for t in plan.search_stats["schedules_tried"] if "total_ms" in t]
    assert len(weighed) > 1 and calls == [1]
    assert plan.search_stats["lower_bound"] <= plan.search_stats["objective_s"]


@pytest.mark.slow
@pytest.mark.parametrize("hardware", ["h100", "tpu_v5p"])
def test_the_problem_without_its_edges_costs_every_plan_no_more(hardware):
    """The relaxation behind recursive_programming's bound on meshes of three axes: without
    its edges (and with the summed pairs' collectives taken out of the nodes, as the whole
    problem takes them out: the TPU compiler reassociates sums) every assignment costs at
    most what it costs in the whole problem, so the nodes' minima bound the optimum."""
    import models
    from autopar.cost.hardware import get_profile
    from autopar.mesh import mesh_shape
    from autopar.planning.problem import build_problem, make_units
    from autopar.trace.tracer import trace
    step, state, batch = models.gpt_setup(batch=8, seq=8)
    hw = get_profile(hardware)
    graph = trace(step, (state, batch), compiler=hw.platform)[0]
    shape, units = mesh_shape({"data": 2, "model": 2, "inner": 2}), make_units(graph)
    whole = build_problem(graph, shape, hw, units=units)
    alone = build_problem(graph, shape, hw, units=units, edges=False)
    assert not alone.graph.edges and len(alone.graph.node_costs) == len(whole.graph.node_costs)
    rng = np.random.default_rng(0)
    for _ in range(200):
        choice = [int(rng.integers(len(c))) for c in whole.graph.node_costs]
        assert alone.graph.total_cost(choice) <= whole.graph.total_cost(choice) + 1e-15
    shape = mesh_shape({"model": 4})  # where exact elimination fits
    whole = build_problem(graph, shape, hw, units=units)
    alone = build_problem(graph, shape, hw, units=units, edges=False)
    optimum = solve(whole.graph, "dynamic_programming").cost
    assert 0 < sum(c.min() for c in alone.graph.node_costs) <= optimum
