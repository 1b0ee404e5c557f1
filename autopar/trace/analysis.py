"""What the program alone says, asked of one traced graph under every plan tried: its data
flow, the kind of each value, the backward pass's steps and the layers a plan may recompute.

Each fact is computed once per graph and kept on the graph object (`per_graph`), so that it
lives exactly as long as the planning call that traced it.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable, TypeVar

from autopar.trace.ir import OpGraph
from autopar.trace.layers import instance_of

T = TypeVar("T")


def per_graph(fact: Callable[..., T]) -> Callable[..., T]:
    """Cache `fact(graph, *args)` on the graph object: computed once per traced graph (a memory
    budget estimates one graph under many plans) and freed with it."""
    @functools.wraps(fact)
    def cached(graph: OpGraph, *args: object) -> T:
        memo = graph.__dict__.setdefault("_facts", {})
        key = (fact.__module__, fact.__name__, *args)
        if key not in memo:
            memo[key] = fact(graph, *args)
        return memo[key]
    return cached


@per_graph
def edges(graph: OpGraph) -> tuple[dict[int, int], dict[int, list[int]]]:
    """Each value's producing program step, and the steps that read it."""
    producer_step = {t: i for i, step in enumerate(graph.program) for t in step.outputs}
    readers: dict[int, list[int]] = {}
    for i, step in enumerate(graph.program):
        for t in set(step.inputs):
            readers.setdefault(t, []).append(i)
    return producer_step, readers


@per_graph
def ancestors(graph: OpGraph) -> list[int]:
    """Per program step, the steps it depends on, as a bit set."""
    producer_step = edges(graph)[0]
    out: list[int] = []
    for step in graph.program:
        bits = 0
        for t in step.inputs:
            p = producer_step.get(t)
            if p is not None:
                bits |= out[p] | 1 << p
        out.append(bits)
    return out


@per_graph
def roles(graph: OpGraph) -> dict[int, str]:
    """The kind of every input, and of the intermediates that are activations or gradients.

    State inputs read before the backward pass begins are parameters; other state inputs (read
    only by the update) are optimizer state. Results of the forward pass that the backward pass
    reads are activations; results of the backward pass read after it are gradients.
    """
    backward = [op.id for op in graph.ops if op.backward]
    first_bwd = backward[0] if backward else len(graph.ops)
    last_bwd = backward[-1] if backward else -1
    state = set(graph.state_pairs.values())
    read_forward: set[int] = set()
    read_backward: set[int] = set()
    read_after: set[int] = set()
    for op in graph.ops:
        if op.backward:
            read_backward.update(op.inputs)
        elif op.id < first_bwd:
            read_forward.update(op.inputs)
        elif op.id > last_bwd:
            read_after.update(op.inputs)
    out: dict[int, str] = {}
    for k, t in enumerate(graph.inputs):
        out[t] = ("other_inputs" if k not in state else
                  "parameters" if t in read_forward else "optimizer_state")
    for op in graph.ops:
        for t in op.outputs:
            if op.backward and t in read_after:
                out[t] = "gradients"
            elif not op.backward and op.id < first_bwd and t in read_backward:
                out[t] = "activations"
    return out


@per_graph  # read by every tally and estimate of a plan with recomputed layers
def producers(graph: OpGraph) -> dict[int, tuple[int, int]]:
    """graph.producers(), made once per graph; read it, never write it."""
    return graph.producers()


@per_graph
def backward_steps(graph: OpGraph) -> frozenset[int]:
    """Program steps that belong to the backward pass."""
    producer = producers(graph)
    out = set()
    for i, step in enumerate(graph.program):
        ops = [graph.ops[producer[t][0]] for t in step.outputs if t in producer]
        if ops and ops[0].backward:
            out.add(i)
    return frozenset(out)


@per_graph
def layer_steps(graph: OpGraph) -> dict[str, tuple[int, ...]]:
    """The forward program steps of every layer that can be recomputed: plain equations (not
    loops) before the backward pass, in a numbered scope."""
    producer = producers(graph)
    backward = backward_steps(graph)
    first_bwd = min(backward, default=len(graph.program))
    out: dict[str, list[int]] = {}
    for i, step in enumerate(graph.program[:first_bwd]):
        if step.eqn is None or step.eqn.primitive.name in ("scan", "while", "cond"):
            continue
        ops = [graph.ops[producer[t][0]] for t in step.outputs if t in producer]
        layer = instance_of(ops[0].scope) if ops else None
        if layer is not None:
            out.setdefault(layer, []).append(i)
    return {name: tuple(steps) for name, steps in out.items()}


def recomputed_layer_of(graph: OpGraph, steps: Iterable[int]) -> dict[int, str]:
    """The layer of each recomputed program step (nothing to walk when none is)."""
    steps = set(steps)
    if not steps:
        return {}
    return {i: name for name, ids in layer_steps(graph).items() for i in ids if i in steps}


def recomputed_ops(graph: OpGraph, steps: Iterable[int]) -> set[int]:
    """The planning ops of the recomputed program steps."""
    steps = set(steps)
    if not steps:
        return set()
    producer = producers(graph)
    return {producer[t][0] for i in steps for t in graph.program[i].outputs if t in producer}


def recomputed_layers(graph: OpGraph, steps: Iterable[int]) -> tuple[str, ...]:
    """The recomputed layers, in program order."""
    return tuple(dict.fromkeys(recomputed_layer_of(graph, steps).values()))
