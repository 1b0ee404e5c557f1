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

from typing import Any, Callable

import models
import optax

import autopar
from autopar.cost.hlo import collectives, compiled_memory_bytes

MiB = 2**20
CONFIG = dict(vocab=512, d_model=128, heads=4, layers=8, scan=True)
# name -> (mesh, microbatches, stages)
CASES = {"one batch": ({"data": 8}, 1, 1), "accumulated": ({"data": 8}, 8, 1),
         "2 stages": ({"stage": 2, "data": 4}, 8, 2), "4 stages": ({"stage": 4, "data": 2}, 8, 4),
         "8 stages": ({"stage": 8}, 8, 8)}


def gpt(batch: int, **config: Any) -> tuple[Callable, Any, Any]:
    config = {**CONFIG, **config}
    _, state, data = models.gpt_setup(batch=batch, seq=64, **config)
    return models.linen_step(models.GPT(**config), models.token_loss, optax.adamw(1e-3),
                             autopar.value_and_grad), state, data


def run(cases: dict[str, tuple[dict, int, int]] = CASES, batch: int = 32,
        config: dict | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    step, state, data = gpt(batch, **(config or {}))
    rows = []
    for name, (axes, m, s) in cases.items():
        mesh = autopar.make_mesh(axes)
        sharded = autopar.auto_parallel(step, mesh=mesh, microbatches=m, pipeline=s,
                                        donate_argnums=0, hardware="h100")
        plan = sharded.plan(state, data)
        compiled = sharded.lower(state, data).compile()
        found = collectives(compiled.as_text())
        permutes = [c for c in found if c.kind == "collective-permute"]
        rows.append({
            "program": name, "mesh": "x".join(map(str, axes.values())), "microbatches": m,
            "stages": s, "bubble": (s - 1) / (m + s - 1),
            "predicted_collective_bytes": sum(v for k, v in plan.cost.items()
                                              if k.endswith("_bytes")
                                              and k != "peak_memory_bytes"),
            "compiled_collective_bytes": sum(c.result_bytes * c.executions for c in found),
            "in_loops_bytes": sum(c.result_bytes * c.executions for c in found
                                  if c.executions > 1),
            "permutes_in_loops": sum(c.executions for c in permutes if c.executions > 1),
            "permute_bytes": sum(c.result_bytes * c.executions for c in permutes),
            "estimated_memory_bytes": plan.cost["peak_memory_bytes"],
            "compiled_memory_bytes": compiled_memory_bytes(compiled),
            "estimated_ms": plan.cost["total_s"] * 1e3,
            "judged_ms": autopar.evaluate(compiled, mesh, "h100").step_s * 1e3})
        r = rows[-1]
        log(f"{name}: collectives {r['compiled_collective_bytes'] / MiB:.2f} MiB compiled, "
            f"{r['predicted_collective_bytes'] / MiB:.2f} predicted")
    return {"pipeline": rows, "batch": batch, "config": {**CONFIG, **(config or {})}}


def markdown(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [f"GPT ({c['layers']} layers as one nn.scan, d_model {c['d_model']}, seq 64, vocab "
             f"{c['vocab']}, batch {result['batch']}), adamw, state donated, 8 simulated "
             "devices; every program planned for h100, compiled for this machine and judged on "
             "h100. Collectives: result bytes per device per step (inside loops: the part run "
             "more than once); permutes: collective-permutes run inside loops (count) and "
             "their bytes. Judged ms of looped programs count a loop body's flops once "
             "(XLA's cost_analysis), so they are not comparable across rows.", "",
             "| program | mesh | M | S | bubble | collectives compiled MiB (inside loops) | "
             "predicted MiB | permutes (MiB) | memory estimate MiB | compiled MiB | judged h100 "
             "ms | estimated ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["pipeline"]:
        lines.append(
            f"| {r['program']} | {r['mesh']} | {r['microbatches']} | {r['stages']} | "
            f"{r['bubble']:.0%} | {r['compiled_collective_bytes'] / MiB:.2f} "
            f"({r['in_loops_bytes'] / MiB:.2f}) | {r['predicted_collective_bytes'] / MiB:.2f} | "
            f"{r['permutes_in_loops']} ({r['permute_bytes'] / MiB:.2f}) | "
            f"{r['estimated_memory_bytes'] / MiB:.1f} | {r['compiled_memory_bytes'] / MiB:.1f} | "
            f"{r['judged_ms']:.3f} | {r['estimated_ms']:.3f} |")
    return "\n".join(lines)
