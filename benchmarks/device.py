"""One real accelerator: measured step times beside the judged ones.

The quality suite judges programs compiled for 8 simulated CPU devices on the GPU and TPU
profiles. A single chip cannot run those sharded programs, but it can say how far the judge and
the planner are from a real device on what one device of them does. For each realistic model of
`zoo.py`, at its full batch and at an eighth of it (one device's share under 8-way data
parallelism), with its state filled with small random values:
- measured: plain `jax.jit` of the step on this chip (state donated), the median step time;
- judged: `autopar.evaluate` on the profile of that program as compiled for this chip, and of the
  same program compiled for the host CPU (what the quality suite's judge reads);
- estimated: autopar's plan of the step on a one-device mesh of this chip (its cost and memory
  estimate; the memory seam of this chip's platform);
- compiled memory of the chip's program (memory_analysis).
Collectives are not exercised on one chip: this checks the compute roofline and the memory
estimate only.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

import autopar
from autopar.cost.judge import evaluate
from benchmarks.zoo import REALISTIC, Case

SHARES = (1, 8)  # the full batch, and one device's share under 8-way data parallelism


def filled(tree: Any, seed: int = 0, random: bool = True) -> Any:
    """Arrays on the default device for a tree of ShapeDtypeStructs: floats small and random
    (as initialised weights) or zero (an optimizer's fresh moments), integers zero (token ids,
    labels, counters)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(jax.random.PRNGKey(seed), max(len(leaves), 1))
    out = [0.02 * jax.random.normal(k, x.shape, x.dtype)
           if random and np.issubdtype(x.dtype, np.floating) else jax.numpy.zeros(x.shape, x.dtype)
           for k, x in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(treedef, out)


def share(batch: Any, parts: int) -> Any:
    """The batch's first `parts`-th along its leading (batch) dimension."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0] // parts,) + tuple(x.shape[1:]), x.dtype),
        batch)


def time_steps(step: Callable, state: Any, batch: Any, repeats: int) -> tuple[float, float]:
    """(first call seconds, median step seconds of `repeats` after two warm-ups); the state
    is fed back, as in training."""
    jitted = jax.jit(step, donate_argnums=0)
    t0 = time.perf_counter()
    state, loss = jitted(state, batch)
    jax.block_until_ready(loss)
    first = time.perf_counter() - t0
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        state, loss = jitted(state, batch)
        jax.block_until_ready((state, loss))
        if i:
            times.append(time.perf_counter() - t0)
    if not np.isfinite(float(loss)):
        raise FloatingPointError(f"loss {float(loss)} after {repeats + 2} steps")
    return first, statistics.median(times)


def on_host(tree: Any) -> Any:
    """The same ShapeDtypeStructs placed on the host CPU: lowered there, XLA's CPU pipeline
    compiles the program the quality suite judges."""
    cpu = SingleDeviceSharding(jax.devices("cpu")[0])
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                  sharding=cpu), tree)


def row(name: str, parts: int, profile: str, repeats: int, hlo_dir: str | None = None,
        zoo: dict[str, Case] = REALISTIC) -> dict[str, Any]:
    step, state_shape, batch_full = zoo[name].setup()
    batch_shape = share(batch_full, parts)
    mesh = autopar.make_mesh({"data": 1})
    out: dict[str, Any] = {"model": name, "batch_share": f"1/{parts}" if parts > 1 else "full"}
    chip = jax.jit(step, donate_argnums=0).lower(state_shape, batch_shape).compile()
    on_chip = evaluate(chip, mesh, profile)
    if hlo_dir:  # the chip's optimised program, to read offline
        os.makedirs(hlo_dir, exist_ok=True)
        with open(os.path.join(hlo_dir, f"{name}-{parts}.hlo"), "w") as f:
            f.write(chip.as_text())
    out.update(judged_chip_ms=on_chip.step_s * 1e3, chip_flops=on_chip.flops,
               chip_bytes_accessed=on_chip.bytes_accessed,
               chip_memory_bytes=on_chip.memory_bytes)
    host = jax.jit(step).lower(*on_host((state_shape, batch_shape))).compile()
    cpu_mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("data",))
    on_cpu = evaluate(host, cpu_mesh, profile)
    out.update(judged_host_ms=on_cpu.step_s * 1e3, host_flops=on_cpu.flops,
               host_bytes_accessed=on_cpu.bytes_accessed, host_memory_bytes=on_cpu.memory_bytes)
    try:
        plan = autopar.plan(step, state_shape, batch_shape, mesh=mesh, hardware=profile,
                            donate_argnums=0)
        out.update(estimated_ms=plan.cost["total_s"] * 1e3,
                   estimated_memory_bytes=plan.cost["peak_memory_bytes"])
    except Exception as e:  # noqa: BLE001 - the measurement stands without the estimate
        out["estimate_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    params, opt_state = state_shape  # the zoo's steps take (params, optimizer state)
    state = (filled(params), filled(opt_state, random=False))
    batch = filled(batch_shape, seed=1)
    first, median = time_steps(step, state, batch, repeats)
    # the chip program's flops as judged: its cuBLAS and cuDNN calls and every loop trip
    out.update(first_call_s=first, measured_ms=median * 1e3,
               achieved_tflops=on_chip.flops / median / 1e12)
    return out


def run(models: list[str] | None = None, profile: str = "h100", repeats: int = 10,
        log: Callable[[str], None] = print, hlo_dir: str | None = None,
        zoo: dict[str, Case] = REALISTIC) -> dict[str, Any]:
    rows = []
    models = models or list(zoo)
    for name in models:
        for parts in SHARES:
            try:
                r = row(name, parts, profile, repeats, hlo_dir, zoo)
            except Exception as e:  # noqa: BLE001 - one model's failure is a result too
                r = {"model": name, "batch_share": f"1/{parts}" if parts > 1 else "full",
                     "error": f"{type(e).__name__}: {str(e)[:300]}"}
                log(f"{name} 1/{parts}: {r['error']}")
            else:
                log(f"{name} {r['batch_share']}: measured {r['measured_ms']:.2f} ms, judged "
                    f"{r['judged_chip_ms']:.2f} (chip program) / {r['judged_host_ms']:.2f} (host "
                    f"program), estimated {r.get('estimated_ms', float('nan')):.2f}; memory "
                    f"{r['chip_memory_bytes'] / 2**20:,.0f} MiB compiled, "
                    f"{r.get('estimated_memory_bytes', float('nan')) / 2**20:,.0f} estimated "
                    f"{r.get('estimate_error', '')}")
            rows.append(r)
    return {"device": rows, "profile": profile,
            "chip": f"{jax.devices()[0].platform}: {jax.devices()[0].device_kind}",
            "models": {n: zoo[n].about for n in models}}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def markdown(result: dict[str, Any]) -> str:
    lines = [f"One chip ({result['chip']}), judged and estimated on the {result['profile']} "
             "profile. Measured: median of the timed steps of plain `jax.jit` (state donated). "
             "Judged: `autopar.evaluate` of the chip's compiled program and of the host CPU's "
             "(the quality suite's judge reads the latter). Estimated: autopar's plan on a "
             "one-device mesh. Ratios are over the measured time / the chip's compiled memory.",
             "", "| model | batch | measured ms | achieved TFLOP/s (chip program's flops) | "
             "judged ms: chip program (/ measured) | judged ms: host program (/ measured) | "
             "estimated ms (/ measured) | compiled memory MiB | estimated memory (/ compiled) | host program flops / chip's |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["device"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch_share']} | {r['error']} |||||||| ")
            continue
        m = r["measured_ms"]
        if "estimate_error" in r:
            r = {**r, "estimated_ms": float("nan"), "estimated_memory_bytes": float("nan")}
        lines.append(
            f"| {r['model']} | {r['batch_share']} | {m:.2f} | {r['achieved_tflops']:.1f} | "
            f"{r['judged_chip_ms']:.2f} ({_ratio(r['judged_chip_ms'], m)}) | "
            f"{r['judged_host_ms']:.2f} ({_ratio(r['judged_host_ms'], m)}) | "
            f"{r['estimated_ms']:.2f} ({_ratio(r['estimated_ms'], m)}) | "
            f"{r['chip_memory_bytes'] / 2**20:,.0f} | "
            f"{r['estimated_memory_bytes'] / 2**20:,.0f} "
            f"({_ratio(r['estimated_memory_bytes'], r['chip_memory_bytes'])}) | "
            f"{_ratio(r['host_flops'], r['chip_flops'])} |")
    return "\n".join(lines)
