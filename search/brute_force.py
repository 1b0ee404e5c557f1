"""Exhaustive search over every assignment; a reference for small graphs."""

from __future__ import annotations

import time

import numpy as np

from .costgraph import CostGraph, InfeasibleError, Solution, register_algorithm

__all__ = ["solve_brute_force"]


def solve_brute_force(graph: CostGraph, *, max_assignments: int = 1_000_000) -> Solution:
    """Evaluate all assignments and return a cheapest one.

    The cost of every assignment is materialised as one dense tensor with an
    axis per node (built by broadcasting, so it stays independent of the
    elimination code it is used to check).  Raises ``ValueError`` when there
    are more than ``max_assignments`` assignments.
    """
    start = time.perf_counter()
    n = graph.num_nodes()
    count = graph.num_assignments()
    if count > max_assignments:
        raise ValueError(
            f"brute force would enumerate {count} assignments, above "
            f"max_assignments={max_assignments}; use dynamic_programming"
        )
    if n == 0:
        return Solution(np.zeros(0, dtype=np.int64), 0.0, {"nodes": 0, "edges": 0,
                                                            "assignments": 1})
    shape = tuple(graph.num_strategies(i) for i in range(n))
    total = np.zeros(shape)

    def along(axes: tuple[int, ...], arr: np.ndarray) -> np.ndarray:
        # Place arr's dimensions on the given tensor axes, size 1 elsewhere.
        view = [1] * n
        for ax, size in zip(axes, arr.shape):
            view[ax] = size
        return arr.reshape(view)

    for i, vec in enumerate(graph.node_costs):
        total += along((i,), vec)
    for u, v, mat in graph.edges:
        if u == v:
            total += along((u,), np.diagonal(mat).copy())
        elif u < v:
            total += along((u, v), mat)
        else:
            total += along((v, u), mat.T.copy())
    flat = int(np.argmin(total))
    best = float(total.flat[flat])
    if not np.isfinite(best):
        raise InfeasibleError(
            f"every one of the {count} assignments has infinite cost"
        )
    choice = np.array(np.unravel_index(flat, shape), dtype=np.int64)
    stats = {
        "nodes": n,
        "edges": graph.num_edges(),
        "assignments": count,
        "seconds": time.perf_counter() - start,
    }
    return Solution(choice, graph.total_cost(choice), stats)


register_algorithm("brute_force", solve_brute_force)
