"""The plan as a record: every input, output and operator decision, and the predicted cost.
What the plan's views (plan_text, plan_json, explain, plan_html) read; autopar.Plan is this
record with those views as its methods."""
from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
from jax.sharding import PartitionSpec

from autopar.name_ranges import collapse, expand
from autopar.placement.lanes import Lanes
from autopar.placement.storable import Storage
from autopar.plan_stats import Cost, SearchStats
from autopar.rules.factors import Spec, to_partition_spec
from autopar.rules.kinds import decides
from autopar.schedule import Schedule
from autopar.trace.layers import instance_of, layer_key


@dataclass(frozen=True)
class TensorPlan:
    """The sharding of one input or output of the step."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: Spec
    bytes_per_device: int

    @property
    def partition_spec(self) -> PartitionSpec:
        return to_partition_spec(self.spec)


@dataclass(frozen=True)
class OpDecision:
    """The strategy chosen for one operator and what it costs per step."""

    index: int
    primitive: str
    source: str
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    in_specs: tuple[Spec, ...]
    out_specs: tuple[Spec, ...]
    partial_axes: tuple[str, ...]
    compute_s: float
    communication_s: float
    scope: str = ""  # the module path it was called from
    backward: bool = False  # part of the backward pass


@dataclass(frozen=True)
class Decision:
    """The strategy of an operator that decides its own sharding (a product, a gather, a
    broadcast: saved.decides). A saved plan records only these: every other operator follows
    the producer of its main operand, and applying the plan derives its strategy from that
    producer's as the search does."""

    op: int  # the operator's index in the traced step
    primitive: str
    scope: str
    backward: bool
    in_shapes: tuple[tuple[int, ...], ...]
    in_specs: tuple[Spec, ...]
    out_specs: tuple[Spec, ...]
    partial_axes: tuple[str, ...]


@dataclass(frozen=True)
class Repeat:
    """Instances of a repeated layer (`GPT/block_1`) whose deciding operators decide as those
    of an earlier instance (`same_as`), in order."""

    layers: tuple[str, ...]
    same_as: str


@dataclass(frozen=True)
class Redistribution:
    """A change of sharding the plan inserts between where a tensor is made and where it is used.

    `annotated` marks those at an annotation (the tensor, or the operator using it, is
    annotated): where two annotations cannot both hold, this is the resharding between them.
    """

    where: str
    tensor: str
    shape: tuple[int, ...]
    from_spec: Spec
    to_spec: Spec
    cost_s: float
    annotated: bool = False

    def describe(self) -> str:
        return (f"{self.tensor} {self.shape} {to_partition_spec(self.from_spec)} -> "
                f"{to_partition_spec(self.to_spec)} for {self.where}: "
                f"{self.cost_s * 1e3:.4f} ms")


@dataclass(frozen=True)
class PlanRecord:
    """The fields and readers of autopar.Plan: what its views (plan_text, plan_json, explain,
    plan_html) read."""

    mesh: tuple[tuple[str, int], ...]
    search: str  # the search algorithm that made it (or "data_parallel")
    hardware: str
    inputs: tuple[TensorPlan, ...]
    outputs: tuple[TensorPlan, ...]
    ops: tuple[OpDecision, ...] = field(compare=False)
    cost: Cost = field(hash=False)
    search_stats: SearchStats = field(hash=False, compare=False, default_factory=SearchStats)
    redistributions: tuple[Redistribution, ...] = ()
    in_tree: Any = field(default=None, compare=False, hash=False, repr=False)
    out_tree: Any = field(default=None, compare=False, hash=False, repr=False)
    # the memory estimate per device (autopar.cost.memory): peak_bytes, at_peak by kind, where,
    # the largest buffers then, and the limit planned for
    memory: dict[str, Any] = field(hash=False, default_factory=dict)
    recompute: tuple[str, ...] = ()  # layers the backward pass recomputes
    microbatches: int = 1  # the gradient accumulated over this many (rewrite/accumulate.py)
    # each microbatch computed as this many shares, one per device group along the batch's
    # axes, their gradients summed once after the loop (1: reduced in every microbatch)
    microbatch_groups: int = 1
    pipeline_stages: int = 1  # stages of the loss's layer stack (rewrite/gpipe.py)
    pipeline_repeats: int = 1  # rounds each microbatch makes through them (circular schedule)
    # the stack's leaves kept in the circular placement between steps (keep_placement=True)
    stored: Storage | None = None
    # a Python loop's layers kept stacked between steps (keep_placement=True, placement/lanes.py)
    lanes: Lanes | None = None
    # a pipelined plan's stages: their layers and sub-mesh, ticks, bubble, the tick loops'
    # estimated seconds (planning/assemble.pipeline_detail)
    pipeline: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    # the decisions read from compact JSON; empty where `ops` holds every operator
    decided: tuple[Decision | Repeat, ...] = field(default=(), compare=False, hash=False)
    # how to search again with inputs pinned (explain.Replanner); None for a plan from JSON
    replanner: Any = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        # a flat mapping given (a plan's JSON, a hand-made Plan) is read as its record
        object.__setattr__(self, "cost", Cost.of(self.cost))
        object.__setattr__(self, "search_stats", SearchStats.of(self.search_stats))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PlanRecord):
            return NotImplemented
        compared = [f.name for f in dataclasses.fields(self) if f.compare]
        return (all(getattr(self, n) == getattr(other, n) for n in compared)
                and self.decisions == other.decisions
                and self.stable_stats() == other.stable_stats())

    @property
    def schedule(self) -> Schedule:
        """Its microbatches, shares, stages and rounds as one record (autopar.schedule)."""
        return Schedule(self.microbatches, self.microbatch_groups, self.pipeline_stages,
                        self.pipeline_repeats)

    def stable_stats(self) -> dict[str, Any]:
        """search_stats without its wall-clock seconds: what the same problem reproduces, on
        any machine and in every process (the JSON holds these)."""
        return self.search_stats.stable()

    @functools.cached_property
    def decisions(self) -> tuple[Decision | Repeat, ...]:
        """The deciding operators' strategies, repeated layers as Repeats."""
        return self.decided or compact_decisions(self.ops)

    # -- reading ---------------------------------------------------------------------------------
    @property
    def specs(self) -> dict[str, PartitionSpec]:
        return {t.path: t.partition_spec for t in (*self.inputs, *self.outputs)}

    @property
    def input_specs(self) -> Any:
        """A pytree shaped like the arguments, with PartitionSpec leaves."""
        return _unflatten(self.in_tree, self.inputs)

    @property
    def output_specs(self) -> Any:
        """A pytree shaped like the outputs, with PartitionSpec leaves."""
        return _unflatten(self.out_tree, self.outputs)


def compact_decisions(ops: Sequence[OpDecision]) -> tuple[Decision | Repeat, ...]:
    """The deciding operators' decisions in operator order; an instance of a repeated layer
    whose decisions equal an earlier instance's (same operators, shapes and specs, in order)
    becomes one Repeat after that instance's last entry."""
    deciding = [o for o in ops if decides(o.primitive, o.in_shapes, o.out_shapes)]
    members: dict[str, list[OpDecision]] = defaultdict(list)
    for o in deciding:
        inst = instance_of(o.scope)
        if inst is not None:
            members[inst].append(o)
    first: dict[tuple, str] = {}
    same_as: dict[str, str] = {}
    for inst, group in members.items():
        key = (layer_key(inst), tuple((o.primitive, o.backward, o.scope[len(inst):], o.in_shapes,
                                       o.in_specs, o.out_specs, o.partial_axes) for o in group))
        if key in first:
            same_as[inst] = first[key]
        else:
            first[key] = inst
    copies: dict[str, list[str]] = defaultdict(list)
    for inst, target in same_as.items():
        copies[target].append(inst)
    out: list[Decision | Repeat] = []
    after: dict[str, int] = {}  # instance -> position after its last entry
    for o in deciding:
        inst = instance_of(o.scope)
        if inst in same_as:
            continue
        out.append(Decision(o.index, o.primitive, o.scope, o.backward, o.in_shapes, o.in_specs,
                            o.out_specs, o.partial_axes))
        if inst in copies:
            after[inst] = len(out)
    for target, at in sorted(after.items(), key=lambda item: -item[1]):
        # in the order their JSON pattern expands to, so that a plan read back compares equal
        names = tuple(n for p in collapse(copies[target]) for n in expand(p))
        out.insert(at, Repeat(names, target))
    return tuple(out)


def _unflatten(tree: Any, tensors: tuple[TensorPlan, ...]) -> Any:
    if tree is not None:
        return jax.tree_util.tree_unflatten(tree, [t.partition_spec for t in tensors])
    nested: dict = {}  # a plan read from JSON: nest by path
    for t in tensors:
        *parents, leaf = t.path.split("/")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = t.partition_spec
    return nested
