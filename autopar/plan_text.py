"""A plan as text: `Plan.summary()` and the lines it is made of."""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Mapping

from autopar.name_ranges import collapse
from autopar.placement.storable import Storage
from autopar.plan_record import PlanRecord, TensorPlan
from autopar.plan_stats import SearchStats
from autopar.trace.layers import layer_key


def summary(plan: PlanRecord, limit: int = 40) -> str:
    """See Plan.summary."""
    rows = [(p, str(t.partition_spec), f"{t.bytes_per_device:,}")
            for p, t in _grouped(plan.inputs)]
    width = max([len(r[0]) for r in rows] + [4])
    lines = [f"{'path':<{width}}  {'spec':<28} bytes/device"]
    lines += [f"{p:<{width}}  {s:<28} {b}" for p, s, b in rows]
    c, stats = plan.cost, plan.search_stats
    if c.predicted:  # a partial plan (annotations read from a file) has no cost
        lines.append(f"predicted per step: compute {c.compute_s * 1e3:.3f} ms, "
                     f"communication {c.communication_s * 1e3:.3f} ms, total "
                     f"{c.total_s * 1e3:.3f} ms; peak memory "
                     f"{c.peak_memory_bytes / 2**20:.1f} MiB per device")
    if stats.bounded:
        lines.append(bound_line(plan.search, stats))
    elif (stats.bound or "").startswith("none"):
        lines.append(f"search: {plan.search}, no bound ({stats.bound})")
    if "total" in stats.planning_seconds:  # made in this process, not read from JSON
        lines.append(planning_line(stats.planning_seconds))
    if {"at_peak", "where"} <= set(plan.memory):
        m = plan.memory
        kinds = ", ".join(f"{k.replace('_', ' ')} {v / 2**20:.1f}"
                          for k, v in m["at_peak"].items() if v)
        allowed = (f" of {m['limit_bytes'] / 2**20:.1f} MiB allowed"
                   if m.get("limit_bytes") else "")
        lines.append(f"memory at its peak{allowed} ({m['where']}): {kinds} MiB")
        if m.get("compiled_bytes"):
            lines.append(f"compiled by XLA: {m['compiled_bytes'] / 2**20:.1f} MiB per device")
    if plan.pipeline_stages > 1:
        lines.append(pipeline_line(plan.pipeline_stages, plan.microbatches,
                                   plan.microbatch_groups, plan.pipeline_repeats))
        if plan.pipeline:
            lines.append(stages_line(plan.pipeline))
        if plan.stored is not None:
            lines.append(stored_line(plan.stored, plan.inputs))
        if plan.lanes is not None:
            lines.append(f"a Python loop's layers stored stacked between steps: "
                         f"{plan.lanes.families} families of {plan.lanes.layers} leaves "
                         "each, one array per family; the step returns them as "
                         "autopar.Placed, autopar.unpack gives your tree")
    elif plan.microbatches > 1:
        reduced = (f"kept per share of {plan.microbatch_groups} device groups and reduced "
                   "once after the loop" if plan.microbatch_groups > 1 else
                   "reduced in each microbatch")
        lines.append(f"gradient accumulated over {plan.microbatches} microbatches, one "
                     f"after the other, {reduced}")
    if stats.schedules_tried:
        lines.append("schedules weighed (pipeline='auto'): " + "; ".join(
            schedule_line(t) for t in stats.schedules_tried))
    if plan.recompute:
        lines.append(f"recomputed in the backward pass ({(c.recompute_s or 0) * 1e3:.3f}"
                     f" ms more compute): {', '.join(plan.recompute)}")
    at = [r for r in plan.redistributions if r.annotated]
    if at:
        lines.append(f"redistributions at annotations ({len(at)}):")
        lines += [f"  {r.describe()}" for r in sorted(at, key=lambda r: -r.cost_s)[:limit]]
    rest = [r for r in plan.redistributions if not r.annotated]
    if rest:
        total = sum(r.cost_s for r in rest)
        lines.append(f"{len(rest)} other redistributions, {total * 1e3:.3f} ms in all; "
                     "the costliest:")
        lines += [f"  {r.describe()}" for r in sorted(rest, key=lambda r: -r.cost_s)[:3]]
    return "\n".join(lines)


def _grouped(tensors: tuple[TensorPlan, ...]) -> list[tuple[str, TensorPlan]]:
    """(path or pattern, tensor) rows: tensors whose paths differ only in their numbers and
    that agree in shape, dtype and spec are one row, block_{0..3}/... (name_ranges.collapse)."""
    groups: dict[tuple, list[TensorPlan]] = defaultdict(list)
    for t in tensors:
        groups[(layer_key(t.path), t.shape, t.dtype, t.spec, t.bytes_per_device)].append(t)
    return [(pattern, members[0]) for members in groups.values()
            for pattern in collapse([t.path for t in members])]


def bound_line(search: str, stats: SearchStats) -> str:
    """How far from the cost model's optimum the search's plan can be, as its bound proves."""
    gap = max(stats.gap or 0.0, 0.0)
    among = f" among {stats.exact_for}" if stats.exact_for not in (None, "all plans") else ""
    priced = (" (the objective with memory priced at "
              f"{stats.memory_price_s_per_byte:.3g} s/byte)"
              if stats.memory_price_s_per_byte else "")
    if stats.exact:
        return f"search: {search}, proven optimal under the cost model{among}"
    return (f"search: {search}, within {gap:.2%} of the cost model's optimum{among}{priced}: "
            f"objective {stats.objective_s * 1e3:.3f} ms, lower bound "
            f"{stats.lower_bound * 1e3:.3f} ms")


def planning_line(seconds: Mapping[str, float]) -> str:
    """How long planning took, and in which stages (progress.stage's names)."""
    stages = ", ".join(f"{name} {s:.2f} s" for name, s in seconds.items() if name != "total")
    return f"planned in {seconds['total']:.2f} s" + (f": {stages}" if stages else "")


def pipeline_line(stages: int, microbatches: int, shares: int = 1, rounds: int = 1) -> str:
    """The summary's line for a pipelined plan."""
    ticks = rounds * microbatches + stages - 1
    schedule = ("GPipe schedule" if rounds == 1 else
                f"circular schedule, {rounds} rounds through the stages")
    return (f"layer stack pipelined over {stages} stages (the mesh's 'stage' axis) and "
            f"{microbatches} microbatches, {schedule}: {ticks} ticks, "
            f"bubble {(stages - 1) / ticks:.0%} of each stage's time"
            + (f"; each stage's microbatch in {shares} shares, its gradient reduced once after "
               "the loop" if shares > 1 else ""))


def stages_line(detail: dict[str, Any]) -> str:
    """The summary's line on a pipeline's stages (planning/assemble.pipeline_detail)."""
    held = "; ".join(f"stage {s}: layers " + ", ".join(f"{a}-{b}" if b > a else str(a)
                                                       for a, b in ranges)
                     for s, ranges in enumerate(detail["stage_layers"]))
    sub = " x ".join(f"{n} {k}" for n, k in detail["sub_mesh"].items()) or "one device"
    return (f"{held} (of {detail['layers']}); each stage on a sub-mesh of {sub}, one "
            f"program: the tick loops, forward and backward of {detail['ticks']} ticks, "
            f"estimated {detail['tick_loops_s'] * 1e3:.3f} ms and the plan's memory per device")


def stored_line(stored: Storage, inputs: tuple[TensorPlan, ...]) -> str:
    """The summary's line for a plan that keeps the stack in the circular placement."""
    named = sorted({inputs[k].path.split("/")[0] for k in stored.inputs})
    return (f"stored in the circular placement between steps: {len(stored.inputs)} leaves of "
            f"{stored.length} layers (of {', '.join(named)}); the step returns them as "
            "autopar.Placed, autopar.unpack gives your tree")


def schedule_line(tried: dict) -> str:
    """One schedule pipeline='auto' weighed (planning/schedules.py), for the summary."""
    stages, m = tried["stages"], tried.get("microbatches")
    if stages == 1:
        name = "no pipeline" + (f", {m} microbatches" if isinstance(m, int) and m > 1 else "")
    elif isinstance(stages, int):
        name = f"{stages} stages x {m} microbatches"
        if tried.get("repeats", 1) > 1:
            name += f" x {tried['repeats']} rounds"
    else:  # why no stage count was weighed (a mesh without a 'stage' axis)
        name = "a pipeline"
    if "total_ms" in tried:
        return f"{name}: {tried['total_ms']:.3f} ms"
    why = tried["left_out"]
    return f"{name}: left out ({why if len(why) <= 80 else why[:77] + '...'})"
