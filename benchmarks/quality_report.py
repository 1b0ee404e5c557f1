"""The quality suite's verdicts and tables: ours against the best expert, per model, mesh and
profile, on the judge's figures of the compiled programs."""
from __future__ import annotations

from typing import Any

from benchmarks.quality import EXPERT, OURS, best_expert

# An expert dominates ours when it moves fewer collective bytes with no more memory and no more
# flops; "no more" allows this much, so that a few bytes of layout noise do not hide it.
TOLERANCE = 0.01


def total(kinds: dict[str, float]) -> float:
    return float(sum(kinds.values()))


def dominates(expert: dict, ours: dict) -> bool:
    """Fewer collective bytes, and no more memory and flops (within TOLERANCE), at once."""
    return (total(expert["collective_bytes"]) < total(ours["collective_bytes"])
            and expert["memory_bytes"] <= ours["memory_bytes"] * (1 + TOLERANCE)
            and expert["flops"] <= ours["flops"] * (1 + TOLERANCE))


def headlines(rows: list[dict]) -> list[dict[str, Any]]:
    """Per model, mesh and profile: ours (each search) over the best expert that fits memory on
    judged step time, the experts that dominate ours, and our planning time."""
    out = []
    for key in dict.fromkeys((r["model"], r["mesh"], r["profile"]) for r in rows):
        group = [r for r in rows if (r["model"], r["mesh"], r["profile"]) == key]
        best = best_expert(group)
        ours = {r["plan"]: r for r in group if r["source"] == OURS}
        dp = ours.get("dynamic_programming") or next(iter(ours.values()))
        out.append({
            "model": key[0], "mesh": key[1], "profile": key[2],
            "realistic": dp["realistic"], "ours_ms": dp["step_ms"], "ours_fits": dp["fits_memory"],
            "best_expert": best["plan"] if best else None,
            "expert_ms": best["step_ms"] if best else None,
            "over_best": {s: r["step_ms"] / best["step_ms"] for s, r in ours.items()} if best
            else {},
            "dominated_by": [r["plan"] for r in group
                             if r["source"] == EXPERT and dominates(r, dp)],
            "plan_s": {s: r["plan_s"] for s, r in ours.items()}})
    return out


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def _kinds(kinds: dict[str, float]) -> str:
    return ", ".join(f"{k} {_mib(v)}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])
                     if v) or "-"


def _headline_table(heads: list[dict]) -> list[str]:
    lines = ["| model | mesh | profile | ours (DP) ms | best expert (fits) | expert ms | "
             "ours / best (DP) | ours / best (RP) | dominated by | planning s (DP / RP) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for h in heads:
        ratio = {s: f"**{v:.3f}**" if v > 1 + 1e-9 else f"{v:.3f}"
                 for s, v in h["over_best"].items()}
        plan_s = " / ".join(f"{h['plan_s'][s]:.1f}" for s in h["plan_s"])
        lines.append(
            f"| {h['model']}{'' if h['realistic'] else ' (small)'} | {h['mesh']} | "
            f"{h['profile']} | {h['ours_ms']:.3f} | {h['best_expert'] or '-'} | "
            f"{h['expert_ms'] or 0:.3f} | {ratio.get('dynamic_programming', '-')} | "
            f"{ratio.get('recursive_programming', '-')} | "
            f"{', '.join(h['dominated_by']) or '-'} | {plan_s} |")
    return lines


def _rows_table(rows: list[dict]) -> list[str]:
    lines = ["| model | mesh | profile | plan | judged ms | compute ms | collective ms | "
             "collective MiB by kind | memory MiB | fits | GFLOP/device | plan s | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = f"{r['plan']} ({r['source']})"
        if r["same_as"] not in (r["plan"], f"{r['plan']}@{r['profile']}"):
            label += f" = {r['same_as']}"
        lines.append(
            f"| {r['model']} | {r['mesh']} | {r['profile']} | {label} | {r['step_ms']:.3f} | "
            f"{r['compute_ms']:.3f} | {r['collective_ms']:.3f} | "
            f"{_kinds(r['collective_bytes'])} | {_mib(r['memory_bytes'])} | "
            f"{'yes' if r['fits_memory'] else 'no'} | {r['flops'] / 1e9:,.1f} | "
            f"{r.get('plan_s', 0):.1f} | {r['compile_s']:.1f} |")
    return lines


def _numerics_table(rows: list[dict]) -> list[str]:
    small = [r for r in rows if "loss_rel_err" in r and r["profile"] == rows[0]["profile"]]
    if not small:
        return []
    lines = ["", "Small models, run once on the simulated CPU devices: each program's loss and "
             "new state against one device's (global relative norm). The simulated step time "
             "is of CPU devices sharing one host and decides nothing.", "",
             "| model | mesh | plan | loss rel. error | state rel. error | simulated CPU ms |",
             "|---|---|---|---|---|---|"]
    seen = set()
    for r in small:
        key = (r["model"], r["mesh"], r["plan"], r["source"], r["same_as"])
        if key in seen:
            continue
        seen.add(key)
        lines.append(f"| {r['model']} | {r['mesh']} | {r['plan']} ({r['source']}) | "
                     f"{r['loss_rel_err']:.1e} | {r['state_rel_err']:.1e} | "
                     f"{r['simulated_step_ms']:.2f} |")
    return lines


def _losses(rows: list[dict], heads: list[dict]) -> list[str]:
    """Where an expert is judged faster than ours (DP) on a realistic model: both programs'
    collectives by mesh axes, flops, bytes and memory."""
    lines = []
    for h in heads:
        if not h["realistic"] or h["over_best"].get("dynamic_programming", 0) <= 1 + 1e-9:
            continue
        group = [r for r in rows if (r["model"], r["mesh"], r["profile"]) ==
                 (h["model"], h["mesh"], h["profile"])]
        ours = next(r for r in group if r["plan"] == "dynamic_programming")
        best = next(r for r in group if r["plan"] == h["best_expert"])
        lines.append(f"- {h['model']} {h['mesh']} {h['profile']}: {best['plan']} "
                     f"{best['step_ms']:.3f} ms against ours {ours['step_ms']:.3f} ms")
        for r in (ours, best):
            lines.append(f"  - {r['plan']}: compute {r['compute_ms']:.3f} ms "
                         f"({r['flops'] / 1e9:,.1f} GFLOP, {r['bytes_accessed'] / 1e9:,.1f} "
                         f"GB accessed), memory {_mib(r['memory_bytes'])} "
                         f"MiB; collectives (MiB): {_kinds(r['collectives_by_axes'])}")
    return (["", "Where an expert is judged faster than ours (DP), realistic models:", ""] + lines
            if lines else [])


def _matched_table(matched: list[dict]) -> list[str]:
    if not matched:
        return []
    lines = ["", "Memory-matched: ours planned with memory_limit = the best expert's compiled "
             "memory. Near the limit autopar compiles its plan to check it, inside 'plan s'; "
             "jax then reuses that executable (compile s ~0).", "",
             "| model | mesh | profile | expert | limit MiB | ours MiB | fits | expert ms | "
             "ours ms | ours / expert | plan s | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in matched:
        head = f"| {m['model']} | {m['mesh']} | {m['profile']} | {m.get('expert', '-')} | "
        if "error" in m:
            lines.append(head + f"{_mib(m.get('limit_bytes', 0))} | no plan: "
                         f"{m['error'][:120]} |" + " |" * 6)
            continue
        ratio = m["over_expert"]
        lines.append(
            head + f"{_mib(m['limit_bytes'])} | {_mib(m['memory_bytes'])} | "
            f"{'yes' if m['fits_limit'] else '**no**'} | {m['expert_ms']:.3f} | "
            f"{m['step_ms']:.3f} | {f'**{ratio:.3f}**' if ratio > 1 + 1e-9 else f'{ratio:.3f}'}"
            f" | {m['plan_s']:.1f} | {m['compile_s']:.1f} |")
    return lines


def markdown(result: dict[str, Any]) -> str:
    rows = result["quality"]
    heads = headlines(rows)
    intro = ["Programs compiled for 8 simulated CPU devices and judged by `autopar."
             "evaluate` on each profile (roofline compute from cost_analysis, each collective "
             "of the HLO on the link of the axes it spans, priced by the planner's own collective "
             "formulas, compiled memory; the TPU suite's judge shares none). Experts: `jax.jit` "
             "with in/out shardings from logical-axis rules (`benchmarks/experts.py`). Ratios "
             "above 1 (bold) are losses. 'dominated by': an expert with fewer collective bytes, "
             f"no more memory and no more flops (within {TOLERANCE:.0%}).", ""]
    intro += [f"- {name}: {about}" for name, about in result.get("models", {}).items()]
    return "\n".join(intro + [""] + _headline_table(heads) + _losses(rows, heads)
                     + _matched_table(result.get("memory_matched", [])) + [""]
                     + _rows_table(rows) + _numerics_table(rows))
