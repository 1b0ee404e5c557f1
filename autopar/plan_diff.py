"""Two plans compared: the inputs whose specs differ, and what the difference costs.

`autopar.diff(a, b)` takes plans of one step (with and without a memory limit, on two meshes,
before and after an upgrade, one loaded from JSON): paths are matched by name, so the meshes,
searches and versions may differ.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.errors import AutoparError
from autopar.name_ranges import collapse
from autopar.plan import Plan, TensorPlan
from autopar.plan_stats import Cost
from autopar.trace.layers import layer_key

# the times compared (Cost's fields), in order, and how they read
TIMES = (("total_s", "step"), ("compute_s", "compute"), ("communication_s", "communication"))


@dataclass(frozen=True)
class SpecChange:
    """One input sharded differently: its specs and bytes per device in a and in b."""
    path: str
    shape: tuple[int, ...]
    a: str
    b: str
    bytes_a: int
    bytes_b: int


@dataclass(frozen=True)
class PlanDiff:
    """What differs between plan `a` and plan `b` (see `diff`)."""
    mesh_a: dict[str, int]
    mesh_b: dict[str, int]
    changed: tuple[SpecChange, ...]
    only_a: tuple[str, ...]  # input paths plan b does not have
    only_b: tuple[str, ...]
    cost_a: Cost
    cost_b: Cost

    @property
    def same_specs(self) -> bool:
        return not (self.changed or self.only_a or self.only_b)

    def collectives(self) -> dict[str, tuple[float, float]]:
        """Bytes per device moved by each collective kind, (in a, in b)."""
        a, b = self.cost_a.collective_bytes, self.cost_b.collective_bytes
        return {k: (a.get(k, 0.0), b.get(k, 0.0)) for k in sorted({*a, *b})}

    def __str__(self) -> str:
        lines = [f"plan a on {self.mesh_a}, plan b on {self.mesh_b}"]
        for key, what in TIMES:
            a, b = getattr(self.cost_a, key), getattr(self.cost_b, key)
            if a is not None and b is not None:
                lines.append(_row(what, a * 1e3, b * 1e3, "ms"))
        a, b = self.cost_a.peak_memory_bytes, self.cost_b.peak_memory_bytes
        if a is not None and b is not None:
            lines.append(_row("peak memory", a / 2**20, b / 2**20, "MiB"))
        for kind, (a, b) in self.collectives().items():
            lines.append(_row(f"{kind} per device", a / 2**20, b / 2**20, "MiB"))
        if self.same_specs:
            lines.append("every input has the same spec")
            return "\n".join(lines)
        lines.append(f"{len(self.changed)} inputs sharded differently:")
        for paths, c in _grouped(self.changed):
            lines.append(f"  {paths} {c.shape}: {c.a} -> {c.b} "
                         f"({c.bytes_a:,} -> {c.bytes_b:,} B/device)")
        for side, paths in (("a", self.only_a), ("b", self.only_b)):
            if paths:
                lines.append(f"only in plan {side}: {', '.join(collapse(list(paths)))}")
        return "\n".join(lines)


def diff(a: Plan, b: Plan) -> PlanDiff:
    """Plan `b` against plan `a`: the inputs whose specs differ (matched by path), those only
    one has, and the predicted step time, compute, communication, collectives and peak
    memory of each. `str()` of it reads as a report."""
    for name, p in (("a", a), ("b", b)):
        if not isinstance(p, Plan):
            raise AutoparError(f"autopar.diff compares two autopar.Plan objects; plan {name} "
                               f"is a {type(p).__name__}. Fix: autopar.load_plan(path) reads "
                               "a saved one.")
    in_a = {t.path: t for t in a.inputs}
    in_b = {t.path: t for t in b.inputs}
    changed = tuple(_change(in_a[p], in_b[p]) for p in in_a
                    if p in in_b and _text(in_a[p]) != _text(in_b[p]))
    return PlanDiff(dict(a.mesh), dict(b.mesh), changed,
                    tuple(p for p in in_a if p not in in_b),
                    tuple(p for p in in_b if p not in in_a), a.cost, b.cost)


def _text(t: TensorPlan) -> str:
    return str(t.partition_spec)


def _change(a: TensorPlan, b: TensorPlan) -> SpecChange:
    return SpecChange(a.path, a.shape, _text(a), _text(b), a.bytes_per_device,
                      b.bytes_per_device)


def _row(what: str, a: float, b: float, unit: str) -> str:
    ratio = f" ({b / a:.3f}x)" if a else ""
    return f"{what}: {a:,.3f} -> {b:,.3f} {unit}{ratio}"


def _grouped(changes: tuple[SpecChange, ...]) -> list[tuple[str, SpecChange]]:
    """Changes alike but for the layer index, as one row (block_{0..3}/...)."""
    groups: dict[tuple, list[SpecChange]] = {}
    for c in changes:
        groups.setdefault((layer_key(c.path), c.shape, c.a, c.b, c.bytes_a, c.bytes_b),
                          []).append(c)
    rows = []
    for members in groups.values():
        for paths in collapse([c.path for c in members]):
            rows.append((paths, members[0]))
    return rows
