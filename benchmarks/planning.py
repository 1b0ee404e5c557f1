"""Planning at scale: search time, overhead and plan quality of both searches.

GPT train steps of growing depth are planned on abstract meshes of 8, 64 and 1,024 devices of a
hardware profile (default: h100; no device is needed, nothing is allocated at full size). For each case: trace, problem-and-search
and total time, the plan's estimated step time, and recursive_programming's cost over
dynamic_programming's. Then, on this machine's devices, autopar's first call of a small GPT
against the first call of its data-parallel jax.jit.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

import autopar
import models
from benchmarks import planning_targets, restart

# jax.monitoring's event for XLA's backend compile (jax/_src/dispatch.py)
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
LOWERING_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration")

MESHES = {8: {"data": 2, "model": 4}, 64: {"data": 8, "model": 8}, 1024: {"data": 64, "model": 16}}


def plan_case(layers: int, devices: int, search: str, d_model: int, seq: int,
              batch: int, hardware: str = "h100") -> dict[str, Any]:
    step, state, data = models.gpt_abstract(batch=batch, seq=seq, vocab=4096, d_model=d_model,
                                            heads=d_model // 64, layers=layers)
    with planning_targets.jax_tracing() as traced:
        t0 = time.perf_counter()
        plan = autopar.plan(step, state, data, mesh=MESHES[devices], search=search,
                            hardware=hardware)
        total = time.perf_counter() - t0
    stats = plan.search_stats
    return {"layers": layers, "devices": devices, "search": search, "ops": stats["ops"],
            "nodes": stats["nodes"], "trace_s": stats["trace_s"], "jax_trace_s": sum(traced),
            # every search the plan took: under a memory budget, one per price tried
            "search_s": stats.get("memory_search_s", stats["search_s"]),
            "searches": stats.get("memory_solves", 1),
            "total_s": total, "plan_step_ms": plan.cost["total_s"] * 1e3,
            "exact": stats.get("exact"), "gap": stats.get("gap"),
            "recomputed": len(plan.recompute)}


def first_call_case(search: str, repeats: int = 3, hardware: str | None = None
                    ) -> dict[str, Any]:
    """autopar's first call of the 4-layer d_model-256 GPT against the first call of its
    data-parallel `jax.jit` (parameters replicated, batch split, as a user writes it) on the
    same devices, the median of `repeats` rounds: each call from fresh single-device arrays,
    so both pay the trace, the compile and the placement of the inputs.

    Both are warmed up on another step first, so neither pays JAX's one-time start-up costs.
    `hardware` is the profile autopar plans for (None: this machine's). On this machine's
    CPU profile the plan shards Adam's moments, a program XLA takes longer to compile; with
    "h100" the plan lays the step out as the data-parallel jit does
    (`data_parallel_layout`), so the ratio is close to what autopar itself adds. The control,
    `jax.jit` given autopar's input shardings (XLA propagating the rest), shows what the
    layout alone costs to compile.
    """
    n = len(jax.devices())
    mesh = autopar.make_mesh({"data": n})
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    warm_step, warm_state, warm_batch = models.mlp_setup()
    jax.block_until_ready(jax.jit(warm_step, in_shardings=(replicated, split))(
        warm_state, warm_batch))
    warm = autopar.auto_parallel(warm_step, mesh=mesh, search=search, hardware=hardware)
    jax.block_until_ready(warm(warm_state, warm_batch))

    def example() -> tuple:
        return models.gpt_setup(batch=16, seq=64, vocab=512, d_model=256, heads=4, layers=4)

    compiles: list[float] = []  # XLA's backend compile of each program, in seconds
    lowerings: list[float] = []  # JAX's traces to a jaxpr and lowerings to StableHLO

    def on_event(event: str, seconds: float, **_: Any) -> None:
        if event == BACKEND_COMPILE_EVENT:
            compiles.append(seconds)
        elif event in LOWERING_EVENTS:
            lowerings.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    rounds = []
    try:
        for _ in range(repeats):
            step, state, batch = example()
            compiles.clear()
            t0 = time.perf_counter()
            stepper = autopar.auto_parallel(step, mesh=mesh, search=search, hardware=hardware)
            stepper.plan(state, batch)  # the planning the call does first, timed apart
            planned = time.perf_counter() - t0
            lowerings.clear()
            jax.block_until_ready(stepper(state, batch))
            ours, ours_compile = time.perf_counter() - t0, sum(compiles)
            lowering = sum(lowerings)  # the planned program traced and lowered
            stats = stepper.plan(state, batch).search_stats
            (state_in, batch_in), _ = stepper.input_shardings(state, batch)
            same_layout = (all(s.spec == P() for s in jax.tree_util.tree_leaves(state_in))
                           and all(s.spec == P("data") for s in
                                   jax.tree_util.tree_leaves(batch_in)))
            step, state, batch = example()
            compiles.clear()
            t0 = time.perf_counter()
            jax.block_until_ready(jax.jit(step, in_shardings=(replicated, split))(state, batch))
            plain, plain_compile = time.perf_counter() - t0, sum(compiles)
            # The control: jax.jit given autopar's input layout, XLA propagating the rest.
            step, state, batch = example()
            compiles.clear()
            t0 = time.perf_counter()
            jax.block_until_ready(jax.jit(step, in_shardings=(state_in, batch_in))(state, batch))
            same, same_compile = time.perf_counter() - t0, sum(compiles)
            rounds.append({"autopar_first_call_s": ours, "plan_s": planned,
                           "lowering_s": lowering, "own_share": (planned + lowering) / ours,
                           "trace_s": stats["trace_s"],
                           "search_s": stats["search_s"], "autopar_compile_s": ours_compile,
                           "jit_first_call_s": plain, "jit_compile_s": plain_compile,
                           "same_layout_jit_first_call_s": same,
                           "same_layout_jit_compile_s": same_compile,
                           "ratio": ours / plain, "ratio_to_same_layout": ours / same,
                           # what autopar adds beyond XLA compiling a different program
                           "ratio_without_compile": (ours - ours_compile)
                           / (plain - plain_compile)})
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    median = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    return {"search": search, "hardware": hardware or "this machine's", "repeats": repeats,
            "devices": n, "data_parallel_layout": same_layout, **median}


def run(depths: list[int], devices: list[int], d_model: int, seq: int, batch: int,
        dp_max_layers: int, hardware: str = "h100", log: Any = print) -> dict[str, Any]:
    rows = []
    for layers in depths:
        for n in devices:
            for search in ("recursive_programming", "dynamic_programming"):
                if search == "dynamic_programming" and layers > dp_max_layers:
                    continue
                row = plan_case(layers, n, search, d_model, seq, batch, hardware)
                log(f"  {layers:3d} layers, {n:5d} devices, {search:22s} "
                    f"search {row['search_s']:7.2f}s total {row['total_s']:7.2f}s "
                    f"plan {row['plan_step_ms']:9.3f} ms")
                rows.append(row)
    first_calls = [first_call_case(b, hardware=hw) for hw in (None, "h100")
                   for b in ("dynamic_programming", "recursive_programming")]
    return {"planning": rows, "first_call": first_calls, "restart": restart.run(log),
            "targets": planning_targets.run(log), "deep": planning_targets.run_deep(log),
            "pipeline": planning_targets.pipeline_case()}


def markdown(result: dict[str, Any]) -> str:
    rows = result["planning"]
    lines = ["## Planning at scale", "",
             "Where the plan that is fastest does not fit the profile's memory, the planner "
             "searches again at memory prices (and with layers recomputed): `searches` counts "
             "them and `search s` is their sum. `JAX trace s` is JAX's own tracing of the "
             "step to a jaxpr (what `jax.jit` pays too), inside `trace s`; `autopar s` is the "
             "total without it.", "",
             "| layers | devices | search | ops | nodes | JAX trace s | trace s | searches | "
             "search s | total s | autopar s | plan ms/step | recomputed layers | exact | "
             "RP/DP cost |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    dp = {(r["layers"], r["devices"]): r for r in rows if r["search"] == "dynamic_programming"}
    for r in rows:
        ratio = ""
        if r["search"] == "recursive_programming" and (r["layers"], r["devices"]) in dp:
            ratio = f"{r['plan_step_ms'] / dp[(r['layers'], r['devices'])]['plan_step_ms']:.3f}"
        exact = {True: "yes", False: f"no (gap {r['gap']:.1%})" if r["gap"] is not None else "no",
                 None: ""}[r["exact"]]
        lines.append(f"| {r['layers']} | {r['devices']} | {r['search']} | {r['ops']} | "
                     f"{r['nodes']} | {r['jax_trace_s']:.2f} | {r['trace_s']:.2f} | "
                     f"{r.get('searches', 1)} | {r['search_s']:.2f} | {r['total_s']:.2f} | "
                     f"{planning_targets.own_s(r):.2f} | {r['plan_step_ms']:.3f} | "
                     f"{r.get('recomputed', 0)} | {exact} | {ratio} |")
    rp = {(r["layers"], r["devices"]): r for r in rows
          if r["search"] == "recursive_programming"}
    depths = sorted({k[0] for k in rp})
    if len(depths) > 1:
        lines += ["", f"recursive_programming search time, {depths[-1]} layers over {depths[0]} "
                  "(all searches; per search, where a memory budget made them differ in number):"]
        for n in sorted({k[1] for k in rp}):
            if (depths[0], n) in rp and (depths[-1], n) in rp:
                deep, shallow = rp[(depths[-1], n)], rp[(depths[0], n)]
                line = f"- {n} devices: {deep['search_s'] / shallow['search_s']:.2f}x"
                if deep["searches"] != shallow["searches"]:
                    per = ((deep["search_s"] / deep["searches"])
                           / (shallow["search_s"] / shallow["searches"]))
                    line += (f"; per search {per:.2f}x ({deep['searches']} searches against "
                             f"{shallow['searches']})")
                line += (f"; total {deep['total_s'] / shallow['total_s']:.2f}x, JAX's trace "
                         f"{deep['jax_trace_s'] / shallow['jax_trace_s']:.2f}x, autopar's own "
                         f"{planning_targets.own_s(deep) / planning_targets.own_s(shallow):.2f}x")
                lines.append(line)
    lines += ["", "## First call against data-parallel jax.jit (this machine's devices)", "",
              "A 4-layer d_model-256 GPT, each call from fresh single-device arrays: trace, "
              "search, compile and placement for autopar; trace, compile and placement for "
              "`jax.jit(step, in_shardings=(replicated, batch split))`. Medians of rounds. "
              "XLA compiles the two plans, which differ, in different times: the last column "
              "leaves XLA's compile out of both sides, to show what autopar itself adds. On "
              "this machine's profile the plan shards Adam's moments; planned for h100 it lays "
              "the step out as the data-parallel jit does. The control is `jax.jit` given "
              "autopar's input shardings, XLA propagating the rest: what the layout alone "
              "costs.", "",
              "`outside XLA's compile` is the share of the first call that is not XLA's "
              "compile: autopar's trace, search and lowering, and the placement of the inputs "
              "(JAX's, as for jax.jit). `autopar's own` is the share of planning (trace, "
              "search, write-up) and lowering (the planned program traced and lowered to "
              "StableHLO, JAX's `jaxpr_trace` and `jaxpr_to_mlir_module` events) alone.", "",
              "| search | profile | data-parallel layout | devices | autopar first call s | "
              "of which trace s | of which search s | of which XLA compile s | "
              "jax.jit first call s | of which XLA compile s | ratio | ratio without XLA compile "
              "| jax.jit in autopar's layout: first call s | of which XLA compile s | "
              "ratio to it | outside XLA's compile | of which plan s | of which lowering s | "
              "autopar's own |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for o in result["first_call"]:
        lines.append(f"| {o['search']} | {o.get('hardware', '')} | "
                     f"{'yes' if o.get('data_parallel_layout') else 'no'} | {o['devices']} | "
                     f"{o['autopar_first_call_s']:.2f} | "
                     f"{o['trace_s']:.2f} | {o['search_s']:.2f} | {o['autopar_compile_s']:.2f} | "
                     f"{o['jit_first_call_s']:.2f} | {o['jit_compile_s']:.2f} | "
                     f"{o['ratio']:.2f} | {o['ratio_without_compile']:.2f} | "
                     f"{o['same_layout_jit_first_call_s']:.2f} | "
                     f"{o['same_layout_jit_compile_s']:.2f} | {o['ratio_to_same_layout']:.2f} | "
                     f"{1 - o['autopar_compile_s'] / o['autopar_first_call_s']:.0%} | "
                     + (f"{o['plan_s']:.2f} | {o['lowering_s']:.2f} | {o['own_share']:.0%} |"
                        if "plan_s" in o else " |  |  |"))
    if result.get("restart"):
        lines += ["", restart.markdown(result["restart"])]
    if result.get("targets"):
        lines += ["", planning_targets.markdown(result["targets"])]
    if result.get("deep"):
        lines += ["", planning_targets.deep_markdown(result["deep"])]
    if result.get("pipeline"):
        lines += ["", planning_targets.pipeline_markdown(result["pipeline"])]
    return "\n".join(lines)
