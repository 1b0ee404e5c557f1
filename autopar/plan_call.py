"""The one path from a call of the step to its plan, for `autopar.plan` and `auto_parallel`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from autopar.calling import Call
from autopar.cost.hardware import Hardware
from autopar.cost.xla import buffer_model
from autopar.errors import AutoparError, MemoryLimitError
from autopar.fitting import Compiled, Make, fitted
from autopar.mesh import MeshShape
from autopar.planning.driver import Planned, Tracer, tracer
from autopar.planning.pins import Annotations
from autopar.planning.schedules import weigh_schedules

# How far over the limit the searches may go, where nothing is estimated within it, when
# the buffer model is not calibrated and XLA checks the plan: the TPU model's estimates read
# 0.94 to 1.12 of the compiler's peak on the TPU suite's programs (docs/memory.md).
UNCALIBRATED_ERROR = 1.1


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
       and planned again where XLA needs more (fitting.py). Where no plan is estimated
       within the limit and the buffer model is not calibrated, steps 1 to 4 are run again
       within UNCALIBRATED_ERROR times the limit, and XLA's figure decides.
    Without `check`, the Planned; with it, the step to run that `check.make` made. Each
    stage's seconds are added to the `progress.timing` under way."""
    tracing = tracer(call, request.batch_argnums, request.hw, request.search,
                     request.annotations, request.platform, request.keep_placement,
                     prove=check is None)  # auto_parallel proves a plan once it is kept
    latest: dict = {}  # the last schedule's Planning: searched again within a larger limit,
    # its price rounds are remembered (Planning.attempts). One only: a search of schedules
    # would otherwise hold every schedule's problems at once.

    def traced(schedule: Any) -> Any:
        if schedule not in latest:
            latest.clear()
            latest[schedule] = tracing(schedule)
        return latest[schedule]
    limit = request.memory_limit
    try:
        kept = _weighed(call, mesh, request, traced, limit)
    except MemoryLimitError as refused:
        # An estimate that errs both ways refuses limits XLA would fit: where the compiler
        # checks the plan and the buffer model is not calibrated, the searches may go over
        # the limit by that model's error, and XLA's figure decides (fitting.fitted).
        if check is None or limit is None or buffer_model(request.platform).calibrated:
            raise
        limit = int(limit * UNCALIBRATED_ERROR)
        try:
            kept = _weighed(call, mesh, request, traced, limit)
        except MemoryLimitError:
            raise refused from None
    latest.clear()
    kept = kept.planning.bounded(kept)
    if check is None:
        return kept
    return fitted(kept, request.memory_limit, check.make, check.compiled_of,  # 5. checked
                  aim=limit)


def _weighed(call: Call, mesh: MeshShape | int, request: Request, traced: Tracer,
             limit: int | None) -> Planned:
    """Steps 1 to 4 of plan_call, the searches within `limit`: the Planned kept."""
    weighing = weigh_schedules(call, request.microbatches, request.batch_argnums, mesh,
                               limit, request.pipeline, request.rounds)
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
    return kept
