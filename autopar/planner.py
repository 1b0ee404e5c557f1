"""`autopar.plan`: a step planned on a mesh, nothing compiled or run."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from autopar import progress
from autopar.applying import applied
from autopar.calling import Call, Conventions, function_name
from autopar.collector import young_objects_only
from autopar.cost.hardware import Hardware
from autopar.devices import compiler_platform, mesh_profile, resolve_memory_limit
from autopar.errors import AutoparError
from autopar.explain import explainable
from autopar.mesh import MeshShape, mesh_or_count, mesh_shape
from autopar.plan import Plan
from autopar.plan_cache import through_cache
from autopar.plan_call import Request, plan_call
from autopar.planning.microbatches import check_microbatches
from autopar.planning.pins import Annotations, check_annotations_type
from autopar.planning.solve import SEARCHES
from autopar.rewrite.gpipe import check_pipeline


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

    request = Request(search, hw, annotations, platform, limit, microbatches, batch_argnums,
                      pipeline, pipeline_repeats, keep_placement)
    options = {"mesh": shape, "search": search, "hardware": hw, "annotations": annotations,
               "memory_limit": limit, "microbatches": microbatches,
               "batch_argnums": batch_argnums, "pipeline": pipeline,
               "pipeline_repeats": pipeline_repeats, "keep_placement": keep_placement}

    def apply(cached: Plan) -> Plan:
        on = shape if isinstance(shape, MeshShape) else mesh_shape(dict(cached.mesh))
        return applied(call, cached, on, hw, platform, batch_argnums).make_plan()

    def searched() -> Plan:
        with young_objects_only():
            return plan_call(call, shape, request).plan

    with progress.task(f"planning {function_name(fn)}"), progress.timing() as spent:
        made = through_cache("plan", call, options, platform, apply, searched, lambda p: p)
    made = dataclasses.replace(made, search_stats=made.search_stats.timed(spent))

    return explainable(made, plan, fn, args, annotations, dict(
        mesh=mesh, search=search, hardware=hardware, memory_limit=limit,
        static_argnums=static_argnums, static_argnames=static_argnames,
        donate_argnums=donate_argnums, donate_argnames=donate_argnames,
        batch_argnums=batch_argnums, keep_placement=keep_placement))


def _check_search(search: str) -> None:
    if search not in SEARCHES:
        raise AutoparError(f"unknown search {search!r}. Fix: use one of {list(SEARCHES)}.")
