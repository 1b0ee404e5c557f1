"""When each value of a step is last needed, for the liveness walk (cost/liveness.py): a
value fused into its readers is needed until its fused readers' results are. The program's
own order is worked out once per graph; the times a walk asks (its schedule) are kept for the
last few walks."""
from __future__ import annotations

from typing import Any, Iterable

from autopar.cost.xla.buffers import BufferModel
from autopar.trace.analysis import edges, per_graph
from autopar.trace.ir import OpGraph

LAST_READS_KEPT = 4  # the schedules whose last reads are kept per graph


@per_graph
def program_last_reads(graph: OpGraph, model: BufferModel) -> dict[int, int]:
    """The program step at which each value is last needed (a fused value is read where its
    fused reader's result is)."""
    program, readers = graph.program, edges(graph)[1]
    materialised = model.values(graph).materialised
    last: dict[int, int] = {}
    for i in range(len(program) - 1, -1, -1):  # backwards: readers are settled first
        for t in program[i].outputs:
            last[t] = last_read(program, materialised, last, readers.get(t, ()), i)
    return last


def timed_last_reads(graph: OpGraph, model: BufferModel, when: tuple[int, ...],
                     materialised: frozenset[int], done: int) -> dict[int, int]:
    """Per value, the last time it is needed when the program's steps run at `when`: the
    steps before the optimizer's keep their order, so a value they alone need is last needed
    at the time of its last step. The last few answers are kept per graph: the estimates of a
    memory budget's plans mostly ask the same."""
    memo = _last_reads_memo(graph)
    key = (when, materialised, done)
    if key not in memo:
        program, readers = graph.program, edges(graph)[1]
        last = {t: when[end] for t, end in program_last_reads(graph, model).items()
                if end <= done}
        for i in range(len(program) - 1, -1, -1):
            for t in program[i].outputs:
                if t not in last:
                    last[t] = last_read(program, materialised, last, readers.get(t, ()),
                                        when[i], when)
        if len(memo) >= LAST_READS_KEPT:
            del memo[next(iter(memo))]
        memo[key] = last
    return memo[key]



@per_graph
def _last_reads_memo(graph: OpGraph) -> dict[tuple, dict[int, int]]:
    return {}


def last_read(program: Any, materialised: Any, last: dict[int, int], steps: Iterable[int],
              default: int, when: Any = None) -> int:
    """The last time a value read at `steps` is needed, fused readers followed; times are
    program steps, or `when[step]` where given (see schedule)."""
    end = default
    for r in steps:
        at = r if when is None else when[r]
        end = max(end, at, *(last.get(o, at) for o in program[r].outputs
                             if o not in materialised))
    return end
