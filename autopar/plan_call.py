"""The one path from a call of the step to its plan, for `autopar.plan` and `auto_parallel`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from autopar.calling import Call
from autopar.cost.hardware import Hardware
from autopar.errors import AutoparError
from autopar.fitting import Compiled, Make, fitted
from autopar.mesh import MeshShape
from autopar.planning.driver import Planned, tracer
from autopar.planning.pins import Annotations
from autopar.planning.schedules import weigh_schedules


@dataclass(frozen=True)
class Request:
    """What is asked of a plan besides the call and the mesh: the options `autopar.plan` and
    `auto_parallel` share, resolved (the profile, the compiler's platform, the limit in
    bytes)."""

    search: str
    hw: Hardware
    annotations: Annotations
    platform: str
    memory_limit: int | None
    microbatches: int | str
    batch_argnums: int | Sequence[int]
    pipeline: int | str
    rounds: int  # the option pipeline_repeats
    keep_placement: bool


@dataclass(frozen=True)
class CompileCheck:
    """How to check a plan against what XLA compiles (fitting.fitted): `make` turns a
    planning's decisions and plan into the step to run, `compiled_of` compiles it."""

    make: Make
    compiled_of: Compiled


def plan_call(call: Call, mesh: MeshShape | int, request: Request,
              check: CompileCheck | None = None) -> Any:
    """The call planned on `mesh` (a device count: each mesh shape of that many devices):
    1. the search of schedules proposes each schedule to weigh, told how the last went: the
       one asked, or for pipeline="auto" each stage count, microbatch count and round count
       worth weighing (planning/schedules.py; microbatches="auto": the fewest that fit,
       planning/microbatches.py);
    2. the step is traced under that schedule;
    3. and searched on each mesh within the memory limit (Planning.plan, planning/budget.py);
    4. the search of schedules keeps the fastest estimated plan that fits, and that plan
       alone is bounded (its distance from the optimum: Planning.bounded);
    5. with `check`, that plan is compiled where its memory estimate's error could decide,
       and planned again where XLA needs more (fitting.py).
    Without `check`, the Planned; with it, the step to run that `check.make` made. Each
    stage's seconds are added to the `progress.timing` under way."""
    traced = tracer(call, request.batch_argnums, request.hw, request.search,
                    request.annotations, request.platform, request.keep_placement,
                    prove=check is None)  # auto_parallel proves a plan once it is kept
    weighing = weigh_schedules(call, request.microbatches, request.batch_argnums, mesh,
                               request.memory_limit, request.pipeline, request.rounds)
    outcome: Planned | AutoparError | None = None
    while True:
        try:
            asked = weighing.send(outcome)  # 1. the next schedule to weigh
        except StopIteration as done:
            kept: Planned = done.value  # 4. the fastest that fits
            break
        try:
            planning = traced(asked.schedule)  # 2. traced
            # 3. searched within the limit; bounded below only if kept
            outcome = planning.plan(asked.mesh, asked.limit, bound=False)
        except AutoparError as e:  # told to the search of schedules, which may go on
            outcome = e
    kept = kept.planning.bounded(kept)
    if check is None:
        return kept
    return fitted(kept, request.memory_limit, check.make, check.compiled_of)  # 5. checked
