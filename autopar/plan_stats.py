"""A plan's cost and its search statistics, as typed records.

Code reads their fields; each also reads as the flat mapping the plan's JSON holds
(`plan.cost["total_s"]`, `plan.search_stats["exact"]`), which is the public contract and the
format on disk. A field left None is absent from that mapping."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

# search statistics that are wall-clock seconds: left out of the JSON and of equality
WALL_CLOCK = frozenset({"seconds", "search_s", "trace_s", "memory_search_s", "dual_s",
                        "shortlist_seconds"})
STAGES = "planning_seconds"  # the flat key of SearchStats.planning_seconds


class _Flat(Mapping):
    """Reads a record as the flat mapping `_flat()` gives (its JSON form); records are equal
    where their flat mappings are, and equal a dict holding the same."""

    def _flat(self) -> dict[str, Any]:
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        return self._flat()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._flat())

    def __len__(self) -> int:
        return len(self._flat())

    def as_json(self) -> dict[str, Any]:
        return self._flat()


@dataclass(frozen=True, eq=False)
class Cost(_Flat):
    """What the cost model predicts for one step, per device: seconds of compute, of
    communication, of both (`total_s`), of recomputed forward layers (within compute), the
    peak memory, and the bytes each kind of collective moves. Fields a plan written by an
    older format lacks are None."""

    compute_s: float | None = None
    communication_s: float | None = None
    total_s: float | None = None
    recompute_s: float | None = None
    peak_memory_bytes: int | float | None = None
    collective_bytes: Mapping[str, float] = field(default_factory=dict)  # by kind

    def _flat(self) -> dict[str, Any]:
        parts = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name != "collective_bytes" and getattr(self, f.name) is not None}
        return {**parts, **{f"{kind}_bytes": n for kind, n in self.collective_bytes.items()}}

    @property
    def predicted(self) -> bool:
        """Whether it holds a prediction: a partial plan (annotations read from a file) has
        none."""
        return None not in (self.compute_s, self.communication_s, self.total_s,
                            self.peak_memory_bytes)

    @classmethod
    def of(cls, flat: Mapping[str, Any]) -> Cost:
        """The record of a flat mapping (a plan's JSON `cost`)."""
        if isinstance(flat, Cost):
            return flat
        named = {f.name for f in dataclasses.fields(cls)} - {"collective_bytes"}
        return cls(**{k: v for k, v in flat.items() if k in named},
                   collective_bytes={k[:-len("_bytes")]: v for k, v in flat.items()
                                     if k not in named and k.endswith("_bytes")})


@dataclass(frozen=True, eq=False)
class SearchStats(_Flat):
    """What planning found out about its answer besides the answer.

    The guarantee: `exact` (proven optimal under the cost model for the step as written),
    `exact_for` (the plans among which it is proven: "all plans", or with repeated layers
    tied only the plans repeating them; None where unproven), the searched `objective_s`
    (time, plus the memory price times the bytes kept), a `lower_bound` on the optimum and
    its relative `gap`, and `bound`: how the bound was found ("dual") or why there is none.

    The search: the `space` searched, the operators (`ops`), the deciding units that took a
    repeated layer's strategies (`tied_units`), and under a memory limit the price found
    (`memory_price_s_per_byte`, 0 where proven under a cap of `kept_budget_bytes`), the
    searches it took (`memory_solves`) and the limit (`memory_limit_bytes`).

    After the search: the compiles that checked its memory (`compile_checks`), whether the
    plan pins the operators inside the step or its inputs and outputs alone
    (`pinned_inside`), and the schedules and microbatch counts weighed (`schedules_tried`,
    `microbatches_tried`, `reduced_per_microbatch`: why the gradient is reduced in every
    microbatch).

    `seconds`: wall-clock times (WALL_CLOCK), and `planning_seconds` the seconds of the call
    that made the plan in each stage (tracing, searching, bounding, compile checks) and in all
    ("total"); neither is in the JSON. `details`: the search's own figures (nodes, edges,
    rounds, the other searches' costs), reported and never read."""

    exact: bool = False
    exact_for: str | None = None
    objective_s: float | None = None
    lower_bound: float | None = None
    gap: float | None = None
    bound: str | None = None
    space: str | None = None
    ops: int | None = None
    tied_units: int | None = None
    memory_price_s_per_byte: float | None = None
    memory_solves: int | None = None
    memory_limit_bytes: int | None = None
    kept_bytes: float | None = None
    kept_budget_bytes: float | None = None
    compile_checks: int | None = None
    pinned_inside: bool | None = None
    schedules_tried: tuple[Mapping[str, Any], ...] | None = None
    microbatches_tried: tuple[Any, ...] | None = None
    reduced_per_microbatch: str | None = None
    seconds: Mapping[str, float] = field(default_factory=dict)
    planning_seconds: Mapping[str, float] = field(default_factory=dict)
    details: Mapping[str, Any] = field(default_factory=dict)

    def _flat(self) -> dict[str, Any]:
        typed = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("seconds", STAGES, "details") or (value is None
                                                             and f.name != "exact_for"):
                continue
            typed[f.name] = list(value) if isinstance(value, tuple) else value
        stages = {STAGES: dict(self.planning_seconds)} if self.planning_seconds else {}
        return {**typed, **self.details, **self.seconds, **stages}

    def stable(self) -> dict[str, Any]:
        """The flat mapping without wall-clock seconds: what the same problem reproduces on
        any machine and in every process (the JSON holds this)."""
        return {k: v for k, v in self._flat().items() if k not in self.seconds and k != STAGES}

    @property
    def bounded(self) -> bool:
        """Whether it holds a lower bound on the optimum of the objective it searched."""
        return self.lower_bound is not None and self.objective_s is not None

    @property
    def budgeted(self) -> bool:
        """Planned under a memory limit that bound (a price or a cap on kept bytes)."""
        return self.memory_price_s_per_byte is not None

    def schedules_weighed(self) -> dict[str, Any]:
        """What the search of schedules and microbatch counts weighed, where it did (fields by
        name): a plan made again for the same schedule keeps it."""
        return {name: value for name, value in (
            ("schedules_tried", self.schedules_tried),
            ("microbatches_tried", self.microbatches_tried),
            ("reduced_per_microbatch", self.reduced_per_microbatch)) if value is not None}

    def noting(self, **entries: Any) -> SearchStats:
        """These statistics with `entries` (flat keys, as `of` reads them) added or replaced."""
        return SearchStats.of({**self._flat(), **entries})

    @classmethod
    def of(cls, flat: Mapping[str, Any]) -> SearchStats:
        """The record of a flat mapping: a search's own statistics, or a plan's JSON."""
        if isinstance(flat, SearchStats):
            return flat
        named = {f.name for f in dataclasses.fields(cls)} - {"seconds", "details"}
        typed = {k: tuple(v) if isinstance(v, list) else v for k, v in flat.items()
                 if k in named}
        return cls(**typed, seconds={k: v for k, v in flat.items() if k in WALL_CLOCK},
                   details={k: v for k, v in flat.items()
                            if k not in named and k not in WALL_CLOCK})

    def timed(self, planning_seconds: Mapping[str, float]) -> SearchStats:
        """These statistics with the seconds of planning by stage (progress.timing)."""
        return dataclasses.replace(self, planning_seconds=dict(planning_seconds))
