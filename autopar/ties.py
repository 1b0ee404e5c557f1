"""Backward operators take their forward operator's strategy.

JAX's transposition keeps the name stack and source line of the operator it differentiates:
`transpose(jvp(GPT))/block_0/mlp_in` is the backward of `jvp(GPT)/block_0/mlp_in`. The two
backward dot_generals of a dense layer (input gradient, weight gradient) then use the forward's
mesh axes on the same factors (batch, input and output features), which is what every
hand-written plan does (Megatron's backward all-reduce, data parallel's gradient all-reduce) and
what MindSpore does by planning the forward graph only. Tying them keeps forward and backward in
one search node, so the graph stays close to the forward graph's elimination width.
"""
from __future__ import annotations

import itertools
import re
from collections import defaultdict

from autopar.ir import OpGraph
from autopar.rules.factors import Rule

TIED = {"dot_general", "conv_general_dilated"}


def factor_map(backward: Rule, b_inputs: tuple[int, ...], forward: Rule,
               f_inputs: tuple[int, ...]) -> dict[str, str] | None:
    """Backward factor -> forward factor of the same size, such that every backward tensor
    (operand or result) covers exactly the factors of one forward tensor; operands that are the
    very tensor the forward consumed should keep their dimensions' factors. None if no mapping
    exists."""
    b_factors = sorted(backward.sizes)
    f_tensors = [frozenset(f for f in dims if f) for dims in (*forward.operands, *forward.results)]
    b_tensors = [[f for f in dims if f] for dims in (*backward.operands, *backward.results)]
    options = [[g for g in forward.sizes if forward.sizes[g] == backward.sizes[f]]
               for f in b_factors]
    best, best_score, count = None, -1, 0
    for image in itertools.product(*options):
        if len(set(image)) != len(image):
            continue
        count += 1
        if count > 5000:
            break  # a rule this large does not come from one layer: leave it untied
        mapping = dict(zip(b_factors, image))
        if any(frozenset(mapping[f] for f in t) not in f_tensors for t in b_tensors):
            continue
        score = sum(1 for i, t in enumerate(b_inputs) for j, u in enumerate(f_inputs)
                    if t == u and all(mapping.get(bf) == ff for bf, ff in
                                      zip(backward.operands[i], forward.operands[j]) if bf))
        if score > best_score:
            best, best_score = mapping, score
    return best


def backward_ties(graph: OpGraph, rules: dict[int, Rule]) -> dict[int, tuple[int, dict[str, str]]]:
    """op id of a backward dot/conv -> (op id of its forward, factor mapping).

    Only unambiguous pairs: exactly one forward operator of that primitive, scope and source line
    (a Python loop that calls one function for every layer, with no named scopes, stays untied).
    """
    forwards: dict[tuple, list[int]] = defaultdict(list)
    for op in graph.ops:
        if op.primitive in TIED and not op.backward and op.scope:
            forwards[(op.primitive, op.scope, op.source)].append(op.id)
    ties = {}
    for op in graph.ops:
        if op.primitive not in TIED or not op.backward or op.id not in rules:
            continue
        match = forwards.get((op.primitive, op.scope, op.source), [])
        if len(match) != 1 or match[0] not in rules:
            continue
        forward = graph.ops[match[0]]
        mapping = factor_map(rules[op.id], op.inputs, rules[forward.id], forward.inputs)
        if mapping is not None:
            ties[op.id] = (forward.id, mapping)
    return ties


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
