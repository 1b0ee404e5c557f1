"""How large exact elimination's tables would get, without building them.

Runs the same greedy order as `dynamic_programming` (smallest new table first) on the graph's
structure alone. Pruning can only shrink tables, so this is an upper bound on what the exact
backend will allocate: a caller can choose a smaller search space before paying for tables.
"""
from __future__ import annotations

import heapq
import math

from .costgraph import CostGraph


def largest_table(graph: CostGraph, stop_above: float = math.inf) -> float:
    """Entries of the largest table greedy elimination builds (it stops early past
    `stop_above`, returning the first size above it)."""
    n = graph.num_nodes()
    size = [int(c.shape[0]) for c in graph.node_costs]
    nbrs: list[set[int]] = [set() for _ in range(n)]
    for u, v, _ in graph.edges:
        if u != v:
            nbrs[u].add(v)
            nbrs[v].add(u)

    def key(x: int) -> tuple[float, int]:
        return (min(math.prod(size[w] for w in nbrs[x]), 1e300), len(nbrs[x]))

    current = {x: key(x) for x in range(n)}
    heap = [(*k, x) for x, k in current.items()]
    heapq.heapify(heap)
    largest = 0.0
    while heap:
        s, d, x = heapq.heappop(heap)
        if current.get(x) != (s, d):
            continue
        del current[x]
        largest = max(largest, s * size[x])
        if largest > stop_above:
            return largest
        scope = nbrs[x]
        for w in scope:
            nbrs[w].discard(x)
            nbrs[w].update(v for v in scope if v != w)
        for w in scope:
            current[w] = key(w)
            heapq.heappush(heap, (*current[w], w))
        nbrs[x] = set()
    return largest
