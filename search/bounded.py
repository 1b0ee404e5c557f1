"""Bounded elimination: when exact elimination would need too large a table.

Mini-bucket elimination (Dechter and Rish, 2003) eliminates a variable separately from groups
of its factors whose joint table fits the size limit. Minimising each group on its own can only
under-estimate, so the value it ends with is a lower bound on the optimum. The assignment read
back from its records is then improved by coordinate descent on the true costs, and the gap to
the bound is reported: the answer is either proven optimal (gap 0) or off by at most the gap.
"""
from __future__ import annotations

import itertools
import math
import time
from typing import Any

import numpy as np

from .costgraph import CostGraph, InfeasibleError, Solution
from .width import EliminationOrder, neighbours

Factor = tuple[tuple[int, ...], np.ndarray]
# Variables a joint table may span, whatever its entries: numpy's arrays take at most 64
# dimensions, and variables of one strategy (pinned shardings) add dimensions, not entries.
MAX_SCOPE = 32


def _table(scope: tuple[int, ...], factors: list[Factor], size: dict[int, int]) -> np.ndarray:
    """Sum of `factors` as one table over `scope`."""
    axes = {w: i for i, w in enumerate(scope)}
    total = np.zeros(tuple(size[w] for w in scope))
    for fscope, table in factors:
        perm = sorted(range(len(fscope)), key=lambda i: axes[fscope[i]])
        view = [1] * len(scope)
        for i in perm:
            view[axes[fscope[i]]] = size[fscope[i]]
        total = total + table.transpose(perm).reshape(view)
    return total


def _partition(x: int, factors: list[Factor], size: dict[int, int],
               limit: float) -> list[list[Factor]]:
    """Groups of factors whose joint table over their scope stays within `limit`."""
    groups: list[tuple[set[int], list[Factor]]] = []
    for f in sorted(factors, key=lambda f: -f[1].size):
        for scope, members in groups:
            joint = scope | set(f[0])
            if len(joint) <= MAX_SCOPE and math.prod(size[w] for w in joint) <= limit:
                scope |= set(f[0])
                members.append(f)
                break
        else:
            groups.append((set(f[0]) | {x}, [f]))
    return [members for _, members in groups]


def solve_bounded(graph: CostGraph, max_factor_size: float = 2e7,
                  sweeps: int = 100, pairs: dict[tuple[int, int], np.ndarray] | None = None
                  ) -> Solution:
    """A plan with a proven lower bound: mini-bucket elimination, then coordinate descent.
    `pairs`: `pair_tables` of a graph of the same edges (read, never changed), from a caller
    that searches these edges again at other node costs."""
    start = time.perf_counter()
    n = graph.num_nodes()
    size, self_cost, pair = factor_tables(graph, pairs)
    bound, records, splits = _mini_buckets(graph, size, self_cost, pair, max_factor_size)
    choice = np.zeros(n, dtype=np.int64)
    for x, bucket in reversed(records):
        costs = np.zeros(size[x])
        for fscope, table in bucket:
            index = tuple(slice(None) if w == x else choice[w] for w in fscope)
            costs = costs + table[index]
        choice[x] = int(np.argmin(costs))
    if not bound < math.inf:
        raise InfeasibleError(f"every assignment of the {n} nodes has infinite cost")
    swept = _descend(choice, self_cost, pair, sweeps)
    cost = graph.total_cost(choice)
    stats: dict[str, Any] = {
        "nodes": n, "edges": graph.num_edges(), "exact": splits == 0, "lower_bound": bound,
        "gap": 0.0 if cost <= bound or cost == 0 else (cost - bound) / cost,
        "mini_bucket_splits": splits, "descent_sweeps": swept,
        "seconds": time.perf_counter() - start,
    }
    return Solution(choice, cost, stats)


def pair_tables(graph: CostGraph) -> dict[tuple[int, int], np.ndarray]:
    """The pairwise tables of `graph` summed per pair of nodes (u < v, indexed [u's strategy,
    v's]), new arrays the caller owns. They depend on the edges alone: a graph searched at
    several node costs (CostGraph.with_node_costs) has the same ones, which a caller may
    keep rather than sum a wide graph's edges again."""
    pair: dict[tuple[int, int], np.ndarray] = {}
    for u, v, m in graph.edges:
        if u == v:
            continue
        key, mat = ((u, v), m) if u < v else ((v, u), m.T)
        pair[key] = pair[key] + mat if key in pair else np.array(mat, dtype=np.float64)
    return pair


def factor_tables(graph: CostGraph, pairs: dict[tuple[int, int], np.ndarray] | None = None
                  ) -> tuple[dict[int, int], list[np.ndarray],
                             dict[tuple[int, int], np.ndarray]]:
    """Strategies per node, each node's own costs (its self-edges included), and the
    pairwise tables summed per pair of nodes (`pairs` where given: see pair_tables)."""
    size = {u: int(graph.node_costs[u].shape[0]) for u in range(graph.num_nodes())}
    pair = pair_tables(graph) if pairs is None else pairs
    self_cost = [np.array(c, dtype=np.float64) for c in graph.node_costs]
    for u, v, m in graph.edges:
        if u == v:
            self_cost[u] = self_cost[u] + np.diag(m)
    return size, self_cost, pair


def _mini_buckets(graph: CostGraph, size: dict[int, int], self_cost: list[np.ndarray],
                  pair: dict[tuple[int, int], np.ndarray], max_factor_size: float
                  ) -> tuple[float, list[tuple[int, list[Factor]]], int]:
    """Mini-bucket elimination: a lower bound, the buckets in elimination order (to choose
    strategies by backtracking) and how many times a bucket was split to fit the limit (none:
    the bound is the optimum)."""
    ids = itertools.count()
    factors: dict[int, Factor] = {}
    of_var: dict[int, set[int]] = {u: set() for u in size}

    def add(scope: tuple[int, ...], table: np.ndarray) -> None:
        fid = next(ids)
        factors[fid] = (scope, table)
        for w in scope:
            of_var[w].add(fid)

    for u in size:
        add((u,), self_cost[u])
    for (u, v), m in pair.items():
        add((u, v), m)

    order = EliminationOrder(size, neighbours(graph))
    bound = 0.0
    records: list[tuple[int, list[Factor]]] = []
    splits = 0
    while (item := order.pop()) is not None:
        x = item[0]
        bucket = [factors.pop(f) for f in of_var.pop(x)]
        for fscope, _ in bucket:
            for w in fscope:
                if w != x:
                    of_var[w] -= {f for f in of_var[w] if f not in factors}
        records.append((x, bucket))
        groups = _partition(x, bucket, size, max_factor_size)
        splits += len(groups) - 1
        scopes = []
        for members in groups:
            scope = tuple(sorted({w for f in members for w in f[0]} - {x}))
            # x first: numpy's min over the first axis runs over whole rows at once, and
            # over a short last axis row by row, many times slower (docs/decisions.md,
            # "Elimination minimises over a variable one strategy at a time").
            best = _table((x, *scope), members, size).min(axis=0)
            if scope:
                add(scope, best)
            else:
                bound += float(best)
            scopes.append(set(scope))
        order.eliminated(x, scopes)
    return bound, records, splits


def _descend(choice: np.ndarray, self_cost: list[np.ndarray],
             pair: dict[tuple[int, int], np.ndarray], sweeps: int) -> int:
    """Coordinate descent on the true costs, in place: each node takes its best strategy given
    the rest, until none changes (or `sweeps` sweeps). Returns the sweeps made."""
    n = len(self_cost)
    incident: dict[int, list[tuple[int, np.ndarray]]] = {u: [] for u in range(n)}
    for (u, v), m in pair.items():
        incident[u].append((v, m))
        incident[v].append((u, m.T))
    for sweep in range(sweeps):
        changed = False
        for u in range(n):
            costs = self_cost[u].copy()
            for v, m in incident[u]:
                costs += m[:, choice[v]]
            best = int(np.argmin(costs))
            if costs[best] < costs[choice[u]] - 1e-15 * abs(costs[choice[u]]):
                choice[u] = best
                changed = True
        if not changed:
            break
    return sweep + 1
