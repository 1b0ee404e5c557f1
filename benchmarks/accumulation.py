"""Gradient accumulation: what autopar compiles for M microbatches, predicted against compiled,
beside what a user writes without it.

For a GPT on 8 simulated devices and M in 1, 2, 4: whether the plan reduces the gradient once
after the microbatch loop (`plan.microbatch_groups` shares per microbatch) or in each
microbatch (and why), the collective bytes per step the cost model predicts beside those read
from the compiled HLO (and the part inside loops), the memory estimate beside XLA's
memory_analysis, and the compiled step judged on the h100 profile (`autopar.evaluate`). The
expert is plain `jax.jit` of a hand-written microbatch loop, data parallel over every device,
measured the same way.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import models
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import autopar
from autopar.cost.hlo import collectives, compiled_memory_bytes

# name -> (batch, microbatch counts); a batch of 32 in 4 microbatches over 8 devices leaves
# shares of one example, where the GPT's loss changes its code: reduced per microbatch
CASES = {"gpt batch 64": (64, (1, 2, 4)), "gpt batch 32": (32, (4,))}
MESHES = ({"data": 8}, {"data": 2, "model": 4})
MiB = 2**20
MODEL = models.GPT(vocab=512, d_model=64, heads=4, layers=2)


def gpt(batch: int) -> tuple[Callable, Any, Any]:
    _, state, data = models.gpt_setup(batch=batch, seq=64, vocab=512, d_model=64, heads=4,
                                      layers=2)
    return models.linen_step(MODEL, models.token_loss, optax.adamw(1e-3),
                             autopar.value_and_grad), state, data


def expert_step(microbatches: int) -> Callable:
    """What a user writes without autopar: jax.value_and_grad of each microbatch in a
    lax.scan (microbatch j the examples j, j+M, ..., so a device keeps its share of each),
    the sums divided by M (the microbatches' token counts are equal), then the update."""
    tx = optax.adamw(1e-3)
    if microbatches == 1:
        return models.linen_step(MODEL, models.token_loss, tx)

    def step(state, batch):
        params, opt_state = state

        def split(x):
            return jnp.swapaxes(x.reshape(x.shape[0] // microbatches, microbatches,
                                          *x.shape[1:]), 0, 1)

        def body(sums, b):
            value = jax.value_and_grad(
                lambda p: models.token_loss(MODEL.apply(p, b["inputs"]), b["targets"]))(params)
            return jax.tree_util.tree_map(jnp.add, sums, value), None

        zeros = (jnp.zeros(()), jax.tree_util.tree_map(jnp.zeros_like, params))
        sums, _ = jax.lax.scan(body, zeros, jax.tree_util.tree_map(split, batch))
        loss, grads = jax.tree_util.tree_map(lambda x: x / microbatches, sums)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss
    return step


def measured(compiled: Any, mesh: Any) -> dict[str, Any]:
    """What any compiled step shows: its collectives (all, and those inside loops), its
    memory and its judged time on h100."""
    found = collectives(compiled.as_text())
    return {"compiled_collective_bytes": sum(c.result_bytes * c.executions for c in found),
            "in_loops_bytes": sum(c.result_bytes * c.executions for c in found
                                  if c.executions > 1),
            "compiled_memory_bytes": compiled_memory_bytes(compiled),
            "judged_ms": autopar.evaluate(compiled, mesh, "h100").step_s * 1e3}


def run(cases: dict[str, tuple[int, tuple[int, ...]]] = CASES,
        meshes: tuple[dict[str, int], ...] = MESHES,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    rows = []
    for name, (batch, counts) in cases.items():
        step, state, data = gpt(batch)
        for axes in meshes:
            mesh = autopar.make_mesh(axes)
            for m in counts:
                row = {"model": name, "mesh": "x".join(map(str, axes.values())),
                       "microbatches": m}
                sharded = autopar.auto_parallel(step, mesh=mesh, microbatches=m,
                                                donate_argnums=0, hardware="h100")
                plan = sharded.plan(state, data)
                rows.append({
                    **row, "program": "autopar", "groups": plan.microbatch_groups,
                    "why_per_microbatch": plan.search_stats.get("reduced_per_microbatch", ""),
                    "predicted_collective_bytes": sum(
                        v for k, v in plan.cost.items()
                        if k.endswith("_bytes") and k != "peak_memory_bytes"),
                    "estimated_memory_bytes": plan.cost["peak_memory_bytes"],
                    "estimated_ms": plan.cost["total_s"] * 1e3,
                    **measured(sharded.lower(state, data).compile(), mesh)})
                # the expert: state replicated, the batch split over every device, donated
                batch_split = NamedSharding(mesh, P(tuple(axes)))
                expert = jax.jit(expert_step(m), donate_argnums=0,
                                 in_shardings=(NamedSharding(mesh, P()), batch_split),
                                 out_shardings=NamedSharding(mesh, P()))
                rows.append({**row, "program": "expert: data-parallel jax.jit",
                             **measured(expert.lower(state, data).compile(), mesh)})
                for r in rows[-2:]:
                    log(f"{name} {r['mesh']} M={m} {r['program']}: collectives "
                        f"{r['compiled_collective_bytes'] / MiB:.2f} MiB compiled")
    return {"accumulation": rows}


def markdown(result: dict[str, Any]) -> str:
    lines = ["GPT (2 layers, d_model 64, seq 64, vocab 512), adamw, state donated. autopar "
             "plans for h100; the expert is plain jax.jit of a hand-written microbatch loop "
             "(jax.value_and_grad in a lax.scan) with the batch split over every device. Both "
             "compiled for this machine's simulated devices and judged on h100. Collectives: "
             "result bytes per device per step (inside loops: the part run more than once). "
             "Judged ms count every trip of the microbatch loop.", "",
             "| model | mesh | M | program | gradient reduced | collectives compiled MiB "
             "(inside loops) | predicted MiB | memory estimate MiB | compiled MiB | judged h100 "
             "ms | estimated ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["accumulation"]:
        ours = r["program"] == "autopar"
        how = ("-" if r["microbatches"] == 1 or not ours else
               f"once ({r['groups']} shares)" if r["groups"] > 1 else
               f"per microbatch: {r['why_per_microbatch'][:60]}")
        estimates = (f"{r['predicted_collective_bytes'] / MiB:.2f} | "
                     f"{r['estimated_memory_bytes'] / MiB:.1f}" if ours else "- | -")
        lines.append(
            f"| {r['model']} | {r['mesh']} | {r['microbatches']} | {r['program']} | {how} | "
            f"{r['compiled_collective_bytes'] / MiB:.2f} ({r['in_loops_bytes'] / MiB:.2f}) | "
            f"{estimates} | {r['compiled_memory_bytes'] / MiB:.1f} | {r['judged_ms']:.3f} | "
            + (f"{r['estimated_ms']:.3f} |" if ours else "- |"))
    return "\n".join(lines)
