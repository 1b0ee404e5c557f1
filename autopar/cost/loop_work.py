"""The work of a loop's other trips, read from the optimised HLO.

`extra_trips_work(hlo_text)` takes a compiled program's optimised HLO text. It returns
(flops, bytes accessed) that the trips after the first add per step: n - 1 times the work of
every computation XLA runs n > 1 times (a loop body, and what it calls, with
`known_trip_count`); (0.0, 0.0) where none does. `cost_analysis()` counts a body once, so the
two added give a loop's whole work. Flops are counted as XLA's HloCostAnalysis counts them
(`instruction_flops`); bytes are every operand and result of the body's own instructions
(`shape_bytes`), not those inside a fusion.
Nothing here raises an AutoparError.

Design and rationale: docs/internals-steps.md, "autopar/cost/loop_work.py".
"""
from __future__ import annotations

import math
import re

from autopar.cost.hlo import (array_bytes, array_dims, computations, definitions, executions,
                              operand_shape)
from autopar.cost.xla.gpu import call_flops, convolution_flops

# HloCostAnalysis: an elementwise operation counts one flop per result element (the
# transcendental ones count as transcendentals, not flops).
ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "compare",
    "select", "clamp", "remainder", "and", "or", "xor", "not", "sign", "floor", "ceil",
    "round-nearest-afz", "round-nearest-even"})
# Instructions that move no data of their own.
NO_BYTES = frozenset({"parameter", "get-tuple-element", "tuple", "bitcast", "constant",
                      "while", "conditional", "call", "after-all", "partition-id",
                      "replica-id"})
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{(?P<dims>[0-9,]*)\}")
_INNER = re.compile(r"\b(?:calls|to_apply)=%?(?P<name>[\w.\-]+)")


def shape_bytes(shape: str) -> int:
    """Bytes of every array in an HLO shape (all of a tuple's elements)."""
    return sum(array_bytes(shape))


def instruction_flops(op: str, shape: str, operands: list[list[int]], rest: str) -> float:
    """Flops of one instruction as HloCostAnalysis counts them (0 for what it counts as none)."""
    result = array_dims(shape)
    if op == "dot" and operands:
        found = _CONTRACTING.search(rest)
        dims = [int(d) for d in found["dims"].split(",") if d] if found else []
        return 2.0 * math.prod(result) * math.prod(operands[0][d] for d in dims)
    if op == "convolution" and len(operands) > 1:
        return convolution_flops(result, operands[1], rest)
    if op == "custom-call":
        return call_flops(shape, operands, rest)
    if op in ELEMENTWISE:
        return float(math.prod(result))
    if op == "reduce" and operands:
        return float(math.prod(operands[0]))
    return 0.0


def extra_trips_work(hlo_text: str) -> tuple[float, float]:
    """(flops, bytes accessed) that the trips after the first of every loop add per step."""
    bodies, entry = computations(hlo_text)
    runs = executions(bodies, entry)
    if all(n <= 1 for n in runs.values()):
        return 0.0, 0.0
    parsed = {name: definitions(lines) for name, lines in bodies.items()}
    shapes = {d["name"]: d["shape"] for found in parsed.values() for d in found}
    # a fusion's or a reduction's inner computation runs in registers: no bytes of its own
    inner = {m["name"] for lines in bodies.values() for line in lines
             for m in _INNER.finditer(line)}
    flops = accessed = 0.0
    for name, found in parsed.items():
        more = runs.get(name, 1) - 1
        if more <= 0:
            continue
        for d in found:
            args = [operand_shape(a, shapes) for a in d["args"].split(",") if a.strip()]
            flops += more * instruction_flops(d["op"], d["shape"], [array_dims(a) for a in args],
                                              d["rest"])
            # an asynchronous pair moves its data once, at its start
            if name not in inner and d["op"] not in NO_BYTES and not d["op"].endswith("-done"):
                accessed += more * _accessed(d, args, parsed)
    return flops, accessed


def _accessed(d: dict[str, str], args: list[str], parsed: dict[str, list[dict]]) -> float:
    """Bytes an instruction reads and writes. A slice of a loop's stacked operand reads the
    slice alone, and an update of one in place writes the update alone (the stacked buffer
    itself is not copied), inside a fusion as outside."""
    if d["op"] == "dynamic-slice":
        return 2.0 * shape_bytes(d["shape"])
    if d["op"] == "dynamic-update-slice" and len(args) > 1:
        return 2.0 * shape_bytes(args[1])
    sizes = [float(shape_bytes(a)) for a in args]
    # a library call's result tuple ends in its scratch space, which is not data
    result = float(array_bytes(d["shape"])[0] if d["op"] == "custom-call"
                   else shape_bytes(d["shape"]))
    if d["op"] == "fusion-start":  # (operands, result, context): its result alone is written
        result = float(shape_bytes(d["shape"])) - sum(sizes)
    callee = _INNER.search(d["rest"]) if d["op"] in ("fusion", "fusion-start") else None
    inside = parsed.get(callee["name"], []) if callee else []
    shapes = {i["name"]: i["shape"] for i in inside}
    root = next((u for u in inside if u["root"]), None)
    for i in inside:
        if i["op"] != "parameter":
            continue
        k = int(i["args"])
        users = [u for u in inside if f"%{i['name']}" in
                 [a.strip() for a in u["args"].split(",")]]
        if users and k < len(sizes) and all(
                u["op"] == "dynamic-slice" and u["args"].split(",")[0].strip() == f"%{i['name']}"
                for u in users):
            sizes[k] = sum(shape_bytes(u["shape"]) for u in users)
        if (root is not None and root["op"] == "dynamic-update-slice" and k < len(sizes)
                and root["args"].split(",")[0].strip() == f"%{i['name']}"):
            sizes[k] = 0.0
            result = float(shape_bytes(operand_shape(root["args"].split(",")[1], shapes)))
    return result + sum(sizes)
