"""`pipeline="auto"`: the schedule chosen with the plan.

`weigh_schedules(call, microbatches, batch_argnums, shape, limit, pipeline, rounds=1)` is a
search of schedules (driver.Weighing). For a stage count given, it is `weigh_microbatches`.
For "auto", the step is planned without a pipeline and as S GPipe stages over M
microbatches, and the plan the cost model estimates fastest among those that fit `limit` is
kept. Each candidate traces the step again and searches it, so "auto" plans several times the
work of one schedule; `search_stats.schedules_tried` lists every candidate with its estimate,
or why it was left out. Where no schedule can be planned, it raises MemoryLimitError (where
one failed for memory) or AutoparError, naming why each was left out.

Design and rationale: docs/internals-planning.md, "autopar/planning/schedules.py".
"""
from __future__ import annotations

from typing import Any, Generator, Sequence

from autopar import progress
from autopar.calling import Call
from autopar.errors import AutoparError, MemoryLimitError
from autopar.mesh import MeshShape
from autopar.plan import Plan
from autopar.planning.driver import Ask, Planned, Weighing
from autopar.planning.microbatches import weigh_microbatches
from autopar.rewrite.accumulate import batch_size
from autopar.rewrite.ticks import STAGE_AXIS

MICROBATCHES_PER_STAGE = (2, 4, 8)  # M = k * S for these k, fewest first
ROUNDS = (2, 4, 8)  # the circular schedule's rounds weighed, fewest first


def weigh_schedules(call: Call, microbatches: int | str, batch_argnums: int | Sequence[int],
                    shape: MeshShape | int, limit: int | None, pipeline: int | str,
                    rounds: int = 1) -> Weighing:
    """The search of schedules (driver.Weighing) for the options asked: `weigh_microbatches`
    for a stage count given, or for pipeline="auto" the fastest estimated schedule that fits
    (docs/internals-planning.md); `rounds`: the circular schedule's rounds asked (where more
    than 1, the only ones weighed). Each schedule is added here."""
    if pipeline != "auto":
        return (yield from weigh_microbatches(call, microbatches, batch_argnums, shape, limit,
                                              pipeline, rounds))
    positions = call.traced_positions(batch_argnums, "batch_argnums")
    size = batch_size(call.abstract(), positions, 1)
    tried: list[dict] = []
    best: Planned | None = None
    errors: list[AutoparError] = []

    def attempt(stages: int, mesh: MeshShape | int, m: int | str, r: int = 1
                ) -> Generator[Ask, Any, Plan | AutoparError]:
        nonlocal best
        entry = {"stages": stages, "mesh": str(mesh), "microbatches": m,
                 **({"repeats": r} if r > 1 else {})}  # the JSON's key, kept
        progress.update("schedule", f"schedule {len(tried) + 1}: " + (
            f"{stages} stages, {m} microbatches" + (f", {r} rounds" if r > 1 else "")
            if stages > 1 else f"no pipeline, {m} microbatches"))
        try:
            planned = yield from weigh_microbatches(call, m, batch_argnums, mesh, limit,
                                                    stages, r)
        except AutoparError as e:
            errors.append(e)
            tried.append({**entry, "left_out": _first_line(e)})
            return e
        p = planned.plan
        tried.append({**entry, "microbatches": p.microbatches, "mesh": str(dict(p.mesh)),
                      "shares": p.microbatch_groups,
                      "total_ms": round(float(p.cost.total_s) * 1e3, 6),
                      "peak_memory_bytes": int(p.cost.peak_memory_bytes)})
        if best is None or p.cost.total_s < best.plan.cost.total_s:
            best = planned
        return p

    yield from attempt(1, shape, "auto" if microbatches == 1 else microbatches)
    if isinstance(shape, MeshShape) and STAGE_AXIS not in shape.names:
        tried.append({"stages": "S > 1", "mesh": str(shape), "left_out": (
            f"the mesh has no {STAGE_AXIS!r} axis to split the layers over: make the mesh "
            f"with one (outermost, on the slowest links), or pass a device count")})
    for stages, mesh in _staged_meshes(shape):
        previous = None
        for m in _microbatch_counts(stages, microbatches, size):
            p = yield from attempt(stages, mesh, m, rounds)
            if isinstance(p, MemoryLimitError):
                continue  # more microbatches keep fewer activations: they may fit
            if isinstance(p, AutoparError) or (
                    previous is not None and p.cost.total_s >= previous.cost.total_s):
                break  # refused (no stack, S does not divide it), or past the best M
            previous = p
        if previous is None or rounds > 1:
            continue
        for r in ROUNDS:  # the circular schedule at the best M
            p = yield from attempt(stages, mesh, previous.microbatches, r)
            if isinstance(p, AutoparError) or p.cost.total_s >= previous.cost.total_s:
                break  # R S does not divide the stack, or more rounds cost more
            previous = p
    if best is None:
        unfit = [e for e in errors if isinstance(e, MemoryLimitError)]
        raise (MemoryLimitError if unfit else AutoparError)(
            "pipeline='auto': no schedule could be planned; "
            + "; ".join(f"{t['stages']} stage(s)"
                        + (f", microbatches={t['microbatches']}" if "microbatches" in t else "")
                        + f": {t['left_out']}" for t in tried)) from (unfit or errors)[0]
    return best.noting(schedules_tried=tuple(tried))


def _staged_meshes(shape: MeshShape | int) -> list[tuple[int, MeshShape]]:
    """(S, the mesh with a 'stage' axis of size S) for every S > 1 the mesh offers: its own
    'stage' axis, or for a device count each divisor, the rest of the devices one 'data' axis
    (each stage data parallel, in shares)."""
    if isinstance(shape, MeshShape):
        stages = shape.as_dict().get(STAGE_AXIS, 1)
        return [(stages, shape)] if stages > 1 else []
    return [(s, MeshShape((STAGE_AXIS, "data"), (s, shape // s)) if shape > s
             else MeshShape((STAGE_AXIS,), (s,))) for s in range(2, shape + 1) if shape % s == 0]


def _microbatch_counts(stages: int, microbatches: int | str, size: int) -> list[int]:
    """The microbatch counts to weigh for `stages` stages: the count asked (at least 2), else
    2S, 4S, 8S where they divide the batch of `size`."""
    if isinstance(microbatches, int) and microbatches >= 2:
        return [microbatches]
    return [k * stages for k in MICROBATCHES_PER_STAGE if size % (k * stages) == 0]


def _first_line(e: Exception) -> str:
    text = str(e).split("\n")[0]
    return text if len(text) <= 300 else text[:297] + "..."
