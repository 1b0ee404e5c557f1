"""Pipeline parallelism: what autopar compiles for S stages, predicted against compiled.

For an 8-layer GPT (an nn.scan stack) on 8 simulated devices, planned for h100: one batch on
a data axis of 8, gradient accumulation over M microbatches, and S = 2, 4, 8 stages of GPipe
over M microbatches (mesh stage x data). Per program: the estimated bubble, the collective
bytes per step the cost model predicts beside those read from the compiled HLO (collective-
permutes apart: their count inside loops and their bytes), the memory estimate beside XLA's
memory_analysis, and the compiled step judged on h100 (`autopar.evaluate`). All compiled,
none run.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import models
import optax

import autopar
from autopar.cost.hardware import get_profile
from autopar.cost.hlo import collectives, compiled_memory_bytes
from benchmarks import pipeline_expert

MiB = 2**20
CONFIG = dict(vocab=512, d_model=128, heads=4, layers=8, scan=True)
# name -> (mesh, microbatches, stages, rounds through the stages: the circular schedule,
# whether the layers are one nn.scan or a Python loop of blocks, keep_placement)
CASES = {"one batch": ({"data": 8}, 1, 1, 1, True, False),
         "accumulated": ({"data": 8}, 8, 1, 1, True, False),
         "2 stages": ({"stage": 2, "data": 4}, 8, 2, 1, True, False),
         "2 stages, Python loop": ({"stage": 2, "data": 4}, 8, 2, 1, False, False),
         "2 stages, Python loop, stored": ({"stage": 2, "data": 4}, 8, 2, 1, False, True),
         "2 stages, circular": ({"stage": 2, "data": 4}, 8, 2, 2, True, False),
         "2 stages, circular, stored": ({"stage": 2, "data": 4}, 8, 2, 2, True, True),
         "4 stages": ({"stage": 4, "data": 2}, 8, 4, 1, True, False),
         "4 stages, Python loop": ({"stage": 4, "data": 2}, 8, 4, 1, False, False),
         "4 stages, Python loop, stored": ({"stage": 4, "data": 2}, 8, 4, 1, False, True),
         "4 stages, circular": ({"stage": 4, "data": 2}, 8, 4, 2, True, False),
         "4 stages, circular, stored": ({"stage": 4, "data": 2}, 8, 4, 2, True, True),
         "8 stages": ({"stage": 8}, 8, 8, 1, True, False)}


def gpt(batch: int, **config: Any) -> tuple[Callable, Any, Any]:
    config = {**CONFIG, **config}
    _, state, data = models.gpt_setup(batch=batch, seq=64, **config)
    return models.linen_step(models.GPT(**config), models.token_loss, optax.adamw(1e-3),
                             autopar.value_and_grad), state, data


def run(cases: dict[str, tuple[dict, int, int, int, bool, bool]] = CASES, batch: int = 64,
        config: dict | None = None, experts: bool = True,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Each case planned and compiled; with `experts`, after each GPipe case of the nn.scan
    model (S > 1, one round) the hand-written GPipe of the same S and M (pipeline_expert.py)
    compiled too."""
    config = {**CONFIG, **(config or {})}
    models_by_layout = {scan: gpt(batch, **{**config, "scan": scan})
                        for scan in {case[4] for case in cases.values()}}
    rows = []
    for name, (axes, m, s, rounds, scan, keep) in cases.items():
        step, state, data = models_by_layout[scan]
        mesh = autopar.make_mesh(axes)
        sharded = autopar.auto_parallel(step, mesh=mesh, microbatches=m, pipeline=s,
                                        pipeline_repeats=rounds, donate_argnums=0,
                                        hardware="h100", keep_placement=keep)
        plan = sharded.plan(state, data)
        rows.append({
            "program": name, "mesh": "x".join(map(str, axes.values())), "microbatches": m,
            "stages": s, "rounds": rounds, "bubble": (s - 1) / (rounds * m + s - 1),
            "shares": plan.microbatch_groups,
            "predicted_collective_bytes": sum(v for k, v in plan.cost.items()
                                              if k.endswith("_bytes")
                                              and k != "peak_memory_bytes"),
            "estimated_memory_bytes": plan.cost["peak_memory_bytes"],
            "estimated_ms": plan.cost["total_s"] * 1e3,
            **({"tick_loops_ms": plan.pipeline["tick_loops_s"] * 1e3} if plan.pipeline else {}),
            **_compiled(sharded.lower(state, data).compile(), mesh)})
        r = rows[-1]
        log(f"{name}: collectives {r['compiled_collective_bytes'] / MiB:.2f} MiB compiled, "
            f"{r['predicted_collective_bytes'] / MiB:.2f} predicted")
        if experts and s > 1 and rounds == 1 and scan:
            expert = pipeline_expert.gpipe_jit(config, s, m, mesh, state, optax.adamw(1e-3))
            rows.append({"program": f"{name}, hand-written GPipe", "mesh": rows[-1]["mesh"],
                         "microbatches": m, "stages": s, "rounds": 1,
                         "bubble": rows[-1]["bubble"], "shares": 1,
                         **_compiled(expert.lower(state, data).compile(), mesh)})
            log(f"{name}, hand-written: collectives "
                f"{rows[-1]['compiled_collective_bytes'] / MiB:.2f} MiB compiled")
    return {"pipeline": rows, "batch": batch, "config": config}


def _compiled(compiled: Any, mesh: Any) -> dict[str, Any]:
    """What the compiled program moves and keeps, and its step judged on h100."""
    found = collectives(compiled.as_text())
    permutes = [c for c in found if c.kind == "collective-permute"]
    judged = autopar.evaluate(compiled, mesh, "h100")
    return {"compiled_collective_bytes": sum(c.result_bytes * c.executions for c in found),
            "in_loops_bytes": sum(c.result_bytes * c.executions for c in found
                                  if c.executions > 1),
            "in_loops_kinds": sorted({c.kind for c in found if c.executions > 1}),
            "permutes_in_loops": sum(c.executions for c in permutes if c.executions > 1),
            "permute_bytes": sum(c.result_bytes * c.executions for c in permutes),
            "compiled_memory_bytes": compiled_memory_bytes(compiled),
            "judged_ms": judged.step_s * 1e3,
            "judged_collective_ms": judged.communication_s * 1e3}


def markdown(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [f"GPT ({c['layers']} layers as one nn.scan, or a Python loop of blocks where "
             f"named, d_model {c['d_model']}, seq 64, vocab "
             f"{c['vocab']}, batch {result['batch']}), adamw, state donated, 8 simulated "
             "devices; every program planned for h100, compiled for this machine and judged on "
             "h100. Collectives: result bytes per device per step (inside loops: the part run "
             "more than once, and its kinds); permutes: collective-permutes run inside loops "
             "(count) and their bytes; judged collective ms: the compiled program's "
             "collectives on h100, every loop trip counted (as are the flops and bytes of the "
             "judged step ms).", "",
             "Shares: each microbatch computed as so many shares, one per device group along "
             "the batch's other axes, the gradient reduced once after the loop (1: none). "
             "R: rounds each microbatch makes through the stages (the circular schedule, "
             "`pipeline_repeats`); \"stored\": with keep_placement=True, the stack and its "
             "optimizer state kept in the circular placement between steps (a Python loop's "
             "per-layer leaves: kept stacked, placement/lanes.py). "
             "\"hand-written GPipe\": the same S and M as a JAX user "
             "writes it in plain jax.jit (benchmarks/pipeline_expert.py); it has no estimate. "
             "Estimated tick loops: the forward and backward loops of R M + S - 1 ticks, "
             "bubble included, that every stage runs on its L/S layers (plan.pipeline).",
             "",
             "| program | mesh | M | S | R | shares | bubble | collectives compiled MiB (inside "
             "loops: kinds) | predicted MiB | permutes (MiB) | judged collective ms | "
             "memory estimate MiB | compiled MiB | judged h100 ms | estimated ms | "
             "estimated tick loops ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["pipeline"]:
        def estimate(key: str, scale: float, digits: int) -> str:
            return f"{r[key] / scale:.{digits}f}" if key in r else "-"
        kinds = ", ".join(k.replace("collective-", "c-") for k in r.get("in_loops_kinds", []))
        lines.append(
            f"| {r['program']} | {r['mesh']} | {r['microbatches']} | {r['stages']} | "
            f"{r.get('rounds', 1)} | {r['shares']} | {r['bubble']:.0%} | "
            f"{r['compiled_collective_bytes'] / MiB:.2f} ({r['in_loops_bytes'] / MiB:.2f}"
            f"{': ' + kinds if kinds else ''}) | "
            f"{estimate('predicted_collective_bytes', MiB, 2)} | "
            f"{r['permutes_in_loops']} ({r['permute_bytes'] / MiB:.2f}) | "
            f"{r.get('judged_collective_ms', float('nan')):.3f} | "
            f"{estimate('estimated_memory_bytes', MiB, 1)} | "
            f"{r['compiled_memory_bytes'] / MiB:.1f} | {r['judged_ms']:.3f} | "
            f"{estimate('estimated_ms', 1, 3)} | {estimate('tick_loops_ms', 1, 3)} |")
    return "\n".join(lines)


# pipeline="auto" at realistic width: a GPT of 8 layers at d_model 1024 (seq 512, vocab 32k,
# batch 32) on 4 nodes of 2 H100s, the network between nodes at these bandwidths (bytes/s):
# InfiniBand's 50 GB/s per GPU (the h100 profile), then slower networks.
CHOICE_CONFIG = dict(vocab=32768, d_model=1024, heads=16, layers=8, scan=True)
NETWORKS = (50e9, 25e9, 10e9, 5e9, 3e9)


def two_per_node(network_bandwidth: float) -> Any:
    """The h100 profile with 2 GPUs per NVLink node and the network at `network_bandwidth`."""
    h100 = get_profile("h100")
    nvlink, network = h100.levels
    return dataclasses.replace(h100, name=f"h100, 2 per node, network {network_bandwidth:g}",
                               levels=(dataclasses.replace(nvlink, devices=2),
                                       dataclasses.replace(network,
                                                           bandwidth=network_bandwidth)))


def _choice_case(config: dict, batch: int, seq: int) -> tuple[Callable, Any, Any, Any]:
    """The choice suite's GPT step (adamw, abstract state and batch) and mesh stage 4 x data 2."""
    _, state, data = models.gpt_abstract(batch=batch, seq=seq, **config)
    step = models.linen_step(models.GPT(**config), models.token_loss, optax.adamw(1e-3),
                             autopar.value_and_grad)
    return step, state, data, autopar.make_mesh({"stage": 4, "data": 2})


def choice(networks: tuple[float, ...] = NETWORKS, config: dict | None = None,
           batch: int = 32, seq: int = 512, log: Callable[[str], None] = print
           ) -> dict[str, Any]:
    """What pipeline="auto" picks on mesh (stage 4, data 2) per network bandwidth: every
    schedule weighed with its estimate, and the kept plan and the flat one compiled (collective
    bytes by kind, predicted beside compiled; memory)."""
    config = {**CHOICE_CONFIG, **(config or {})}
    step, state, data, mesh = _choice_case(config, batch, seq)
    rows = []
    for bandwidth in networks:
        hw = two_per_node(bandwidth)
        t0 = time.perf_counter()
        chosen = autopar.auto_parallel(step, mesh=mesh, pipeline="auto", donate_argnums=0,
                                       hardware=hw)
        plan = chosen.plan(state, data)
        planning_s = time.perf_counter() - t0
        flat = autopar.auto_parallel(step, mesh=mesh, donate_argnums=0, hardware=hw)
        compiled = {}
        for name, sharded in (("chosen", chosen), ("flat", flat)):
            program = sharded.lower(state, data).compile()
            found = collectives(program.as_text())
            compiled[name] = {
                "predicted": _by_kind(sharded.plan(state, data).cost),
                "compiled": {k: sum(c.result_bytes * c.executions for c in found if c.kind == k)
                             for k in sorted({c.kind for c in found})},
                "memory_bytes": compiled_memory_bytes(program),
                # per trip of every loop (the judge reads trip counts from the HLO)
                "judged_collective_ms": autopar.evaluate(program, mesh, hw).communication_s
                * 1e3}
        rows.append({"network_bytes_per_s": bandwidth, "planning_s": planning_s,
                     "stages": plan.pipeline_stages, "microbatches": plan.microbatches,
                     "repeats": plan.pipeline_repeats,
                     "shares": plan.microbatch_groups,
                     "tried": plan.search_stats["schedules_tried"], **compiled})
        log(f"network {bandwidth:g} B/s: {plan.pipeline_stages} stages, "
            f"{plan.microbatches} microbatches, planned in {planning_s:.1f} s")
    return {"choice": rows, "choice_config": config, "choice_batch": batch, "choice_seq": seq}


def choice_within(limits: tuple[float, ...] = (12 * 2**30, 6 * 2**30, 4 * 2**30),
                  networks: tuple[float, ...] = (5e10, 1e10), config: dict | None = None,
                  batch: int = 32, seq: int = 512, log: Callable[[str], None] = print
                  ) -> dict[str, Any]:
    """What pipeline="auto" keeps for the same GPT under memory limits (bytes per device) per
    network: the kept schedule, every one weighed, and the kept plan compiled (its memory
    beside the limit)."""
    step, state, data, mesh = _choice_case({**CHOICE_CONFIG, **(config or {})}, batch, seq)
    rows = []
    for limit in limits:
        for bandwidth in networks:
            chosen = autopar.auto_parallel(step, mesh=mesh, pipeline="auto", donate_argnums=0,
                                           hardware=two_per_node(bandwidth), memory_limit=limit)
            plan = chosen.plan(state, data)
            program = chosen.lower(state, data).compile()
            rows.append({"limit_bytes": limit, "network_bytes_per_s": bandwidth,
                         "stages": plan.pipeline_stages, "microbatches": plan.microbatches,
                         "repeats": plan.pipeline_repeats, "shares": plan.microbatch_groups,
                         "estimated_ms": plan.cost["total_s"] * 1e3,
                         "estimated_memory_bytes": plan.cost["peak_memory_bytes"],
                         "compiled_memory_bytes": compiled_memory_bytes(program),
                         "tried": plan.search_stats["schedules_tried"]})
            log(f"limit {limit / 2**30:g} GiB, network {bandwidth:g} B/s: "
                f"{_schedule_name(rows[-1])}")
    return {"choice_within": rows}


def _schedule_name(r: dict[str, Any]) -> str:
    if r["stages"] == 1:
        return "no pipeline" + (f", {r['microbatches']} microbatches" if r["microbatches"] > 1
                                else "")
    return (f"{r['stages']} stages x {r['microbatches']} microbatches"
            + (f" x {r['repeats']} rounds" if r.get("repeats", 1) > 1 else "")
            + (f", {r['shares']} shares" if r["shares"] > 1 else ""))


def _by_kind(cost: dict[str, float]) -> dict[str, float]:
    return {k[:-len("_bytes")]: v for k, v in cost.items()
            if k.endswith("_bytes") and k != "peak_memory_bytes" and v}


def _tried(t: dict, kept: dict) -> str:
    """One schedule pipeline="auto" weighed, for a table: in bold where it was kept."""
    name = f"{t['stages']}x{t['microbatches']}"
    if t.get("repeats", 1) > 1:
        name += f"x{t['repeats']} rounds"
    if "total_ms" not in t:
        return f"{name}: left out"
    chosen = ((t["stages"], t["microbatches"], t.get("repeats", 1))
              == (kept["stages"], kept["microbatches"], kept.get("repeats", 1)))
    return f"**{name}: {t['total_ms']:.2f}**" if chosen else f"{name}: {t['total_ms']:.2f}"


def within_markdown(result: dict[str, Any]) -> str:
    lines = ["", "## pipeline=\"auto\" under a memory limit: the same GPT and mesh", "",
             "Schedules that do not fit the limit are left out; the kept plan is compiled for "
             "8 simulated devices and its memory (XLA CPU) set beside the limit. Where XLA "
             "compiles the kept plan over the limit, the compile check plans it again for a "
             "smaller estimate: the estimated ms and memory are then those of the plan that "
             "runs, not of the schedule's entry.", "",
             "| limit GiB | network GB/s | schedules (S x M: estimated ms) | kept | estimated ms | "
             "memory estimate MiB | compiled MiB |", "|---|---|---|---|---|---|---|"]
    for r in result["choice_within"]:
        lines.append(
            f"| {r['limit_bytes'] / 2**30:g} | {r['network_bytes_per_s'] / 1e9:g} | "
            f"{', '.join(_tried(t, r) for t in r['tried'])} | {_schedule_name(r)} | "
            f"{r['estimated_ms']:.2f} | {r['estimated_memory_bytes'] / MiB:.0f} | "
            f"{r['compiled_memory_bytes'] / MiB:.0f} |")
    return "\n".join(lines)


def choice_markdown(result: dict[str, Any]) -> str:
    c = result["choice_config"]
    lines = ["", f"## pipeline=\"auto\": GPT of {c['layers']} layers, d_model {c['d_model']}, "
             f"seq {result['choice_seq']}, vocab {c['vocab']}, batch {result['choice_batch']}; "
             "mesh stage 4 "
             "x data 2 on 4 nodes of 2 H100s (NVLink inside a node, the network between)", "",
             "Every schedule weighed, with its estimated step (ms) or why it was left out; the "
             "kept one in bold. For the kept plan and the flat one (no pipeline, one batch), "
             "compiled for 8 simulated devices (XLA CPU): collective MiB per step, predicted / "
             "compiled, and the compiled collectives judged on the same profile (every loop "
             "trip counted).", "",
             "| network GB/s | schedules (S x M: estimated ms) | kept | planning s | "
             "kept: collectives predicted / compiled MiB | flat: predicted / compiled MiB | "
             "judged collective ms kept / flat | memory MiB kept / flat |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["choice"]:
        totals = {k: (sum(v["predicted"].values()) / MiB, sum(v["compiled"].values()) / MiB)
                  for k, v in (("chosen", r["chosen"]), ("flat", r["flat"]))}
        lines.append(
            f"| {r['network_bytes_per_s'] / 1e9:g} | "
            f"{', '.join(_tried(t, r) for t in r['tried'])} | "
            f"{_schedule_name(r)} | "
            f"{r['planning_s']:.1f} | {totals['chosen'][0]:.0f} / {totals['chosen'][1]:.0f} | "
            f"{totals['flat'][0]:.0f} / {totals['flat'][1]:.0f} | "
            f"{r['chosen']['judged_collective_ms']:.2f} / "
            f"{r['flat']['judged_collective_ms']:.2f} | "
            f"{r['chosen']['memory_bytes'] / MiB:.0f} / {r['flat']['memory_bytes'] / MiB:.0f} |")
    return "\n".join(lines)
