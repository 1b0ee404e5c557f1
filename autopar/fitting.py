"""A memory-limited plan checked against what XLA compiles.

`fitted(planned, memory_limit, make, compiled_of)` returns the step's signature for the plan
to run under `memory_limit`, starting from the budgeted search's plan (`planned`). That plan
is compiled where its estimate is within the estimate's error of the limit (CHECK_BAND; on a
platform whose buffer model is not calibrated, UNCALIBRATED_BAND, or wherever the budget
binds), and XLA's figure decides; over the limit, the plan for a smaller estimate, or the
next fastest plan within the last estimate, is compiled. A compiled plan returned fits the
limit by that figure (`memory["compiled_bytes"]`, `search_stats.compile_checks`). Where the
budget bound, a faster plan that XLA fits may be returned instead. It raises AutoparError
where the plan still compiles over the limit after COMPILE_CHECKS plans for smaller
estimates, or where planning for a smaller estimate and the next fastest plan both fail.

Design and rationale: docs/internals-planning.md, "autopar/fitting.py".
"""
from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Any, Callable

import jax

from autopar import progress
from autopar.cost.estimate import mib
from autopar.cost.hlo import compiled_memory_bytes
from autopar.cost.judge import evaluate
from autopar.decisions import Decisions
from autopar.errors import AutoparError
from autopar.mesh import MeshShape, mesh_shape
from autopar.plan import Plan
from autopar.planning.driver import Planned, Planning

CHECK_BAND = 0.85
# The TPU model's estimates read 0.93-1.00 of the TPU compiler's peak on the 64-chip suite's
# programs and 1.05-1.08 on d_model-512 decoders, but 0.36-0.77 on tiny ones, whose buffers
# the TPU's (8, 128) tiles pad (docs/decisions.md, "TPU buffer model"): a plan estimated above
# this share of the limit is compiled before it is used.
UNCALIBRATED_BAND = 0.6
COMPILE_CHECKS = 3
COSTLY_BUDGET = 1.25
# How far over memory_limit a plan may compile for its propagated lowering to be tried. The
# constraints that pin a plan move XLA's schedule: a small ResNet's data-parallel plan, the
# very program of the data-parallel jax.jit (same instructions), compiled to 0.39% more
# temporaries pinned than propagated.
NEAR_MISS = 1.02


@dataclass
class _Again:
    """Plans the step again (another limit, no tracing): on `mesh` (a device count stays a
    count), its statistics with what the schedules' search weighed (`weighed`)."""

    planning: Planning
    mesh: MeshShape | int
    weighed: dict[str, Any]

    def plan(self, limit: int | None, excluded: tuple[Decisions, ...] = ()
             ) -> tuple[Decisions, Plan]:
        planned = self.planning.plan(self.mesh, limit, excluded=excluded).noting(**self.weighed)
        return planned.decisions, planned.plan


# (planning, decisions, plan) -> the step's signature: a dataclass whose `make_plan` field
# gives the Plan it runs
Make = Callable[[Planning, Decisions, Plan], Any]
Build = Callable[[Decisions, Plan], Any]  # a Make of the planning under way
Compiled = Callable[[Any], Any]  # signature -> its XLA executable (jax Compiled)


def fitted(planned: Planned, memory_limit: int, make: Make, compiled_of: Compiled,
           aim: int | None = None) -> Any:
    """The signature of the plan to run under `memory_limit`, starting from the budgeted
    search's (`planned`), compiled where the estimate's error could decide. A plan searched
    again here keeps what `planned` says of the schedules and microbatch counts weighed.
    `aim`: the estimate `planned` was searched within, where not `memory_limit` (above it,
    where nothing was estimated within the limit: plan_call)."""
    aim = aim or memory_limit
    planning, decisions, p = planned.planning, planned.decisions, planned.plan
    again = _Again(planning, planned.mesh, p.search_stats.schedules_weighed())
    build = functools.partial(make, planning)  # the step to run of this planning's plans
    budgeted = p.search_stats.budgeted
    if budgeted:
        unbudgeted, scale = _unbudgeted(again, memory_limit, build, compiled_of, p)
        if unbudgeted is not None:
            return unbudgeted
        if not planning.prove and planning.search == "dynamic_programming":
            # the budget's answer is kept: now worth proving (stepper.py put it off)
            planning.prove, again.mesh = True, mesh_shape(dict(p.mesh))
            decisions, p = again.plan(aim)
        if scale > 1:
            scaled = _scaled(again, memory_limit, scale, p, build, compiled_of)
            if scaled is not None:
                return scaled
    # A platform without a calibrated buffer model is checked whenever the budget binds, and
    # wherever its estimate is within that model's error of the limit.
    band = CHECK_BAND if planning.buffers.calibrated else UNCALIBRATED_BAND
    if (p.cost.peak_memory_bytes < band * memory_limit
            and (planning.buffers.calibrated or not budgeted)):
        return build(decisions, p)
    limit, compiled, over, aimed = aim, 0, [], aim
    near: list[tuple[Decisions, Plan]] = []  # compiled over, by less than NEAR_MISS
    for check in range(COMPILE_CHECKS + 1):
        if check:
            try:
                decisions, p = again.plan(limit)
                aimed = limit
            except AutoparError as e:
                # The estimate errs by plan: the next fastest plan at the last estimate that
                # found one, the plans compiled over left out, may fit where none is leaner.
                try:
                    decisions, p = again.plan(aimed, excluded=tuple(over))
                except AutoparError:
                    loosened = _loosened(near, memory_limit, build, compiled_of, check)
                    if loosened is not None:
                        return loosened
                    raise AutoparError(
                        f"the plan estimated to fit memory_limit={mib(memory_limit)} compiled "
                        f"to {mib(compiled)}, and planning for an estimate of {mib(limit)} "
                        f"failed: {e}") from e
        made = build(decisions, p)
        compiled = _compiled(compiled_of, made)[1]
        p = _with_compiled(p, compiled, check + 1, memory_limit)
        if compiled <= memory_limit:
            return dataclasses.replace(made, make_plan=lambda: p)
        over.append(dataclasses.replace(decisions, pinned_inside=True))
        if compiled <= NEAR_MISS * memory_limit:
            near.append((decisions, p))
        if check == COMPILE_CHECKS:
            raise AutoparError(
                f"the plan estimated at {mib(p.cost.peak_memory_bytes)} per device "
                f"compiles to {mib(compiled)}, over memory_limit={mib(memory_limit)} on mesh "
                f"{again.mesh}, after planning for {COMPILE_CHECKS} smaller estimates. Fix: raise "
                "memory_limit, use more devices, or shrink the batch.")
        # Plan for the estimate that, off by as much as this one, would fit.
        limit = min(limit - 1, int(memory_limit * p.cost.peak_memory_bytes / compiled))
    raise AssertionError("unreachable")


def _with_compiled(p: Plan, compiled: int, checks: int, memory_limit: int) -> Plan:
    """`p` with XLA's figure and the limit asked (a plan searched again within a smaller or
    larger estimate reports the limit it runs under, not the one it was searched within)."""
    return dataclasses.replace(
        p, memory={**p.memory, "compiled_bytes": compiled, "limit_bytes": memory_limit},
        search_stats=dataclasses.replace(p.search_stats, compile_checks=checks,
                                         memory_limit_bytes=memory_limit))


def _unbudgeted(again: _Again, memory_limit: int, make: Build, compiled_of: Compiled,
                budgeted: Plan) -> tuple[Any, float]:
    """The plan made without a memory limit, where XLA's own figure puts it within the
    limit: it is faster than the leaner plan the budget chose. Compiled only where its
    estimate is within the estimate's error of the limit, where the estimate's buffer model
    is not calibrated for the platform (a conservative estimate says little of what XLA
    needs), or where the `budgeted` plan is predicted COSTLY_BUDGET times slower (the
    measurements behind both: docs/decisions.md, "Measurements moved out of the planning
    code"). With it, or None, how far its estimate reads over XLA's figure (1: not known)."""
    decisions, p = again.plan(None)
    costly = budgeted.cost.total_s > COSTLY_BUDGET * p.cost.total_s
    if (again.planning.buffers.calibrated and not costly
            and CHECK_BAND * p.cost.peak_memory_bytes > memory_limit):
        return None, 1.0
    made = make(decisions, p)
    executable, compiled = _compiled(compiled_of, made)
    if compiled > memory_limit:
        scale = p.cost.peak_memory_bytes / max(compiled, 1)
        if compiled > NEAR_MISS * memory_limit:
            return None, scale
        return _propagated(again.planning, memory_limit, decisions, p, made, executable, make,
                           compiled_of), scale
    return _kept(made, p, compiled, memory_limit, 1), 1.0


def _kept(made: Any, p: Plan, compiled: int, memory_limit: int, checks: int,
          pinned_inside: bool = True) -> Any:
    """`made`, its Plan with XLA's memory figure and the limit; not `pinned_inside`: lowered
    with its inputs' and outputs' shardings alone (said in its statistics)."""
    p = _with_compiled(p, compiled, checks, memory_limit)
    if not pinned_inside:
        p = dataclasses.replace(p, search_stats=dataclasses.replace(p.search_stats,
                                                                    pinned_inside=False))
    return dataclasses.replace(made, make_plan=lambda: p)


def _loose(make: Build, compiled_of: Compiled, decisions: Decisions, p: Plan
           ) -> tuple[Any, Any, int]:
    """The plan lowered with its inputs' and outputs' shardings alone (XLA's propagation
    placing the rest): the step, its executable, and the bytes XLA needs for it."""
    made = make(dataclasses.replace(decisions, pinned_inside=False), p)
    return (made, *_compiled(compiled_of, made))


def _propagated(planning: Planning, memory_limit: int, decisions: Decisions, p: Plan,
                pinned: Any, executable: Any, make: Build, compiled_of: Compiled) -> Any:
    """The plan lowered loose (`_loose`), where XLA fits it within the limit and judges it
    (`autopar.evaluate` on the plan's hardware) no slower than the program pinned
    throughout; else None."""
    made, loose, compiled = _loose(make, compiled_of, decisions, p)
    if compiled > memory_limit:
        return None
    if evaluate(loose, made.mesh, planning.hw).step_s > evaluate(
            executable, pinned.mesh, planning.hw).step_s * (1 + 1e-9):
        return None
    return _kept(made, p, compiled, memory_limit, 2, pinned_inside=False)


def _loosened(near: list[tuple[Decisions, Plan]], memory_limit: int, make: Build,
              compiled_of: Compiled, checks: int) -> Any:
    """The first of the plans that compiled over the limit by less than NEAR_MISS that fits
    lowered loose (`_loose`; such programs held 1.5 to 16% less of Llama-2-7B's
    memory-limited plans on 64 v5p chips: docs/decisions.md, "Which reduce-scatters the TPU
    compiler makes all-reduces" and "A reduce-scatter inside a dot's layout is an all-reduce
    on TPU"), where no plan for a smaller estimate was found; None where none fits.
    `checks`: the compiles made before these."""
    for checks, (decisions, p) in enumerate(near, start=checks + 1):
        made, _, compiled = _loose(make, compiled_of, decisions, p)
        if compiled <= memory_limit:
            return _kept(made, p, compiled, memory_limit, checks, pinned_inside=False)
    return None


def _scaled(again: _Again, memory_limit: int, scale: float, budgeted: Plan, make: Build,
            compiled_of: Compiled) -> Any:
    """The plan for the estimate that, reading `scale` times over XLA's figure as the
    unbudgeted plan's did, fills the limit: kept where it compiles within the limit and is
    predicted faster than the `budgeted` plan: an estimate that reads over XLA's figure makes
    the budget choose a leaner, slower plan than fits (docs/decisions.md, "The compiler's
    fusion, gathers' layout copies and reduce-scatters everywhere", its part "At the
    expert's memory")."""
    try:
        decisions, p = again.plan(int(memory_limit * scale))
    except AutoparError:
        return None
    if p.cost.total_s >= budgeted.cost.total_s:
        return None
    made = make(decisions, p)
    compiled = _compiled(compiled_of, made)[1]
    if compiled > memory_limit:
        return None
    return _kept(made, p, compiled, memory_limit, 2)


_REQUIRED = re.compile(r"memory required for HLO temporaries \((?P<n>[0-9.]+)(?P<unit>[KMGT])\)")


def _compiled(compiled_of: Compiled, made: Any) -> tuple[Any, int]:
    """(the executable, or None, and the bytes a device needs to run it). The TPU compiler
    refuses a program over the chip's memory (RESOURCE_EXHAUSTED) where XLA CPU compiles
    anything: the bytes are then those its error names (its temporaries), at least."""
    try:
        with progress.stage("compile checks", "compiling the plan to check its memory"):
            executable = compiled_of(made)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        found = _REQUIRED.search(str(e))
        scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        return None, (int(float(found["n"]) * scale[found["unit"]]) if found else 2**62)
    return executable, compiled_memory_bytes(executable)
