"""Bounded elimination: its lower bound never exceeds the optimum, its answer never beats it,
and with room enough it is exact. No JAX here."""
import itertools

import numpy as np
import pytest

from autopar_search import CostGraph, solve
from autopar_search.bounded import solve_bounded


def random_graph(rng, n, k_max, p):
    costs = [rng.random(rng.integers(1, k_max + 1)) for _ in range(n)]
    edges = [(u, v, rng.random((len(costs[u]), len(costs[v])))) for u, v in
             itertools.combinations(range(n), 2) if rng.random() < p]
    return CostGraph(tuple(costs), tuple(edges))


@pytest.mark.parametrize("seed", range(40))
def test_bound_brackets_brute_force(seed):
    rng = np.random.default_rng(seed)
    g = random_graph(rng, int(rng.integers(2, 8)), 4, 0.7)
    best = solve(g, "brute_force").cost
    tight = solve_bounded(g, max_factor_size=1e9)
    assert tight.stats["exact"]
    assert tight.cost == pytest.approx(best, rel=1e-9)
    small = solve_bounded(g, max_factor_size=8)  # forces mini-buckets on dense graphs
    assert small.stats["lower_bound"] <= best + 1e-9
    assert small.cost >= best - 1e-9
    assert small.cost == pytest.approx(g.total_cost(small.choice))


def test_a_bucket_of_many_single_strategy_variables_is_split():
    """Pinned shardings leave nodes of one strategy: a dense graph of them makes buckets whose
    tables have one entry and more dimensions than numpy allows (64), which crashed the
    search of a Python-loop Llama-3-8B on 8x4x8 with its inputs pinned."""
    n = 70
    rng = np.random.default_rng(0)
    costs = [rng.random(1) for _ in range(n - 1)] + [rng.random(2)]
    edges = [(u, v, rng.random((len(costs[u]), len(costs[v]))))
             for u, v in itertools.combinations(range(n), 2)]
    g = CostGraph(tuple(costs), tuple(edges))
    answer = solve_bounded(g, max_factor_size=1e9)
    best = min(g.total_cost([0] * (n - 1) + [k]) for k in range(2))
    assert answer.cost == pytest.approx(best, rel=1e-9)
    assert answer.stats["lower_bound"] <= best + 1e-9
