"""Reading a compiled program: the collectives XLA emitted, in bytes per device, and the
memory it holds per device.

Each collective instruction of the optimised HLO counts the bytes of its result on one device
(every element of a tuple result: XLA combines collectives into tuple-shaped ones). Async pairs
count once, at their start, by the result part of the start's tuple. Instructions inside loop
bodies count once, not per iteration.
"""
from __future__ import annotations

import re
from typing import Any

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>\(.*?\)|[a-z][a-z0-9]*\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2,
          "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
          "c128": 16}


def array_bytes(shape: str) -> list[int]:
    """Bytes of each array in an HLO shape string (one, or a tuple's elements)."""
    sizes = []
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        sizes.append(n * _BYTES.get(dtype, 4))
    return sizes


def collective_bytes(hlo_text: str) -> dict[str, float]:
    """Result bytes on one device of every collective in `hlo_text`, summed by kind."""
    out: dict[str, float] = {}
    for match in _INSTRUCTION.finditer(hlo_text):
        sizes = array_bytes(match["shape"])
        if match["start"]:  # (operands..., results...): the second half is the result
            sizes = sizes[len(sizes) // 2:]
        out[match["kind"]] = out.get(match["kind"], 0.0) + float(sum(sizes))
    return out


def collective_counts(hlo_text: str) -> dict[str, int]:
    """How many collective instructions of each kind `hlo_text` has."""
    out: dict[str, int] = {}
    for match in _INSTRUCTION.finditer(hlo_text):
        out[match["kind"]] = out.get(match["kind"], 0) + 1
    return out


def compiled_memory_bytes(compiled: Any) -> int:
    """Bytes one device holds to run `compiled` (a jax Compiled): arguments, outputs and
    temporaries, less the outputs that reuse (alias) their donated arguments' buffers.
    Not `peak_memory_in_bytes`: XLA's CPU compiler reports the arguments' size there."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)
