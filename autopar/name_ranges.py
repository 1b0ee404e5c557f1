"""Names that differ only in their numbers, written as one pattern: block_{0..2}/x.

A plan's JSON and its summary list a layer stack's inputs and decisions once per pattern
rather than once per layer; `expand` gives back exactly the names a pattern stands for.
"""
from __future__ import annotations

import itertools
import math
import re
from collections import defaultdict
from typing import Sequence

from autopar.trace.layers import layer_key

_NUMBER = re.compile(r"(\d+)")
_RANGES = re.compile(r"\{(\d+(?:\.\.\d+)?(?:,\d+(?:\.\.\d+)?)*)\}")


def collapse(names: Sequence[str]) -> list[str]:
    """Names that differ only in their numbers as few patterns: block_0/x, block_1/x,
    block_2/x -> block_{0..2}/x. Each pattern stands for exactly the names it expands to."""
    groups: dict[str, list[list[str]]] = defaultdict(list)
    for name in names:
        groups[layer_key(name)].append(_NUMBER.split(name))
    out = []
    for pieces in groups.values():
        numbers = [p[1::2] for p in pieces]
        if len(pieces) == 1 or any(str(int(n)) != n for ns in numbers for n in ns):
            out += ["".join(p) for p in pieces]  # zero-padded numbers would not expand back
            continue
        varying = [k for k in range(len(numbers[0])) if len({ns[k] for ns in numbers}) > 1]
        subsets: dict[tuple, list[list[str]]] = defaultdict(list)
        full = math.prod(len({ns[k] for ns in numbers}) for k in varying)
        for p, ns in zip(pieces, numbers):  # all varying places as one product, else the last
            fixed = () if full == len(pieces) else tuple(ns[k] for k in varying[:-1])
            subsets[fixed].append(p)
        for members in subsets.values():
            pattern = list(members[0])
            for k in range(len(numbers[0])):
                values = sorted({int(m[1 + 2 * k]) for m in members})
                if len(values) > 1:
                    pattern[1 + 2 * k] = "{" + _ranges(values) + "}"
            out.append("".join(pattern))
    return out


def _ranges(values: list[int]) -> str:
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ",".join(f"{r[0]}..{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)


def expand(pattern: str) -> list[str]:
    """The names a `collapse` pattern stands for."""
    parts = _RANGES.split(pattern)
    choices = []
    for k, part in enumerate(parts):
        if k % 2 == 0:
            choices.append([part])
            continue
        values = []
        for item in part.split(","):
            lo, _, hi = item.partition("..")
            values += [str(v) for v in range(int(lo), int(hi or lo) + 1)]
        choices.append(values)
    return ["".join(c) for c in itertools.product(*choices)]
