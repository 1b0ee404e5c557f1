"""The Plan: every input, output and operator decision, readable and saved as JSON."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import jax
from jax.sharding import PartitionSpec

from autopar.errors import AutoparError
from autopar.rules.factors import Spec, to_partition_spec

FORMAT_VERSION = 1


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
    decision; `cost` the totals per device. `to_json`/`from_json` round-trip exactly.
    """

    mesh: tuple[tuple[str, int], ...]
    backend: str
    hardware: str
    inputs: tuple[TensorPlan, ...]
    outputs: tuple[TensorPlan, ...]
    ops: tuple[OpDecision, ...]
    cost: dict[str, float] = field(hash=False)
    search_stats: dict[str, Any] = field(hash=False, default_factory=dict)
    redistributions: tuple[Redistribution, ...] = ()
    in_tree: Any = field(default=None, compare=False, hash=False, repr=False)
    out_tree: Any = field(default=None, compare=False, hash=False, repr=False)
    # the memory estimate per device (autopar.memory): peak_bytes, at_peak by kind, where,
    # the largest buffers then, and the limit planned for
    memory: dict[str, Any] = field(hash=False, default_factory=dict)
    recompute: tuple[str, ...] = ()  # layers the backward pass recomputes

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
        """A table of input path -> PartitionSpec, then the predicted cost."""
        rows = [(t.path, str(t.partition_spec), f"{t.bytes_per_device:,}") for t in self.inputs]
        width = max([len(r[0]) for r in rows] + [4])
        lines = [f"{'path':<{width}}  {'spec':<28} bytes/device"]
        lines += [f"{p:<{width}}  {s:<28} {b}" for p, s, b in rows[:limit]]
        if len(rows) > limit:
            lines.append(f"... {len(rows) - limit} more")
        c = self.cost
        lines.append(f"predicted per step: compute {c['compute_s'] * 1e3:.3f} ms, communication "
                     f"{c['communication_s'] * 1e3:.3f} ms, total {c['total_s'] * 1e3:.3f} ms; "
                     f"peak memory {c['peak_memory_bytes'] / 2**20:.1f} MiB per device")
        if self.memory:
            m = self.memory
            kinds = ", ".join(f"{k.replace('_', ' ')} {v / 2**20:.1f}"
                              for k, v in m["at_peak"].items() if v)
            allowed = (f" of {m['limit_bytes'] / 2**20:.1f} MiB allowed"
                       if m.get("limit_bytes") else "")
            lines.append(f"memory at its peak{allowed} ({m['where']}): {kinds} MiB")
            if m.get("compiled_bytes"):
                lines.append(f"compiled by XLA: {m['compiled_bytes'] / 2**20:.1f} MiB per device")
        if self.recompute:
            lines.append(f"recomputed in the backward pass ({c.get('recompute_s', 0) * 1e3:.3f}"
                         f" ms more compute): {', '.join(self.recompute)}")
        at = [r for r in self.redistributions if r.annotated]
        if at:
            lines.append(f"redistributions at annotations ({len(at)}):")
            lines += [f"  {r.describe()}" for r in sorted(at, key=lambda r: -r.cost_s)[:limit]]
        rest = [r for r in self.redistributions if not r.annotated]
        if rest:
            total = sum(r.cost_s for r in rest)
            lines.append(f"{len(rest)} other redistributions, {total * 1e3:.3f} ms in all; "
                         "the costliest:")
            lines += [f"  {r.describe()}" for r in sorted(rest, key=lambda r: -r.cost_s)[:3]]
        return "\n".join(lines)

    # -- JSON --------------------------------------------------------------------------------------
    def to_json(self, indent: int | None = 1) -> str:
        body = {
            "format_version": FORMAT_VERSION,
            "mesh": {"axis_names": [n for n, _ in self.mesh], "axis_sizes": [s for _, s in self.mesh]},
            "backend": self.backend,
            "hardware": self.hardware,
            "inputs": [_tensor_json(t) for t in self.inputs],
            "outputs": [_tensor_json(t) for t in self.outputs],
            "ops": [_op_json(o) for o in self.ops],
            "cost": self.cost,
            "search_stats": self.search_stats,
            "redistributions": [_redistribution_json(r) for r in self.redistributions],
            "memory": self.memory,
            "recompute": list(self.recompute),
        }
        return json.dumps(body, indent=indent)

    @staticmethod
    def from_json(text: str) -> "Plan":
        """A plan from its JSON. A partial plan (only `mesh` and some `inputs`, each with path,
        shape and spec) reads too: it serves as annotations, not to run a step."""
        try:
            body = json.loads(text)
            if body.get("format_version") != FORMAT_VERSION:
                raise AutoparError(f"plan format_version {body.get('format_version')!r} is not "
                                   f"{FORMAT_VERSION}. Fix: plan again with this autopar version.")
            mesh = tuple(zip(body["mesh"]["axis_names"], body["mesh"]["axis_sizes"]))
            return Plan(
                mesh=tuple((str(n), int(s)) for n, s in mesh), backend=body.get("backend", ""),
                hardware=body.get("hardware", ""),
                inputs=tuple(_tensor_from(t) for t in body["inputs"]),
                outputs=tuple(_tensor_from(t) for t in body.get("outputs", [])),
                ops=tuple(_op_from(o) for o in body.get("ops", [])),
                cost=body.get("cost", {}), search_stats=body.get("search_stats", {}),
                redistributions=tuple(_redistribution_from(r)
                                      for r in body.get("redistributions", [])),
                memory=body.get("memory", {}), recompute=tuple(body.get("recompute", [])))
        except (KeyError, TypeError, ValueError) as e:
            raise AutoparError(f"not a valid autopar plan JSON ({e!r}). Fix: load a file written "
                               "by Plan.save or Plan.to_json.") from e

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())


def load_plan(path: str) -> Plan:
    """Read a plan written by `Plan.save`."""
    with open(path) as f:
        return Plan.from_json(f.read())


def _spec_json(spec: Spec) -> list[list[str]]:
    return [list(axes) for axes in spec]


def _spec_from(raw: list) -> Spec:
    return tuple(tuple(str(a) for a in axes) for axes in raw)


def _tensor_json(t: TensorPlan) -> dict:
    return {"path": t.path, "shape": list(t.shape), "dtype": t.dtype,
            "spec": _spec_json(t.spec), "partition_spec": str(t.partition_spec),
            "bytes_per_device": t.bytes_per_device}


def _tensor_from(d: dict) -> TensorPlan:
    return TensorPlan(d["path"], tuple(d["shape"]), d.get("dtype", ""), _spec_from(d["spec"]),
                      int(d.get("bytes_per_device", 0)))


def _op_json(o: OpDecision) -> dict:
    d = asdict(o)
    d["in_specs"] = [_spec_json(s) for s in o.in_specs]
    d["out_specs"] = [_spec_json(s) for s in o.out_specs]
    return d


def _op_from(d: dict) -> OpDecision:
    return OpDecision(
        int(d["index"]), d["primitive"], d["source"], tuple(tuple(s) for s in d["in_shapes"]),
        tuple(tuple(s) for s in d["out_shapes"]), tuple(_spec_from(s) for s in d["in_specs"]),
        tuple(_spec_from(s) for s in d["out_specs"]), tuple(d["partial_axes"]),
        float(d["compute_s"]), float(d["communication_s"]), d.get("scope", ""),
        bool(d.get("backward", False)))


def _redistribution_json(r: Redistribution) -> dict:
    return {"where": r.where, "tensor": r.tensor, "shape": list(r.shape),
            "from_spec": _spec_json(r.from_spec), "to_spec": _spec_json(r.to_spec),
            "from": str(to_partition_spec(r.from_spec)), "to": str(to_partition_spec(r.to_spec)),
            "cost_s": r.cost_s, "annotated": r.annotated}


def _redistribution_from(d: dict) -> Redistribution:
    return Redistribution(d["where"], d["tensor"], tuple(d["shape"]), _spec_from(d["from_spec"]),
                          _spec_from(d["to_spec"]), float(d["cost_s"]), bool(d["annotated"]))


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
