"""Sharding propagation: spread a few fixed choices over the graph at least resharding cost.

MindSpore's sharding_propagation, on a CostGraph. The seed nodes keep their (cheapest finite)
strategy. Then the graph is visited breadth-first from them: each node reached takes the
strategy whose edges to the nodes already decided cost least (the resharding it causes), ties
broken by its own cost. A node waits while a node that feeds it (an edge into it) is still
undecided and reachable another way; when every node of the frontier waits, the one found
first goes ahead. Nodes no seed reaches take their default. Each node is decided once, looking
at its edges once: linear in the size of the graph.
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Sequence

import numpy as np

from .costgraph import CostGraph, InfeasibleError, Solution, register_algorithm

TIE = 1e-9  # relative: resharding costs this close count as equal


def solve_sharding_propagation(graph: CostGraph, *, seeds: Sequence[int],
                               defaults: Sequence[int] | None = None) -> Solution:
    """Propagate from `seeds`; unreached nodes take `defaults` (else their cheapest strategy)."""
    start = time.perf_counter()
    n = graph.num_nodes()
    if not len(seeds):
        raise ValueError("sharding propagation needs at least one seed node")
    own, incident = graph.local_view()
    feeds: list[set[int]] = [set() for _ in range(n)]  # node -> the nodes with an edge into it
    for u, v, _ in graph.edges:
        if u != v:
            feeds[v].add(u)
    choice = np.full(n, -1, dtype=np.int64)
    ready: deque[int] = deque()
    found: deque[int] = deque()
    seen = np.zeros(n, dtype=bool)

    def decide(u: int, pick: int) -> None:
        choice[u] = pick
        for v, _ in incident[u]:
            if choice[v] >= 0:
                continue
            feeds[v].discard(u)
            if not seen[v]:
                seen[v] = True
                found.append(v)
            if not feeds[v]:
                ready.append(v)

    for s in seeds:
        seen[s] = True
        finite = np.isfinite(own[s])
        if not finite.any():
            raise InfeasibleError(f"seed {graph.name(s)} has no finite strategy")
        decide(s, int(np.argmin(own[s])))
    reached = len(set(int(s) for s in seeds))
    while True:
        u = _next(ready, choice)
        if u is None:
            u = _next(found, choice)
        if u is None:
            break
        resharding = np.zeros_like(own[u])
        for v, m in incident[u]:
            if choice[v] >= 0:
                resharding += m[:, choice[v]]
        decide(u, _least(resharding, own[u], graph.name(u)))
        reached += 1
    for u in range(n):
        if choice[u] < 0:
            choice[u] = int(defaults[u]) if defaults is not None else int(np.argmin(own[u]))
    cost = graph.total_cost(choice)
    if not cost < math.inf:
        raise InfeasibleError(f"propagation reached no finite assignment for the {n} nodes")
    return Solution(choice, cost, {"nodes": n, "edges": graph.num_edges(), "exact": False,
                                   "seeds": len(seeds), "reached": reached,
                                   "seconds": time.perf_counter() - start})


def _next(queue: deque[int], choice: np.ndarray) -> int | None:
    while queue:
        u = queue.popleft()
        if choice[u] < 0:
            return u
    return None


def _least(resharding: np.ndarray, own: np.ndarray, name: str) -> int:
    """Least resharding, then least own cost, among the finite strategies."""
    total = resharding + own
    feasible = np.isfinite(total)
    if not feasible.any():
        raise InfeasibleError(f"{name} has no finite strategy next to its decided neighbours")
    best = resharding[feasible].min()
    tied = feasible & (resharding <= best + TIE * abs(best))
    return int(np.flatnonzero(tied)[np.argmin(own[tied])])


register_algorithm("sharding_propagation", solve_sharding_propagation)
