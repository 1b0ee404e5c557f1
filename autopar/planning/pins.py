"""Pins: the shardings a user fixes, checked and turned into constraints of the search.

Three sources end in one map, tensor id -> Spec, which every search treats as fixed:
- `autopar.shard(x, P(...))` in model code (autopar.trace.shard): its results.
- `annotations={regex: P(...)}` over the step's input paths: `re.search`, first match wins, as
  with logical-axis rules.
- a saved `Plan`, whole or partial (a JSON file with only some inputs): its input specs, by
  exact path.
An annotation that cannot apply is an AutoparError naming the path, the shape, the mesh and the
fix; all such problems are reported together.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

from jax.sharding import PartitionSpec

from autopar.errors import AutoparError, collect_errors
from autopar.mesh import MeshShape
from autopar.plan import Plan
from autopar.rules.factors import Spec, from_partition_spec
from autopar.trace.ir import OpGraph
from autopar.trace.shard import SHARD_PRIMITIVE

Annotations = Mapping[str, Any] | Iterable[tuple[str, Any]] | Plan | None


def resolve(graph: OpGraph, mesh: MeshShape, annotations: Annotations) -> dict[int, Spec]:
    """Tensor id -> fixed spec, from `annotations` and the graph's `shard` calls, checked."""
    problems: list[str] = []
    seeds: dict[int, Spec] = {}
    if isinstance(annotations, Plan):
        _from_plan(graph, mesh, annotations, seeds, problems)
    elif annotations is not None:
        _from_rules(graph, mesh, annotations, seeds, problems)
    for op in graph.ops:
        if op.primitive == SHARD_PRIMITIVE:
            t = op.outputs[0]
            where = f"autopar.shard at {op.source}" + (f" in {op.scope}" if op.scope else "")
            spec = check_spec(op.params["spec"], graph.tensors[t].shape, mesh, where, problems)
            if spec is not None:
                seeds[t] = spec
    collect_errors(problems, f"annotations that cannot apply on mesh {mesh}:")
    return seeds


def _from_rules(graph: OpGraph, mesh: MeshShape, annotations: Any, seeds: dict[int, Spec],
                problems: list[str]) -> None:
    pairs = list(annotations.items() if isinstance(annotations, Mapping) else annotations)
    compiled = []
    for pattern, spec in pairs:
        try:
            compiled.append((pattern, re.compile(pattern), spec))
        except (re.error, TypeError) as e:
            problems.append(f"annotation {pattern!r} is not a regular expression ({e}). Fix: "
                            "write a Python regex over input paths like 'params/.*/kernel'.")
    used = set()
    for t in graph.inputs:
        tensor = graph.tensors[t]
        for pattern, regex, spec in compiled:
            if regex.search(tensor.path or ""):
                used.add(pattern)
                where = f"input {tensor.path} (annotation {pattern!r})"
                checked = check_spec(spec, tensor.shape, mesh, where, problems)
                if checked is not None:
                    seeds[t] = checked
                break
    for pattern, _, _ in compiled:
        if pattern not in used:
            sample = ", ".join(repr(graph.tensors[t].path) for t in graph.inputs[:4])
            problems.append(f"annotation {pattern!r} matches no input path (mesh {mesh}; it "
                            f"may be shadowed by an earlier annotation). Inputs look like {sample}"
                            " ... Fix: correct the regex, or see plan.specs for every path.")


def _from_plan(graph: OpGraph, mesh: MeshShape, saved: Plan, seeds: dict[int, Spec],
               problems: list[str]) -> None:
    by_path = {graph.tensors[t].path: t for t in graph.inputs}
    shared = [entry for entry in saved.inputs if entry.path in by_path]
    if not shared:
        problems.append(f"the saved plan shares no input path with this step (its first: "
                        f"{[e.path for e in saved.inputs[:3]]}, the step's: "
                        f"{list(by_path)[:3]}). Fix: seed with a plan of this step.")
    for entry in shared:
        t = by_path[entry.path]
        shape = graph.tensors[t].shape
        where = f"input {entry.path} (saved plan)"
        if tuple(entry.shape) != shape:
            problems.append(f"{where} has shape {shape} here but {tuple(entry.shape)} in the "
                            f"plan (mesh {mesh}). Fix: plan again for these arguments.")
            continue
        checked = check_spec(entry.partition_spec, shape, mesh, where, problems)
        if checked is not None:
            seeds[t] = checked


def check_spec(spec: Any, shape: tuple[int, ...], mesh: MeshShape, where: str,
               problems: list[str]) -> Spec | None:
    """`spec` as our Spec for a tensor of `shape`, or None after adding what is wrong with it.

    Axes of size 1 split nothing and are dropped. An entry `PartitionSpec.UNCONSTRAINED` is a
    free dimension (None in the Spec): the search places it (see problem._group).
    """
    head = f"{where} with shape {shape} on mesh {mesh}"
    if spec is None:
        spec = PartitionSpec()
    if not isinstance(spec, PartitionSpec):
        problems.append(f"{head}: {spec!r} is not a PartitionSpec. Fix: write "
                        "jax.sharding.PartitionSpec(...), e.g. P(None, 'model').")
        return None
    if len(spec) > len(shape):
        problems.append(f"{head}: {spec} has {len(spec)} entries for a tensor of rank "
                        f"{len(shape)}. Fix: give at most {len(shape)} entries.")
        return None
    found = len(problems)
    out: list[tuple[str, ...] | None] = []
    seen: set[str] = set()
    entries = list(spec)
    free = {k for k, e in enumerate(entries) if e is PartitionSpec.UNCONSTRAINED}
    entries = [None if k in free else e for k, e in enumerate(entries)]
    for k, axes in enumerate(from_partition_spec(PartitionSpec(*entries), len(shape))):
        if k in free:
            out.append(None)
            continue
        unknown = [a for a in axes if a not in mesh.names]
        if unknown:
            problems.append(f"{head}: {spec} names axis {unknown[0]!r}, which the mesh does not "
                            f"have. Fix: use the mesh's axes {list(mesh.names)}.")
            continue
        twice = [a for j, a in enumerate(axes) if a in seen or a in axes[:j]]
        if twice:
            problems.append(f"{head}: {spec} uses axis {twice[0]!r} twice. Fix: split each "
                            "dimension over different axes, each axis once.")
        seen.update(axes)
        in_order = tuple(sorted(axes, key=mesh.names.index))
        if axes != in_order:
            problems.append(f"{head}: {spec} lists axes {axes} of dimension {k} out of mesh "
                            f"order. Fix: write them as {in_order}.")
        axes = tuple(a for a in axes if mesh.axis_size(a) > 1)
        ways = 1
        for a in axes:
            ways *= mesh.axis_size(a)
        if shape[k] % ways:
            problems.append(f"{head}: dimension {k} has size {shape[k]}, which {axes} "
                            f"({ways} devices) does not divide. Fix: annotate that dimension "
                            "with axes whose sizes divide it, or None.")
        out.append(axes)
    return tuple(out) if len(problems) == found else None


def check_annotations_type(annotations: Any) -> None:
    """Reject what cannot be annotations before any tracing."""
    if annotations is None or isinstance(annotations, (Plan, Mapping)):
        return
    if isinstance(annotations, (list, tuple)):
        odd = [a for a in annotations if not (isinstance(a, (list, tuple)) and len(a) == 2)]
        if not odd:
            return
        raise AutoparError(f"annotations as a list hold (regex, PartitionSpec) pairs; "
                           f"{odd[0]!r} is not one. Fix: e.g. [('params/.*', P(None, "
                           "'model'))], or a dict of regex -> PartitionSpec.")
    raise AutoparError(f"annotations={annotations!r} is not understood. Fix: pass a dict of "
                       "regex -> PartitionSpec over input paths, a list of such pairs, or a Plan "
                       "(autopar.load_plan(path)).")

