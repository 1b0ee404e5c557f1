"""Reading a compiled program: the collectives XLA emitted, with their device groups and how
often they run, and the memory it holds per device.

Each collective instruction of the optimised HLO counts the bytes of its result on one device
(every element of a tuple result: XLA combines collectives into tuple-shaped ones). Async pairs
count once, at their start, by the result part of the start's tuple. An instruction inside a
loop body runs once per iteration where XLA knows the trip count (`known_trip_count`), else
once.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>\(.*?\)|[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\((?P<rest>.*)$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_DEFINITION = re.compile(
    r"^\s*(?P<root>ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*"
    r"(?P<shape>\([^)]*\)|[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<rest>.*)$")
_OPERAND = re.compile(r"%(?P<name>[\w.\-]+)\s*$")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2,
          "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
          "c128": 16}
_HEADER = re.compile(r"^(ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(\(.*\)\s*->\s*.*)?\{\s*$")
_CALLEE = re.compile(r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)"
                     r"=%?(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')
_EXPLICIT_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)=\{(?P<groups>(?:\{[0-9,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<shape>[0-9,]+)\]<=\[(?P<dims>[0-9,]+)\]"
                          r"(?:T\((?P<perm>[0-9,]+)\))?")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<mesh>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?:\[(?P<dims>[0-9,]+)\](?:T\((?P<perm>[0-9,]+)\))?|(?P<ids>[0-9,\s]+))\))?"
    r"\s*\{(?P<axes>[^}]*)\}")


@dataclass(frozen=True)
class HloCollective:
    """One collective instruction of a compiled program."""

    kind: str  # one of KINDS
    result_bytes: int  # bytes of its result on one device (all elements of a tuple)
    groups: tuple[tuple[int, ...], ...] | None  # device ids per group (pairs for a permute);
    #                                             None: one group of every device
    executions: int  # times it runs per step (loop trip counts multiplied)


def array_bytes(shape: str) -> list[int]:
    """Bytes of each array in an HLO shape string (one, or a tuple's elements)."""
    sizes = []
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        sizes.append(n * _BYTES.get(dtype, 4))
    return sizes


def definitions(lines: list[str]) -> list[dict[str, str]]:
    """The instructions among HLO text lines: root (set for a computation's result), name,
    shape, op, args (operand text), rest."""
    return [m.groupdict() for line in lines if (m := _DEFINITION.match(line))]


def array_dims(shape: str) -> list[int]:
    """The first array's dimensions in an HLO shape (a tuple's first element)."""
    found = _ARRAY.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def operand_shape(argument: str, shapes: dict[str, str]) -> str:
    """An operand's shape: written beside it (`f32[2,3]{1,0} %x`) or defined earlier."""
    if "[" in argument:
        return argument
    found = _OPERAND.search(argument.strip())
    return shapes.get(found.group("name"), "") if found else ""


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """XLA's iota device list `[dims]T(perm)`: 0..n-1 laid out as `dims`, then transposed."""
    ids = np.arange(int(np.prod(_ints(dims)))).reshape(_ints(dims))
    return ids.transpose(_ints(perm)) if perm else ids


def device_groups(attributes: str) -> tuple[tuple[int, ...], ...] | None:
    """The device groups of a collective's attributes, in any of XLA's three spellings: lists
    (`{{0,1},{2,3}}`, a permute's pairs too), iota (`[2,4]<=[4,2]T(1,0)`) or mesh axes
    (`mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`, with `device_ids=([2,4]T(1,0))` where the
    devices are not in order). None where every device is one group."""
    if m := _IOTA_GROUPS.search(attributes):
        return tuple(tuple(int(i) for i in row)
                     for row in _iota(m["dims"], m["perm"]).reshape(_ints(m["shape"])))
    if m := _MESH_GROUPS.search(attributes):
        named = re.findall(r"'([^']+)'=(\d+)", m["mesh"])
        names, sizes = [n for n, _ in named], [int(v) for _, v in named]
        chosen = [names.index(a) for a in re.findall(r"'([^']+)'", m["axes"])]
        if m["dims"]:
            devices = _iota(m["dims"], m["perm"]).reshape(sizes)
        elif m["ids"]:
            devices = np.array(_ints(m["ids"].replace(" ", ""))).reshape(sizes)
        else:
            devices = np.arange(int(np.prod(sizes))).reshape(sizes)
        if not chosen:
            return tuple((int(i),) for i in devices.flat)
        rest = [k for k in range(len(sizes)) if k not in chosen]
        ids = devices.transpose(rest + chosen)
        return tuple(tuple(int(i) for i in row)
                     for row in ids.reshape(-1, int(np.prod([sizes[k] for k in chosen]))))
    if m := _EXPLICIT_GROUPS.search(attributes):
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([0-9,]*)\}", m["groups"]))
        return groups or None
    return None


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """The lines of each computation, and the entry's name (text without headers: one entry)."""
    bodies: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if current is None and (m := _HEADER.match(line.strip())) and "=" not in line.split("(")[0]:
            current = m["name"]
            bodies[current] = []
            entry = current if m.group(1) else entry
        elif line.strip() == "}":
            current = None
        elif current is not None:
            bodies[current].append(line)
    if not bodies:
        return {"": hlo_text.splitlines()}, ""
    return bodies, entry or next(reversed(bodies))


def executions(bodies: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How often each computation runs per step: callers' counts times loop trip counts."""
    calls: dict[str, list[tuple[str, int]]] = {name: [] for name in bodies}
    for name, lines in bodies.items():
        for line in lines:
            trips = int(m["n"]) if " while(" in line and (m := _TRIPS.search(line)) else 1
            callees = [c["name"] for c in _CALLEE.finditer(line)]
            for b in _BRANCHES.finditer(line):
                callees += [n.strip().lstrip("%") for n in b["names"].split(",") if n.strip()]
            for callee in callees:
                body = f"body=%{callee}" in line or f"body={callee}" in line
                calls[name].append((callee, trips if body else 1))
    counts: dict[str, int] = {}

    def visit(name: str, times: int) -> None:
        counts[name] = counts.get(name, 0) + times
        for callee, factor in calls.get(name, ()):
            visit(callee, times * factor)

    visit(entry, 1)
    return counts


def collectives(hlo_text: str) -> list[HloCollective]:
    """Every collective instruction of `hlo_text` (optimised HLO, `compiled.as_text()`)."""
    bodies, entry = computations(hlo_text)
    counts = executions(bodies, entry)
    out = []
    for name, lines in bodies.items():
        for line in lines:
            if not (match := _INSTRUCTION.search(line)):
                continue
            sizes = array_bytes(match["shape"])
            if match["start"]:  # (operands..., results...): the second half is the result
                sizes = sizes[len(sizes) // 2:]
            out.append(HloCollective(match["kind"], sum(sizes), device_groups(match["rest"]),
                                     counts.get(name, 1)))
    return out


def collective_bytes(hlo_text: str) -> dict[str, float]:
    """Result bytes on one device of every collective in `hlo_text` per step, by kind."""
    out: dict[str, float] = {}
    for c in collectives(hlo_text):
        out[c.kind] = out.get(c.kind, 0.0) + float(c.result_bytes * c.executions)
    return out


def collective_counts(hlo_text: str) -> dict[str, int]:
    """How many collective instructions of each kind `hlo_text` has (each counted once)."""
    out: dict[str, int] = {}
    for c in collectives(hlo_text):
        out[c.kind] = out.get(c.kind, 0) + 1
    return out


def compiled_memory_bytes(compiled: Any) -> int:
    """Bytes one device holds to run `compiled` (a jax Compiled), as its compiler reports it.
    XLA's CPU compiler: arguments, outputs and temporaries, less the outputs that reuse (alias)
    their donated arguments' buffers (its `peak_memory_in_bytes` is the arguments' size). The
    TPU compiler: `peak_memory_in_bytes`, its own peak of everything live at once (it reports
    no temporaries)."""
    m = compiled.memory_analysis()
    if compiled_platform(compiled) == "tpu":
        return int(m.peak_memory_in_bytes)
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def compiled_platform(compiled: Any) -> str:
    """The platform of the devices `compiled` (a jax Compiled) was built for."""
    for sharding in jax.tree.leaves((compiled.input_shardings, compiled.output_shardings)):
        return next(iter(sharding.device_set)).platform
    return "cpu"
