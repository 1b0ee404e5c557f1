"""Sharding propagation on plain CostGraphs (no jax)."""
import numpy as np
import pytest

from autopar_search import CostGraph, solve

# Two strategies per node: 0 = "split one way", 1 = "split the other way".
SWITCH = np.array([[0.0, 5.0], [5.0, 0.0]])


def chain(n, own=None):
    own = own or [np.array([1.0, 1.0])] * n
    return CostGraph(tuple(own), tuple((i, i + 1, SWITCH) for i in range(n - 1)))


def test_seed_spreads_along_a_chain():
    graph = chain(5, [np.array([np.inf, 0.0])] + [np.array([0.0, 1.0])] * 4)
    sol = solve(graph, "sharding_propagation", seeds=[0])
    # Each node would rather pick 0 on its own, but following the seed costs less resharding.
    assert list(sol.choice) == [1, 1, 1, 1, 1]
    assert sol.stats["reached"] == 5


def test_ties_in_resharding_are_broken_by_own_cost():
    own = [np.array([0.0]), np.array([3.0, 2.0, 7.0])]
    edge = np.array([[1.0, 1.0, 4.0]])
    graph = CostGraph(tuple(own), ((0, 1, edge),))
    assert list(solve(graph, "sharding_propagation", seeds=[0]).choice) == [0, 1]


def test_a_node_waits_for_what_feeds_it():
    # 0 (seed) -> 1 -> 3 and 0 -> 2 -> 3 via a long way: 3 is decided after both 1 and 2.
    own = [np.array([np.inf, 0.0]), np.array([0.0, 0.0]), np.array([0.0, 0.0]),
           np.array([0.0, 0.0])]
    edges = ((0, 1, SWITCH), (0, 2, SWITCH), (1, 3, SWITCH), (2, 3, SWITCH * 3))
    sol = solve(CostGraph(tuple(own), edges), "sharding_propagation", seeds=[0])
    assert list(sol.choice) == [1, 1, 1, 1]


def test_unreached_nodes_take_their_defaults():
    own = [np.array([0.0, 1.0]), np.array([0.0, 1.0]), np.array([0.0, 1.0])]
    graph = CostGraph(tuple(own), ((0, 1, SWITCH),))
    sol = solve(graph, "sharding_propagation", seeds=[1], defaults=[0, 0, 1])
    assert list(sol.choice) == [0, 0, 1] and sol.stats["reached"] == 2


def test_propagation_needs_a_seed():
    with pytest.raises(ValueError, match="at least one seed"):
        solve(chain(2), "sharding_propagation", seeds=[])
