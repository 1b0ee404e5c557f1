"""The greedy elimination order, and how large exact elimination's tables would get.

`EliminationOrder` picks next the variable whose elimination builds the smallest table (ties:
fewest neighbours), with a heap whose stale entries are skipped, so thousands of variables stay
cheap. `largest_table` runs it on the graph's structure alone: pruning can only shrink tables,
so this bounds what the exact algorithm will allocate, and a caller can choose another method
before paying for tables.
"""
from __future__ import annotations

import heapq
import math
from typing import Iterable

from .costgraph import CostGraph


class EliminationOrder:
    """Variables in greedy min-table order, updated as eliminations connect neighbours."""

    def __init__(self, size: dict[int, int], nbrs: dict[int, set[int]]) -> None:
        self.size, self.nbrs = size, nbrs
        self.current = {x: self._key(x) for x in nbrs}
        self.heap = [(*k, x) for x, k in self.current.items()]
        heapq.heapify(self.heap)

    def _key(self, x: int) -> tuple[float, int]:
        return (min(math.prod(self.size[w] for w in self.nbrs[x]), 1e300), len(self.nbrs[x]))

    def pop(self) -> tuple[int, float] | None:
        """The next variable and the entries of its table (its strategies times its
        neighbours'); None when all are eliminated."""
        while self.heap:
            s, d, x = heapq.heappop(self.heap)
            if self.current.get(x) == (s, d):
                del self.current[x]
                return x, s * self.size[x]
        return None

    def eliminated(self, x: int, scopes: Iterable[set[int]]) -> None:
        """x is gone; each scope (the variables of one new table) becomes a clique."""
        touched: set[int] = set()
        for scope in scopes:
            for w in scope:
                self.nbrs[w].update(v for v in scope if v != w)
            touched |= scope
        for w in self.nbrs.pop(x):
            self.nbrs[w].discard(x)
            touched.add(w)
        for w in touched:
            if w in self.current:
                self.current[w] = self._key(w)
                heapq.heappush(self.heap, (*self.current[w], w))


def neighbours(graph: CostGraph) -> dict[int, set[int]]:
    nbrs: dict[int, set[int]] = {u: set() for u in range(graph.num_nodes())}
    for u, v, _ in graph.edges:
        if u != v:
            nbrs[u].add(v)
            nbrs[v].add(u)
    return nbrs


def largest_table(graph: CostGraph, stop_above: float = math.inf) -> float:
    """Entries of the largest table greedy elimination builds (it stops early past
    `stop_above`, returning the first size above it)."""
    order = EliminationOrder({u: int(c.shape[0]) for u, c in enumerate(graph.node_costs)},
                             neighbours(graph))
    largest = 0.0
    while (item := order.pop()) is not None:
        x, table = item
        largest = max(largest, table)
        if largest > stop_above:
            break
        order.eliminated(x, [set(order.nbrs[x])])
    return largest
