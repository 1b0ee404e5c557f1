"""Greedy search over the graph, heaviest node first: linear in the size of the graph.

The graph half of MindSpore's double recursion: nodes are visited in order of their weight (the
most expensive operators first), and each takes the strategy that minimises its own cost plus the
resharding against the neighbours already decided. A few sweeps of coordinate descent then let
early choices see the later ones. The device half (one mesh axis at a time) lives with the caller,
which knows what an axis is.
"""
from __future__ import annotations

import math
import time

import numpy as np

from .costgraph import CostGraph, InfeasibleError, Solution, register_algorithm


def solve_recursive_programming(graph: CostGraph, *, sweeps: int = 3) -> Solution:
    """Heaviest-first greedy choice, then up to `sweeps` rounds of coordinate descent."""
    start = time.perf_counter()
    n = graph.num_nodes()
    own, incident = graph.local_view()

    def weight(u: int) -> float:
        finite = own[u][np.isfinite(own[u])]
        return float(finite.max()) if finite.size else math.inf

    choice = np.full(n, -1, dtype=np.int64)

    def costs(u: int) -> np.ndarray:
        total = own[u].copy()
        for v, m in incident[u]:
            if choice[v] >= 0:
                total += m[:, choice[v]]
        return total

    for u in sorted(range(n), key=lambda u: -weight(u)):
        choice[u] = int(np.argmin(costs(u)))
    done = 0
    for done in range(1, sweeps + 1):
        changed = False
        for u in range(n):
            c = costs(u)
            best = int(np.argmin(c))
            if c[best] < c[choice[u]]:
                choice[u], changed = best, True
        if not changed:
            break
    cost = graph.total_cost(choice)
    if not cost < math.inf:
        raise InfeasibleError(f"no finite assignment found for the {n} nodes")
    return Solution(choice, cost, {"nodes": n, "edges": graph.num_edges(), "exact": False,
                                   "descent_sweeps": done,
                                   "seconds": time.perf_counter() - start})


register_algorithm("recursive_programming", solve_recursive_programming)
