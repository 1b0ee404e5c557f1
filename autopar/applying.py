"""A saved plan applied to a call of the step: the step traced as the plan schedules it, and
the plan's decisions rebuilt on that trace. Nothing is searched; the Plan with its costs is
assembled only when asked for, since running the step needs the decisions alone."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from autopar.calling import Call
from autopar.cost.hardware import Hardware
from autopar.cost.xla import buffer_model
from autopar.decisions import Decisions
from autopar.errors import AutoparError
from autopar.mesh import MeshShape
from autopar.placement.lanes import Lanes, StackedTrace, traced_lanes
from autopar.placement.storable import Storage, storage
from autopar.plan import Plan
from autopar.planning.assemble import assemble, output_specs, pipeline_detail
from autopar.planning.saved import decisions_from_plan
from autopar.primitives.stack_read import reading_stored
from autopar.rewrite.accumulate import step_of
from autopar.rules.factors import Spec
from autopar.trace.ir import OpGraph
from autopar.trace.tracer import trace


@dataclasses.dataclass
class Applied:
    """A saved plan on one call: the traced graph, its decisions, the specs of the outputs,
    the user's output tree, and how to assemble the Plan."""
    graph: OpGraph
    decisions: Decisions
    out_specs: list[Spec]
    out_tree: Any
    make_plan: Callable[[], Plan]
    stored: Storage | None
    lanes: Lanes | None


def applied(call: Call, saved: Plan, shape: MeshShape, hw: Hardware, platform: str,
            batch_argnums: Any, microbatches: int | None = None) -> Applied:
    """`saved`'s decisions on this call's trace, on mesh `shape`; `microbatches`: the count to
    trace with where the caller asked for one (the plan's own by default). An AutoparError
    where the plan does not fit this step."""
    schedule = saved.schedule
    if microbatches is not None:
        schedule = dataclasses.replace(schedule, microbatches=microbatches)
    step = step_of(call, schedule, batch_argnums)
    stored = saved.stored
    if stored is not None:  # the stack reads the leaves the plan stores
        step = reading_stored(step, stored.reads)
    lanes = saved.lanes
    if lanes is not None:  # the Python loop's layers stacked, as the plan stores them
        found = _saved_lanes(step, call, lanes, platform)
        graph, lanes, out_tree = found.graph, found.lanes, found.out_tree
        in_tree, plan_out_tree = found.in_tree, found.plan_out_tree
    else:
        plain = not schedule.rewrites and stored is None  # the step as written
        graph, in_tree, out_shape = trace(step, call.abstract(), call.donated,
                                          compiler=platform,
                                          jaxpr=call.jaxpr if plain else None)
        out_tree = plan_out_tree = jax.tree_util.tree_structure(out_shape)
    if stored is not None:
        found = storage(graph, schedule.stages, schedule.rounds)
        if found != stored:
            raise AutoparError(
                f"the saved plan keeps {len(stored.inputs)} leaves of the stack in the "
                f"circular placement ({stored.inputs}), and this step lets "
                f"{len(found.inputs)} be stored ({found.inputs}). Fix: plan this step again.")
    decisions = decisions_from_plan(graph, saved, shape)

    def assembled() -> Plan:
        plan = assemble(graph, decisions, shape, hw, saved.search, saved.search_stats,
                        in_tree, plan_out_tree, buffers=buffer_model(platform))
        # what was recorded when it was planned (the limit, the compiled bytes) stays
        plan = dataclasses.replace(plan, memory={**saved.memory, **plan.memory},
                                   **schedule.plan_fields(), stored=stored, lanes=lanes)
        if schedule.stages > 1:
            plan = dataclasses.replace(plan, pipeline=pipeline_detail(graph, plan))
        return plan

    return Applied(graph, decisions, output_specs(graph, decisions), out_tree, assembled,
                   stored, lanes)


def _saved_lanes(step: Callable, call: Call, saved: Lanes, platform: str) -> StackedTrace:
    """The step traced over the layers a saved plan stores stacked (traced_lanes); an
    AutoparError where this step stacks other leaves."""
    found = traced_lanes(step, call.abstract(), call.donated, platform)
    if found is None or found.lanes != saved:
        got = found.lanes.families if found else 0
        raise AutoparError(
            f"the saved plan keeps {saved.families} families of a Python loop's layers "
            f"stacked, and this step lets {got} be stacked "
            f"({'other leaves' if got else 'none'}). Fix: plan this step again.")
    return found
