"""The public entry points: `auto_parallel` and `plan`."""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Sequence

from jax.sharding import Mesh

from autopar.calling import Conventions
from autopar.cost.hardware import Hardware
from autopar.devices import mesh_profile, resolve_memory_limit
from autopar.errors import AutoparError
from autopar.plan import Plan, load_plan
from autopar.planner import _check_search, plan
from autopar.planning.microbatches import check_microbatches
from autopar.planning.pins import Annotations, check_annotations_type
from autopar.rewrite.gpipe import check_pipeline
from autopar.stepper import AutoParallel

__all__ = ["AutoParallel", "auto_parallel", "plan"]


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
    sum over microbatches is refused, naming the operation (rewrite/accumulate.py).

    `pipeline=S` (with `microbatches=M`, on a mesh with a 'stage' axis of size S) runs the
    loss's layer stack (an nn.scan, a lax.scan over stacked weights) as S GPipe stages over
    the M microbatches in the one program (rewrite/gpipe.py); the rest runs once.
    `pipeline_repeats=R` makes it circular: each stage holds R chunks of L/(S R) layers, and
    each microbatch goes round the stages R times (M >= S), so the bubble falls from
    (S-1)/(M+S-1) to (S-1)/(R M+S-1) of a stage's time, at R times the shifts.
    `keep_placement=True` keeps a circular schedule's stacked layers, with their optimizer
    state, in that placement between steps rather than moving them there every step, and a
    Python loop's per-layer leaves stacked on their stages rather than stacked every step:
    the step returns its state as `autopar.Placed` (pass it back as it is;
    `autopar.unpack(state)` gives your tree, with the layers in your order). Off by default:
    the state you get back is then not your tree until unpacked (placement/stored.py,
    placement/lanes.py).
    `pipeline="auto"` weighs no pipeline (with gradient accumulation where one batch does not
    fit) against every stage count the mesh offers (its 'stage' axis, or for a device count
    each divisor), several microbatch and round counts, and keeps the schedule estimated
    fastest that fits `memory_limit` (planning/schedules.py).
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
