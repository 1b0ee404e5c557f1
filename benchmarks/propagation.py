"""Sharding propagation against the search: what a few annotations spread to, and its cost.

For GPT train steps, two sets of annotations are planned with every search:
- "batch": only the batch inputs, split over 'data';
- "megatron": the batch plus the attention and MLP kernels, column then row parallel over
  'model'.
Reported per case: the plan's estimated step time, its ratio to dynamic_programming's plan under
the same annotations (DP's own gap to the optimum where it is not proven), the forward
all-reduces over 'model', and the search time. The unannotated DP plan is the reference for
what the annotations themselves cost.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from jax.sharding import PartitionSpec as P

import autopar
import models

ALGORITHMS = ("sharding_propagation", "dynamic_programming", "recursive_programming")
ANNOTATIONS = {
    "batch": {r"^batch/": P("data")},
    "megatron": {
        r"^batch/": P("data"),
        r"params/.*/mlp_in/kernel": P(None, "model"),
        r"params/.*/mlp_out/kernel": P("model", None),
        r"params/.*/(query|key|value)/kernel": P(None, "model", None),
        r"params/.*/MultiHeadDotProductAttention_0/out/kernel": P("model", None, None),
    },
}
# (name, model arguments, mesh, hardware profile): the example's step, and a 12-layer GPT with
# d_model 1024 planned for 64 devices it does not need.
CASES = [
    ("example GPT", dict(batch=16, seq=32, vocab=256, d_model=64, heads=4, layers=2),
     {"data": 2, "model": 4}, "cpu"),
    ("GPT 12x1024", dict(batch=256, seq=256, vocab=4096, d_model=1024, heads=16, layers=12),
     {"data": 8, "model": 8}, "h100"),
]
QUICK_CASES = [("example GPT", dict(batch=16, seq=32, vocab=256, d_model=64, heads=4, layers=2),
                {"data": 2, "model": 4}, "cpu")]


def run(cases: list[tuple], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Plan every case of `cases` (name, GPT arguments, mesh, hardware) as described above."""
    rows = []
    for name, config, mesh, hardware in cases:
        step, state, batch = models.gpt_abstract(**config)
        reference = autopar.plan(step, state, batch, mesh=mesh, hardware=hardware)
        for kind, rules in ANNOTATIONS.items():
            by_backend = {}
            for search in ALGORITHMS:
                t0 = time.perf_counter()
                plan = autopar.plan(step, state, batch, mesh=mesh, search=search,
                                    hardware=hardware, annotations=rules)
                elapsed = time.perf_counter() - t0
                by_backend[search] = plan
                forward = [o for o in plan.ops if not o.backward and "model" in o.partial_axes]
                rows.append({
                    "case": name, "mesh": mesh, "annotations": kind, "search": search,
                    "plan_step_ms": plan.cost["total_s"] * 1e3,
                    "unannotated_dp_ms": reference.cost["total_s"] * 1e3,
                    "forward_all_reduces_model": len(forward),
                    "search_s": plan.search_stats["search_s"], "total_s": elapsed,
                    "dp_gap": plan.search_stats.get("gap")})
            dp = by_backend["dynamic_programming"].cost["total_s"]
            for row in rows[-len(ALGORITHMS):]:
                row["over_dp"] = row["plan_step_ms"] / 1e3 / dp
                log(f"{name} {kind:<8} {row['search']:<22} {row['plan_step_ms']:.3f} ms "
                    f"({row['over_dp']:.3f}x DP) search {row['search_s']:.2f}s")
    return {"propagation": rows}


def markdown(result: dict[str, Any]) -> str:
    lines = ["| case | mesh | annotations | search | est. step ms | / DP same annotations "
             "| / DP unannotated | fwd all-reduces over 'model' | search s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["propagation"]:
        mesh = "x".join(str(s) for s in r["mesh"].values())
        lines.append(f"| {r['case']} | {mesh} | {r['annotations']} | {r['search']} | "
                     f"{r['plan_step_ms']:.3f} | {r['over_dp']:.3f} | "
                     f"{r['plan_step_ms'] / r['unannotated_dp_ms']:.3f} | "
                     f"{r['forward_all_reduces_model']} | {r['search_s']:.2f} |")
    return "\n".join(lines)
