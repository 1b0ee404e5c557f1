"""Lowering a loop (a `scan`) under the plan: a while loop whose every value is pinned.

- `run_loop(lowering, step, values, p)`: the scan's results (carries, then stacked results),
  computed by a `while_loop` over the body's own steps, each constrained as planned, the
  carries and stacking buffers pinned to the plan's specs. A recomputation in the body reads
  values from outside it through one optimization barrier.
- `pinnable_loop(graph, step)`: whether `step` is a scan with a recorded body and no PRNG
  keys among its results.
- `sharded_inside(lowering, step)`: whether the plan splits any value of the loop.
- `remat_inputs(graph, steps)`: what each recomputation reads from outside it.
- `side_results(graph, backward)`: what the backward loop does not need, to be made before it.
lower.py uses `run_loop` only where both hold. Nothing here raises an error of its own.

Design and rationale: docs/internals-planning.md, "autopar/lower_loop.py".
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopar.cost.loop_bodies import LAYOUT_AND_DTYPE
from autopar.trace.analysis import edges
from autopar.trace.ir import OpGraph, Equation
from autopar.trace.tracer import scan_counts

def pinnable_loop(graph: OpGraph, step: Equation) -> bool:
    """Whether `step` is a scan whose body the tracer recorded, without PRNG keys among its
    results."""
    if step.eqn is None or step.eqn.primitive.name != "scan" or not step.outputs:
        return False
    body = graph.loop_bodies.get(step.outputs[0])
    keys = any(jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.extended)
               for v in step.eqn.outvars)  # PRNG keys: no zeros to start their buffers from
    return body is not None and not keys


def sharded_inside(lowering: Any, step: Equation) -> bool:
    """Whether the plan splits any value of the loop `step`: its operands, results or body's.
    A loop kept whole on every device needs no pins, and gets none: they would cut XLA's
    fusions in its body, and with them the float32 that fused bfloat16 arithmetic keeps
    (a bf16 step's state after two steps: 2.3e-2 from the float32 step, pinned, against
    7.5e-3 for jax.jit; jax 0.10.2, XLA CPU)."""
    steps = lowering.graph.loop_bodies[step.outputs[0]][0]
    tensors = {*step.inputs, *step.outputs, *(t for s in steps for t in s.outputs)}
    return any(axes for t in tensors for axes in lowering.produced.get(t) or ())


def run_loop(lowering: Any, step: Equation, values: list, p: dict) -> list:
    """The scan `step`'s results (its carries, then its stacked results) on `values`, its
    operands, computed by a pinned while loop (docs/internals-planning.md). `lowering`: the
    `autopar.lower._Lowering` of the program."""
    graph, spec = lowering.graph, lowering.produced.get
    steps, ids, outs = graph.loop_bodies[step.outputs[0]]
    (nc, ncarry), length = scan_counts(p), p["length"]
    consts, init, xs = values[:nc], values[nc:nc + ncarry], values[nc + ncarry:]
    carry_ids, x_ids = ids[nc:nc + ncarry], ids[nc + ncarry:]
    stacked = step.outputs[ncarry:]
    explicit = [lowering.explicit_of(s) for s in steps]  # reduce-scatters written out
    outside = remat_inputs(graph, steps)
    # how the stacking reads each body result (the body may make it otherwise)
    read_as = {op.outputs[0]: lowering.decisions.ops[op.id].in_specs[0] for op in graph.ops
               if op.primitive == "scan_stack" and op.outputs[0] in stacked}

    def pin(v: Any, s: Any) -> Any:
        return v if s is None else lowering.constrain(v, s)

    def body(state: tuple) -> tuple:
        i, carry, buffers = state
        at = length - 1 - i if p["reverse"] else i
        sliced = [pin(jax.lax.dynamic_index_in_dim(x, at, 0, keepdims=False), spec(t))
                  for x, t in zip(xs, x_ids)]
        env = dict(zip(ids, [*consts, *carry, *sliced]))

        def read(t: int) -> Any:
            return env[t] if t in env else graph.const_values[t]
        barred: dict[int, dict[int, Any]] = {}

        def inside(path: tuple[int, ...], t: int) -> Any:
            """`t` as the recomputation path[-1] reads it: from outside it, through its
            barrier, read as the enclosing recomputation reads it."""
            g = path[-1]
            if t not in outside[g]:
                return read(t)
            if g not in barred:
                held = [inside(path[:-1], u) if len(path) > 1 else read(u) for u in outside[g]]
                barred[g] = {u: lowering.pinned(u, v) for u, v in
                             zip(outside[g], jax.lax.optimization_barrier(held))}
            return barred[g][t]
        for k, s in enumerate(steps):
            reader = functools.partial(inside, s.remat) if s.remat else read
            env.update(zip(s.outputs, lowering.run_step(s, reader, explicit[k], in_loop=True)))
        results = [read(t) for t in outs]
        carry = [pin(v, spec(t)) for v, t in zip(results[:ncarry], carry_ids)]
        buffers = [pin(jax.lax.dynamic_update_index_in_dim(b, pin(v, read_as.get(t)), at, 0),
                       spec(t)) for b, v, t in zip(buffers, results[ncarry:], stacked)]
        return i + 1, carry, buffers

    buffers = [pin(jnp.zeros(graph.tensors[t].shape, np.dtype(v.aval.dtype)), spec(t))
               for t, v in zip(stacked, p["jaxpr"].jaxpr.outvars[ncarry:])]
    start = (0, [pin(v, spec(t)) for v, t in zip(init, carry_ids)], buffers)
    _, carry, buffers = jax.lax.while_loop(lambda state: state[0] < length, body, start)
    return [*carry, *buffers]


def remat_inputs(graph: OpGraph, steps: Sequence[Equation]) -> dict[int, tuple[int, ...]]:
    """remat (Equation.remat) -> the values its steps (of `steps`) read from outside it,
    constants left out."""
    made_by = {t: s for s in steps for t in s.outputs}
    out: dict[int, dict[int, None]] = {}
    for step in steps:
        for g in step.remat:
            reads = out.setdefault(g, {})
            for t in step.inputs:
                maker = made_by.get(t)
                if not graph.tensors[t].const and (maker is None or g not in maker.remat):
                    reads[t] = None
    return {g: tuple(reads) for g, reads in out.items()}


def side_results(graph: OpGraph, backward: frozenset[int]) -> dict[int, tuple[int, ...]]:
    """Loop steps of the backward pass -> the results, made before them, of the steps that the
    loop does not need, read after it (or step outputs): the loss, the weight gradients of
    the layers after the loop's. XLA's scheduler may run such steps after the loop, holding
    their inputs across it: the TPU compiler computed Llama-2-7B's loss (a gather of the f32
    logits, 500 MiB a chip) after the layers' backward loop (docs/decisions.md, "Work the
    backward loop does not need, before it"). Tied to the loop (`_Run.tie`, where the loop
    reads no recomputed value), they run where the program and the memory estimate have
    them."""
    loops = [i for i in sorted(backward) if graph.program[i].eqn is not None
             and graph.program[i].eqn.primitive.name in ("scan", "while")]
    if not loops:  # most steps: nothing to walk at each lowering
        return {}
    made_by, readers = edges(graph)
    last = {t: max(steps) for t, steps in readers.items()}
    last.update({t: len(graph.program) for t in graph.outputs})
    out: dict[int, tuple[int, ...]] = {}
    for i in loops:
        step = graph.program[i]
        needed, todo = set(), [made_by[t] for t in step.inputs if t in made_by]
        while todo:
            j = todo.pop()
            if j not in needed:
                needed.add(j)
                todo += [made_by[t] for t in graph.program[j].inputs if t in made_by]
        side = tuple(t for j in range(i) if j not in needed
                     for t in graph.program[j].outputs if last.get(t, -1) > i)
        side = tuple(dict.fromkeys(side + tuple(_made_from(graph, side, made_by, needed))))
        if side:
            out[i] = side
    return out


def _made_from(graph: OpGraph, values: Sequence[int], made_by: dict[int, int],
               needed: set[int]) -> list[int]:
    """The values that `values` are made from by layout and dtype changes alone, by steps
    the loop does not need: a weight gradient's dot result before its transpose and
    conversion to float32. Given the converted gradient alone, the TPU compiler ran the
    output layer's weight-gradient dot after the loop all the same, holding the logits it
    reads across it (v5p, Llama-2-7B width, libtpu 0.0.42.1: 3,365 -> 3,096 MiB a chip on
    4 layers with the dot's result tied too)."""
    out = []
    for t in values:
        j = made_by.get(t)
        while (j is not None and j not in needed and graph.program[j].eqn is not None
               and graph.program[j].eqn.primitive.name in LAYOUT_AND_DTYPE):
            t = graph.program[j].inputs[0]
            out.append(t)
            j = made_by.get(t)
    return out
