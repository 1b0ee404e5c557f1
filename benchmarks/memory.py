"""Memory-aware planning: what the search does as the budget shrinks, and how true the estimate is.

For each model and mesh, the unconstrained plan first, then budgets of a shrinking fraction of its
predicted peak. Per budget: the plan's estimated time, its predicted peak, what XLA compiled of
it (memory_analysis), the share of parameters and of optimizer state it shards, whether it
reduce-scatters gradients, the layers it recomputes; or the error when nothing fits.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import jax
import models

import autopar
from autopar.cost.hlo import compiled_memory_bytes
from autopar.cost.estimate import mib
from autopar.errors import AutoparError

# Links slow against compute: unconstrained, the search keeps the state replicated (plain data
# parallel or less), so each shrinking budget shows what memory alone makes it shard.
SLOW_LINKS = autopar.Hardware("slow-links", flops=1e12, memory_bandwidth=1e12,
                              link_bandwidth=1e9, link_latency=1e-4, memory_bytes=2**30)

CASES: dict[str, Callable[[], tuple]] = {
    "mlp": lambda: models.mlp_setup(batch=64, features=256, hidden=1024, out=256),
    "gpt": lambda: models.gpt_setup(batch=32, seq=64, vocab=64, d_model=64, heads=4, layers=4),
}
FRACTIONS = (1.0, 0.5, 0.25, 0.12, 0.06, 0.03)


def _sharded_share(plan: Any, optimizer: bool) -> float:
    """The share of the elements of the parameters (or of the optimizer's moments) that are
    not replicated."""
    chosen = [t for t in plan.inputs if t.path.startswith("state/") and "count" not in t.path
              and ("/mu/" in t.path or "/nu/" in t.path) == optimizer]
    total = sum(math.prod(t.shape) for t in chosen)
    return sum(math.prod(t.shape) for t in chosen if any(t.spec)) / total if total else 0.0


def run(cases: dict[str, Callable[[], tuple]], mesh_axes: dict[str, int],
        fractions: tuple[float, ...] = FRACTIONS, hardware: Any = SLOW_LINKS,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    mesh = autopar.make_mesh(mesh_axes)
    rows = []
    for name, setup in cases.items():
        step, state, batch = setup()
        free = autopar.plan(step, state, batch, donate_argnums=0, mesh=mesh, hardware=hardware,
                            memory_limit="1TiB")
        for fraction in fractions:
            limit = int(fraction * free.cost["peak_memory_bytes"])
            row: dict[str, Any] = {"model": name, "mesh": "x".join(map(str, mesh_axes.values())),
                                   "fraction": fraction, "limit_bytes": limit}
            t0 = time.perf_counter()
            sharded = autopar.auto_parallel(step, donate_argnums=0, mesh=mesh, hardware=hardware,
                                            memory_limit=limit)
            try:
                plan = sharded.plan(state, batch)
            except AutoparError as e:
                row.update(plan_s=time.perf_counter() - t0, error=str(e).split(". Largest")[0])
                rows.append(row)
                log(f"{name} budget {fraction}: {row['error']}")
                continue
            plan_s = time.perf_counter() - t0
            compiled = compiled_memory_bytes(sharded.lower(state, batch).compile())
            row.update(
                plan_s=plan_s, estimated_ms=plan.cost["total_s"] * 1e3,
                predicted_bytes=plan.cost["peak_memory_bytes"], compiled_bytes=compiled,
                params_sharded=_sharded_share(plan, optimizer=False),
                optimizer_sharded=_sharded_share(plan, optimizer=True),
                reduce_scatter_bytes=plan.cost.get("reduce-scatter_bytes", 0.0),
                recompute=list(plan.recompute), solves=plan.search_stats.get("memory_solves", 1),
                proof=_proof(plan.search_stats))
            rows.append(row)
            log(f"{name} budget {fraction}: {row['estimated_ms']:.3f} ms, predicted "
                f"{mib(row['predicted_bytes'])}, compiled {mib(compiled)}, recompute "
                f"{len(plan.recompute)} layers")
    return {"memory": rows, "hardware": hardware.name, "mesh": mesh_axes,
            "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}"}


def _proof(stats: dict[str, Any]) -> str:
    """What the search proved about the plan: optimal outright, optimal (or within a gap)
    among plans keeping at most a cap of bytes, or nothing (the price search's best)."""
    if "memory_price_s_per_byte" not in stats:
        return "optimal" if stats.get("exact") else f"gap {stats.get('gap', 0):.1%}"
    if "kept_budget_bytes" not in stats:
        return "none (price)"
    cap = f"kept <= {stats['kept_budget_bytes'] / 2**20:.2f} MiB"
    return f"fastest with {cap}" if stats["exact"] else f"within {stats['gap']:.1%}, {cap}"


def markdown(result: dict[str, Any]) -> str:
    lines = [f"Plans for shrinking budgets (hardware profile `{result['hardware']}`, mesh "
             f"{result['mesh']}, {result['devices']}; compiled = memory_analysis of the "
             "compiled step on these devices: arguments + outputs + temporaries - aliased).", "",
             "| model | budget (x unconstrained peak) | budget MiB | est. ms | predicted MiB "
             "| compiled MiB | pred. / compiled | compiled fits | params sharded | opt. state "
             "sharded | reduce-scatter | recomputed layers | proven | solves | plan s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["memory"]:
        head = (f"| {r['model']} | {r['fraction']} | {r['limit_bytes'] / 2**20:.2f} | ")
        if "error" in r:
            lines.append(head + f"nothing fits: {r['error']} |" + " |" * 11)
            continue
        lines.append(
            head + f"{r['estimated_ms']:.3f} | {r['predicted_bytes'] / 2**20:.2f} | "
            f"{r['compiled_bytes'] / 2**20:.2f} | {r['predicted_bytes'] / r['compiled_bytes']:.2f}"
            f" | {'yes' if r['compiled_bytes'] <= r['limit_bytes'] else 'no'} | "
            f"{r['params_sharded']:.0%} | {r['optimizer_sharded']:.0%} | "
            f"{'yes' if r['reduce_scatter_bytes'] else 'no'} | {len(r['recompute'])} | "
            f"{r['proof']} | {r['solves']} | {r['plan_s']:.1f} |")
    return "\n".join(lines)
