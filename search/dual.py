"""A lower bound from the dual of the problem's linear-programming relaxation.

Moving cost between a node and its edges, subtracting φ(x_u) from edge (u, v) and adding it to
node u, changes no assignment's total: it is a reparametrisation. For any of them, the sum of
each node's and each edge's smallest cost is a lower bound on the optimum. Min-sum diffusion
(Kovalevsky and Koval; Werner 2007, "A linear programming approach to max-sum problem")
raises that bound by making each node's costs equal to the least costs of its edges on each
of its strategies, node after node. It converges to a fixed point of the LP relaxation's dual,
which is the optimum where the relaxation is tight. The bound is valid after every sweep,
converged or not, so the sweeps stop when the bound reaches a target (the plan at hand is then
proven optimal), when it stops rising, or when a budget of work is spent. The budget counts
table entries, not seconds, so that the same problem gets the same bound on any machine.

Where diffusion got to also says where to look for a plan (`shortlisted`): a strategy whose
reparametrised node cost is far above its node's least cannot be in a plan near the bound, so
each node keeps its few cheapest, and the problem left is narrow enough to solve exactly.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .bounded import factor_tables
from .costgraph import CostGraph, InfeasibleError, SearchTooLargeError, Solution, solve
from .width import largest_table

# The bound counts as reaching a cost within this relative distance: float sums of
# reparametrised costs are off by about 1e-15 of their size per term.
REACHED = 1e-9
# A node's update costs about as much as this many table entries in numpy calls (measured:
# 2.6 ns an entry, 7 us a node-edge incidence, on the 2-core machine of docs/decisions.md).
INCIDENCE_ENTRIES = 2800


@dataclass
class Reparametrisation:
    """Where diffusion got to: the edges' reparametrised costs and what each node gained.
    Searches of one problem at other node costs (memory prices) start from it: the edges are
    the same, and any reparametrisation is valid."""
    edges: list[np.ndarray]
    gained: list[np.ndarray]


def dual_bound(graph: CostGraph, target: float | None = None, work: float = 2e8,
               max_sweeps: int = 500, stall: float = 1e-7,
               start: Reparametrisation | None = None
               ) -> tuple[float, dict[str, Any], Reparametrisation]:
    """(a lower bound on the optimum of `graph`, stats, where diffusion got to): min-sum
    diffusion from `start` (an earlier call's, on a graph of the same edges) until the bound
    reaches `target`, rises by less than `stall` (relative) over a sweep, or `max_sweeps`
    sweeps or `work` table entries (INCIDENCE_ENTRIES a node-edge incidence) are spent,
    at least one sweep."""
    began = time.perf_counter()
    # The pairs in factor_tables' order; their summed tables only where no start has them.
    pairs = list(dict.fromkeys((min(u, v), max(u, v)) for u, v, _ in graph.edges if u != v))
    own = graph.local_view()[0]
    if start is None or len(start.edges) != len(pairs):
        _, _, pair = factor_tables(graph)
        start = Reparametrisation(list(pair.values()), [np.zeros(len(c)) for c in own])
    edges, gained = start.edges, start.gained
    per_sweep = 2 * sum(m.size for m in edges) + 2 * INCIDENCE_ENTRIES * len(edges)
    max_sweeps = max(1, min(max_sweeps, int(work // max(per_sweep, 1))))
    node = [c + g for c, g in zip(own, gained)]
    incident: list[list[tuple[int, int]]] = [[] for _ in own]
    for i, (u, v) in enumerate(pairs):
        incident[u].append((i, 0))
        incident[v].append((i, 1))
    order = [u for u in range(len(node)) if incident[u]]
    best = _bound(node, edges)
    sweeps = 0
    reason = "no edges" if not order else "sweep budget"
    with np.errstate(invalid="ignore"):  # inf - inf where a strategy is forbidden
        while order and sweeps < max_sweeps:
            if target is not None and best >= target - REACHED * abs(target):
                reason = "reached the plan's cost"
                break
            for u in (order if sweeps % 2 == 0 else order[::-1]):
                _diffuse(u, node, gained, edges, incident[u])
            sweeps += 1
            bound = _bound(node, edges)
            rose = bound - best
            best = max(best, bound)
            if rose <= stall * max(abs(best), 1e-30):
                reason = "converged"
                break
    stats = {"dual_sweeps": sweeps, "dual_stop": reason, "dual_s": time.perf_counter() - began}
    return best, stats, start


def _diffuse(u: int, node: list[np.ndarray], gained: list[np.ndarray],
             edges: list[np.ndarray], incident: list[tuple[int, int]]) -> None:
    """Node u's costs and each incident edge's least costs over u's strategies made equal."""
    least = [edges[i].min(axis=1 - side) for i, side in incident]
    average = (node[u] + sum(least)) / (len(least) + 1)
    live = np.isfinite(average)  # where it is inf, every edge agrees the strategy is forbidden
    everywhere = live.all()
    costs, gain = node[u], gained[u]  # arrays of this node alone: updated in place
    for (i, side), m in zip(incident, least):
        delta = m - average
        if not everywhere:
            delta[~live] = 0.0
        edges[i] -= delta[:, None] if side == 0 else delta
        costs += delta
        gain += delta


def _bound(node: list[np.ndarray], edges: list[np.ndarray]) -> float:
    total = math.fsum(float(c.min()) for c in node) + math.fsum(float(m.min()) for m in edges)
    return total if not math.isnan(total) else -math.inf


def shortlisted(graph: CostGraph, reached: Reparametrisation,
                sizes: tuple[int, ...] = (2, 3, 4, 6), max_factor_size: float = 1e6
                ) -> Solution | None:
    """The cheapest plan over `graph` (on its true costs) among those solved exactly with each
    node keeping only its `k` strategies of least reparametrised cost, for each `k` of `sizes`
    whose tables stay within `max_factor_size`; None where none does. `reached`: `dual_bound`'s
    reparametrisation of this graph's edges (at any node costs)."""
    began = time.perf_counter()
    reduced = [c + g for c, g in zip(graph.local_view()[0], reached.gained)]
    # Restricted once to the widest shortlist, then from there: a graph of thousands of edges
    # costs far more to restrict than the few-by-few tables left.
    widest = [_cheapest(c, max(sizes)) for c in reduced]
    narrowed = graph.restricted(widest)
    within = [c[m] for c, m in zip(reduced, widest)]
    best: Solution | None = None
    for k in sorted(sizes):
        keep = [_cheapest(c, k) for c in within]
        shortlist = narrowed.restricted(keep)
        if largest_table(shortlist, max_factor_size) > max_factor_size:
            break  # a longer shortlist only widens the tables
        try:
            answer = solve(shortlist, "dynamic_programming", max_factor_size=max_factor_size,
                           prune=False)
        except (SearchTooLargeError, InfeasibleError):
            continue
        choice = np.array([int(np.flatnonzero(w)[np.flatnonzero(m)[c]])
                           for w, m, c in zip(widest, keep, answer.choice)], dtype=np.int64)
        cost = graph.total_cost(choice)
        if best is None or cost < best.cost:
            best = Solution(choice, cost, {"nodes": graph.num_nodes(),
                                           "edges": graph.num_edges(), "shortlist": k})
    if best is not None:
        best.stats["shortlist_seconds"] = time.perf_counter() - began
    return best


def _cheapest(costs: np.ndarray, k: int) -> np.ndarray:
    """A mask of the k least of `costs` (ties: the first), every strategy where it has k."""
    keep = np.zeros(len(costs), dtype=bool)
    keep[np.argsort(costs, kind="stable")[:k]] = True
    return keep
