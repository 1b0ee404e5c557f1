"""The strategy-selection problem shared by every search algorithm.

A :class:`CostGraph` holds nodes with a vector of candidate-strategy costs
and edges with a matrix of pairwise costs.  An algorithm picks one strategy per
node minimising the total; :func:`solve` dispatches to an algorithm by name.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

__all__ = [
    "ALGORITHMS",
    "CostGraph",
    "CostGraphBuilder",
    "InfeasibleError",
    "SearchTooLargeError",
    "Solution",
    "register_algorithm",
    "solve",
]


class InfeasibleError(ValueError):
    """Raised when every assignment of strategies has infinite cost."""


class SearchTooLargeError(ValueError):
    """Raised when an exact algorithm would need tables beyond its size limit."""


def _as_cost_array(values: Any, ndim: int, what: str) -> np.ndarray:
    """Convert to a read-only float64 array, rejecting NaN and -inf.

    Only finite values and +inf are accepted so that sums of costs never
    produce NaN (``inf - inf`` cannot arise without a ``-inf`` operand).
    A read-only float64 array that owns its data is taken as it is: nothing
    can change it (a three-axis mesh's edge matrices are megabytes each).
    """
    if (isinstance(values, np.ndarray) and values.dtype == np.float64
            and not values.flags.writeable and values.base is None):
        arr = values
    else:
        try:
            arr = np.array(values, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{what}: costs must be numeric ({exc})") from exc
    if arr.ndim != ndim:
        raise ValueError(f"{what}: expected a {ndim}-D array, got shape {arr.shape}")
    least = arr.min() if arr.size else 0.0  # one pass: a NaN anywhere makes it NaN
    if np.isnan(least):
        raise ValueError(f"{what}: costs contain NaN")
    if least == -np.inf:
        raise ValueError(f"{what}: costs contain -inf")
    arr.flags.writeable = False
    return arr


@dataclass(frozen=True, eq=False)
class CostGraph:
    """Nodes with per-strategy costs and edges with pairwise cost matrices.

    ``node_costs[i]`` has shape ``(k_i,)`` with ``k_i >= 1``.  Each edge
    ``(u, v, M)`` has ``M.shape == (k_u, k_v)``; ``M[a, b]`` is paid when
    ``u`` picks ``a`` and ``v`` picks ``b``.  Several edges may join the same
    pair (their costs add), and an edge ``(u, u, M)`` charges ``M[a, a]``.
    Costs are finite or ``+inf`` (forbidden).  Arrays are copied to
    read-only float64 on construction.
    """

    node_costs: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int, np.ndarray], ...]
    node_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        costs = []
        for i, vec in enumerate(self.node_costs):
            label = self.node_names[i] if i < len(self.node_names) else f"node {i}"
            arr = _as_cost_array(vec, 1, f"node {i} ({label!r})")
            if arr.shape[0] == 0:
                raise ValueError(f"node {i} ({label!r}) has no strategies")
            costs.append(arr)
        # Frozen dataclass: normalised copies are written through object.__setattr__.
        object.__setattr__(self, "node_costs", tuple(costs))
        names = tuple(str(s) for s in self.node_names)
        if names and len(names) != len(costs):
            raise ValueError(
                f"node_names has {len(names)} entries but there are {len(costs)} nodes"
            )
        object.__setattr__(self, "node_names", names)
        n = len(costs)
        edges = []
        for e, edge in enumerate(self.edges):
            if len(edge) != 3:
                raise ValueError(f"edge {e}: expected (u, v, matrix), got {len(edge)} items")
            u, v, mat = edge
            for end in (u, v):
                if not isinstance(end, (int, np.integer)) or isinstance(end, bool):
                    raise ValueError(f"edge {e}: node index {end!r} is not an integer")
                if not 0 <= int(end) < n:
                    raise ValueError(f"edge {e}: node index {end} out of range [0, {n})")
            u, v = int(u), int(v)
            arr = _as_cost_array(mat, 2, f"edge {e} ({self.name(u)} -> {self.name(v)})")
            want = (costs[u].shape[0], costs[v].shape[0])
            if arr.shape != want:
                raise ValueError(
                    f"edge {e} ({self.name(u)} -> {self.name(v)}): matrix shape "
                    f"{arr.shape} does not match strategy counts {want}"
                )
            edges.append((u, v, arr))
        object.__setattr__(self, "edges", tuple(edges))

    def with_node_costs(self, node_costs: Sequence[Any]) -> CostGraph:
        """The same graph with other node costs of the same shapes. The edges, validated
        already, are shared rather than checked again: a caller searching one graph at many
        prices pays for its edges once."""
        costs = tuple(_as_cost_array(v, 1, f"node {i} ({self.name(i)!r})")
                      for i, v in enumerate(node_costs))
        if [c.shape for c in costs] != [c.shape for c in self.node_costs]:
            raise ValueError("with_node_costs: the new costs must have the old shapes")
        return _unchecked(costs, self.edges, self.node_names)

    def restricted(self, keep: Sequence[np.ndarray]) -> CostGraph:
        """The graph with only the strategies `keep` (a boolean mask per node, none empty)
        selects: strategy ``j`` of a node here is ``np.flatnonzero(keep[node])[j]`` there."""
        idx = [np.flatnonzero(k) for k in keep]
        if len(idx) != self.num_nodes() or any(
                i.size == 0 or len(k) != c.shape[0]
                for i, k, c in zip(idx, keep, self.node_costs)):
            raise ValueError("restricted: one non-empty mask per node, as long as its costs")

        def frozen(a: np.ndarray) -> np.ndarray:
            a.flags.writeable = False
            return a

        costs = tuple(frozen(c[i]) for c, i in zip(self.node_costs, idx))
        # take along each axis: several times faster than indexing with np.ix_, and a
        # recursion round restricts thousands of edges
        edges = tuple((u, v, frozen(m.take(idx[u], axis=0).take(idx[v], axis=1)))
                      for u, v, m in self.edges)
        return _unchecked(costs, edges, self.node_names)

    def num_nodes(self) -> int:
        """Number of nodes."""
        return len(self.node_costs)

    def num_edges(self) -> int:
        """Number of edges as given (parallel edges counted separately)."""
        return len(self.edges)

    def num_strategies(self, node: int) -> int:
        """Number of candidate strategies of ``node``."""
        return int(self.node_costs[node].shape[0])

    def name(self, node: int) -> str:
        """Human-readable label of ``node`` for messages."""
        if node < len(self.node_names):
            return self.node_names[node]
        return f"node {node}"

    def local_view(self) -> tuple[list[np.ndarray], list[list[tuple[int, np.ndarray]]]]:
        """Each node's own costs with its self-edges folded in, and its edges to other nodes
        as (neighbour, matrix indexed [own strategy, neighbour's strategy]): what greedy
        algorithms look at when they decide one node."""
        own = [np.array(c, dtype=np.float64) for c in self.node_costs]
        incident: list[list[tuple[int, np.ndarray]]] = [[] for _ in own]
        for u, v, m in self.edges:
            if u == v:
                own[u] = own[u] + np.diag(m)
            else:
                incident[u].append((v, m))
                incident[v].append((u, m.T))
        return own, incident

    def num_assignments(self) -> int:
        """Number of distinct assignments (product of strategy counts)."""
        return math.prod(int(c.shape[0]) for c in self.node_costs)

    def total_cost(self, choice: Sequence[int]) -> float:
        """Cost of choosing strategy ``choice[i]`` at every node ``i``."""
        if len(choice) != self.num_nodes():
            raise ValueError(f"choice has {len(choice)} entries, graph has {self.num_nodes()} nodes")
        idx = [int(c) for c in choice]
        for i, c in enumerate(idx):
            if not 0 <= c < self.node_costs[i].shape[0]:
                raise ValueError(
                    f"choice {c} for {self.name(i)} out of range [0, {self.node_costs[i].shape[0]})"
                )
        total = 0.0
        for i, c in enumerate(idx):
            total += float(self.node_costs[i][c])
        for u, v, mat in self.edges:
            total += float(mat[idx[u], idx[v]])
        return total


def _unchecked(costs: tuple, edges: tuple, names: tuple) -> CostGraph:
    """A CostGraph of parts taken from a validated one, without validating them again."""
    graph = object.__new__(CostGraph)
    for name, value in (("node_costs", costs), ("edges", edges), ("node_names", names)):
        object.__setattr__(graph, name, value)
    return graph


class CostGraphBuilder:
    """Incrementally assemble a :class:`CostGraph`."""

    def __init__(self) -> None:
        self._costs: list[np.ndarray] = []
        self._names: list[str] = []
        self._edges: list[tuple[int, int, np.ndarray]] = []

    def add_node(self, costs: Sequence[float] | np.ndarray, name: str | None = None) -> int:
        """Add a node with the given strategy costs; return its index."""
        self._costs.append(np.asarray(costs, dtype=np.float64))
        self._names.append(name if name is not None else f"node {len(self._costs) - 1}")
        return len(self._costs) - 1

    def add_edge(self, u: int, v: int, matrix: Sequence[Sequence[float]] | np.ndarray) -> None:
        """Add an edge whose ``matrix[a, b]`` is paid when ``u`` picks ``a`` and ``v`` picks ``b``."""
        self._edges.append((u, v, np.asarray(matrix, dtype=np.float64)))

    def build(self) -> CostGraph:
        """Return the validated graph."""
        return CostGraph(tuple(self._costs), tuple(self._edges), tuple(self._names))


@dataclass(frozen=True, eq=False)
class Solution:
    """One strategy index per node, its total cost and algorithm statistics."""

    choice: np.ndarray
    cost: float
    stats: dict[str, Any] = field(default_factory=dict)


Algorithm = Callable[..., Solution]

#: Algorithms by name; each is called as ``algorithm(graph, **options)``.
ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(name: str, algorithm: Algorithm) -> None:
    """Make ``algorithm`` available to :func:`solve` under ``name``."""
    ALGORITHMS[name] = algorithm


def solve(graph: CostGraph, algorithm: str = "dynamic_programming", **options: Any) -> Solution:
    """Choose one strategy per node of ``graph`` minimising the total cost.

    ``options`` are passed to the algorithm.  Raises :class:`InfeasibleError`
    when every assignment costs ``inf`` and ``ValueError`` for an unknown
    algorithm name.
    """
    try:
        fn = ALGORITHMS[algorithm]
    except KeyError:
        known = ", ".join(sorted(ALGORITHMS)) or "(none registered)"
        raise ValueError(f"unknown search algorithm {algorithm!r}; known algorithms: {known}") from None
    start = time.perf_counter()
    sol = fn(graph, **options)
    sol.stats.setdefault("algorithm", algorithm)
    sol.stats.setdefault("seconds", time.perf_counter() - start)
    return sol
