"""Gradient accumulation: what autopar compiles for M microbatches, predicted against compiled.

For a GPT on 8 simulated devices and M in 1, 2, 4: whether the plan reduces the gradient once
after the microbatch loop (`plan.microbatch_groups` shares per microbatch) or in each
microbatch (and why), the collective bytes per step the cost model predicts beside those read
from the compiled HLO (and the part inside loops), the memory estimate beside XLA's
memory_analysis, and the compiled step judged on the h100 profile (`autopar.evaluate`).
"""
from __future__ import annotations

from typing import Any, Callable

import models
import optax

import autopar
from autopar.cost.hlo import collectives, compiled_memory_bytes

# name -> (batch, microbatch counts); a batch of 32 in 4 microbatches over 8 devices leaves
# shares of one example, where the GPT's loss changes its code: reduced per microbatch
CASES = {"gpt batch 64": (64, (1, 2, 4)), "gpt batch 32": (32, (4,))}
MESHES = ({"data": 8}, {"data": 2, "model": 4})
MiB = 2**20


def gpt(batch: int) -> tuple[Callable, Any, Any]:
    _, state, data = models.gpt_setup(batch=batch, seq=64, vocab=512, d_model=64, heads=4,
                                      layers=2)
    model = models.GPT(vocab=512, d_model=64, heads=4, layers=2)
    return models.linen_step(model, models.token_loss, optax.adamw(1e-3),
                             autopar.value_and_grad), state, data


def run(cases: dict[str, tuple[int, tuple[int, ...]]] = CASES,
        meshes: tuple[dict[str, int], ...] = MESHES,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    rows = []
    for name, (batch, counts) in cases.items():
        step, state, data = gpt(batch)
        for axes in meshes:
            mesh = autopar.make_mesh(axes)
            for m in counts:
                sharded = autopar.auto_parallel(step, mesh=mesh, microbatches=m,
                                                donate_argnums=0, hardware="h100")
                plan = sharded.plan(state, data)
                compiled = sharded.lower(state, data).compile()
                found = collectives(compiled.as_text())
                predicted = sum(v for k, v in plan.cost.items()
                                if k.endswith("_bytes") and k != "peak_memory_bytes")
                rows.append({
                    "model": name, "mesh": "x".join(map(str, axes.values())), "microbatches": m,
                    "groups": plan.microbatch_groups,
                    "why_per_microbatch": plan.search_stats.get("reduced_per_microbatch", ""),
                    "predicted_collective_bytes": predicted,
                    "compiled_collective_bytes": sum(c.result_bytes * c.executions
                                                     for c in found),
                    "in_loops_bytes": sum(c.result_bytes * c.executions for c in found
                                          if c.executions > 1),
                    "estimated_memory_bytes": plan.cost["peak_memory_bytes"],
                    "compiled_memory_bytes": compiled_memory_bytes(compiled),
                    "judged_ms": autopar.evaluate(compiled, mesh, "h100").step_s * 1e3,
                    "estimated_ms": plan.cost["total_s"] * 1e3})
                r = rows[-1]
                log(f"{name} {r['mesh']} M={m}: groups {r['groups']}, collectives "
                    f"{r['compiled_collective_bytes'] / MiB:.2f} MiB compiled, "
                    f"{r['predicted_collective_bytes'] / MiB:.2f} predicted")
    return {"accumulation": rows}


def markdown(result: dict[str, Any]) -> str:
    lines = ["GPT (2 layers, d_model 64, seq 64, vocab 512), adamw, state donated, planned for "
             "h100 and compiled for this machine's simulated devices. Collectives: result "
             "bytes per device per step (inside loops: the part run more than once). Judged "
             "ms of M > 1 are not comparable with M = 1: XLA's cost_analysis counts a loop "
             "body's flops and bytes once.", "",
             "| model | mesh | M | gradient reduced | collectives compiled MiB (inside loops) "
             "| predicted MiB | memory estimate MiB | compiled MiB | judged h100 ms | "
             "estimated ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["accumulation"]:
        how = ("-" if r["microbatches"] == 1 else
               f"once ({r['groups']} shares)" if r["groups"] > 1 else
               f"per microbatch: {r['why_per_microbatch'][:60]}")
        lines.append(
            f"| {r['model']} | {r['mesh']} | {r['microbatches']} | {how} | "
            f"{r['compiled_collective_bytes'] / MiB:.2f} ({r['in_loops_bytes'] / MiB:.2f}) | "
            f"{r['predicted_collective_bytes'] / MiB:.2f} | "
            f"{r['estimated_memory_bytes'] / MiB:.1f} | {r['compiled_memory_bytes'] / MiB:.1f} | "
            f"{r['judged_ms']:.3f} | {r['estimated_ms']:.3f} |")
    return "\n".join(lines)
