"""How true the cost model's numbers are, against what XLA compiles (a diagnostic; plan quality
against hand-written `jax.jit` shardings is the `quality` suite's).

For every model, mesh and plan (our three searches; the pinned baselines of `baselines.py`,
expert input specs with our search choosing the operators, so not what an expert runs): the
cost model's estimate; from XLA's compiled program on this machine's simulated devices, collective
bytes per device by kind (read from the HLO), peak memory (memory_analysis) and flops per
device (cost_analysis); and the step time measured on the simulated devices. Simulated CPU
devices share one host: their step time says nothing about GPUs; it is reported because it is
what was measured.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import architectures
import jax
import models
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from autopar.cost.hardware import get_profile
from autopar.cost.hlo import collective_bytes, compiled_memory_bytes
from autopar.lower import jit_step
from autopar.mesh import make_mesh, mesh_shape
from autopar.planning.assemble import assemble
from autopar.planning.pins import resolve
from autopar.planning.solve import solve
from autopar.rules.factors import to_partition_spec
from autopar.trace.tracer import trace
from benchmarks.baselines import KINDS, baseline_annotations

# name -> (setup taking a scale factor for batch and width, rule family)
MODELS: dict[str, tuple[Callable[[int], tuple], str]] = {
    "mlp-wide": (lambda k: models.mlp_setup(batch=64 * k, features=256 * k, hidden=1024 * k,
                                            out=256 * k), "mlp"),
    "gpt-small": (lambda k: models.gpt_setup(batch=16 * k, seq=32, vocab=256, d_model=64 * k,
                                             heads=4, layers=2), "transformer"),
    "gpt-medium": (lambda k: models.gpt_setup(batch=16 * k, seq=32, vocab=512, d_model=128 * k,
                                              heads=8, layers=3), "transformer"),
    "moe": (lambda k: architectures.moe_setup(batch=8 * k, seq=16, experts=8, d_model=64 * k),
            "moe"),
    "resnet": (lambda k: architectures.resnet_setup(batch=16 * k, size=16,
                                                    channels=(32 * k, 64 * k)), "cnn"),
    "encoder-decoder": (lambda k: architectures.encdec_setup(batch=8 * k, seq=16,
                                                             d_model=64 * k), "transformer"),
}
MESHES = {"8": {"data": 8}, "2x4": {"data": 2, "model": 4}, "4x2": {"data": 4, "model": 2},
          "2x2x2": {"data": 2, "model": 2, "inner": 2}}


def parse_mesh(name: str) -> dict[str, int]:
    """'2x4' -> {'data': 2, 'model': 4}: axes named data, model, inner (one to three)."""
    if name in MESHES:
        return MESHES[name]
    sizes = [int(s) for s in name.split("x")]
    return dict(zip(("data", "model", "inner"), sizes))


OURS = ("dynamic_programming", "recursive_programming", "sharding_propagation")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _time_steps(compiled: Any, graph: Any, placed: list, repeats: int) -> float:
    """Median seconds of `repeats` steps after one warm-up; the state is fed back."""
    times = []
    args = list(placed)
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        outs = jax.block_until_ready(compiled(*args))
        if i:
            times.append(time.perf_counter() - t0)
        for out_index, in_index in graph.state_pairs.items():
            args[in_index] = outs[out_index]
    return statistics.median(times)


def measure(graph: Any, decisions: Any, plan: Any, mesh: Any, flat_args: list,
            repeats: int) -> dict[str, Any]:
    """Compile the plan on `mesh` and read what XLA made of it."""
    jitted = jit_step(graph, decisions, mesh, [t.spec for t in plan.outputs])
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat_args]
    t0 = time.perf_counter()
    compiled = jitted.lower(*abstract).compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    peak = compiled_memory_bytes(compiled)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    placed = [jax.device_put(x, NamedSharding(mesh, to_partition_spec(s)))
              for x, s in zip(flat_args, decisions.inputs)]
    return {"compiled_collective_bytes": collective_bytes(text),
            "compiled_peak_memory_bytes": int(peak), "compiled_flops": float(cost.get("flops", 0)),
            "compile_s": compile_s,
            "step_ms_simulated": 1e3 * _time_steps(compiled, graph, placed, repeats)}


def run(model_names: list[str], mesh_names: list[str], repeats: int = 3,
        log: Callable[[str], None] = print, zoo: dict | None = None,
        scale: int = 1) -> dict[str, Any]:
    """Every plan of every model in `model_names` (from `zoo`, default MODELS; batch and width
    times `scale`) on every mesh ('2x4' and the like, over jax.devices())."""
    hw = get_profile(None)
    zoo = MODELS if zoo is None else zoo
    rows = []
    overhead = []
    for name in model_names:
        setup, family = zoo[name]
        step, state, batch = setup(scale)
        # Host copies: every plan's run gets fresh device arrays (its state is donated).
        flat = [np.asarray(x) for x in jax.tree_util.tree_leaves((state, batch))]
        t0 = time.perf_counter()
        donated = frozenset(range(len(jax.tree_util.tree_leaves(state))))
        graph, in_tree, out_shape = trace(step, (state, batch), donated)
        trace_s = time.perf_counter() - t0
        out_tree = jax.tree_util.tree_structure(out_shape)
        inputs = [(graph.tensors[t].path, graph.tensors[t].shape) for t in graph.inputs]
        for mesh_name in mesh_names:
            axes = parse_mesh(mesh_name)
            shape, mesh = mesh_shape(axes), make_mesh(axes)
            everything = tuple(a for a, s in axes.items() if s > 1)
            candidates = [(b, b, None) for b in OURS[:2]]
            candidates.append(("sharding_propagation", "sharding_propagation",
                               [(r"^batch/", P(everything))]))
            candidates += [(k, "dynamic_programming", baseline_annotations(k, family, inputs, axes))
                           for k in KINDS]
            measured: dict[tuple, dict] = {}  # equal plans are compiled once
            for label, search, seeds in candidates:
                if label in KINDS and seeds is None:
                    continue
                t0 = time.perf_counter()
                pinned = resolve(graph, shape, seeds)
                solved = solve(graph, shape, hw, search, pinned)
                decisions, stats = solved.decisions, solved.stats
                plan = assemble(graph, decisions, shape, hw, label, stats, in_tree, out_tree,
                                pinned)
                plan_s = time.perf_counter() - t0
                row = {"model": name, "mesh": mesh_name, "plan": label,
                       "ours": label in OURS, "estimated_ms": plan.cost["total_s"] * 1e3,
                       "predicted_collective_bytes": {
                           k: plan.cost.collective_bytes.get(k, 0.0) for k in COLLECTIVES},
                       "predicted_peak_memory_bytes": plan.cost["peak_memory_bytes"],
                       "fits_memory": plan.cost["peak_memory_bytes"] <= hw.memory_bytes,
                       "exact": stats.exact, "gap": stats.gap,
                       "plan_s": plan_s, "trace_s": trace_s}
                key = (tuple(decisions.inputs), tuple(
                    (o.in_specs, o.out_specs, o.partial_axes) for o in decisions.ops))
                if key not in measured:
                    measured[key] = {**measure(graph, decisions, plan, mesh, flat, repeats),
                                     "same_as": label}
                row.update(measured[key])
                rows.append(row)
                log(f"{name} {mesh_name} {label:<22} est {row['estimated_ms']:.3f} ms, "
                    f"collectives {_total(row['predicted_collective_bytes']):,.0f} B predicted / "
                    f"{_total(row['compiled_collective_bytes']):,.0f} B compiled, "
                    f"step {row['step_ms_simulated']:.2f} ms (simulated)")
        overhead.append(_overhead(name, step, state, batch, trace_s, rows))
    return {"quality": rows, "overhead": overhead, "hardware": hw.name}


def _total(kinds: dict[str, float]) -> float:
    return float(sum(kinds.values()))


def _overhead(name: str, step: Any, state: Any, batch: Any, trace_s: float,
              rows: list[dict]) -> dict[str, Any]:
    """Our planning time (trace plus DP's search on the first mesh) over jax.jit's compile."""
    t0 = time.perf_counter()
    jax.jit(step).lower(state, batch).compile()
    jit_s = time.perf_counter() - t0
    ours = next(r for r in rows if r["model"] == name and r["plan"] == "dynamic_programming")
    return {"model": name, "jit_compile_s": jit_s, "plan_s": trace_s + ours["plan_s"],
            "plan_over_compile": (trace_s + ours["plan_s"]) / jit_s}


def headlines(rows: list[dict]) -> list[dict[str, Any]]:
    """Per model and mesh: ours (DP) over the best pinned baseline that fits, on estimated cost
    and on compiled collective bytes. Pinned baselines share our search, so ours can only lose
    here where the search is not exact."""
    out = []
    for key in dict.fromkeys((r["model"], r["mesh"]) for r in rows):
        group = [r for r in rows if (r["model"], r["mesh"]) == key]
        ours = next(r for r in group if r["plan"] == "dynamic_programming")
        hands = [r for r in group if not r["ours"] and r["fits_memory"]]
        best = min(hands, key=lambda r: r["estimated_ms"])
        compiled_best = _total(best["compiled_collective_bytes"])
        out.append({
            "model": key[0], "mesh": key[1], "best_baseline": best["plan"],
            "estimated_over_best": ours["estimated_ms"] / best["estimated_ms"],
            "collective_bytes_over_best": (_total(ours["compiled_collective_bytes"])
                                           / compiled_best if compiled_best else None),
            "best_of_ours": min((r for r in group if r["ours"]),
                                key=lambda r: r["estimated_ms"])["plan"]})
    return out


def _ratio(a: float, b: float) -> str:
    return "-" if not b else f"{a / b:.2f}"


def markdown(result: dict[str, Any]) -> str:
    rows = result["quality"]
    lines = ["| model | mesh | plan | est. ms | pred. / compiled collective bytes | by kind "
             "(compiled) | pred. / compiled peak memory | compiled GFLOP/device | step ms "
             "(simulated CPU) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred, comp = _total(r["predicted_collective_bytes"]), _total(r["compiled_collective_bytes"])
        kinds = ", ".join(f"{k} {v / 1e3:,.0f}k" for k, v in r["compiled_collective_bytes"].items())
        same = "" if r["same_as"] == r["plan"] else f" (= {r['same_as']})"
        lines.append(
            f"| {r['model']} | {r['mesh']} | {r['plan']}{'' if r['ours'] else ' (pinned)'}{same} | "
            f"{r['estimated_ms']:.3f} | {pred / 1e3:,.0f}k / {comp / 1e3:,.0f}k "
            f"({_ratio(pred, comp)}) | {kinds or '-'} | "
            f"{_ratio(r['predicted_peak_memory_bytes'], r['compiled_peak_memory_bytes'])} | "
            f"{r['compiled_flops'] / 1e9:.3f} | {r['step_ms_simulated']:.2f} |")
    lines += ["", "| model | mesh | best pinned baseline (fits memory) | ours (DP) / best: "
              "estimated | ours / best: compiled collective bytes | best of our searches |",
              "|---|---|---|---|---|---|"]
    for h in headlines(rows):
        coll = "-" if h["collective_bytes_over_best"] is None else \
            f"{h['collective_bytes_over_best']:.2f}"
        lines.append(f"| {h['model']} | {h['mesh']} | {h['best_baseline']} | "
                     f"{h['estimated_over_best']:.3f} | {coll} | {h['best_of_ours']} |")
    lines += ["", "| model | jax.jit compile s | our planning s (trace + DP) | ratio |",
              "|---|---|---|---|"]
    for o in result["overhead"]:
        lines.append(f"| {o['model']} | {o['jit_compile_s']:.2f} | {o['plan_s']:.2f} | "
                     f"{o['plan_over_compile']:.2f} |")
    return "\n".join(lines)
