"""The JSON layout of a Plan: compact by default, one entry per line, read top-down.

A plan's JSON holds the format version, the mesh, the search and hardware, every input with its
spec, the outputs (a run of outputs that are inputs handed back, as a training step returns its
state, is one line), the decisions the search made, then costs, memory, search statistics,
recomputed layers and redistributions. The decisions are those of the operators that decide
their own sharding (rules.kinds.decides; `compact_decisions`); every other operator follows the
producer of its main operand and is rebuilt from it when the plan is applied (planning/saved.py).
A repeated layer whose decisions equal an earlier instance's is one line naming that instance.
`detail=True` adds every operator's strategy and cost (`ops`).
"""
from __future__ import annotations

import ast
import json
from collections import defaultdict
from dataclasses import asdict
from typing import Any, Sequence

from autopar.name_ranges import collapse, expand
from autopar.placement.lanes import Lanes
from autopar.placement.storable import Storage
from autopar.plan_record import (Decision, OpDecision, PlanRecord, Redistribution, Repeat,
                                 TensorPlan)
from autopar.plan_check import check_axes, check_document
from autopar.plan_stats import Cost, SearchStats
from autopar.rules.factors import Spec
from autopar.rules.kinds import decides

FORMAT_VERSION = 2
READS = (1, 2)  # version 1: specs as lists of axis lists, every operator in `ops`
PER_LINE = ("inputs", "outputs", "decisions", "redistributions", "ops")


# -- specs ---------------------------------------------------------------------------------------------
def spec_text(spec: Spec, trim: bool = False) -> str:
    """P('data', None, ('data', 'model')): a PartitionSpec with every dimension, or with
    `trim` without the trailing replicated ones, as one writes it (P() is replicated); a
    tensor's shape gives it its rank back."""
    dims = ["None" if not axes else repr(axes[0]) if len(axes) == 1
            else "(" + ", ".join(map(repr, axes)) + ")" for axes in spec]
    while trim and dims and dims[-1] == "None":
        dims.pop()
    return "P(" + ", ".join(dims) + ")"


def spec_from(raw: Any, rank: int = 0) -> Spec:
    """A spec from its text (P(...)) or its list of axis lists, padded with replicated
    dimensions to `rank`."""
    if not isinstance(raw, str):
        return tuple(tuple(str(a) for a in axes) for axes in raw)
    spec = _parsed(raw)
    return spec + ((),) * (rank - len(spec))


def _parsed(raw: str) -> Spec:
    text = raw.strip()
    if not (text.startswith("P(") and text.endswith(")")):
        raise ValueError(f"spec {raw!r} is not P(...)")
    inner = text[2:-1].strip()
    if not inner:
        return ()
    try:
        entries = ast.literal_eval("(" + inner + ",)")
    except SyntaxError as e:
        raise ValueError(f"spec {raw!r} does not parse") from e
    spec = tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)
    if not all(isinstance(a, str) for axes in spec for a in axes):
        raise ValueError(f"spec {raw!r} names axes that are not strings")
    return spec


# -- entries -------------------------------------------------------------------------------------------
def tensor_json(t: TensorPlan) -> dict:
    """An input or output; its spec as in format 1, per dimension the axes that split it
    ([["data"], []] is P('data', None)), so that a file's inputs still make a partial plan."""
    return {"path": t.path, "shape": list(t.shape), "dtype": t.dtype,
            "spec": [list(axes) for axes in t.spec], "bytes_per_device": t.bytes_per_device}


def tensor_from(d: dict) -> TensorPlan:
    return TensorPlan(d["path"], tuple(d["shape"]), d.get("dtype", ""),
                      spec_from(d["spec"], len(d["shape"])), int(d.get("bytes_per_device", 0)))


def outputs_json(outputs: Sequence[TensorPlan], inputs: Sequence[TensorPlan]) -> list[dict]:
    """One entry per output, except that a run of outputs equal to a run of inputs but for a
    path prefix (the state a step returns: out/0/... for state/...) is one entry."""
    by_rest: dict[str, list[int]] = defaultdict(list)  # path after its first part -> inputs
    for i, t in enumerate(inputs):
        head, sep, rest = t.path.partition("/")
        if sep:
            by_rest["/" + rest].append(i)

    def match(o: TensorPlan) -> tuple[int, str, str] | None:
        for k, ch in enumerate(o.path):
            found = by_rest.get(o.path[k:]) if ch == "/" else None
            if found and len(found) == 1 and _same(inputs[found[0]], o):
                i = found[0]
                return i, inputs[i].path[:len(inputs[i].path) - len(o.path) + k], o.path[:k]
        return None

    out: list[dict] = []
    run: list = []  # [first input, count, input prefix, output prefix]
    for o in outputs:
        m = match(o)
        if run and m == (run[0] + run[1], run[2], run[3]):
            run[1] += 1
            continue
        _close(run, inputs, out)
        run = [m[0], 1, m[1], m[2]] if m else []
        if not m:
            out.append(tensor_json(o))
    _close(run, inputs, out)
    return out


def _same(a: TensorPlan, b: TensorPlan) -> bool:
    return (a.shape, a.dtype, a.spec, a.bytes_per_device) == (b.shape, b.dtype, b.spec,
                                                              b.bytes_per_device)


def _close(run: list, inputs: Sequence[TensorPlan], out: list[dict]) -> None:
    if not run:
        return
    first, count, in_prefix, out_prefix = run
    if count == 1:
        t = inputs[first]
        out.append(tensor_json(TensorPlan(out_prefix + t.path[len(in_prefix):], t.shape, t.dtype,
                                          t.spec, t.bytes_per_device)))
    else:
        out.append({"as_inputs_from": inputs[first].path, "count": count,
                    "renamed": [in_prefix, out_prefix]})


def outputs_from(entries: list[dict], inputs: Sequence[TensorPlan]) -> list[TensorPlan]:
    index = {t.path: i for i, t in enumerate(inputs)}
    out = []
    for d in entries:
        if "as_inputs_from" not in d:
            out.append(tensor_from(d))
            continue
        first, (in_prefix, out_prefix) = index[d["as_inputs_from"]], d["renamed"]
        for t in inputs[first:first + int(d["count"])]:
            if not t.path.startswith(in_prefix):
                raise ValueError(f"input {t.path} does not start with {in_prefix!r}")
            out.append(TensorPlan(out_prefix + t.path[len(in_prefix):], t.shape, t.dtype,
                                  t.spec, t.bytes_per_device))
    return out


def decision_json(d: Decision | Repeat) -> dict:
    if isinstance(d, Repeat):
        names = collapse(d.layers)
        return {"layers": names[0] if len(names) == 1 else names, "same_as": d.same_as}
    body: dict[str, Any] = {"op": d.op, "primitive": d.primitive, "scope": d.scope}
    if d.backward:
        body["backward"] = True
    body.update({"in_shapes": [list(s) for s in d.in_shapes],
                 "in": [spec_text(s) for s in d.in_specs],
                 "out": [spec_text(s) for s in d.out_specs]})
    if d.partial_axes:
        body["partial"] = list(d.partial_axes)
    return body


def decision_from(d: dict) -> Decision | Repeat:
    if "same_as" in d:
        names = [d["layers"]] if isinstance(d["layers"], str) else d["layers"]
        return Repeat(tuple(n for pattern in names for n in expand(pattern)), d["same_as"])
    return Decision(int(d["op"]), d["primitive"], d.get("scope", ""), bool(d.get("backward")),
                    tuple(tuple(s) for s in d["in_shapes"]),
                    tuple(spec_from(s) for s in d["in"]), tuple(spec_from(s) for s in d["out"]),
                    tuple(d.get("partial", ())))


def op_json(o: OpDecision) -> dict:
    d = asdict(o)
    d["in_specs"] = [spec_text(s) for s in o.in_specs]
    d["out_specs"] = [spec_text(s) for s in o.out_specs]
    return d


def op_from(d: dict) -> OpDecision:
    return OpDecision(
        int(d["index"]), d["primitive"], d["source"], tuple(tuple(s) for s in d["in_shapes"]),
        tuple(tuple(s) for s in d["out_shapes"]), tuple(spec_from(s) for s in d["in_specs"]),
        tuple(spec_from(s) for s in d["out_specs"]), tuple(d["partial_axes"]),
        float(d["compute_s"]), float(d["communication_s"]), d.get("scope", ""),
        bool(d.get("backward", False)))


def redistribution_json(r: Redistribution) -> dict:
    return {"where": r.where, "tensor": r.tensor, "shape": list(r.shape),
            "from": spec_text(r.from_spec, trim=True), "to": spec_text(r.to_spec, trim=True),
            "cost_s": r.cost_s,
            "annotated": r.annotated}


def redistribution_from(d: dict) -> Redistribution:
    rank = len(d["shape"])  # format 1 has lists in from_spec and to_spec
    return Redistribution(d["where"], d["tensor"], tuple(d["shape"]),
                          spec_from(d.get("from_spec", d["from"]), rank),
                          spec_from(d.get("to_spec", d["to"]), rank), float(d["cost_s"]),
                          bool(d["annotated"]))


def plan_body(plan: PlanRecord, detail: bool) -> dict[str, Any]:
    """The JSON document of `plan`, top-down; with `detail`, every operator as well."""
    body = {
        "format_version": FORMAT_VERSION,
        "mesh": {"axis_names": [n for n, _ in plan.mesh],
                 "axis_sizes": [s for _, s in plan.mesh]},
        "search": plan.search,
        "hardware": plan.hardware,
        **({"microbatches": plan.microbatches} if plan.microbatches > 1 else {}),
        **({"microbatch_groups": plan.microbatch_groups} if plan.microbatch_groups > 1 else {}),
        **({"pipeline_stages": plan.pipeline_stages} if plan.pipeline_stages > 1 else {}),
        **({"pipeline_repeats": plan.pipeline_repeats} if plan.pipeline_repeats > 1 else {}),
        **({"pipeline": plan.pipeline} if plan.pipeline else {}),
        **({"stored_in_placement": stored_json(plan.stored)} if plan.stored else {}),
        **({"stored_stacked": {"inputs": [list(o) for o in plan.lanes.inputs],
                               "outputs": [list(o) for o in plan.lanes.outputs]}}
           if plan.lanes else {}),
        "inputs": [tensor_json(t) for t in plan.inputs],
        "outputs": outputs_json(plan.outputs, plan.inputs),
        "decisions": [decision_json(d) for d in plan.decisions],
        "cost": plan.cost.as_json(),
        "memory": plan.memory,
        "search_stats": plan.stable_stats(),
        "recompute": list(plan.recompute),
        "redistributions": [redistribution_json(r) for r in plan.redistributions],
    }
    if detail:
        body["ops"] = [op_json(o) for o in plan.ops]
    return body


def stored_json(stored: Storage) -> dict[str, Any]:
    """The stack's leaves kept in the circular placement: the stack's per-layer inputs read
    from them, the flat input and output leaves stored, the layer count."""
    return {"layers": stored.length, "stages": stored.stages, "repeats": stored.repeats,
            "stack_inputs": list(stored.reads),
            "input_leaves": list(stored.inputs), "output_leaves": list(stored.outputs)}


def stored_from(body: dict[str, Any] | None) -> Storage | None:
    if not body:
        return None
    return Storage(tuple(body["stack_inputs"]), tuple(body["input_leaves"]),
                   tuple(body["output_leaves"]), int(body["layers"]), int(body["stages"]),
                   int(body["repeats"]))


def lanes_from(body: dict[str, Any] | None, inputs: tuple) -> Lanes | None:
    """A Python loop's layers kept stacked: the user's flat leaves of each stacked input and
    output (placement/lanes.py)."""
    if not body:
        return None
    return Lanes(tuple(tuple(o) for o in body["inputs"]), tuple(tuple(o) for o in body["outputs"]),
                 tuple(t.path for t in inputs))


def plan_fields(body: Any) -> dict[str, Any]:
    """The fields of a Plan from its JSON document (any version in READS); an AutoparError
    naming every place where it is malformed (plan_check)."""
    check_document(body, READS, FORMAT_VERSION)
    names, sizes = body["mesh"]["axis_names"], body["mesh"]["axis_sizes"]
    inputs = tuple(tensor_from(t) for t in body["inputs"])
    fields = dict(
        mesh=tuple((str(n), int(s)) for n, s in zip(names, sizes)),
        search=body.get("search", body.get("backend", "")), hardware=body.get("hardware", ""),
        microbatches=int(body.get("microbatches", 1)),
        microbatch_groups=int(body.get("microbatch_groups", 1)),
        pipeline_stages=int(body.get("pipeline_stages", 1)),
        pipeline_repeats=int(body.get("pipeline_repeats", 1)), inputs=inputs,
        pipeline=body.get("pipeline", {}),
        stored=stored_from(body.get("stored_in_placement")),
        lanes=lanes_from(body.get("stored_stacked"), inputs),
        outputs=tuple(outputs_from(body.get("outputs", []), inputs)),
        ops=tuple(op_from(o) for o in body.get("ops", [])),
        cost=Cost.of(body.get("cost", {})),
        search_stats=SearchStats.of(body.get("search_stats", {})),
        redistributions=tuple(redistribution_from(r) for r in body.get("redistributions", [])),
        memory=body.get("memory", {}), recompute=tuple(body.get("recompute", [])),
        decided=tuple(decision_from(d) for d in body.get("decisions", [])))
    check_axes(names, _specs_of(fields))
    return fields


def _specs_of(fields: dict[str, Any]) -> list[tuple[str, Any, Spec]]:
    """(where, shape, spec) of every spec in a plan's fields (shape None: not recorded)."""
    found = [(f"{kind} {t.path!r}", t.shape, t.spec)
             for kind in ("inputs", "outputs") for t in fields[kind]]
    for kind, entries in (("decisions", fields["decided"]), ("ops", fields["ops"])):
        for k, d in enumerate(entries):
            if isinstance(d, Repeat):
                continue
            shapes = (*d.in_shapes, *(getattr(d, "out_shapes", None) or [None] * len(
                d.out_specs)))
            specs = (*d.in_specs, *d.out_specs)
            found += [(f"{kind}[{k}] ({d.primitive}) spec {i}", shape, spec)
                      for i, (shape, spec) in enumerate(zip(shapes, specs))]
    found += [(f"redistributions[{k}] of {r.tensor!r}", r.shape, spec)
              for k, r in enumerate(fields["redistributions"]) for spec in (r.from_spec,
                                                                             r.to_spec)]
    return found


def dumps(body: dict[str, Any]) -> str:
    """`body` as JSON with one top-level key per line and one entry per line in the lists of
    PER_LINE: a reader scrolls through it, a diff shows which entries changed."""
    lines = ["{"]
    keys = list(body)
    for n, key in enumerate(keys):
        comma = "," if n < len(keys) - 1 else ""
        value = body[key]
        if key in PER_LINE and value:
            lines.append(f"{json.dumps(key)}: [")
            lines += [f" {json.dumps(v)}{',' if k < len(value) - 1 else ''}"
                      for k, v in enumerate(value)]
            lines.append(f"]{comma}")
        else:
            lines.append(f"{json.dumps(key)}: {json.dumps(value)}{comma}")
    lines.append("}")
    return "\n".join(lines)
