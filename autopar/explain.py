"""Why an input got its spec: what it costs, what the alternatives would cost, what decided.

`plan.explain(path)` plans the step again with the input pinned to each alternative spec (an
annotation, so the rest of the plan adapts as the search would), and compares each with the
plan. That costs a search per alternative: seconds for a large step. A plan read from JSON
cannot search again; it says what it holds.
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass
from typing import Any, Callable

from jax.sharding import PartitionSpec

from autopar.errors import AutoparError, MemoryLimitError
from autopar.cost.resharding import reshard_sequence
from autopar.mesh import mesh_shape
from autopar.plan_record import OpDecision, PlanRecord, Redistribution, TensorPlan
from autopar.rules.factors import to_partition_spec

Replan = Callable[[dict[str, PartitionSpec], bool], PlanRecord]  # (pins, keep the memory limit)


@dataclass(frozen=True)
class Replanner:
    """How a plan searches again with some inputs pinned: `replan(pins, keep_limit)` plans
    the same step, options and `annotations` (pins first), within the memory limit or not."""
    replan: Replan
    annotations: Any


@dataclass(frozen=True)
class Alternative:
    """The plan with the input pinned to `spec`: its step time and peak memory where it fits
    the memory limit; where it does not, its time without the limit (`unlimited_s`); where it
    cannot be planned at all, why."""
    spec: PartitionSpec
    total_s: float | None = None
    peak_memory_bytes: int | None = None
    unlimited_s: float | None = None
    why_not: str = ""


@dataclass(frozen=True)
class Explanation:
    """Why an input has its spec (see Plan.explain); str() of it reads as a report."""
    tensor: TensorPlan
    total_s: float  # the plan's predicted step time
    peak_memory_bytes: int
    redistributions: tuple[Redistribution, ...]  # the reshardings of this input
    alternatives: tuple[Alternative, ...]
    decided_by: str
    mesh: tuple[tuple[str, int], ...] = ()

    def __str__(self) -> str:
        t = self.tensor
        lines = [f"{t.path} {t.shape} {t.dtype}: {t.partition_spec}, "
                 f"{t.bytes_per_device:,} B/device",
                 f"the plan: {self.total_s * 1e3:.3f} ms per step, peak "
                 f"{self.peak_memory_bytes / 2**20:.2f} MiB per device"]
        for r in self.redistributions:
            lines.append(f"  resharded: {r.describe()}; {_collectives(r, self.mesh)}")
        if self.alternatives:
            lines.append("alternatives, the rest of the plan searched again:")
        for a in self.alternatives:
            if a.unlimited_s is not None:
                lines.append(f"  {a.spec}: does not fit memory_limit "
                             f"({a.unlimited_s * 1e3:.3f} ms without it)")
            elif a.total_s is None:
                lines.append(f"  {a.spec}: cannot be planned: {a.why_not}")
            else:
                more = (a.total_s - self.total_s) * 1e3
                lines.append(f"  {a.spec}: {a.total_s * 1e3:.3f} ms ({more:+.3f} ms), peak "
                             f"{a.peak_memory_bytes / 2**20:.2f} MiB")
        lines.append(f"decided by: {self.decided_by}")
        return "\n".join(lines)


UNLIMITED = 1 << 62  # bytes: a memory limit every plan meets


def explainable(made: PlanRecord, plan: Callable[..., PlanRecord], fn: Callable, args: tuple,
                annotations: Any, options: dict[str, Any]) -> PlanRecord:
    """`made` with how to plan `fn(*args)` again (by `plan`, autopar.plan) with inputs pinned:
    the same `options` and schedule, the pins before the user's `annotations`."""
    def replan(pins: dict[str, PartitionSpec], keep_limit: bool) -> PlanRecord:
        given = annotations if isinstance(annotations, dict) else {}
        return plan(fn, *args, **{**options, "annotations": {**pins, **given},
                                  "memory_limit": options["memory_limit"] if keep_limit
                                  else UNLIMITED},
                    microbatches=made.microbatches, pipeline=made.pipeline_stages,
                    pipeline_repeats=made.pipeline_repeats)

    return dataclasses.replace(made, replanner=Replanner(replan, annotations))


@dataclass(frozen=True)
class ScopeExplanation:
    """The intermediates made in one scope of the step (a layer's module path, as
    `OpDecision.scope` names it): each operator's result spec, compute, collectives and
    reshardings. The search decided them; annotations pin inputs only."""
    scope: str
    ops: tuple[OpDecision, ...]
    redistributions: tuple[Redistribution, ...]
    mesh: tuple[tuple[str, int], ...]
    decided_by: str

    def __str__(self) -> str:
        lines = [f"{self.scope}: {len(self.ops)} operators"]
        for o in self.ops:
            spec = to_partition_spec(o.out_specs[0]) if o.out_specs else "()"
            parts = [f"  {o.primitive}{' (backward)' if o.backward else ''} -> "
                     f"{o.out_shapes[0] if o.out_shapes else ()} {spec}: compute "
                     f"{o.compute_s * 1e3:.4f} ms"]
            if o.communication_s:
                parts.append(f"collectives {o.communication_s * 1e3:.4f} ms (" + ", ".join(
                    f"{kind} over {','.join(axes)}" for kind, axes in partial_sums(o)) + ")")
            lines.append(", ".join(parts))
        for r in self.redistributions:
            lines.append(f"  resharded: {r.describe()}; {_collectives(r, self.mesh)}")
        lines.append(f"decided by: {self.decided_by}")
        return "\n".join(lines)


def explain(plan: PlanRecord, path: str, replanner: Replanner | None, alternatives: int
            ) -> Explanation | ScopeExplanation:
    """See Plan.explain."""
    tensor = next((t for t in plan.inputs if t.path == path), None)
    if tensor is None:
        ops = tuple(o for o in plan.ops if o.scope == path and not o.primitive.startswith("scan"))
        if ops:
            return _scope(plan, path, ops)
        near = sorted({t.path for t in plan.inputs if path.split("/")[-1] in t.path} |
                      {o.scope for o in plan.ops if path.split("/")[-1] in o.scope})[:5]
        raise AutoparError(f"the plan has no input, nor operators of scope, {path!r}. Fix: "
                           f"name an input path as plan.summary() lists them, or a scope of "
                           f"plan.ops (a plan made in this process)" +
                           (f"; such as {near}" if near else "") + ".")
    moved = tuple(r for r in plan.redistributions if r.tensor == path)
    annotated = _annotation(replanner.annotations if replanner else None, path)
    if annotated is not None:
        return Explanation(tensor, plan.cost.total_s, plan.cost.peak_memory_bytes, moved,
                           (), f"your annotation {annotated[0]!r}: {annotated[1]}", plan.mesh)
    specs = _candidates(tensor, dict(plan.mesh))[:alternatives]
    if not specs:
        return Explanation(tensor, plan.cost.total_s, plan.cost.peak_memory_bytes, moved,
                           (), "no alternative: no dimension divides by a mesh axis", plan.mesh)
    if replanner is None:
        return Explanation(tensor, plan.cost.total_s, plan.cost.peak_memory_bytes, moved,
                           (), "not known: this plan was read from JSON and cannot search "
                           "again (plan the step, then explain)", plan.mesh)
    tried = tuple(_tried(replanner.replan, path, spec) for spec in specs)
    return Explanation(tensor, plan.cost.total_s, plan.cost.peak_memory_bytes, moved,
                       tried, _decided(plan, tried), plan.mesh)


def _annotation(annotations: Any, path: str) -> tuple[str, str] | None:
    """The user's annotation (pattern, spec) that pins `path`, if one does."""
    if not isinstance(annotations, dict):
        return None
    for pattern, spec in annotations.items():
        if re.search(pattern, path):
            return pattern, str(spec)
    return None


def _candidates(tensor: TensorPlan, mesh: dict[str, int]) -> list[PartitionSpec]:
    """Specs other than the chosen one: replicated, each axis on each dimension it divides,
    and two axes on two dimensions; the most sharded first."""
    axes = [a for a, n in mesh.items() if n > 1]
    rank = len(tensor.shape)
    options: list[tuple[str | None, ...]] = [(None,) * rank]
    for k in (1, 2):
        for chosen in itertools.permutations(axes, k):
            for dims in itertools.permutations(range(rank), k):
                if all(tensor.shape[d] % mesh[a] == 0 for a, d in zip(chosen, dims)):
                    spec: list[str | None] = [None] * rank
                    for a, d in zip(chosen, dims):
                        spec[d] = a
                    options.append(tuple(spec))
    current = tuple(tensor.partition_spec) + (None,) * (rank - len(tensor.partition_spec))
    out = []
    for spec in sorted(dict.fromkeys(options), key=lambda s: -sum(x is not None for x in s)):
        if spec != current:
            out.append(PartitionSpec(*spec))
    return out


def _tried(replan: Replan, path: str, spec: PartitionSpec) -> Alternative:
    pins = {f"^{re.escape(path)}$": spec}
    try:
        p = replan(pins, True)
        return Alternative(spec, p.cost.total_s, int(p.cost.peak_memory_bytes))
    except MemoryLimitError:
        try:
            return Alternative(spec, unlimited_s=replan(pins, False).cost.total_s)
        except AutoparError as e:
            return Alternative(spec, why_not=_line(e))
    except AutoparError as e:
        return Alternative(spec, why_not=_line(e))


def _decided(plan: PlanRecord, tried: tuple[Alternative, ...]) -> str:
    total, stats = plan.cost.total_s, plan.search_stats
    unfit = [a for a in tried if a.unlimited_s is not None and a.unlimited_s < total]
    if unfit:
        best = min(unfit, key=lambda a: a.unlimited_s)
        return (f"the memory limit: {best.spec} would be faster "
                f"({best.unlimited_s * 1e3:.3f} ms) and does not fit")
    cheaper = [a for a in tried if a.total_s is not None and a.total_s < total]
    if cheaper:  # the search is not exact: an alternative beats it
        best = min(cheaper, key=lambda a: a.total_s)
        return (f"the search, which missed a faster plan: {best.spec} "
                f"({best.total_s * 1e3:.3f} ms); its gap is "
                f"{'unknown' if stats.gap is None else stats.gap}")
    planned = [a for a in tried if a.total_s is not None]
    if not planned:
        return "the rules: no alternative could be planned"
    notes = []
    if stats.tied_units:
        notes.append("instances of a repeated layer two apart share their strategies")
    if stats.memory_price_s_per_byte or plan.recompute:
        notes.append("the whole plan was searched within memory_limit")
    return ("the cost model: every alternative tried is no faster"
            + (f" ({'; '.join(notes)})" if notes else ""))


def _scope(plan: PlanRecord, scope: str, ops: tuple[OpDecision, ...]) -> ScopeExplanation:
    ids = {o.index for o in ops}
    moved = tuple(r for r in plan.redistributions
                  if (m := re.search(r"#(\d+)", r.where)) and int(m.group(1)) in ids)
    return ScopeExplanation(scope, ops, moved, plan.mesh,
                            "the search: annotations pin inputs, not intermediates; "
                            "autopar.shard(x, P(...)) in the step fixes one, and explaining "
                            "the inputs these operators read weighs their alternatives")


def partial_sums(o: OpDecision) -> list[tuple[str, tuple[str, ...]]]:
    """The collectives of an operator's partial sums, (kind, mesh axes): a reduce-scatter
    over the axes its result is split on, an all-reduce over the rest."""
    placed = {a for axes in (o.out_specs[0] if o.out_specs else ()) for a in axes}
    scattered = tuple(a for a in o.partial_axes if a in placed)
    summed = tuple(a for a in o.partial_axes if a not in placed)
    return [(kind, axes) for kind, axes in (("reduce-scatter", scattered),
                                            ("all-reduce", summed)) if axes]


def _collectives(r: Redistribution, mesh: tuple[tuple[str, int], ...]) -> str:
    steps = reshard_sequence(r.from_spec, r.to_spec, mesh_shape(dict(mesh)))
    return ", ".join(f"{kind} over {','.join(axes)}" for kind, _, _, _, axes in steps) or \
        "a local slice"


def _line(error: Exception) -> str:
    return str(error).strip().splitlines()[0]
