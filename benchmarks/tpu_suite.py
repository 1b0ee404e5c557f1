"""The `tpu` suite: our plans against MaxText-style experts on TPU slices, compiled by the
TPU compiler (libtpu's compile-only topologies: no TPU needed) and judged by
`benchmarks/judge.py`, which shares no code with the planner.

For each case, every program an expert would try (`tpu_experts.sweep`: data parallel,
ZeRO-1, FSDP, FSDP x tensor over mesh splits, expert parallel for the MoE) is lowered and
compiled; ours is planned on the meshes of the same shapes (the devices as one axis, and split 2 to 16
ways), the cheapest predicted plan compiled. With `memory_matched`,
ours is planned again within the peak of the fastest expert that fits, and compiled.
Every row records the compile seconds, the judge's two bounds (collectives not overlapped,
and hidden behind compute), the compiler's peak memory, and for ours the estimate beside it.
A program the compiler refuses (over the chip's memory) is a row with its error.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import autopar
from benchmarks import tpu_experts, tpu_models
from benchmarks.judge import CHIPS, judge

# name -> (workload name, batch, seq, Config overrides, topology)
CASES: dict[str, tuple[str, int, int, dict[str, Any], str]] = {
    "llama2-7b-v5p64": ("llama2-7b", 128, 2048, {}, "v5p:4x4x4"),
    "llama3-8b-v5p64": ("llama3-8b", 128, 4096, {}, "v5p:4x4x4"),
    "mixtral-2l-v5p64": ("mixtral-8x7b", 64, 2048, {"layers": 2}, "v5p:4x4x4"),
    "vit-large-v5p64": ("vit-large", 1024, 0, {}, "v5p:4x4x4"),
    "llama2-7b-loop8-v5p64": ("llama2-7b", 128, 2048, {"layers": 8, "scan_layers": False},
                              "v5p:4x4x4"),
    "llama2-7b-v5p256": ("llama2-7b", 512, 2048, {}, "v5p:4x8x8"),
    "llama2-7b-v5p512": ("llama2-7b", 1024, 2048, {}, "v5p:8x8x8"),
}
QUICK = {"llama-tiny-v5e8": ("llama-tiny", 16, 128, {}, "v5e:2x4")}
SPLITS = (1, 2, 4, 8, 16)  # our meshes: (N,), (N/2, 2), ... as the experts' sweep


def run(cases: dict[str, tuple], memory_matched: bool = False,
        log: Callable[[str], None] = print, experts_from: dict[str, Any] | None = None,
        devices_for: Callable[[str], list] = tpu_experts.tpu_devices) -> dict[str, Any]:
    """Every case's rows (see the module). `experts_from`: an earlier result whose expert rows
    are kept for its cases (the experts' programs do not depend on autopar), so that only
    ours is planned and compiled again. `devices_for`: a case's topology -> its devices
    (compile-only TPU devices by default; `gpu_suite` gives one node's GPUs)."""
    out: dict[str, Any] = {"cases": {}}
    for name, (model, batch, seq, overrides, topology) in cases.items():
        work = tpu_models.setup(model, batch=batch, seq=seq or 2048, **overrides)
        devices = devices_for(topology)
        earlier = (experts_from or {}).get("cases", {}).get(name)
        if earlier is not None:
            rows = [r for r in earlier["rows"] if r["program"].startswith("expert")]
            log(f"  {len(rows)} expert rows kept from the earlier result")
        else:
            rows = [_expert(work, kind, axes, devices, log)
                    for kind, axes in tpu_experts.sweep(model, len(devices))]
        rows.append(_ours(work, devices, None, log))
        fitting = [r for r in rows if r.get("fits") and r["program"].startswith("expert")]
        if memory_matched and fitting:
            best = min(fitting, key=lambda r: r["no_overlap_ms"])
            rows.append(_ours(work, devices, best["peak_bytes"], log))
        out["cases"][name] = {"model": model, "batch": batch, "seq": seq, "overrides": overrides,
                              "topology": topology, "devices": len(devices), "rows": rows}
    return out


def _judged(compiled: Any, mesh: Any) -> dict[str, Any]:
    j = judge(compiled, mesh)
    return {"no_overlap_ms": j.no_overlap_s * 1e3, "overlapped_ms": j.overlapped_s * 1e3,
            "compute_ms": j.compute_s * 1e3, "collectives_ms": j.collectives_s * 1e3,
            "collectives": len(j.collectives), "peak_bytes": j.peak_memory_bytes,
            "fits": j.peak_memory_bytes <= j.chip.hbm_bytes, "chip": j.chip.name}


def _expert(work: Any, kind: str, axes: dict[str, int], devices: list,
            log: Callable[[str], None]) -> dict[str, Any]:
    row: dict[str, Any] = {"program": f"expert {kind}", "mesh": axes}
    t = time.perf_counter()
    try:
        compiled = tpu_experts.expert_program(work.step, work.state, work.batch, work.logical,
                                              kind, axes, devices).compile()
    except Exception as e:  # the compiler refuses a program over the chip's memory
        row.update(error=f"{type(e).__name__}: {str(e)[:300]}", fits=False)
        log(f"  {row['program']} {axes}: {row['error'][:120]}")
        return row
    row["compile_s"] = time.perf_counter() - t
    row.update(_judged(compiled, tpu_experts.expert_mesh(axes, devices)))
    log(f"  {row['program']} {axes}: {row['no_overlap_ms']:.2f} / {row['overlapped_ms']:.2f} "
        f"ms, {row['peak_bytes'] / 2**30:.2f} GiB, compiled in {row['compile_s']:.0f} s")
    return row


def _ours(work: Any, devices: list, memory_limit: int | None,
          log: Callable[[str], None]) -> dict[str, Any]:
    """Ours: planned on each mesh of SPLITS, the cheapest predicted compiled."""
    n, t = len(devices), time.perf_counter()
    program = "ours" if memory_limit is None else "ours, memory-matched"
    planned, refused = [], {}
    for split in SPLITS:
        if n % split or split >= n and split > 1:
            continue
        axes = {"data": n} if split == 1 else {"data": n // split, "model": split}
        mesh = tpu_experts.expert_mesh(axes, devices)
        step = autopar.auto_parallel(work.step, mesh=mesh, donate_argnums=0,
                                     memory_limit=memory_limit)
        try:
            planned.append((step.plan(work.state, work.batch), step, mesh, axes))
        except autopar.AutoparError as e:
            log(f"  ours {axes}: {e}")
            refused[" x ".join(map(str, axes.values()))] = str(e)[:400]
            continue
        log(f"  ours planned on {axes}: predicted {planned[-1][0].cost['total_s'] * 1e3:.2f} ms")
    if not planned:
        return {"program": program, "error": "no mesh planned", "fits": False,
                "memory_limit": memory_limit, "refused_by_mesh": refused}
    plan, step, mesh, axes = min(planned, key=lambda p: p[0].cost["total_s"])
    plan_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = step.lower(work.state, work.batch).compile()
    row = {"program": program, "mesh": axes, "plan_s": plan_s,
           "predicted_ms_by_mesh": {" x ".join(map(str, a.values())): p.cost["total_s"] * 1e3
                                    for p, _, _, a in planned}, "compile_s": time.perf_counter() - t,
           "estimate_bytes": plan.cost["peak_memory_bytes"],
           "predicted_ms": plan.cost["total_s"] * 1e3, "memory_limit": memory_limit,
           "compile_checks": plan.search_stats.get("compile_checks", 0)}
    row.update(_judged(compiled, mesh))
    log(f"  {row['program']} {axes}: {row['no_overlap_ms']:.2f} / {row['overlapped_ms']:.2f} "
        f"ms, {row['peak_bytes'] / 2**30:.2f} GiB (estimated "
        f"{row['estimate_bytes'] / 2**30:.2f}), planned in {plan_s:.1f} s, compiled in "
        f"{row['compile_s']:.0f} s")
    return row


def markdown(result: dict[str, Any]) -> str:
    """One table per case, and ours against the best expert under both bounds."""
    parts = []
    for name, case in result["cases"].items():
        rows = case["rows"]
        parts.append(f"## {name}: {case['model']} {case['overrides'] or ''}, batch "
                     f"{case['batch']} x {case['seq'] or 'images'}, {case['topology']} "
                     f"({case['devices']} chips; {_chip_note(rows)})\n")
        parts.append("| program | mesh | no overlap ms | overlapped ms | collectives | peak GiB "
                     "| estimate GiB | compile s |\n|---|---|---|---|---|---|---|---|")
        for r in rows:
            mesh = " x ".join(f"{a} {s}" for a, s in r.get("mesh", {}).items())
            if "error" in r:
                within = (f" within {r['memory_limit'] / 2**30:.2f} GiB"
                          if r.get("memory_limit") else "")
                parts.append(f"| {r['program']} | {mesh} | {r['error'][:80]}{within} "
                             "| | | | | |")
                continue
            est = f"{r['estimate_bytes'] / 2**30:.2f}" if "estimate_bytes" in r else ""
            parts.append(f"| {r['program']} | {mesh} | {r['no_overlap_ms']:.2f} | "
                         f"{r['overlapped_ms']:.2f} | {r['collectives']} | "
                         f"{r['peak_bytes'] / 2**30:.2f}{'' if r['fits'] else ' (over)'} | "
                         f"{est} | {r['compile_s']:.0f} |")
        parts.append(_versus(rows) + "\n")
    return "\n".join(parts)


def _chip_note(rows: list[dict[str, Any]]) -> str:
    chip = CHIPS.get(next((r["chip"] for r in rows if "chip" in r), ""))
    link = ("busbw over NVSwitch, any group" if chip and chip.switched
            else "ICI per mesh axis")
    return "" if chip is None else (
        f"judged per chip: {chip.name} {chip.flops / 1e12:.0f} TFLOP/s, "
        f"{chip.hbm_bandwidth / 1e9:,.0f} GB/s HBM, {chip.ici_axis_bandwidth / 1e9:.0f} GB/s "
        f"{link}")


def _versus(rows: list[dict[str, Any]]) -> str:
    experts = [r for r in rows if r["program"].startswith("expert") and r.get("fits")]
    ours = [r for r in rows if r["program"].startswith("ours") and "error" not in r]
    if not experts or not ours:
        return "\nno fitting expert or no plan of ours to compare."
    lines = []
    for bound in ("no_overlap_ms", "overlapped_ms"):
        best = min(experts, key=lambda r: r[bound])
        for r in ours:
            lines.append(f"- {r['program']} / best expert ({best['program']}, "
                         f"{' x '.join(map(str, best['mesh'].values()))}) "
                         f"{bound.replace('_ms', '').replace('_', ' ')}: "
                         f"{r[bound] / best[bound]:.3f}x; estimate / peak "
                         f"{r['estimate_bytes'] / r['peak_bytes']:.2f}")
    return "\n" + "\n".join(lines)


def ratio_table(result: dict[str, Any]) -> list[tuple[str, float]]:
    """(case, ours' estimate / the compiler's peak) for every plan of ours."""
    return [(name, r["estimate_bytes"] / r["peak_bytes"]) for name, case in
            result["cases"].items() for r in case["rows"]
            if r["program"].startswith("ours") and "error" not in r and r["peak_bytes"]]

