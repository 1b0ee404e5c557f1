"""Train a small GPT for a few steps on 8 simulated CPU devices with autopar.

Run with `make run` (it sets XLA_FLAGS=--xla_force_host_platform_device_count=8).
Prints the loss per step, the plan's parameter -> PartitionSpec table, the predicted cost, how the
plan compares with plain data parallel, and where the plan JSON was written.
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import models  # noqa: E402

import autopar  # noqa: E402
from autopar.cost import get_profile  # noqa: E402
from autopar.mesh import mesh_shape  # noqa: E402
from autopar.planning.driver import data_parallel_plan


def main() -> None:
    n = len(jax.devices())
    axes = {"data": 2, "model": n // 2} if n >= 4 else {"data": n}
    mesh = autopar.make_mesh(axes)
    step, state, batch = models.gpt_setup(batch=16, seq=32, vocab=256, d_model=64, heads=4,
                                          layers=2)
    # donate_argnums=0: each step's new state reuses the memory of the state passed in
    train_step = autopar.auto_parallel(step, mesh=mesh, search="dynamic_programming",
                                       donate_argnums=0)

    t0 = time.perf_counter()
    plan = train_step.plan(state, batch)
    print(f"planned on mesh {axes} in {time.perf_counter() - t0:.2f}s "
          f"({plan.search_stats.ops} operators, {plan.search_stats.details['nodes']} "
          f"decisions, search exact: {plan.search_stats.exact})")
    for i in range(5):
        state, loss = train_step(state, batch)
        print(f"step {i}: loss {float(loss):.4f}")

    print("\nparameters:")
    params = [t for t in plan.inputs if t.path.startswith("state/0/")]
    width = max(len(t.path) for t in params)
    for t in params:
        print(f"  {t.path:<{width}}  {str(t.partition_spec):<24} {t.bytes_per_device:>9,} B/device")
    c = plan.cost
    print(f"\npredicted per step and device: compute {c['compute_s'] * 1e3:.3f} ms, "
          f"communication {c['communication_s'] * 1e3:.3f} ms, total {c['total_s'] * 1e3:.3f} ms, "
          f"peak memory {c['peak_memory_bytes'] / 2**20:.2f} MiB")
    dp = data_parallel_plan(step, (state, batch), mesh_shape(mesh), get_profile(None), "batch/")
    print(f"plain data parallel on the same mesh (batch split over all {n} devices, parameters "
          f"replicated): total {dp.cost['total_s'] * 1e3:.3f} ms; this plan costs "
          f"{c['total_s'] / dp.cost['total_s']:.2f}x that")
    differ = [(t.path, d.partition_spec, t.partition_spec)
              for t, d in zip(plan.inputs, dp.inputs) if t.spec != d.spec]
    print(f"{len(differ)} of {len(plan.inputs)} inputs are sharded differently from data parallel")
    for path, was, now in differ[:8]:
        print(f"  {path}: {was} -> {now}")

    os.makedirs("plans", exist_ok=True)
    path = os.path.join("plans", "gpt_plan.json")
    plan.save(path)
    print(f"plan written to {path}")


if __name__ == "__main__":
    main()
