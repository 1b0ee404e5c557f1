"""What the memory estimate is made of: the buffers the liveness walk (cost/liveness.py)
records, the estimate it returns by kind of value, and how they are named."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from autopar.trace.ir import OpGraph, Equation

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


class Buffer(NamedTuple):  # a tuple: a walk makes one per value of the step, every estimate
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


TIMELINE_POINTS = 100


def timeline_of(series: list[int]) -> tuple[tuple[int, int], ...]:
    """(time, the most live) of each of at most TIMELINE_POINTS equal spans of `series`."""
    span = max(1, -(-len(series) // TIMELINE_POINTS))
    return tuple((i + max(range(len(part)), key=part.__getitem__), int(max(part)))
                 for i in range(0, len(series), span) if (part := series[i:i + span]))


def buffer_name(graph: OpGraph, producer_step: dict[int, int], b: Buffer) -> str:
    """A buffer's name (named only if among the largest at the peak: naming is slow)."""
    tensors, program = graph.tensors, graph.program
    path = tensors[b.tensor].path
    if b.how == "input":
        return path or f"input {b.tensor}"
    if b.how == "loop":
        i = producer_step[b.tensor]
        return f"the values inside {step_name(program[i], i)}"
    if b.how == "copied":
        return f"{path or f'input {b.tensor}'} (copied before its update)"
    if b.how == "converted":
        return f"{path or f'tensor {b.tensor}'} (converted whole for a loop)"
    if b.how in ("resharding", "transposing"):
        return f"{b.how} {path or f'tensor {b.tensor}'} for {step_name(program[b.step], b.step)}"
    made = producer_step[b.tensor]
    name = path or step_name(program[made], made)
    return f"{name} (recomputed)" if b.how == "recomputed" else name


def step_name(step: Equation, i: int) -> str:
    """An equation named for messages: its primitive, place and source scope."""
    eqn = step.eqn
    what = eqn.primitive.name if eqn is not None else "copy"
    source = getattr(getattr(eqn, "source_info", None), "name_stack", None)
    return f"{what} (step {i}{f', {source}' if str(source or '') else ''})"
