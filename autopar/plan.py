"""The Plan: every input, output and operator decision, readable and saved as JSON.

Its views (plan_text, plan_json, explain, plan_html) take a Plan, and its methods call them:
they are imported when a method is called, the one place an autopar module is imported
inside a function (tests/test_imports.py)."""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import PartitionSpec

from autopar.errors import AutoparError
from autopar.placement.lanes import Lanes
from autopar.placement.storable import Storage
from autopar.plan_stats import Cost, SearchStats
from autopar.rules.factors import Spec, to_partition_spec
from autopar.schedule import Schedule


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
class Plan:
    """A sharding plan for one step function on one mesh.

    `specs` maps every input and output path to its PartitionSpec; `ops` holds every operator
    decision, `decisions` those the search made (the rest follow them); `cost` the totals per
    device (a Cost) and `search_stats` what the search found out (a SearchStats): records
    read by field (`plan.cost.total_s`) that also read as the JSON's flat mappings
    (`plan.cost["total_s"]`; `dict(plan.cost)` for json.dumps). A plan read from compact
    JSON has `decisions` but no `ops` (`decided` holds them).
    Plans are equal when all but `ops` are: the same decisions make the same operators.
    """

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
        if not isinstance(other, Plan):
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
        """The deciding operators' strategies, repeated layers as Repeats (plan_json)."""
        from autopar.plan_json import compact_decisions
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

    def summary(self, limit: int = 40) -> str:
        """Every input path -> PartitionSpec (instances of a repeated layer with equal specs as
        one row, block_{0..3}/...), then the predicted cost; `limit` redistributions at most."""
        from autopar.plan_text import summary
        return summary(self, limit)

    def explain(self, path: str, alternatives: int = 6) -> Any:
        """Why input `path` has its spec (autopar.explain.Explanation; print it): its bytes,
        its reshardings, then up to `alternatives` other specs, each with the step planned
        again around it (its time and memory, or that it does not fit memory_limit and its
        time without), and what decided: an annotation, the memory limit, the cost model, or
        a search that missed a faster plan. A search per alternative, and a second where it
        does not fit memory_limit. `path` may also be
        a scope of the step's operators (`OpDecision.scope`, "GPT/block_0/mlp_in"): its
        intermediates' specs, compute, collectives and reshardings
        (autopar.explain.ScopeExplanation)."""
        from autopar.explain import explain
        return explain(self, path, self.replanner, alternatives)

    def to_html(self, path: str, title: str = "autopar plan") -> None:
        """Write the plan as one self-contained HTML page (autopar/plan_html.py): the mesh,
        each layer's specs, the collectives by layer, kind and mesh axes, the memory over the
        step with its peak, and the compiled peak beside the predicted one where known."""
        from autopar.plan_html import plan_page
        with open(path, "w") as f:
            f.write(plan_page(self, title))

    # -- JSON --------------------------------------------------------------------------------------
    def to_json(self, detail: bool = False) -> str:
        """The plan as JSON, one entry per line (layout: plan_json). Compact by default: the
        decisions the search made; `detail` adds every operator's strategy and cost."""
        from autopar.plan_json import dumps, plan_body
        if detail and not self.ops and self.decided:
            raise AutoparError("this plan was read from compact JSON and holds no per-operator "
                               "detail. Fix: apply it (auto_parallel(step, mesh=..., plan=p)"
                               ".plan(*args)) and save that plan with detail=True.")
        return dumps(plan_body(self, detail))

    @staticmethod
    def from_json(text: str) -> "Plan":
        """A plan from its JSON, compact or detailed, of this format or the one before. A
        partial plan (only `mesh` and some `inputs`, each with path, shape and spec) reads too:
        it serves as annotations, not to run a step."""
        from autopar.plan_json import plan_fields
        try:
            return Plan(**plan_fields(json.loads(text)))
        except json.JSONDecodeError as e:
            raise AutoparError(f"a plan file holds JSON, and this text does not parse ({e}); "
                               "it may have been cut short. Fix: load a file written by "
                               "Plan.save or Plan.to_json.") from e
        except (KeyError, TypeError, ValueError, IndexError) as e:  # what the schema cannot see
            raise AutoparError(f"not a valid autopar plan JSON ({e!r}). Fix: load a file written "
                               "by Plan.save or Plan.to_json.") from e

    def save(self, path: str, detail: bool = False) -> None:
        """Write the plan's JSON (compact; `detail` adds every operator) to `path`. In several
        processes (jax.distributed) only process 0 writes: every process holds the same plan."""
        if jax.process_index() != 0:
            return
        with open(path, "w") as f:
            f.write(self.to_json(detail))


def load_plan(path: str) -> Plan:
    """Read a plan written by `Plan.save`."""
    try:
        with open(path) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise AutoparError(f"cannot read a plan from {path}: {e}. Fix: pass the path of a file "
                           "written by Plan.save.") from e
    return Plan.from_json(text)


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
