"""Repeated layers: instances of a layer share strategies with the instance two before them.

Instances of a layer are told apart by the numbers in their scope or path (`block_3`,
`Dense_5`, `state/0/params/block_3/...`). Tying every instance to the first one would make the
search see each layer once, but it also forbids plans that alternate between neighbouring
layers: column- then row-split Megatron pairs over a stack of equal Dense layers, where one
all-reduce serves two layers. So instances are tied with period 2: along each number of the
scope, instances of even rank share the first even instance's strategies and instances of odd
rank the first odd one's. The search then sees each distinct layer at most twice per number
that varies, whatever the depth, and every alternating pattern stays reachable.
"""
from __future__ import annotations

import re
from collections import defaultdict

from autopar.trace.ir import OpGraph

TIE_PERIOD = 2  # instances this many ranks apart along a number share their strategies
TIED_SPACE = "plans in which instances of a repeated layer two apart share their strategies"

_NUMBER = re.compile(r"\d+")
_DIGIT = re.compile(r"\d")


def layer_key(text: str) -> str:
    """A scope or path with its numbers blanked: block_3/mlp_in and block_7/mlp_in agree."""
    return _NUMBER.sub("#", text)


def _numbers(text: str) -> tuple[int, ...]:
    return tuple(int(n) for n in _NUMBER.findall(text))


def instance_classes(names: set[str]) -> dict[str, tuple[int, ...]]:
    """name -> its class: for each number in it, the number's rank among the numbers at that
    place in the names of its layer (the same text with numbers blanked), modulo TIE_PERIOD.

    Ranks are numeric (block_10 comes after block_9) and taken per place, so a parameter path
    (state/0/params/Dense_3/kernel, adam's state/1/0/mu/params/Dense_3/kernel) and the scope of
    the layer's operators (MLP/Dense_3) agree on the parity of Dense_3, and nested numbers
    (block_1/LayerNorm_0) alternate along each of them independently.
    """
    by_layer: dict[str, list[str]] = defaultdict(list)
    for name in names:
        by_layer[layer_key(name)].append(name)
    classes = {}
    for members in by_layer.values():
        numbers = {name: _numbers(name) for name in members}
        places = zip(*numbers.values())  # every member of a layer has as many numbers
        ranks = [{v: r for r, v in enumerate(sorted(set(values)))} for values in places]
        for name, nums in numbers.items():
            classes[name] = tuple(rank[v] % TIE_PERIOD for rank, v in zip(ranks, nums))
    return classes


def repeated_ties(graph: OpGraph, units: list) -> dict[int, int]:
    """unit -> the unit whose strategy it takes, for the units of repeated layers.

    Two deciding units are the same operator of two instances of a layer when their primitive,
    pass (forward or backward), scope with numbers blanked, source line, shapes and rule agree,
    and so does their occurrence among such operators within their own instance (the scope with
    its numbers): `dense(tanh(dense(x, w1)), w2)` through one helper holds two such products,
    which are different operators of the layer and never tie to each other. Inputs are the same
    parameter of two instances when their paths agree with numbers blanked and their shapes and
    dtypes agree (block_3/mlp_in/kernel and block_7/mlp_in/kernel). A unit ties to the first
    unit that is the same operator or parameter of an instance of its class (`instance_classes`).
    """
    scopes = {u.op.scope for u in units if u.op is not None and _NUMBER.search(u.op.scope)}
    paths = {graph.tensors[u.outputs[0]].path or "" for u in units if u.op is None}
    scope_class = instance_classes(scopes)
    path_class = instance_classes({p for p in paths if _NUMBER.search(p)})
    first: dict[tuple, int] = {}
    seen: dict[tuple, int] = defaultdict(int)  # (instance, operator kind) -> occurrences so far
    ties = {}
    for u, unit in enumerate(units):
        if unit.op is None:
            t = graph.tensors[unit.outputs[0]]
            path = t.path or ""
            if path not in path_class:
                continue
            key: tuple = ("input", layer_key(path), t.shape, t.dtype, path_class[path])
        else:
            op = unit.op
            if op.scope not in scope_class:
                continue
            kind = (op.primitive, op.backward, layer_key(op.scope), op.source, unit.rule.key,
                    tuple(graph.tensors[t].shape for t in (*op.inputs, *op.outputs)))
            occurrence = seen[(op.scope, kind)]
            seen[(op.scope, kind)] += 1
            key = (*kind, occurrence, scope_class[op.scope])
        if key in first:
            ties[u] = first[key]
        else:
            first[key] = u
    return ties


def instance_of(scope: str) -> str | None:
    """The layer instance an operator belongs to: its scope up to the first part with a number
    (`GPT/block_3` for `GPT/block_3/mlp_in`; its layer is `layer_key` of that); None outside
    numbered layers. An instance is what a plan recomputes and what a compact plan repeats."""
    parts = scope.split("/")
    for k, part in enumerate(parts):
        if _DIGIT.search(part):
            return "/".join(parts[:k + 1])
    return None
