"""What a loop's body holds while its step runs, for the memory estimate (cost/liveness.py):
every value at once (an upper bound), or the most live at once where the platform's compiler
reuses buffers inside a body (autopar.cost.xla's `reuses_in_loops`)."""
from __future__ import annotations

from typing import Callable

from autopar.trace.ir import OpGraph

# The tracer's markers of a loop's carries and slices: views of buffers counted elsewhere. A
# loop's stacked results and final carries (scan_stack, scan_carry_out) are not among them:
# inside another loop's body they are that body's values.
LOOP_VIEWS = frozenset({"scan_carry", "scan_slice"})


def _values(graph: OpGraph, ids: tuple[int, ...], fused: frozenset[int]
            ) -> list[tuple[int, list[int]]]:
    """Per op of the body, by its place in `ids`: its results that take memory."""
    ops = graph.ops
    return [(n, [t for t in ops[k].outputs if t not in fused])
            for n, k in enumerate(ids) if ops[k].primitive not in LOOP_VIEWS]


def body_sum(graph: OpGraph, ids: tuple[int, ...], fused: frozenset[int],
             size: Callable[[int], int]) -> int:
    """Every value of the body at once."""
    return sum(size(t) for _, ts in _values(graph, ids, fused) for t in ts)


def body_peak(graph: OpGraph, ids: tuple[int, ...], fused: frozenset[int],
              size: Callable[[int], int]) -> int:
    """The most the body holds at once, each value live from its op to its last reader in the
    body (a value the loop's marks read, to the end of the iteration)."""
    last: dict[int, int] = {}
    for n, k in enumerate(ids):
        for t in graph.ops[k].inputs:
            last[t] = n
    delta = [0] * (len(ids) + 1)
    for n, ts in _values(graph, ids, fused):
        for t in ts:
            delta[n] += size(t)
            delta[max(last.get(t, n), n) + 1] -= size(t)
    live = peak = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak
