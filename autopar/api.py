"""The public entry points: `auto_parallel` and `plan`."""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from autopar import progress
from autopar.applying import applied
from autopar.calling import Call, Conventions, function_name, place, shape_and_dtype
from autopar.collector import young_objects_only
from autopar.cost.hardware import Hardware
from autopar.devices import (check_runnable, compiler_platform, mesh_profile,
                             resolve_memory_limit)
from autopar.distributed import agree, call_items, decisions_items
from autopar.errors import AutoparError
from autopar.explain import explainable
from autopar.fitting import fitted
from autopar.lower import jit_step
from autopar.mesh import MeshShape, auto_axes, make_mesh, mesh_or_count, mesh_shape
from autopar.plan import Decisions, Plan, load_plan
from autopar.plan_cache import through_cache
from autopar.planning.pins import Annotations, check_annotations_type
from autopar.planning.pipeline import Planning
from autopar.planning.solve import SEARCHES
from autopar.rules.factors import Spec, to_partition_spec
from autopar.schedule.choice import planned_schedule
from autopar.schedule.gpipe import check_pipeline
from autopar.schedule.lanes import Lanes, as_leaf
from autopar.schedule.microbatches import check_microbatches
from autopar.schedule.storable import Storage
from autopar.schedule.stored import placed_outputs, stored_inputs
from autopar.trace.ir import OpGraph


def plan(fn: Callable, *args: Any, mesh: Any, search: str = "dynamic_programming",
         hardware: str | Hardware | None = None, annotations: Annotations = None,
         memory_limit: int | str | None = None, static_argnums: int | Sequence[int] = (),
         static_argnames: str | Sequence[str] = (), donate_argnums: int | Sequence[int] = (),
         donate_argnames: str | Sequence[str] = (), microbatches: int | str = 1,
         batch_argnums: int | Sequence[int] = -1, pipeline: int | str = 1,
         pipeline_repeats: int = 1, keep_placement: bool = False) -> Plan:
    """Plan `fn(*args)` on `mesh` without running it.

    `args` may be arrays or `jax.ShapeDtypeStruct`s; `mesh` a jax Mesh, an AbstractMesh, a
    dict of axis sizes (plans for devices you do not have), a device count, or "auto" (all of
    jax.devices()): for a count, every mesh shape is tried and the cheapest plan kept.
    `annotations` fixes the sharding of inputs: a dict of regex over input paths ->
    PartitionSpec (first match wins), or a saved Plan whose input specs seed the search.
    `memory_limit` (bytes, or a string like '2GiB') is what one device may hold; by default the
    device's memory (the runtime's figure for real devices, else the hardware profile's). The
    plan is the fastest found that fits, sharding optimizer state, gradients, parameters and
    activations and recomputing layers as needed; if none fits, an AutoparError says how much
    the leanest plan needs. `static_argnums` / `static_argnames`, `donate_argnums` /
    `donate_argnames`: as in `auto_parallel` (the memory estimate holds an undonated state
    twice, the old and the new). `microbatches`, `batch_argnums`, `pipeline`: as in
    `auto_parallel`, and `pipeline_repeats`, `keep_placement`.
    """
    _check_search(search)
    check_annotations_type(annotations)
    check_microbatches(microbatches)
    check_pipeline(pipeline, microbatches, mesh, pipeline_repeats)
    call = Call(fn, Conventions.of(fn, static_argnums, static_argnames, donate_argnums,
                                   donate_argnames), args, {})
    hw = mesh_profile(hardware, mesh)
    limit = resolve_memory_limit(memory_limit, hw, mesh)
    platform = compiler_platform(mesh, hw)
    shape = mesh_or_count(mesh)

    def traced(step: Callable, microbatches: int, groups: int, stages: int = 1,
               repeats: int = 1) -> Planning:
        return Planning.traced(step, call.abstract(), hw, search, annotations, call.donated,
                               platform, microbatches, groups, stages, repeats,
                               keep_placement)

    options = {"mesh": shape, "search": search, "hardware": hw, "annotations": annotations,
               "memory_limit": limit, "microbatches": microbatches,
               "batch_argnums": batch_argnums, "pipeline": pipeline,
               "pipeline_repeats": pipeline_repeats, "keep_placement": keep_placement}

    def apply(cached: Plan) -> Plan:
        on = shape if isinstance(shape, MeshShape) else mesh_shape(dict(cached.mesh))
        return applied(call, cached, on, hw, platform, batch_argnums).make_plan()

    def searched() -> Plan:
        with young_objects_only():
            return planned_schedule(call, microbatches, batch_argnums, traced, shape, limit,
                                    pipeline, pipeline_repeats)[2]

    with progress.task(f"planning {function_name(fn)}"):
        made = through_cache("plan", call, options, platform, apply, searched, lambda p: p)

    return explainable(made, plan, fn, args, annotations, dict(
        mesh=mesh, search=search, hardware=hardware, memory_limit=limit,
        static_argnums=static_argnums, static_argnames=static_argnames,
        donate_argnums=donate_argnums, donate_argnames=donate_argnames,
        batch_argnums=batch_argnums, keep_placement=keep_placement))


def auto_parallel(fn: Callable | None = None, *, mesh: Mesh, search: str = "dynamic_programming",
                  hardware: str | Hardware | None = None,
                  plan: Plan | str | os.PathLike | None = None,
                  annotations: Annotations = None, memory_limit: int | str | None = None,
                  static_argnums: int | Sequence[int] = (),
                  static_argnames: str | Sequence[str] = (),
                  donate_argnums: int | Sequence[int] = (),
                  donate_argnames: str | Sequence[str] = (), microbatches: int | str = 1,
                  batch_argnums: int | Sequence[int] = -1, pipeline: int | str = 1,
                  pipeline_repeats: int = 1, keep_placement: bool = False) -> Any:
    """Decorate a single-device step so that it runs sharded over `mesh`.

    The first call with given input shapes traces the step, searches a plan with `search`
    (or applies `plan`, a Plan or the path of one saved by `Plan.save`, with no search) and
    compiles it; later calls reuse the executable.
    `mesh` may also be a device count or "auto" (all devices): the mesh shape is then chosen
    with the plan, as the cheapest of every arrangement of those devices. A mesh from
    `jax.make_mesh` (Explicit axes) is used with its axes made Auto (see `mesh.auto_axes`).
    `annotations` fixes shardings the search must keep (see `plan`); `autopar.shard(x, spec)`
    in the step does the same for an intermediate value. `memory_limit`: see `plan`.

    The step is called as `jax.jit` calls it. Keyword arguments are traced like positional
    ones (their paths start with the keyword). `static_argnums` / `static_argnames` name
    hashable Python values (a bool `train` flag, a mode string) baked into the trace: each
    distinct value gets its own plan and executable, cached. Nothing is donated unless asked,
    as in jax.jit: `donate_argnums=0` (or `donate_argnames="state"`) lets XLA write the
    returned state into the buffers of the state passed in, saving the state's memory on
    every device, and deletes those arrays. An argument autopar has to move onto the mesh (a
    single-device array, say) is copied there and only the copy is donated: the caller's
    array is never deleted.

    `microbatches=M` accumulates the gradient over M microbatches of the batch (the positional
    arguments `batch_argnums`, by default the last, split along their first dimension; "auto":
    the fewest that fit `memory_limit`): the step's `autopar.value_and_grad` (or `grad`) runs
    on one after the other and the rest of the step once, on the sums; a loss that is not a
    sum over microbatches is refused, naming the operation (schedule/accumulate.py).

    `pipeline=S` (with `microbatches=M`, on a mesh with a 'stage' axis of size S) runs the
    loss's layer stack (an nn.scan, a lax.scan over stacked weights) as S GPipe stages over
    the M microbatches in the one program (schedule/gpipe.py); the rest runs once.
    `pipeline_repeats=R` makes it circular: each stage holds R chunks of L/(S R) layers, and
    each microbatch goes round the stages R times (M >= S), so the bubble falls from
    (S-1)/(M+S-1) to (S-1)/(R M+S-1) of a stage's time, at R times the shifts.
    `keep_placement=True` keeps a circular schedule's stacked layers, with their optimizer
    state, in that placement between steps rather than moving them there every step, and a
    Python loop's per-layer leaves stacked on their stages rather than stacked every step:
    the step returns its state as `autopar.Placed` (pass it back as it is;
    `autopar.unpack(state)` gives your tree, with the layers in your order). Off by default:
    the state you get back is then not your tree until unpacked (schedule/stored.py,
    schedule/lanes.py).
    `pipeline="auto"` weighs no pipeline (with gradient accumulation where one batch does not
    fit) against every stage count the mesh offers (its 'stage' axis, or for a device count
    each divisor), several microbatch counts and repeats, and keeps the schedule estimated
    fastest that fits `memory_limit` (schedule/choice.py).
    """
    if fn is None:
        return functools.partial(auto_parallel, mesh=mesh, search=search, hardware=hardware,
                                 plan=plan, annotations=annotations, memory_limit=memory_limit,
                                 static_argnums=static_argnums, static_argnames=static_argnames,
                                 donate_argnums=donate_argnums, donate_argnames=donate_argnames,
                                 microbatches=microbatches, batch_argnums=batch_argnums,
                                 pipeline=pipeline, pipeline_repeats=pipeline_repeats,
                                 keep_placement=keep_placement)
    _check_real_mesh(mesh)
    _check_search(search)
    check_annotations_type(annotations)
    check_microbatches(microbatches)
    check_pipeline(pipeline, microbatches, mesh, pipeline_repeats)
    plan = _saved_plan(plan, annotations)
    conventions = Conventions.of(fn, static_argnums, static_argnames, donate_argnums,
                                 donate_argnames)
    hw = mesh_profile(hardware, mesh)
    return AutoParallel(fn, mesh, search, hw, plan, annotations,
                        resolve_memory_limit(memory_limit, hw, mesh), conventions, microbatches,
                        batch_argnums, pipeline, pipeline_repeats, keep_placement)


def _saved_plan(plan: Plan | str | os.PathLike | None, annotations: Annotations) -> Plan | None:
    """auto_parallel's plan=, read and checked."""
    if plan is not None and annotations is not None:
        raise AutoparError("auto_parallel got both plan= (apply a saved plan, no search) and "
                           "annotations= (seeds for a search). Fix: pass one; to seed a search "
                           "with a saved plan, pass it as annotations=plan.")
    if isinstance(plan, (str, os.PathLike)):
        return load_plan(os.fspath(plan))
    if plan is not None and not isinstance(plan, Plan):
        raise AutoparError(f"auto_parallel's plan= takes an autopar.Plan or the path of a "
                           f"saved one, got {type(plan).__name__}. Fix: plan=autopar.load_plan("
                           "path), or plan=path.")
    return plan


def _check_real_mesh(mesh: Any) -> None:
    if not isinstance(mesh, (Mesh, str, int)) or isinstance(mesh, bool):
        raise AutoparError(f"auto_parallel needs a jax Mesh of real devices, a device count or "
                           f"'auto', got {mesh!r}. Fix: autopar.make_mesh({{'data': 2, 'model': "
                           "4}); to plan for devices you do not have, use autopar.plan(fn, "
                           "*args, mesh={...}).")


def _check_search(search: str) -> None:
    if search not in SEARCHES:
        raise AutoparError(f"unknown search {search!r}. Fix: use one of {list(SEARCHES)}.")


@dataclasses.dataclass
class _Signature:
    """One call signature's graph, decisions, executable and mesh. Its Plan is made when first
    asked for: a saved plan's step runs without it."""
    graph: OpGraph
    decisions: Decisions
    jitted: Any
    mesh: Mesh
    out_tree: Any
    make_plan: Callable[[], Plan]
    stored: Storage | None = None  # the stack's leaves kept in the circular placement
    lanes: Lanes | None = None  # a Python loop's layers kept stacked (schedule/lanes.py)

    @functools.cached_property
    def plan(self) -> Plan:
        return self.make_plan()


class AutoParallel:
    """A step function with its plans and executables, one per input signature."""

    def __init__(self, fn: Callable, mesh: Mesh | str | int, search: str, hw: Hardware,
                 saved: Plan | None, annotations: Annotations = None,
                 memory_limit: int | None = None, conventions: Conventions | None = None,
                 microbatches: int | str = 1, batch_argnums: int | Sequence[int] = -1,
                 pipeline: int | str = 1, pipeline_repeats: int = 1,
                 keep_placement: bool = False) -> None:
        self.fn, self.search, self.hw, self.saved = fn, search, hw, saved
        self.annotations, self.memory_limit = annotations, memory_limit
        self.conventions = conventions or Conventions()
        if saved is not None and (saved.microbatches > 1 or microbatches == "auto"):
            if microbatches not in (1, "auto", saved.microbatches):
                raise AutoparError(f"the saved plan accumulates over {saved.microbatches} "
                                   f"microbatches, and microbatches={microbatches} was asked. "
                                   "Fix: drop microbatches= to apply the plan as saved.")
            microbatches = saved.microbatches
        self.microbatches, self.batch_argnums = microbatches, batch_argnums
        self.stages = saved.pipeline_stages if saved is not None else pipeline
        self.repeats = saved.pipeline_repeats if saved is not None else pipeline_repeats
        self.keep_placement = keep_placement
        self.requested = auto_axes(mesh) if isinstance(mesh, Mesh) else mesh_or_count(mesh)
        # the step runs on the mesh's devices, or on jax's for a count: their compiler's platform
        self.platform = compiler_platform(mesh, hw)
        if saved is not None and not isinstance(mesh, Mesh):
            self.requested = mesh_shape(dict(saved.mesh))
        self._cache: dict[Any, _Signature] = {}
        self._called: set[Any] = set()  # signatures whose executable exists
        functools.update_wrapper(self, fn)

    def _call(self, args: tuple, kwargs: dict) -> Call:
        return Call(self.fn, self.conventions, args, kwargs)

    def _compiled(self, call: Call, key: Any = None) -> _Signature:
        key = call.key() if key is None else key
        if key not in self._cache:
            # several processes: each plans the same program, or all stop here (distributed.py)
            agree("the step's call", call_items(call, self._options()))
            with young_objects_only(), progress.task(f"planning {function_name(self.fn)}"):
                self._cache[key] = made = self._make(call)
            agree("the plan made from that call", decisions_items(made.decisions))
        return self._cache[key]

    def _options(self) -> dict[str, Any]:
        return {"mesh": self.requested, "search": self.search, "hardware": self.hw,
                "plan": self.saved, "annotations": self.annotations,
                "memory_limit": self.memory_limit, "microbatches": self.microbatches,
                "batch_argnums": self.batch_argnums, "pipeline": self.stages,
                "pipeline_repeats": self.repeats, "keep_placement": self.keep_placement}

    def _make(self, call: Call) -> _Signature:
        """Plan (or apply the saved plan, or the plan cache's) for these arguments; the jitted
        step."""
        requested = self.requested
        shape = mesh_shape(requested) if isinstance(requested, Mesh) else requested
        if self.saved is not None:
            return self._from_saved(call, shape, self.saved, self.microbatches)
        return through_cache("auto_parallel", call, self._options(), self.platform,
                             lambda cached: self._from_saved(call, shape, cached),
                             lambda: self._planned(call, shape), lambda made: made.plan)

    def _from_saved(self, call: Call, shape: MeshShape | int, saved: Plan,
                    microbatches: int | None = None) -> _Signature:
        """The saved plan's decisions applied to this step: no search."""
        if not isinstance(shape, MeshShape):  # a device count: the plan's mesh
            shape = mesh_shape(dict(saved.mesh))
        done = applied(call, saved, shape, self.hw, self.platform, self.batch_argnums,
                       microbatches)
        return self._signature(done.graph, done.decisions, dict(saved.mesh), done.out_specs,
                               done.out_tree, done.make_plan, done.stored, done.lanes)

    def _planned(self, call: Call, shape: MeshShape | int) -> _Signature:
        """The searched plan, compiled to check where the memory estimate may be wrong."""
        def traced(step: Callable, microbatches: int, groups: int, stages: int = 1,
                   repeats: int = 1) -> Planning:
            return Planning.traced(step, call.abstract(), self.hw, self.search,
                                   self.annotations, call.donated, self.platform, microbatches,
                                   groups, stages, repeats, self.keep_placement)

        planning, decisions, p, shape = planned_schedule(
            call, self.microbatches, self.batch_argnums, traced, shape, self.memory_limit,
            self.stages, self.repeats)

        def make(decisions: Decisions, p: Plan) -> _Signature:
            return self._signature(planning.graph, decisions, dict(p.mesh),
                                   [t.spec for t in p.outputs], planning.out_tree, lambda: p,
                                   planning.stored, planning.lanes)

        def compiled_of(made: _Signature) -> Any:
            return made.jitted.lower(*_abstract(call.leaves, made.lanes)).compile()

        return fitted(planning, shape, self.memory_limit, decisions, p, make, compiled_of)

    def _signature(self, graph: OpGraph, decisions: Decisions, axes: dict[str, int],
                   out_specs: list[Spec], out_tree: Any, make_plan: Callable[[], Plan],
                   stored: Storage | None = None, lanes: Lanes | None = None) -> _Signature:
        """The jitted step of `decisions` on the mesh of `axes` (the requested Mesh itself
        where one was given)."""
        requested = self.requested
        mesh = requested if isinstance(requested, Mesh) else make_mesh(axes)
        return _Signature(graph, decisions, jit_step(graph, decisions, mesh, out_specs), mesh,
                          out_tree, make_plan, stored, lanes)

    def mesh(self, *args: Any, **kwargs: Any) -> Mesh:
        """The mesh the step runs on for these arguments (chosen with the plan for 'auto')."""
        return self._compiled(self._call(args, kwargs)).mesh

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = self._call(args, kwargs)
        key = call.key()
        made = self._compiled(call, key)
        check_runnable(made.mesh)
        stored, lanes = made.stored, made.lanes
        if lanes is not None:  # the Python loop's layers, one array a family
            into, out_of = lanes.placements(stored)
            leaves, call = lanes.stacked_inputs(call.leaves, into), lanes.stacked_call(call)
        else:
            leaves = stored_inputs(call, stored) if stored or call.placed else call.leaves
            if call.placed:  # a state with stacked layers, given to a step planned otherwise
                leaves = [as_leaf(x) for x in leaves]
        placed = place(call, [NamedSharding(made.mesh, to_partition_spec(s))
                              for s in made.decisions.inputs], leaves)
        if key in self._called:
            outs = made.jitted(*placed)
        else:  # the first call traces the planned program and compiles it
            with young_objects_only(), progress.task(f"compiling {function_name(self.fn)}"):
                progress.update("stage", "XLA compiling the sharded step")
                outs = made.jitted(*placed)
            self._called.add(key)
        if lanes is not None:
            return lanes.placed_outputs(made.out_tree, outs, out_of)
        if stored:
            return placed_outputs(made.out_tree, outs, stored)
        return jax.tree_util.tree_unflatten(made.out_tree, outs)

    def input_shardings(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """Where the step wants its arguments, as jax's Compiled.input_shardings: (positional,
        keyword), each argument a pytree of NamedSharding (None for a static one). Arguments
        may be ShapeDtypeStructs. For the batch: autopar.process_rows, autopar.global_batch.
        Where the plan keeps a Python loop's layers stacked, it takes each family as one
        array; a layer's leaf gets its row of that array's sharding (the stack's spec without
        the layers' dimension), and is stacked on the way in."""
        call = self._call(args, kwargs)
        made = self._compiled(call)
        specs = list(made.decisions.inputs)
        if made.lanes is not None:
            specs = made.lanes.user_specs(specs)
        leaves = iter(NamedSharding(made.mesh, to_partition_spec(s)) for s in specs)
        by_slot = {w: t.unflatten([next(leaves) for _ in range(t.num_leaves)])
                   for w, t in zip(call.slots, call.trees)}
        return (tuple(by_slot.get(i) for i in range(len(args))),
                {name: by_slot.get(name) for name in kwargs})

    def init(self, init_fn: Callable, *init_args: Any, step_args: Sequence[Any] = (),
             state_argnum: int = 0) -> Any:
        """`init_fn(*init_args)` (a model's parameters and optimizer state, say) computed on
        the mesh, its result created already sharded as the plan wants the step's argument
        `state_argnum`: no device ever holds all of it. `step_args`: the step's other
        positional arguments (arrays or ShapeDtypeStructs: the batch), without the state.
        The step is planned for the state's shapes (jax.eval_shape of init_fn), and the first
        call with that state runs the plan made here."""
        state = jax.eval_shape(init_fn, *init_args)
        args = list(step_args)
        if not 0 <= state_argnum <= len(args):
            raise AutoparError(f"init: state_argnum={state_argnum} with {len(args)} other "
                               f"step argument(s) in step_args. Fix: state_argnum is the "
                               f"state's position among the step's {len(args) + 1} "
                               "positional arguments.")
        args.insert(state_argnum, state)
        shardings = self.input_shardings(*args)[0][state_argnum]
        with young_objects_only():
            return jax.jit(init_fn, out_shardings=shardings)(*init_args)

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan for these arguments (arrays or ShapeDtypeStruct); nothing is run."""
        made = self._compiled(self._call(args, kwargs)).plan
        if kwargs:  # autopar.plan takes positional arguments: no explaining by search
            return made
        c = self.conventions
        return explainable(made, plan, self.fn, args, self.annotations, dict(
            mesh=dict(made.mesh), search=self.search, hardware=self.hw,
            memory_limit=self.memory_limit, static_argnums=tuple(c.static_nums),
            static_argnames=tuple(c.static_names), donate_argnums=tuple(c.donate_nums),
            donate_argnames=tuple(c.donate_names), batch_argnums=self.batch_argnums,
            keep_placement=self.keep_placement))

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The jax AOT Lowered object of the sharded step: .compile(), .as_text()."""
        call = self._call(args, kwargs)
        made = self._compiled(call)
        with young_objects_only():  # traces the planned program
            return made.jitted.lower(*_abstract(call.leaves, made.lanes))


def _abstract(leaves: Sequence[Any], lanes: Lanes | None = None
              ) -> list[jax.ShapeDtypeStruct]:
    """The flat arguments' shapes and dtypes (as the stacked step takes them, with
    `lanes`)."""
    shapes = [jax.ShapeDtypeStruct(*shape_and_dtype(x)) for x in leaves]
    return lanes.stacked_abstract(shapes) if lanes is not None else shapes
