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
    in_tree: Any = field(default=None, compare=False, hash=False, repr=False)
    out_tree: Any = field(default=None, compare=False, hash=False, repr=False)

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
        }
        return json.dumps(body, indent=indent)

    @staticmethod
    def from_json(text: str) -> "Plan":
        try:
            body = json.loads(text)
            if body.get("format_version") != FORMAT_VERSION:
                raise AutoparError(f"plan format_version {body.get('format_version')!r} is not "
                                   f"{FORMAT_VERSION}. Fix: plan again with this autopar version.")
            mesh = tuple(zip(body["mesh"]["axis_names"], body["mesh"]["axis_sizes"]))
            return Plan(
                mesh=tuple((str(n), int(s)) for n, s in mesh), backend=body["backend"],
                hardware=body["hardware"],
                inputs=tuple(_tensor_from(t) for t in body["inputs"]),
                outputs=tuple(_tensor_from(t) for t in body["outputs"]),
                ops=tuple(_op_from(o) for o in body["ops"]),
                cost=body["cost"], search_stats=body.get("search_stats", {}))
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
    return TensorPlan(d["path"], tuple(d["shape"]), d["dtype"], _spec_from(d["spec"]),
                      int(d["bytes_per_device"]))


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
        float(d["compute_s"]), float(d["communication_s"]))


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
