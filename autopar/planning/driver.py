"""The planning pipeline for one call signature: trace, pin, search (under a memory budget),
assemble; and the plain data-parallel plan."""
from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Sequence

import jax

from autopar import progress
from autopar.calling import Call
from autopar.collector import paused, settle
from autopar.cost.hardware import Hardware
from autopar.cost.memory import plan_memory
from autopar.cost.xla import BufferModel, buffer_model
from autopar.decisions import Decisions
from autopar.errors import AutoparError, AutoparWarning
from autopar.mesh import MeshShape, mesh_shape
from autopar.placement.lanes import Lanes, traced_lanes
from autopar.placement.storable import Storage, storage
from autopar.plan import Plan
from autopar.plan_stats import SearchStats
from autopar.planning.assemble import (Candidate, assemble, pipeline_detail, tallying,
                                      written_up)
from autopar.planning.budget import plan_within
from autopar.planning.pins import Annotations, resolve as resolve_annotations
from autopar.planning.plan_bound import with_dual_bound
from autopar.planning.pricing import Unit
from autopar.planning.problem import make_units
from autopar.planning.solve import Solved, exactness, solve
from autopar.primitives.stack_read import reading_stored
from autopar.rewrite.accumulate import step_of
from autopar.rules.factors import Spec
from autopar.schedule import Schedule
from autopar.trace.ir import OpGraph
from autopar.trace.tracer import trace


@dataclass
class Planning:
    """One call signature's planning: the traced step and what every search of it shares, so
    that planning again (another memory limit, a compile check's retry, another mesh shape)
    traces nothing again and rebuilds no problem it has built.

    `buffers` is the compiler's buffer model the memory estimate walks (autopar.cost.xla)."""

    graph: OpGraph
    in_tree: Any
    out_tree: Any
    hw: Hardware
    search: str
    annotations: Annotations
    buffers: BufferModel
    trace_s: float
    units: list[Unit] = field(init=False)
    problems: dict[MeshShape, dict] = field(default_factory=dict)  # built, unpriced, per mesh
    # Every search's candidate, by (mesh, price, recompute, kept-bytes cap): planning again
    # (the proofs put off until the unlimited plan is ruled out, fitting.py) repeats none.
    attempts: dict[tuple, Candidate] = field(default_factory=dict)
    # (mesh, decisions) -> their tally and memory estimate: prices a bisection apart often
    # find the same decisions
    costed: dict[tuple, tuple] = field(default_factory=dict)
    # (mesh, price, kept-bytes cap) -> the search's answer: recomputing layers changes a
    # plan's cost and memory, not what the search finds at a price, and the budget tries the
    # prices it tried without recompute again with it
    solved: dict[tuple, Solved] = field(default_factory=dict)
    schedule: Schedule = Schedule()  # how the traced step accumulates and pipelines
    stored: Storage | None = None  # the stack's leaves kept in placement (placement/stored.py)
    lanes: Lanes | None = None  # a Python loop's layers kept stacked (placement/lanes.py)
    plan_out_tree: Any = None  # the plan's outputs' tree (with `lanes`: the stacked step's)
    # Under a memory limit, dynamic_programming proves the price search's answer where its
    # tables fit (budget.py); False keeps the prices' answer, found sooner (and proven later,
    # where fitting.py keeps a budgeted plan).
    prove: bool = True

    def __post_init__(self) -> None:
        self.units = make_units(self.graph)

    @classmethod
    def traced(cls, fn: Callable, args: Sequence[Any], hw: Hardware, search: str,
               annotations: Annotations = None, donated: frozenset[int] = frozenset(),
               platform: str | None = None, schedule: Schedule = Schedule(),
               keep_placement: bool = False) -> Planning:
        """Trace `fn(*args)` (`donated`: the flat inputs the caller donates, which the memory
        estimate reads) for a compiler of `platform` (default: the hardware profile's);
        `schedule`: how `fn` accumulates its gradient and pipelines its layers (step_of), for
        the plan to say. `keep_placement`: a Python loop's
        layers kept stacked (the step traced, then traced again over the stacks:
        placement/lanes.py), and the circular schedule's stack stored in its placement where
        the step allows (traced again: to find which leaves, then reading them so)."""
        t0 = time.perf_counter()
        # Tracing makes what planning keeps (the program, its units): no collection runs
        # while it does (a 96-layer GPT's trace and units had eleven full ones, which freed nothing), and
        # what it made is set aside from the collections after it (collector.settle).
        with progress.stage("tracing"), paused():
            platform = platform or hw.platform
            found = (traced_lanes(fn, args, donated, platform)
                     if keep_placement and schedule.stages > 1 else None)
            if found is not None:  # a Python loop's layers stored stacked (placement/lanes.py)
                graph, lanes, out_tree = found.graph, found.lanes, found.out_tree
                in_tree, plan_out_tree = found.in_tree, found.plan_out_tree
            else:
                graph, in_tree, out_shape = trace(fn, args, donated, compiler=platform)
                lanes, out_tree = None, jax.tree_util.tree_structure(out_shape)
                plan_out_tree = out_tree
            stored = None
            if keep_placement and schedule.rounds > 1:
                def again(reads: Sequence[int]) -> OpGraph:  # the step, its stack read as stored
                    stepped = reading_stored(fn, reads)
                    if lanes is None:
                        return trace(stepped, args, donated, compiler=platform)[0]
                    found = traced_lanes(stepped, args, donated, platform)
                    if found is None or found.lanes != lanes:
                        raise AutoparError("keep_placement: the step stacks other layers when its "
                                           "stack is read in the circular placement.")
                    return found.graph
                graph, stored = traced_stored(again, graph, schedule.stages, schedule.rounds,
                                              lanes)
            planning = cls(graph, in_tree, out_tree, hw, search, annotations,
                           buffer_model(platform), time.perf_counter() - t0, schedule=schedule,
                           stored=stored, lanes=lanes, plan_out_tree=plan_out_tree)
            settle()  # before the collector runs again, which would scan all tracing made
        return planning

    def plan(self, mesh: MeshShape | int, memory_limit: int | None = None,
             bound: bool = True, excluded: tuple[Decisions, ...] = ()) -> Planned:
        """Pin, search and assemble on `mesh`. A device count tries every mesh shape of that
        many devices (`candidate_meshes`) on which the annotations apply, and keeps the plan of
        least estimated cost. With `memory_limit` (bytes per device), only plans that fit it
        (`budget`), none of `excluded`. `bound` False leaves the plan's dual bound to
        `bounded`: the search of schedules bounds only the plan it keeps."""
        shapes = candidate_meshes(mesh) if isinstance(mesh, int) else [mesh]
        prove = self.prove and self.search == "dynamic_programming"
        best = None
        first_error = fit_error = None
        pins = {}
        for n, shape in enumerate(shapes, 1):
            progress.update("mesh", f"mesh {dict(zip(shape.names, shape.sizes))}" +
                            (f" ({n} of {len(shapes)})" if len(shapes) > 1 else ""))
            try:
                pinned = pins[shape] = resolve_annotations(self.graph, shape, self.annotations)
            except AutoparError as e:  # a candidate mesh without the annotated axes
                first_error = first_error or e
                continue
            try:
                chosen = plan_within(
                    functools.partial(self._attempt, shape, pinned), self.graph, shape,
                    memory_limit, self.buffers, prove, excluded)
            except AutoparError as e:  # nothing fits this mesh: the error to report
                fit_error = fit_error or e
                continue
            if best is None or chosen.tally.total_s < best[1].tally.total_s:
                best = (shape, chosen)
        if best is None:
            raise fit_error or first_error
        shape, chosen = best
        if bound:
            chosen = dataclasses.replace(chosen, stats=self._bound(shape, pins[shape],
                                                                   chosen.stats))
        plan = written_up(self.graph, chosen, shape, self.hw, self.search, self.in_tree,
                          self.plan_out_tree, memory_limit, self.buffers)
        plan = dataclasses.replace(plan, **self.schedule.plan_fields(), stored=self.stored,
                                   lanes=self.lanes)
        if self.schedule.stages > 1:
            plan = dataclasses.replace(plan, pipeline=pipeline_detail(self.graph, plan))
        return Planned(self, chosen.decisions, plan, mesh)

    def bounded(self, planned: Planned) -> Planned:
        """`planned` (planned here with bound=False) with its plan's dual bound and
        exactness."""
        plan = planned.plan
        shape = mesh_shape(dict(plan.mesh))
        pinned = resolve_annotations(self.graph, shape, self.annotations)
        return dataclasses.replace(planned, plan=dataclasses.replace(
            plan, search_stats=self._bound(shape, pinned, plan.search_stats)))

    def _bound(self, shape: MeshShape, pinned: dict[int, Spec], stats: SearchStats
               ) -> SearchStats:
        with progress.stage("bounding", "bounding the plan's distance from the optimum"):
            stats = with_dual_bound(self.graph, shape, self.hw, self.search, pinned,
                                    self.units, self.problems.setdefault(shape, {}), stats)
        return exactness(stats)

    def _attempt(self, shape: MeshShape, pinned: dict[int, Spec], price: float,
                 recompute: frozenset, kept_budget: float | None) -> Candidate:
        """One search at a memory price (budget.Attempt): its decisions, cost and memory."""
        key = (shape, price, recompute, kept_budget)
        if key in self.attempts:
            return self.attempts[key]
        problems = self.problems.setdefault(shape, {})
        searched = (shape, price, kept_budget)
        if searched not in self.solved:
            with progress.stage("searching", f"searching ({self.search})"):
                self.solved[searched] = solve(self.graph, shape, self.hw, self.search, pinned,
                                              price, self.units, problems, kept_budget)
        solved = self.solved[searched]
        decisions = solved.decisions.recomputing(recompute)
        same = (shape, tuple(decisions.inputs), tuple(decisions.ops), recompute)
        if same not in self.costed:
            self.costed[same] = (tallying(self.graph, decisions, shape, self.hw, pinned),
                                 plan_memory(self.graph, decisions, shape, self.buffers))
        found = self.attempts[key] = Candidate(decisions, *self.costed[same],
                                               solved.stats.noting(trace_s=self.trace_s))
        settle()  # the problems, answers and estimates kept for the next memory price
        return found


@dataclass(frozen=True)
class Planned:
    """A step planned: its Planning (to plan it again, another limit, without tracing), the
    decisions the search made, the Plan written from them, and the mesh to plan it on again:
    the one it was planned on as asked (a device count stays a count; a pipeline's schedule
    asks for its mesh with a 'stage' axis)."""

    planning: Planning
    decisions: Decisions
    plan: Plan
    mesh: MeshShape | int

    def noting(self, **stats: Any) -> Planned:
        """The same, its plan's search statistics with `stats` (SearchStats' fields)."""
        return dataclasses.replace(self, plan=dataclasses.replace(
            self.plan, search_stats=dataclasses.replace(self.plan.search_stats, **stats)))


Tracer = Callable[[Schedule], Planning]  # a call's step traced under a schedule


@dataclass(frozen=True)
class Ask:
    """A schedule that a search of schedules weighs: the step traced under it and planned on
    `mesh` within `limit`."""

    schedule: Schedule
    mesh: MeshShape | int
    limit: int | None


# A search of schedules (planning/schedules.py, microbatches.py): it yields each Ask and is sent
# the Planned, or the AutoparError planning it raised, and returns the Planned it keeps. The
# tracing and searching are the caller's (autopar.plan_call), which it does in one place.
Weighing = Generator[Ask, Planned | AutoparError, Planned]


def ask(schedule: Schedule, mesh: MeshShape | int, limit: int | None
        ) -> Generator[Ask, Planned | AutoparError, Planned]:
    """The step planned under `schedule` on `mesh` within `limit`, in a search of schedules
    (`yield from` it): the AutoparError planning it raised is raised here."""
    outcome = yield Ask(schedule, mesh, limit)
    if isinstance(outcome, AutoparError):
        raise outcome
    return outcome


def tracer(call: Call, batch_argnums: int | Sequence[int], hw: Hardware, search: str,
           annotations: Annotations, platform: str, keep_placement: bool,
           prove: bool = True) -> Tracer:
    """The call's step, rewritten as a schedule says (step_of) and traced for planning: what
    autopar.plan and auto_parallel give the schedules' search. `prove`: Planning.prove."""
    def traced(schedule: Schedule) -> Planning:
        planning = Planning.traced(step_of(call, schedule, batch_argnums), call.abstract(), hw,
                                   search, annotations, call.donated, platform, schedule,
                                   keep_placement)
        planning.prove = prove
        return planning
    return traced


def traced_stored(again: Callable[[Sequence[int]], OpGraph], graph: OpGraph, stages: int,
                  rounds: int, lanes: Lanes | None = None) -> tuple[OpGraph, Storage | None]:
    """The step traced again (`again`) with its stack reading the leaves that `graph` (the
    step traced in layer order) lets be stored, and what is stored; a warning names each of
    the stack's leaves kept in layer order and why. Where nothing can be stored, `graph` and
    None. With `lanes` (a Python loop's layers stacked), only stacked families are stored."""
    found = storage(graph, stages, rounds)
    for index, why in found.refused.items():
        warnings.warn(AutoparWarning(
            f"keep_placement: the stack's input {index} stays in layer order and moves "
            f"into the circular placement every step, since the step reads {why}."),
            stacklevel=3)
    if lanes is not None and any(len(lanes.inputs[k]) == 1 for k in found.inputs):
        warnings.warn(AutoparWarning(
            "keep_placement: the Python loop's layers are stored stacked in layer order, not "
            "in the circular placement: the step stores a leaf of the user's tree with them."),
            stacklevel=3)
        return graph, None
    if not found.reads:
        return graph, None
    return again(found.reads), found


def plan_step(fn: Callable, args: Sequence[Any], mesh: MeshShape | int, hw: Hardware,
              search: str, annotations: Annotations = None, memory_limit: int | None = None,
              donated: frozenset[int] = frozenset(), platform: str | None = None) -> Planned:
    """Trace, search and assemble once (see Planning)."""
    planning = Planning.traced(fn, args, hw, search, annotations, donated, platform)
    return planning.plan(mesh, memory_limit)


AUTO_AXIS_NAMES = {1: ("data",), 2: ("data", "model"), 3: ("data", "model", "inner")}


def candidate_meshes(devices: int) -> list[MeshShape]:
    """Every way to arrange `devices` as a mesh of one to three axes of size > 1."""
    if devices < 1:
        raise AutoparError(f"a mesh needs at least one device, got {devices}.")
    shapes: list[tuple[int, ...]] = [(devices,)]
    for a in range(2, devices):
        if devices % a == 0:
            shapes.append((a, devices // a))
            rest = devices // a
            shapes += [(a, b, rest // b) for b in range(2, rest) if rest % b == 0]
    return [MeshShape(AUTO_AXIS_NAMES[len(s)], s) for s in shapes]


def data_parallel_pins(graph: OpGraph, mesh: MeshShape, batch_prefix: str) -> dict[int, Spec]:
    """Plain data parallel as pins: inputs under `batch_prefix` split on their first dimension
    over every mesh axis, everything else replicated."""
    everything = tuple(n for n, s in zip(mesh.names, mesh.sizes) if s > 1)
    pins = {}
    for t in graph.inputs:
        tensor = graph.tensors[t]
        spec = [()] * len(tensor.shape)
        batch = tensor.path.startswith(batch_prefix)
        if batch and tensor.shape and tensor.shape[0] % mesh.size == 0:
            spec[0] = everything
        pins[t] = tuple(spec)
    return pins


def data_parallel_plan(fn: Callable, args: Sequence[Any], mesh: MeshShape, hw: Hardware,
                       batch_prefix: str) -> Plan:
    """The baseline a person writes first: batch split over all devices, the rest replicated,
    with the operators' strategies searched under those pins."""
    graph, in_tree, out_shape = trace(fn, args, compiler=hw.platform)
    solved = solve(graph, mesh, hw, "dynamic_programming",
                   data_parallel_pins(graph, mesh, batch_prefix))
    return assemble(graph, solved.decisions, mesh, hw, "data_parallel",
                    exactness(solved.stats), in_tree,
                    jax.tree_util.tree_structure(out_shape))
