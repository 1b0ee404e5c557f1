"""Exact search under a budget (search.constrained) against brute force. No JAX here."""
import itertools
import math

import numpy as np
import pytest

from autopar_search import CostGraph, InfeasibleError
from autopar_search.constrained import solve_constrained


def random_problem(seed):
    """A small dense graph with a use per strategy that pulls against its cost (cheap
    strategies use more), as replicating against sharding does; some pairs forbidden."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 8))
    ks = [int(k) for k in rng.integers(1, 5, size=n)]
    use = [rng.integers(0, 20, size=k).astype(float) for k in ks]
    costs = tuple(rng.random(k) + 0.05 * (20 - u) for k, u in zip(ks, use))
    edges = []
    for u, v in itertools.combinations(range(n), 2):
        if rng.random() < 0.6:
            m = rng.random((ks[u], ks[v]))
            m[rng.random(m.shape) < 0.1] = math.inf
            edges.append((u, v, m))
    return CostGraph(costs, tuple(edges)), use


def brute_force(graph, use, budget):
    """The cheapest fitting assignment's cost, enumerated (None when nothing fits)."""
    best = None
    for choice in itertools.product(*(range(len(c)) for c in graph.node_costs)):
        cost = graph.total_cost(choice)
        if math.isfinite(cost) and sum(u[c] for u, c in zip(use, choice)) <= budget:
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_matches_brute_force_at_every_budget(seed):
    graph, use = random_problem(seed)
    lowest, highest = sum(u.min() for u in use), sum(u.max() for u in use)
    for budget in np.linspace(lowest, highest, 5):
        want = brute_force(graph, use, budget)
        if want is None:
            with pytest.raises(InfeasibleError):
                solve_constrained(graph, use, budget)
            continue
        got = solve_constrained(graph, use, budget)
        assert got.stats["exact"], got.stats
        assert got.cost == pytest.approx(want, rel=1e-9)
        assert got.cost == graph.total_cost(got.choice)
        assert got.stats["use"] == sum(u[c] for u, c in zip(use, got.choice)) <= budget
        assert got.stats["lower_bound"] <= want * (1 + 1e-9)


def test_branching_is_needed_and_finds_what_prices_miss():
    """Over the random problems, some constrained optima lie above the convex hull of
    (use, cost): the root's Lagrangian bound alone is below them, and branching finds them."""
    branched = 0
    for seed in range(60):
        graph, use = random_problem(seed)
        lowest, highest = sum(u.min() for u in use), sum(u.max() for u in use)
        for budget in np.linspace(lowest, highest, 5)[1:-1]:
            if brute_force(graph, use, budget) is None:
                continue
            root = solve_constrained(graph, use, budget, max_parts=1)
            full = solve_constrained(graph, use, budget)
            assert root.stats["lower_bound"] <= full.cost * (1 + 1e-9)
            assert root.cost >= full.cost * (1 - 1e-9)
            if full.stats["parts"] > 1 and root.cost > full.cost * (1 + 1e-9):
                branched += 1
                assert not root.stats["exact"] and root.stats["gap"] > 0
    assert branched >= 3


def test_a_proof_stopped_at_a_gap_is_within_it_and_not_called_exact():
    """With stop_gap, the optimum is at least (1 - stop_gap) times the answer, the reported
    bound is a true lower bound, and the answer is `exact` only where its gap is nil; some
    searches stop earlier than the full proof and some answers then miss the optimum."""
    stop_gap, earlier, missed = 0.05, 0, 0
    for seed in range(60):
        graph, use = random_problem(seed)
        lowest, highest = sum(u.min() for u in use), sum(u.max() for u in use)
        for budget in np.linspace(lowest, highest, 5)[1:-1]:
            want = brute_force(graph, use, budget)
            if want is None:
                continue
            full = solve_constrained(graph, use, budget)
            got = solve_constrained(graph, use, budget, stop_gap=stop_gap)
            assert want * (1 - 1e-9) <= got.cost
            assert got.cost * (1 - stop_gap) <= want * (1 + 1e-9)
            assert got.stats["lower_bound"] <= want * (1 + 1e-9)
            assert got.stats["exact"] == (got.stats["gap"] <= 1e-9)
            if got.stats["exact"]:
                assert got.cost == pytest.approx(want, rel=1e-9)
            earlier += got.stats["solves"] < full.stats["solves"]
            missed += got.cost > want * (1 + 1e-9)
    assert earlier >= 3 and missed >= 1, (earlier, missed)


def test_a_generous_budget_gives_the_unconstrained_optimum():
    graph, use = random_problem(3)
    free = solve_constrained(graph, use, sum(u.max() for u in use))
    assert free.stats["exact"] and free.stats["solves"] == 1
    assert free.cost == pytest.approx(brute_force(graph, use, math.inf))


def test_bad_use_is_rejected():
    graph, use = random_problem(4)
    with pytest.raises(ValueError, match="one vector per node"):
        solve_constrained(graph, use[:-1], 10.0)
    with pytest.raises(ValueError, match="non-negative"):
        solve_constrained(graph, [-u for u in use], 10.0)
