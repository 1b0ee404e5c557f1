"""What the memory estimate is made of: the buffers the liveness walk (cost/liveness.py)
records, and the estimate it returns, by kind of value."""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("parameters", "optimizer_state", "other_inputs", "activations", "gradients",
         "temporaries")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device: the peak, what is live then by kind, and the largest buffers then."""

    peak_bytes: int
    at_peak: dict[str, int]
    where: str  # the operator at which the peak occurs
    largest: tuple[tuple[str, int], ...]  # (what, bytes), largest first
    # (time, bytes): the most live within each of at most TIMELINE_POINTS spans of the step's
    # times, in program order (the peak's span holds the peak)
    timeline: tuple[tuple[int, int], ...] = ()

    def describe(self) -> str:
        parts = ", ".join(f"{k.replace('_', ' ')} {mib(v)}" for k, v in self.at_peak.items() if v)
        return f"{mib(self.peak_bytes)} per device at {self.where} ({parts})"


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f} MiB"


@dataclass(frozen=True)
class Buffer:
    """A buffer of the walk: live from time `first` to `last` (inclusive), `nbytes` of `kind`,
    holding tensor `tensor` as `how` says: "" the value itself, "recomputed" its
    recomputation, "resharding" or "transposing" it for program step `step`, "copied" a
    donated input copied before its update, "input" an argument."""

    first: int
    last: int
    kind: str
    nbytes: int
    tensor: int
    how: str = ""
    step: int = -1
