"""The exact reduction before variable elimination (dynamic_programming.py): a
working copy of a CostGraph with parallel edges merged, strategies that are
always infinite or dominated by another strategy of their node dropped, and
nodes left with one strategy folded into their neighbours' costs. Every step
keeps the optimum."""

from __future__ import annotations

from collections import deque

import numpy as np

from .costgraph import CostGraph, InfeasibleError


# Rows x rows x columns up to which ``dominated`` compares every pair directly.
_ALL_AT_ONCE = 1 << 14


class Reduced:
    """Mutable working copy of a graph: one merged matrix per adjacent pair."""

    def __init__(self, graph: CostGraph) -> None:
        self.graph = graph
        n = graph.num_nodes()
        self.unary: list[np.ndarray] = [c.copy() for c in graph.node_costs]
        # Original strategy indices still present at each node.
        self.keep: list[np.ndarray] = [np.arange(c.shape[0]) for c in graph.node_costs]
        self.adj: list[set[int]] = [set() for _ in range(n)]
        # Key (u, v) with u < v; matrix rows index u's strategies.
        self.pair: dict[tuple[int, int], np.ndarray] = {}
        self.fixed: dict[int, int] = {}
        self.constant = 0.0
        for u, v, mat in graph.edges:
            if u == v:
                self.unary[u] = self.unary[u] + np.diagonal(mat)
                continue
            key, m = ((u, v), mat) if u < v else ((v, u), mat.T)
            if key in self.pair:
                self.pair[key] = self.pair[key] + m
            else:
                self.pair[key] = np.array(m, dtype=np.float64)
                self.adj[u].add(v)
                self.adj[v].add(u)

    def oriented(self, u: int, v: int) -> np.ndarray:
        """Matrix of edge u-v with rows indexing ``u``'s strategies."""
        return self.pair[(u, v)] if u < v else self.pair[(v, u)].T

    def restrict(self, u: int, mask: np.ndarray) -> None:
        """Keep only the strategies of ``u`` selected by ``mask``."""
        self.unary[u] = self.unary[u][mask]
        self.keep[u] = self.keep[u][mask]
        for v in self.adj[u]:
            if u < v:
                self.pair[(u, v)] = self.pair[(u, v)][mask, :]
            else:
                self.pair[(v, u)] = self.pair[(v, u)][:, mask]

    def fix(self, u: int) -> list[int]:
        """Condition on the single strategy left at ``u``; return its old neighbours."""
        self.constant += float(self.unary[u][0])
        nbrs = list(self.adj[u])
        for v in nbrs:
            self.unary[v] = self.unary[v] + self.oriented(v, u)[:, 0]
            del self.pair[(min(u, v), max(u, v))]
            self.adj[v].discard(u)
        self.adj[u].clear()
        self.fixed[u] = int(self.keep[u][0])
        return nbrs

    def prune(self, u: int) -> bool:
        """Drop infeasible and dominated strategies of ``u``; return whether any went.

        Strategy ``b`` dominates ``a`` when its node cost and its row of every
        incident matrix are elementwise ``<=`` those of ``a``: swapping ``a``
        for ``b`` in any assignment never costs more, so removing ``a`` keeps
        an optimum.  Among equal strategies the lowest index survives.
        Strategies that cost ``inf`` whatever the neighbours choose go too.
        """
        cost = self.unary[u]
        rows = [self.oriented(u, v) for v in self.adj[u]]
        alive = ~np.isinf(cost)
        for m in rows:
            alive &= ~np.isinf(m).all(axis=1)
        if not alive.any():
            raise InfeasibleError(
                f"every strategy of {self.graph.name(u)} has infinite cost "
                "whatever its neighbours choose, so every assignment costs inf"
            )
        idx = np.flatnonzero(alive)
        if idx.size > 1:
            blocks = [cost[idx, None]] + [m[idx] for m in rows]
            alive[idx[dominated(blocks)]] = False
        if alive.all():
            return False
        self.restrict(u, alive)
        return True

    def reduce(self, prune: bool) -> None:
        """Fix single-strategy nodes and, with ``prune``, prune until stable.

        Pruning or fixing a node changes what its neighbours see, so they are
        queued again; every requeue follows a strategy removal, so this ends.
        """
        if not prune:
            for u in range(len(self.unary)):
                if self.unary[u].shape[0] == 1:
                    self.fix(u)
            return
        n = len(self.unary)
        queue = deque(range(n))
        queued = [True] * n
        while queue:
            u = queue.popleft()
            queued[u] = False
            if u in self.fixed:
                continue
            changed = self.prune(u)
            if self.unary[u].shape[0] == 1:
                touched = self.fix(u)
            elif changed:
                touched = list(self.adj[u])
            else:
                continue
            for v in touched:
                if not queued[v]:
                    queued[v] = True
                    queue.append(v)


def dominated(blocks: list[np.ndarray]) -> np.ndarray:
    """Mask of rows to drop because another kept row dominates them.

    Row ``b`` dominates ``a`` when ``b <= a`` in every column of every block;
    ``a`` goes when the dominance is strict or the rows are equal and ``b``
    comes first.  Per-block row sums (``inf`` clipped to a finite ceiling)
    are a necessary condition, as clipping and floating-point summation are
    both monotone, so all pairs are screened on those few numbers and only
    the survivors are compared column by column. Few rows of few columns
    are compared all at once: the screening costs more than it saves there.
    """
    k = blocks[0].shape[0]
    if k * k * sum(b.shape[1] for b in blocks) <= _ALL_AT_ONCE:
        feats = np.hstack(blocks)
        dom = (feats[:, None, :] <= feats[None, :, :]).all(axis=2)
        np.fill_diagonal(dom, False)
        return _beaten(dom)
    gone = np.ones(k, dtype=bool)
    # Strategies often differ only in their own cost (same layout towards
    # every neighbour); a dictionary on the neighbour-facing part settles
    # those groups in linear time before the quadratic pair check.
    cost = blocks[0][:, 0]
    facing = np.hstack(blocks[1:]) if len(blocks) > 1 else np.zeros((k, 0))
    best: dict[bytes, int] = {}
    for i in range(k):
        key = facing[i].tobytes()
        j = best.get(key)
        if j is None or cost[i] < cost[j]:
            best[key] = i
    rep = np.array(sorted(best.values()))
    if rep.size == 1:
        gone[rep] = False
        return gone
    blocks = [b[rep] for b in blocks]
    feats = np.hstack(blocks)
    k = feats.shape[0]
    finite = np.isfinite(feats)
    ceiling = float(np.abs(feats[finite]).max()) + 1.0 if finite.any() else 1.0
    bounds = np.cumsum([0] + [b.shape[1] for b in blocks])
    sums = np.add.reduceat(np.minimum(feats, ceiling), bounds[:-1], axis=1)
    # A little slack only lets more pairs through to the exact check.
    slack = 1e-9 * np.abs(sums) + 1e-300
    cand = (sums[:, None, :] <= (sums + slack)[None, :, :]).all(axis=2)
    np.fill_diagonal(cand, False)
    pb, pa = np.nonzero(cand)
    # Narrow blocks first: cheap to compare and often enough to reject.
    for i in np.argsort(np.diff(bounds), kind="stable"):
        if pb.size == 0:
            break
        blk = feats[:, bounds[i]:bounds[i + 1]]
        ok = (blk[pb] <= blk[pa]).all(axis=1)
        pb, pa = pb[ok], pa[ok]
    dom = np.zeros((k, k), dtype=bool)
    dom[pb, pa] = True
    gone[rep[~_beaten(dom)]] = False
    return gone


def _beaten(dom: np.ndarray) -> np.ndarray:
    """Rows ``a`` with some ``b`` where ``dom[b, a]`` (``b`` dominates ``a``)
    strictly, or equally and ``b`` comes first: equal rows dominate each
    other, and only the later one of such a pair goes."""
    k = dom.shape[0]
    earlier = np.arange(k)[:, None] < np.arange(k)[None, :]
    return (dom & (~dom.T | earlier)).any(axis=0)
