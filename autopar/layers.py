"""Repeated layers: every instance of a layer takes the first instance's strategies."""
from __future__ import annotations

import re

from autopar.ir import OpGraph


def layer_key(text: str) -> str:
    """A scope or path with its numbers blanked: block_3/mlp_in and block_7/mlp_in agree."""
    return re.sub(r"\d+", "#", text)


def repeated_ties(graph: OpGraph, units: list) -> dict[int, int]:
    """unit -> the first unit of its kind, for the units of repeated layers.

    Two deciding units are of one kind when their primitive, pass (forward or backward), layer
    scope with numbers blanked, source line, shapes and rule agree: the same operator of another
    instance of a layer. Inputs are of one kind when their paths agree with numbers blanked and
    their shapes and dtypes agree (block_3/mlp_in/kernel and block_7/mlp_in/kernel). A unit of a
    kind seen before takes the first one's strategy, so the search sees each layer once.
    """
    first: dict[tuple, int] = {}
    ties = {}
    for u, unit in enumerate(units):
        if unit.op is None:
            t = graph.tensors[unit.outputs[0]]
            key: tuple = ("input", layer_key(t.path or ""), t.shape, t.dtype)
            if not re.search(r"\d", t.path or ""):
                continue
        else:
            op = unit.op
            if not op.scope or not re.search(r"\d", op.scope):
                continue
            key = (op.primitive, op.backward, layer_key(op.scope), op.source, unit.rule.key,
                   tuple(graph.tensors[t].shape for t in (*op.inputs, *op.outputs)))
        if key in first:
            ties[u] = first[key]
        else:
            first[key] = u
    return ties
