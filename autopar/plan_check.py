"""What a plan file may hold, checked before it is read: every malformed plan is one
AutoparError naming where in the file each problem is, never a KeyError from deep inside.

`check_document` walks the parsed JSON against SCHEMA, a description of the layout written by
plan_json.plan_body (formats 1 and 2). `check_axes` then checks what a schema cannot: that every
spec splits a dimension the tensor has, over axes of the plan's mesh, each axis once.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from autopar.errors import AutoparError

FIX = "Fix: load a file written by Plan.save or Plan.to_json, or plan again."


class Opt:
    """A key that may be left out."""

    def __init__(self, schema: Any) -> None:
        self.schema = schema


class AnyOf:
    def __init__(self, *schemas: Any) -> None:
        self.schemas = schemas


class ListOf:
    def __init__(self, schema: Any) -> None:
        self.schema = schema


class MapOf:
    """A dict with string keys and values of one kind; `known` types some keys exactly."""

    def __init__(self, schema: Any, known: dict[str, Any] | None = None) -> None:
        self.schema, self.known = schema, known or {}


def _kind(name: str, test: Callable[[Any], bool]) -> Callable[[Any], str | None]:
    return lambda v: None if test(v) else f"is {v!r}, not {name}"


INT = _kind("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool))
COUNT = _kind("a count (an integer >= 0)",
              lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0)
POSITIVE = _kind("an integer >= 1",
                 lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1)
NUMBER = _kind("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
STR = _kind("a string", lambda v: isinstance(v, str))
BOOL = _kind("true or false", lambda v: isinstance(v, bool))
JSON = _kind("a JSON value", lambda v: True)
SPEC = AnyOf(STR, ListOf(ListOf(STR)))  # P('data', None), or [["data"], []] (format 1)
SHAPE = ListOf(COUNT)
TENSOR = {"path": STR, "shape": SHAPE, "dtype": Opt(STR), "spec": SPEC,
          "bytes_per_device": Opt(COUNT)}
RUN = {"as_inputs_from": STR, "count": POSITIVE, "renamed": ListOf(STR)}
DECISION = {"op": COUNT, "primitive": STR, "scope": Opt(STR), "backward": Opt(BOOL),
            "in_shapes": ListOf(SHAPE), "in": ListOf(SPEC), "out": ListOf(SPEC),
            "partial": Opt(ListOf(STR))}
REPEAT = {"layers": AnyOf(STR, ListOf(STR)), "same_as": STR}
OP = {"index": COUNT, "primitive": STR, "source": STR, "in_shapes": ListOf(SHAPE),
      "out_shapes": ListOf(SHAPE), "in_specs": ListOf(SPEC), "out_specs": ListOf(SPEC),
      "partial_axes": ListOf(STR), "compute_s": NUMBER, "communication_s": NUMBER,
      "scope": Opt(STR), "backward": Opt(BOOL)}
REDISTRIBUTION = {"where": STR, "tensor": STR, "shape": SHAPE, "from": Opt(SPEC),
                  "to": Opt(SPEC), "from_spec": Opt(SPEC), "to_spec": Opt(SPEC),
                  "cost_s": NUMBER, "annotated": BOOL}
TRIED = MapOf(JSON, {"stages": AnyOf(INT, STR), "microbatches": Opt(JSON),
                     "repeats": Opt(POSITIVE), "total_ms": Opt(NUMBER), "left_out": Opt(STR)})
COST = MapOf(NUMBER)
MEMORY = MapOf(JSON, {"at_peak": Opt(MapOf(NUMBER)), "where": Opt(STR), "limit_bytes": Opt(NUMBER),
                      "compiled_bytes": Opt(NUMBER)})
PIPELINE = MapOf(JSON, {"layers": COUNT, "stage_layers": ListOf(ListOf(ListOf(COUNT))),
                        "sub_mesh": MapOf(POSITIVE), "ticks": POSITIVE,
                        "tick_loops_s": NUMBER})
SCHEMA = {
    "format_version": INT,
    "mesh": {"axis_names": ListOf(STR), "axis_sizes": ListOf(POSITIVE)},
    "search": Opt(STR), "backend": Opt(STR), "hardware": Opt(STR),
    "microbatches": Opt(POSITIVE), "microbatch_groups": Opt(POSITIVE),
    "pipeline_stages": Opt(POSITIVE), "pipeline_repeats": Opt(POSITIVE),
    "pipeline": Opt(PIPELINE),
    "stored_in_placement": Opt({"layers": POSITIVE, "stages": POSITIVE, "repeats": POSITIVE,
                                "stack_inputs": ListOf(COUNT), "input_leaves": ListOf(COUNT),
                                "output_leaves": ListOf(COUNT)}),
    "stored_stacked": Opt({"inputs": ListOf(ListOf(COUNT)), "outputs": ListOf(ListOf(COUNT))}),
    "inputs": ListOf(TENSOR), "outputs": Opt(ListOf(AnyOf(TENSOR, RUN))),
    "decisions": Opt(ListOf(AnyOf(DECISION, REPEAT))), "ops": Opt(ListOf(OP)),
    "cost": Opt(COST), "memory": Opt(MEMORY),
    "search_stats": Opt(MapOf(JSON, {"ops": Opt(COUNT), "pinned_inside": Opt(BOOL),
                                     "schedules_tried": Opt(ListOf(TRIED))})),
    "recompute": Opt(ListOf(STR)), "redistributions": Opt(ListOf(REDISTRIBUTION)),
}


def _problems(value: Any, schema: Any, where: str) -> list[str]:
    """Where `value` departs from `schema`, as 'where: what' lines (none: it matches)."""
    if isinstance(schema, Opt):
        return _problems(value, schema.schema, where)
    if isinstance(schema, AnyOf):
        found = [_problems(value, s, where) for s in schema.schemas]
        return [] if any(not f for f in found) else min(found, key=len)
    if isinstance(schema, ListOf):
        if not isinstance(value, list):
            return [f"{where} is {_short(value)}, not a list"]
        return [p for i, v in enumerate(value) for p in _problems(v, schema.schema,
                                                                  f"{where}[{i}]")]
    if isinstance(schema, (dict, MapOf)):
        if not isinstance(value, dict):
            return [f"{where} is {_short(value)}, not an object"]
        known = schema if isinstance(schema, dict) else schema.known
        problems = [f"{where} has no {k!r}" for k, s in known.items()
                    if k not in value and not isinstance(s, Opt)]
        for k, v in value.items():
            inner = known.get(k, schema.schema if isinstance(schema, MapOf) else None)
            if inner is not None:  # an unknown key of a record is ignored, as JSON readers do
                problems += _problems(v, inner, f"{where}.{k}" if where else k)
        return problems
    problem = schema(value)
    return [f"{where} {problem}"] if problem else []


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_document(body: Any, reads: Sequence[int], newest: int) -> None:
    """An AutoparError listing every place where `body` is not a plan this autopar reads."""
    if not isinstance(body, dict):
        raise AutoparError(f"a plan file holds a JSON object; this one holds {_short(body)}. "
                           f"{FIX}")
    version = body.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > newest:
        raise AutoparError(f"this plan is of format {version}, written by a newer autopar; "
                           f"this one reads formats {tuple(reads)}. Fix: upgrade autopar "
                           "(pip install -U autopar), or plan again with this version.")
    if version not in reads:
        raise AutoparError(f"plan format_version {_short(version)} is not one this autopar "
                           f"reads {tuple(reads)}. {FIX}")
    problems = _problems(body, SCHEMA, "")
    mesh = body["mesh"]
    if not problems and len(mesh["axis_names"]) != len(mesh["axis_sizes"]):
        problems.append(f"mesh has {len(mesh['axis_names'])} axis names and "
                        f"{len(mesh['axis_sizes'])} sizes")
    if not problems and len(set(mesh["axis_names"])) != len(mesh["axis_names"]):
        problems.append(f"mesh names an axis twice: {mesh['axis_names']}")
    _raise(problems)


def check_axes(mesh: Sequence[str], tensors: Sequence[tuple[str, tuple[int, ...], Any]]) -> None:
    """Each (where, shape, spec): the spec names axes of `mesh`, each once, on dimensions the
    shape has (a shape of None: any rank)."""
    problems = []
    for where, shape, spec in tensors:
        axes = [a for dim in spec for a in dim]
        unknown = sorted(set(axes) - set(mesh))
        if unknown:
            problems.append(f"{where} splits over {unknown}, not axes of the plan's mesh "
                            f"{tuple(mesh)}")
        elif len(set(axes)) != len(axes):
            problems.append(f"{where} splits over an axis twice: {spec}")
        if shape is not None and len(spec) > len(shape):
            problems.append(f"{where} has {len(spec)} dimensions in its spec, {len(shape)} in "
                            f"its shape {tuple(shape)}")
    _raise(problems)


def _raise(problems: list[str]) -> None:
    if problems:
        shown = "\n".join(f"  - {p}" for p in problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise AutoparError(f"not a valid autopar plan:\n{shown}{more}\n{FIX}")
