"""The planning targets, time, plan and bound per search: a Llama-3-8B-class train step for
256 chips (below), a deep GPT for 1,024 devices within 16 GiB (`deep_case`), and
pipeline="auto" against one schedule (`pipeline_case`).

The decoder of `tpu_models.llama("llama3-8b")` (32 layers, d_model 4096, grouped-query
attention, SwiGLU, vocabulary 128,256, adamw; batch 256 of 4,096 tokens) with its layers as
one `nn.scan` and as a Python loop, planned for the tpu_v5p profile under 95 GiB per chip on
a 2-D (16 x 16) and a 3-D (8 x 4 x 8) abstract mesh. Targets: dynamic_programming within 10 s
and recursive_programming within 5 s.
"""
from __future__ import annotations

import contextlib
import inspect
import statistics
import time
from typing import Any, Iterator

import jax

import autopar
import models
from benchmarks import tpu_models

# jax.monitoring's event for a top-level trace to a jaxpr (jax/_src/dispatch.py)
JAXPR_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"

MESHES = {"16x16": {"data": 16, "model": 16}, "8x4x8": {"data": 8, "fsdp": 4, "model": 8}}
SEARCHES = ("recursive_programming", "dynamic_programming")
TARGET_S = {"dynamic_programming": 10.0, "recursive_programming": 5.0}


@contextlib.contextmanager
def jax_tracing() -> Iterator[list[float]]:
    """The seconds JAX spends tracing functions to jaxprs inside the block (one event per
    top-level trace): what a `jax.jit` of the step pays too. Planning adds the rest."""
    spent: list[float] = []

    def on_event(event: str, seconds: float, **_: Any) -> None:
        if event == JAXPR_TRACE_EVENT:
            spent.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        yield spent
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)


def own_s(row: dict[str, Any]) -> float:
    """A planning row's seconds outside JAX's tracing of the step: autopar's share."""
    return row["total_s"] - row["jax_trace_s"]


def case(form: str, mesh: str, search: str) -> dict[str, Any]:
    w = tpu_models.llama("llama3-8b", batch=256, seq=4096, scan_layers=form == "nn.scan")
    with jax_tracing() as traced:
        t0 = time.perf_counter()
        plan = autopar.plan(w.step, w.state, w.batch, mesh=MESHES[mesh], search=search,
                            hardware="tpu_v5p", memory_limit="95GiB")
        total = time.perf_counter() - t0
    s = plan.search_stats
    return {"form": form, "mesh": mesh, "search": search, "total_s": total,
            "jax_trace_s": sum(traced),
            "trace_s": s["trace_s"], "searches": s.get("memory_solves", 1),
            "ops": s["ops"], "plan_ms": plan.cost["total_s"] * 1e3,
            "peak_gib": plan.cost["peak_memory_bytes"] / 2**30,
            "gap": s.get("gap"), "exact": s.get("exact"), "bound": s.get("bound", "")}


def deep_case(layers: int, scan: bool = False) -> dict[str, Any]:
    """A GPT at d_model 2,048 with a 32k vocabulary and adamw (batch 1,024 of 256 tokens, its
    layers a Python loop, or one nn.scan), planned by recursive_programming for 1,024 h100s as
    64 x 16 within 16 GiB each. Targets: 10 s at 96 layers, and at most 3x the 12-layer
    time."""
    step, state, data = models.gpt_abstract(batch=1024, seq=256, vocab=32768, d_model=2048,
                                            heads=32, layers=layers, scan=scan)
    with jax_tracing() as traced:
        t0 = time.perf_counter()
        plan = autopar.plan(step, state, data, mesh={"data": 64, "model": 16},
                            search="recursive_programming", hardware="h100",
                            memory_limit="16GiB")
        total = time.perf_counter() - t0
    s = plan.search_stats
    return {"layers": layers, "form": "nn.scan" if scan else "Python loop",
            "total_s": total, "jax_trace_s": sum(traced),
            "searches": s.get("memory_solves", 1), "ops": s["ops"],
            "plan_ms": plan.cost["total_s"] * 1e3,
            "peak_gib": plan.cost["peak_memory_bytes"] / 2**30, "gap": s.get("gap")}


def run(log: Any = print) -> list[dict[str, Any]]:
    rows = []
    for form in ("nn.scan", "Python loop"):
        for mesh in MESHES:
            for search in SEARCHES:
                rows.append(row := case(form, mesh, search))
                log(f"  {form:11s} {mesh:6s} {search:22s} {row['total_s']:6.1f} s, "
                    f"plan {row['plan_ms']:.1f} ms, gap {row['gap']}")
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["## Llama-3-8B class on 256 chips", "", __doc__.split("\n\n", 1)[1].strip(), "",
             "`JAX trace s` is JAX's own tracing of the step to a jaxpr (what `jax.jit` pays too), "
             "`trace s` autopar's tracing stage with it.", "",
             "| layers | mesh | search | total s | within target | JAX trace s | trace s | "
             "searches | ops | plan ms/step | peak GiB | gap to the bound |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = ("0 (proven)" if r["exact"] else f"{r['gap']:.2%}" if r["gap"] is not None
               else r["bound"] or "none")
        within = "yes" if r["total_s"] <= TARGET_S[r["search"]] else "no"
        lines.append(f"| {r['form']} | {r['mesh']} | {r['search']} | {r['total_s']:.1f} | "
                     f"{within} | {r['jax_trace_s']:.1f} | "
                     f"{r['trace_s']:.1f} | {r['searches']} | {r['ops']} | "
                     f"{r['plan_ms']:.1f} | {r['peak_gib']:.1f} | {gap} |")
    return "\n".join(lines)


DEEP_LAYERS = (12, 96)


def run_deep(log: Any = print) -> list[dict[str, Any]]:
    rows = []
    for scan in (False, True):
        for layers in DEEP_LAYERS:
            rows.append(row := deep_case(layers, scan))
            log(f"  GPT d 2048, {row['form']}, {layers:3d} layers, 64x16 within 16 GiB: "
                f"{row['total_s']:6.1f} s (JAX's trace {row['jax_trace_s']:.1f} s), plan "
                f"{row['plan_ms']:.1f} ms")
    return rows


def deep_markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["## A deep GPT on 1,024 devices within 16 GiB", "",
             inspect.cleandoc(deep_case.__doc__), "",
             "| form | layers | total s | JAX trace s | autopar s | searches | ops | "
             "plan ms/step | peak GiB | gap to the bound |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    def form(r: dict[str, Any]) -> str:  # rows measured before the nn.scan form have none
        return r.get("form", "Python loop")

    for r in rows:
        gap = f"{r['gap']:.2%}" if r["gap"] is not None else "none"
        lines.append(f"| {form(r)} | {r['layers']} | {r['total_s']:.1f} | "
                     f"{r['jax_trace_s']:.1f} | {own_s(r):.1f} | {r['searches']} | {r['ops']} | "
                     f"{r['plan_ms']:.1f} | {r['peak_gib']:.1f} | {gap} |")
    lines.append("")
    for kind in dict.fromkeys(map(form, rows)):
        same = [r for r in rows if form(r) == kind]
        if len(same) < 2:
            continue
        shallow, deep = same[0], same[-1]
        lines.append(
            f"- {kind}: {deep['layers']} layers over {shallow['layers']}: total "
            f"{deep['total_s'] / shallow['total_s']:.2f}x (target 3x), JAX's trace "
            f"{deep['jax_trace_s'] / shallow['jax_trace_s']:.2f}x, autopar's own "
            f"{own_s(deep) / own_s(shallow):.2f}x; {deep['layers']} layers within 10 s: "
            f"{'yes' if deep['total_s'] <= 10 else 'no'}")
    return "\n".join(lines)


def pipeline_case(rounds: int = 3) -> dict[str, Any]:
    """pipeline="auto" against one schedule: the pipeline suite's GPT (8 layers at d_model
    1,024, seq 512, batch 32, adamw) on stage 4 x data 2, 2 h100s a node and the network
    between at 10 GB/s (where "auto" keeps a pipeline), planned flat, as 4 stages x 8
    microbatches, and with pipeline="auto", in turn; the median of three rounds (`rounds`) of
    each. Target: "auto" within 3x the one schedule."""
    from benchmarks import pipeline  # the suite's model and profile

    step, state, data, mesh = pipeline._choice_case(dict(pipeline.CHOICE_CONFIG), 32, 512)
    hw = pipeline.two_per_node(10e9)
    forms = {"flat": {}, "one schedule": {"pipeline": 4, "microbatches": 8},
             "auto": {"pipeline": "auto"}}

    def seconds(options: dict[str, Any]) -> tuple[float, Any]:
        t0 = time.perf_counter()
        plan = autopar.auto_parallel(step, mesh=mesh, donate_argnums=0, hardware=hw,
                                     **options).plan(state, data)
        return time.perf_counter() - t0, plan

    seconds({})  # JAX's one-time costs, paid by none of the rows
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(rounds):
        for name, options in forms.items():
            spent, plan = seconds(options)
            times[name].append(spent)
            if name == "auto":
                kept, tried = plan.schedule, len(plan.search_stats.schedules_tried or ())
    row = {name: statistics.median(ts) for name, ts in times.items()}
    return {**row, "schedules": tried, "kept": kept, "rounds": rounds}


def pipeline_markdown(row: dict[str, Any]) -> str:
    kept = row["kept"]
    chosen = (f"{kept.stages} stages x {kept.microbatches} microbatches"
              + (f", {kept.rounds} rounds" if kept.rounds > 1 else "")
              if kept.stages > 1 else "no pipeline")
    return "\n".join([
        "## pipeline=\"auto\" against one schedule", "", inspect.cleandoc(pipeline_case.__doc__),
        "", "| flat s | one schedule s | auto s | schedules weighed | kept | auto / one schedule |",
        "|---|---|---|---|---|---|",
        f"| {row['flat']:.2f} | {row['one schedule']:.2f} | {row['auto']:.2f} | "
        f"{row['schedules']} | {chosen} | {row['auto'] / row['one schedule']:.2f}x |"])
