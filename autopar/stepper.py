"""The decorated step: its plans and executables, one per input signature."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from autopar import progress
from autopar.applying import applied
from autopar.calling import Call, Conventions, function_name, place, shape_and_dtype
from autopar.collector import young_objects_only
from autopar.cost.hardware import Hardware
from autopar.decisions import Decisions
from autopar.devices import check_runnable, compiler_platform
from autopar.distributed import agree, call_items, decisions_items
from autopar.errors import AutoparError
from autopar.explain import explainable
from autopar.lower import jit_step
from autopar.mesh import MeshShape, auto_axes, make_mesh, mesh_or_count, mesh_shape
from autopar.placement.lanes import Lanes, as_leaf
from autopar.placement.storable import Storage
from autopar.placement.stored import placed_outputs, stored_inputs
from autopar.plan import Plan
from autopar.plan_cache import through_cache
from autopar.planner import plan
from autopar.plan_call import CompileCheck, Request, plan_call
from autopar.planning.driver import Planning
from autopar.planning.pins import Annotations
from autopar.rules.factors import Spec, to_partition_spec
from autopar.trace.ir import OpGraph


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
    lanes: Lanes | None = None  # a Python loop's layers kept stacked (placement/lanes.py)
    # seconds of its planning by stage (progress.timing), for the plan's statistics
    planning_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def plan(self) -> Plan:
        p = self.make_plan()
        return dataclasses.replace(p, search_stats=p.search_stats.timed(self.planning_seconds))


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
        self.rounds = saved.pipeline_repeats if saved is not None else pipeline_repeats
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
            agree("the step's call", call_items(self._options(), call.static,
                                                   zip(call.paths, call.leaves)))
            with (young_objects_only(), progress.task(f"planning {function_name(self.fn)}"),
                  progress.timing() as spent):
                self._cache[key] = made = self._make(call)
            made.planning_seconds = spent
            agree("the plan made from that call", decisions_items(made.decisions))
        return self._cache[key]

    def _options(self) -> dict[str, Any]:
        return {"mesh": self.requested, "search": self.search, "hardware": self.hw,
                "plan": self.saved, "annotations": self.annotations,
                "memory_limit": self.memory_limit, "microbatches": self.microbatches,
                "batch_argnums": self.batch_argnums, "pipeline": self.stages,
                "pipeline_repeats": self.rounds, "keep_placement": self.keep_placement}

    def _make(self, call: Call) -> _Signature:
        """Plan (or apply the saved plan, or the plan cache's) for these arguments; the jitted
        step."""
        requested = self.requested
        shape = mesh_shape(requested) if isinstance(requested, Mesh) else requested
        if self.saved is not None:
            return self._from_saved(call, shape, self.saved, self.microbatches)
        return through_cache("auto_parallel", call, self._options(), self.platform,
                             lambda cached: self._from_saved(call, shape, cached),
                             lambda: self._planned(call, shape), lambda made: made.make_plan())

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
        def make(planning: Planning, decisions: Decisions, p: Plan) -> _Signature:
            return self._signature(planning.graph, decisions, dict(p.mesh),
                                   [t.spec for t in p.outputs], planning.out_tree, lambda: p,
                                   planning.stored, planning.lanes)

        def compiled_of(made: _Signature) -> Any:
            return made.jitted.lower(*_abstract(call.leaves, made.lanes)).compile()

        request = Request(self.search, self.hw, self.annotations, self.platform,
                          self.memory_limit, self.microbatches, self.batch_argnums, self.stages,
                          self.rounds, self.keep_placement)
        return plan_call(call, shape, request, CompileCheck(make, compiled_of))

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
