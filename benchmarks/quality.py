"""Plan quality: autopar's plans against what experts write, judged from the compiled programs.

For each model (`zoo.py`: realistic widths from abstract inputs, and small models), mesh of the
8 simulated devices and hardware profile:
- ours: `autopar.auto_parallel(step, mesh=..., hardware=profile, search=...)`, lowered with
  ShapeDtypeStructs and compiled (a plan per profile: the search prices that profile);
- every expert of `experts.py` that applies: plain `jax.jit` with in/out shardings from
  logical-axis rules, XLA propagating the rest; compiled once per mesh.
Every compiled program is judged by `autopar.evaluate` on each profile: per-device flops
and bytes as a roofline, each collective of the HLO on the link of the mesh axes it spans, and
the compiled memory. Realistic models are compiled, never run. Small models are also run once on
the simulated devices, to check each program's loss and new state against one device's; their
simulated step time is reported for what it is and decides nothing.

With `memory_matched`, ours is planned again with `memory_limit` set to the compiled memory of
the best expert that fits, and checked to compile within it and to be judged no slower.
"""
from __future__ import annotations

import hashlib
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np

import autopar
from autopar.cost.hardware import get_profile
from autopar.cost.judge import Evaluation, evaluate
from autopar.errors import AutoparError
from benchmarks import experts
from benchmarks.zoo import ZOO, Case

MESHES = {"8": {"data": 8}, "2x4": {"data": 2, "model": 4},
          "2x2x2": {"data": 2, "model": 2, "inner": 2}}
PROFILES = ("h100", "tpu_v4")
SEARCHES = ("dynamic_programming", "recursive_programming")
OURS = "ours"
EXPERT = "expert"

Log = Callable[[str], None]


def parse_mesh(name: str) -> dict[str, int]:
    """'2x4' -> {'data': 2, 'model': 4}: axes named data, model, inner (one to three)."""
    if name in MESHES:
        return MESHES[name]
    return dict(zip(("data", "model", "inner"), (int(s) for s in name.split("x"))))


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs of a tree of arrays (or of ShapeDtypeStructs): what is compiled."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def judged(e: Evaluation, profile: str) -> dict[str, Any]:
    """The judge's figures as a row's fields."""
    by_axes: dict[str, float] = {}
    for c in e.collectives:
        key = f"{c.kind} over {'/'.join(c.axes) or '-'}"
        by_axes[key] = by_axes.get(key, 0.0) + float(c.result_bytes * c.executions)
    return {"profile": profile, "step_ms": e.step_s * 1e3, "compute_ms": e.compute_s * 1e3,
            "collective_ms": e.communication_s * 1e3, "collective_bytes": e.collective_bytes(),
            "collectives_by_axes": by_axes, "memory_bytes": e.memory_bytes, "flops": e.flops,
            "bytes_accessed": e.bytes_accessed,
            "fits_memory": e.memory_bytes <= get_profile(profile).memory_bytes}


class Compiler:
    """Compiles lowered programs once each: plans that lower to the same program (our search
    on two profiles, or two searches) share one compile."""

    def __init__(self) -> None:
        self._done: dict[str, tuple[Any, float, str]] = {}

    def __call__(self, lowered: Any, label: str) -> tuple[Any, float, str]:
        """(compiled, compile seconds, label of the plan first compiled to this program)."""
        key = hashlib.sha256(lowered.as_text().encode()).hexdigest()
        if key not in self._done:
            t0 = time.perf_counter()
            self._done[key] = (lowered.compile(), time.perf_counter() - t0, label)
        return self._done[key]


def run_once(compiled: Any, host: tuple, reference: tuple, repeats: int) -> dict[str, Any]:
    """Run `compiled` on fresh device copies of `host` (the state is donated), `repeats`
    times; its loss and new state against the single-device `reference` (global relative
    norms), and the median simulated step time."""
    # Ours takes the flat leaves, an expert's jit the (state, batch) tree: the executable's
    # own input tree says which.
    shardings = jax.tree_util.tree_leaves(compiled.input_shardings)
    leaves = jax.tree_util.tree_leaves(host)
    times, out = [], None
    for _ in range(max(repeats, 1)):
        placed = [jax.device_put(x, s) for x, s in zip(leaves, shardings)]
        call, kwargs = jax.tree_util.tree_unflatten(compiled.in_tree, placed)
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*call, **kwargs))
        times.append(time.perf_counter() - t0)
    got, want = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(reference)
    return {"loss_rel_err": _rel(got[-1:], want[-1:]), "state_rel_err": _rel(got[:-1], want[:-1]),
            "simulated_step_ms": statistics.median(times) * 1e3}


def _rel(got: list, want: list) -> float:
    """||got - want|| / ||want|| over all float leaves together."""
    pairs = [(np.asarray(g, np.float64), np.asarray(w, np.float64)) for g, w in zip(got, want)
             if np.issubdtype(np.asarray(w).dtype, np.floating)]
    num = sum(float(np.sum((g - w) ** 2)) for g, w in pairs)
    den = sum(float(np.sum(w ** 2)) for _, w in pairs)
    return (num / den) ** 0.5 if den else num ** 0.5


def run(model_names: list[str], mesh_names: list[str], profiles: tuple[str, ...] = PROFILES,
        searches: tuple[str, ...] = SEARCHES, memory_matched: bool = False, repeats: int = 1,
        log: Log = print, zoo: dict[str, Case] | None = None) -> dict[str, Any]:
    """Every plan of every model on every mesh, judged on every profile (see the module)."""
    zoo = ZOO if zoo is None else zoo
    rows: list[dict] = []
    matched: list[dict] = []
    for name in model_names:
        case = zoo[name]
        step, state, batch = case.setup()
        args = abstract((state, batch))
        numerics = None
        if not case.realistic:  # small: run each program and compare with one device
            host = jax.tree_util.tree_map(np.asarray, (state, batch))
            reference = jax.device_get(jax.jit(step)(*host))
            numerics = (host, reference)
        for mesh_name in mesh_names:
            axes = parse_mesh(mesh_name)
            mesh = autopar.make_mesh(axes)
            # A program equal to one compiled on an earlier mesh would come from jax's
            # in-memory cache: every mesh's compile times are its own.
            jax.clear_caches()
            group = _mesh_rows(name, case, step, args, mesh_name, axes, mesh, profiles,
                               searches, numerics, repeats, log)
            rows += group
            if memory_matched:
                matched += [_memory_matched(name, step, args, mesh_name, mesh, profile, group,
                                            log) for profile in profiles]
    return {"quality": rows, "memory_matched": matched, "profiles": list(profiles),
            "models": {n: zoo[n].about for n in model_names}}


def _mesh_rows(name: str, case: Case, step: Callable, args: tuple, mesh_name: str,
               axes: dict[str, int], mesh: Any, profiles: tuple[str, ...],
               searches: tuple[str, ...], numerics: tuple | None, repeats: int,
               log: Log) -> list[dict]:
    compiler = Compiler()
    programs: list[tuple[dict, Any, tuple[str, ...]]] = []  # (row base, compiled, profiles)
    for kind in experts.KINDS:
        if not experts.applies(kind, case.family, axes):
            continue
        lowered = experts.expert_step(step, kind, case.family, *args, mesh).lower(*args)
        compiled, compile_s, same = compiler(lowered, kind)
        programs.append(({"plan": kind, "source": EXPERT, "compile_s": compile_s,
                          "same_as": same}, compiled, profiles))
    for profile in profiles:
        for search in searches:
            t0 = time.perf_counter()
            ours = autopar.auto_parallel(step, donate_argnums=0, mesh=mesh, hardware=profile, search=search)
            plan = ours.plan(*args)
            plan_s = time.perf_counter() - t0
            compiled, compile_s, same = compiler(ours.lower(*args), f"{search}@{profile}")
            programs.append(({"plan": search, "source": OURS, "plan_s": plan_s,
                              "estimated_ms": plan.cost["total_s"] * 1e3,
                              "compile_s": compile_s, "same_as": same}, compiled, (profile,)))
    rows = []
    for base, compiled, judged_on in programs:
        extra = {}
        if numerics is not None:
            extra = run_once(compiled, *numerics, repeats)
        for profile in judged_on:
            row = {"model": name, "mesh": mesh_name, "realistic": case.realistic, **base,
                   **judged(evaluate(compiled, mesh, profile), profile), **extra}
            rows.append(row)
            log(f"{name} {mesh_name} {profile} {row['source']} {row['plan']:<22} judged "
                f"{row['step_ms']:.3f} ms (compute {row['compute_ms']:.3f}, collectives "
                f"{row['collective_ms']:.3f}), {row['memory_bytes'] / 2**20:,.0f} MiB, "
                f"compile {row['compile_s']:.1f} s")
    return rows


def best_expert(rows: list[dict]) -> dict | None:
    """The expert judged fastest among those that fit the profile's memory."""
    fitting = [r for r in rows if r["source"] == EXPERT and r["fits_memory"]]
    return min(fitting, key=lambda r: r["step_ms"]) if fitting else None


def _memory_matched(name: str, step: Callable, args: tuple, mesh_name: str, mesh: Any,
                    profile: str, group: list[dict], log: Log) -> dict[str, Any]:
    """Ours, given the best expert's compiled memory as its memory_limit."""
    best = best_expert([r for r in group if r["profile"] == profile])
    row: dict[str, Any] = {"model": name, "mesh": mesh_name, "profile": profile}
    if best is None:
        return {**row, "error": "no expert fits the profile's memory"}
    limit = best["memory_bytes"]
    row.update(expert=best["plan"], expert_ms=best["step_ms"], limit_bytes=limit)
    t0 = time.perf_counter()
    try:
        ours = autopar.auto_parallel(step, donate_argnums=0, mesh=mesh, hardware=profile, memory_limit=limit)
        ours.plan(*args)
        row["plan_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = ours.lower(*args).compile()
        row["compile_s"] = time.perf_counter() - t0
    except AutoparError as e:
        row.update(plan_s=time.perf_counter() - t0, error=str(e)[:300])
        log(f"{name} {mesh_name} {profile} memory-matched: {row['error']}")
        return row
    e = evaluate(compiled, mesh, profile)
    row.update(step_ms=e.step_s * 1e3, memory_bytes=e.memory_bytes,
               fits_limit=e.memory_bytes <= limit, over_expert=e.step_s * 1e3 / best["step_ms"])
    log(f"{name} {mesh_name} {profile} memory-matched to {best['plan']} "
        f"({limit / 2**20:,.0f} MiB): {row['step_ms']:.3f} ms, {e.memory_bytes / 2**20:,.0f} "
        f"MiB, {row['over_expert']:.3f} of the expert's time")
    return row
