"""Pipeline parallelism: the loss's layer stack run as S stages over M microbatches (GPipe).

- `check_pipeline(pipeline, microbatches, mesh, rounds=1)` raises an AutoparError unless
  `pipeline` is "auto" or the size S of the mesh's `stage` axis, M >= 2 where S > 1, and
  `rounds` R is a positive int, above 1 only with S > 1 and M >= S.
- `pipelined_value_and_grad(full, probe, ...)`: the loss's outputs and gradient, its layer
  stack pipelined. The stack (a loop over layers) must have a length S x R divides, keep
  examples apart, carry only per-example values and leave its per-layer outputs unused; the
  rest of the loss must be a sum over microbatches. Else: an AutoparError naming the
  operation.

Design and rationale: docs/internals-steps.md, "autopar/rewrite/gpipe.py".
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import Literal, jaxpr_as_fun
from jax.sharding import PartitionSpec

from autopar.errors import AutoparError
from autopar.primitives.rotate import rotate
from autopar.rewrite.batches import regroup, strided, unstrided
from autopar.rewrite.blocks import chain, find_blocks, hoisted, rolled
from autopar.rewrite.separable import Separability
from autopar.rewrite.ticks import (STAGE_AXIS, drawing_body, lead_mask, passes, per_stage,
                                    shift, stage_layers, stage_step)
from autopar.trace.jaxpr import bind_equation, eqn_source
from autopar.trace.shard import shard
from autopar.trace.tracer import scan_counts



def check_pipeline(pipeline: int | str, microbatches: int | str, mesh: Any,
                   rounds: int = 1) -> None:
    """An AutoparError unless `pipeline` is "auto" (planning/schedules.py) or a stage count that
    `mesh` (a Mesh, a dict of axis sizes; a device count has no 'stage' axis) has as its
    'stage' axis, with an int `microbatches` of at least 2 where it is more than 1, and
    `rounds` (the circular schedule's, the option pipeline_repeats) a positive int, more than
    1 only with stages and at least as many microbatches as stages."""
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise AutoparError(f"pipeline_repeats={rounds!r}: a count of rounds through the stages "
                           "is needed (1: GPipe's one round).")
    if pipeline == "auto":
        return
    if not isinstance(pipeline, int) or isinstance(pipeline, bool) or pipeline < 1:
        raise AutoparError(f"pipeline={pipeline!r}: a stage count is needed (1: no pipeline), "
                           "or 'auto' (the schedule chosen with the plan).")
    if pipeline == 1:
        if rounds > 1:
            raise AutoparError(f"pipeline_repeats={rounds} sends microbatches round the "
                               "stages, and there is no pipeline. Fix: pass pipeline=S too.")
        return
    if not isinstance(microbatches, int) or microbatches < 2:
        raise AutoparError(
            f"pipeline={pipeline} streams microbatches through the stages, and microbatches="
            f"{microbatches!r} was given. Fix: pass microbatches=M, M >= 2 (the bubble is "
            f"(S-1)/(M+S-1) of each stage's time: M = {4 * pipeline} leaves "
            f"{(pipeline - 1) / (5 * pipeline - 1):.0%}).")
    _check_rounds(pipeline, microbatches, rounds)
    sizes = (dict(mesh.shape) if hasattr(mesh, "shape") and hasattr(mesh, "axis_names")
             else dict(mesh) if isinstance(mesh, dict) else {})
    if sizes.get(STAGE_AXIS) != pipeline:
        raise AutoparError(
            f"pipeline={pipeline} splits the layers over a mesh axis named {STAGE_AXIS!r} of "
            f"size {pipeline}, and the mesh is {sizes or mesh!r}. Fix: make the mesh with it, "
            f"e.g. autopar.make_mesh({{{STAGE_AXIS!r}: {pipeline}, 'data': ...}}); put it "
            "first, as the slowest links.")


def _check_rounds(stages: int, microbatches: int, rounds: int) -> None:
    if rounds > 1 and microbatches < stages:
        raise AutoparError(
            f"pipeline_repeats={rounds} sends each microbatch back to the first of {stages} "
            f"stages when it leaves the last, which needs at least as many microbatches as "
            f"stages, and microbatches={microbatches}. Fix: microbatches={stages} or more.")


def pipelined_value_and_grad(full: Any, probe: Any, parts: int, diff: list[int], out_tree: Any,
                             args: tuple, argnums: int | Sequence[int], options: dict,
                             stages: int, microbatches: int, shares: int = 1,
                             rounds: int = 1) -> Any:
    """The loss's value and gradient, its layer stack pipelined (docs/internals-steps.md).
    `full`, `probe`: the loss's jaxprs at the full batch and at one of its `parts`
    (`microbatches` x `shares`); `diff`: the differentiated leaves; `shares`: shares per
    microbatch (see `_pipeline`); `rounds`: the circular schedule's rounds through the
    stages."""
    _check_rounds(stages, microbatches, rounds)  # pipeline="auto" with microbatches given
    analysis, full, stack = _stack_of(full, probe, parts, diff, stages, rounds)
    flat = jax.tree_util.tree_leaves(args)
    diff = analysis.diff_leaves

    def loss(*diff_values: Any) -> tuple[Any, list]:
        leaves = list(flat)
        for k, v in zip(diff, diff_values):
            leaves[k] = v

        def run_stack(values: list) -> list:
            kinds, micro = analysis.loops[(id(stack),)]
            return _pipeline(stack, micro, kinds, values, stages, microbatches, shares,
                             rounds, analysis)
        outs = _evaluate(full.jaxpr, list(full.consts), leaves, stack, run_stack)
        return outs[0], outs

    (_, outs), grads = jax.value_and_grad(loss, argnums=tuple(range(len(diff))), has_aux=True,
                                          **options)(*[flat[k] for k in diff])
    return jax.tree_util.tree_unflatten(out_tree, outs), regroup(grads, args, argnums)


def _stack_of(full: Any, probe: Any, parts: int, diff: list[int], stages: int,
              rounds: int) -> tuple[Separability, Any, Any]:
    """(the loss's separability, its jaxpr, its layer stack): a loop over layers where the loss
    has one that can be pipelined, else its run of repeated layers (a Python loop of blocks)
    re-traced as one loop (blocks.py)."""
    analysis = Separability(full, probe, parts, diff)
    try:
        return analysis, full, _find_stack(analysis, full, stages, rounds)
    except AutoparError:
        full, probe = hoisted(full), hoisted(probe)
        found = find_blocks(full.jaxpr)
        at_microbatch = found and chain(probe.jaxpr, found.start, found.period, found.count)
        if not at_microbatch:
            raise
    full, probe = rolled(full, found), rolled(probe, at_microbatch)
    analysis = Separability(full, probe, parts, diff)
    return analysis, full, _find_stack(analysis, full, stages, rounds)


def _find_stack(analysis: Separability, full: Any, stages: int, rounds: int = 1) -> Any:
    """The loss's layer stack: its longest loop that keeps examples apart, carries only
    per-example values and whose length `stages` x `rounds` divides."""
    chunks = stages * rounds
    # the message names the option's count as pipeline_repeats= does
    what = f"{stages} stages" + (f" x {rounds} repeats" if rounds > 1 else "")
    used_later = _used_after(full.jaxpr)
    found, why = [], []
    for eqn in full.jaxpr.eqns:
        if eqn.primitive.name != "scan":
            continue
        p = eqn.params
        length, (nc, ncarry) = p["length"], scan_counts(p)
        kinds = analysis.loops.get((id(eqn),), (None,))[0]
        where = f"the loop of {length} at {eqn_source(eqn)}"
        if kinds is None:
            why.append(f"{where} mixes examples")
        elif length % chunks:
            why.append(f"{where}: {what} do not divide {length} layers")
        elif any(k.batch is None for k in kinds[nc:nc + ncarry]):
            why.append(f"{where} carries a value without the batch dimension")
        elif any(k.batch is not None for k in kinds[nc + ncarry:]):
            why.append(f"{where} loops over per-example values")
        elif any(id(v) in used_later for v in eqn.outvars[ncarry:]):
            why.append(f"{where} has per-layer outputs the loss uses")
        else:
            found.append((length * len(p["jaxpr"].jaxpr.eqns), eqn))
    if not found:
        raise AutoparError(
            f"pipeline={stages} runs the loss's stack of layers as {stages} stages, and the "
            "loss has no stack autopar can pipeline" + (f" ({'; '.join(why)})" if why else
                                                          " (no loop over layers)") +
            f". Fix: a stack of layers whose count {chunks} divides, each layer reading the "
            "previous one's output and its own weights: a Python loop of blocks, an nn.scan "
            "(or lax.scan over stacked weights); or train without pipeline=.")
    return max(found, key=lambda f: f[0])[1]


def _pipeline(eqn: Any, micro: Any, kinds: list, values: list, stages: int,
              microbatches: int, shares: int = 1, rounds: int = 1,
              analysis: Separability | None = None) -> list:
    """The stack equation's outputs, computed by the pipeline (`micro`: the equation traced
    at one microbatch, or one share of one, whose body each stage runs).

    With `shares` G > 1 every stage computes its microbatch as G shares side by side (vmapped),
    as gradient accumulation does (accumulate.py): share g holds what the g-th of G device
    groups keeps of the batch, and uses its own copy of the stage's layers and of the stack's
    constants, broadcast [S, G, ...] before the loop. A copy's gradient is then that share's
    alone, so the loop carries per-share sums that need no reduction, and the broadcast's
    transpose adds the shares once, after the loop: stage-local data parallelism with the
    gradient reduced once per step, not once per tick.

    Where the layers draw random bits (dropout), each stage draws its microbatch's examples'
    bits of the full batch's draw (draws.py): the examples' indices are streamed to the
    stages with their microbatches."""
    p = eqn.params
    nc, ncarry = scan_counts(p)
    s, m, g, r = stages, microbatches, shares, rounds
    draws = analysis is not None and analysis.actions.get((id(eqn),)) == ("loop_draws",)
    plain = jaxpr_as_fun(micro.params["jaxpr"])
    body = (drawing_body(eqn, micro, analysis) if draws
            else lambda examples, *args: plain(*args))
    consts, carry, xs = values[:nc], values[nc:nc + ncarry], values[nc + ncarry:]
    const_kinds, carry_kinds = kinds[:nc], kinds[nc:nc + ncarry]
    size = jnp.shape(carry[0])[carry_kinds[0].batch]

    def micro(v: Any, batch: int) -> Any:  # [.., B, ..] -> [M, (G,) B/(M G), ..]
        return strided(jnp.moveaxis(v, batch, 0), m, g)

    def copies(x: Any, lead: int) -> Any:  # one per share, after the `lead` dimensions
        shape = jnp.shape(x)
        return x if g == 1 else jnp.broadcast_to(
            jnp.expand_dims(x, lead), (*shape[:lead], g, *shape[lead:]))

    layers = [shard(copies(stage_layers(x, s, r, i), 1), PartitionSpec(STAGE_AXIS))
              for i, x in enumerate(xs)]
    inputs = [micro(c, k.batch) for c, k in zip(carry, carry_kinds)]
    streamed = {i: micro(c, k.batch) for i, (c, k) in enumerate(zip(consts, const_kinds))
                if k.batch is not None}
    # the examples' indices [M, (G,) B/(M G)], for the layers' draws only (None: no input)
    examples = strided(jnp.arange(size, dtype=jnp.int32), m, g) if draws else None
    fixed = {i: copies(c, 0) for i, c in enumerate(consts) if i not in streamed}
    stage = stage_step(body, const_kinds, carry_kinds, ncarry, r)
    if g > 1:
        stage = jax.vmap(stage, in_axes=(0, 0, 0, 0, None, None, 0))

    outputs = _loop(stage, layers, fixed, inputs, streamed, examples, s, m, r)
    # The last stage's outputs at the last M ticks (the last round's microbatches 0 .. M-1, in
    # order), taken by a sum over the stages masked to the last: an all-reduce of one stage's
    # outputs, where indexing the split dimension gathers every stage's.
    last = jnp.arange(s) == s - 1
    outs = [jnp.moveaxis(unstrided(jnp.sum(jnp.where(lead_mask(last, y.ndim - 2), y[-m:],
                                                     0), axis=1), size, g), 0, k.batch)
            for y, k in zip(outputs, carry_kinds)]
    unused = [jnp.zeros(v.aval.shape, v.aval.dtype) for v in eqn.outvars[ncarry:]]
    return outs + unused


def _loop(stage: Callable, layers: list, fixed: dict, inputs: list, streamed: dict,
          examples: Any, s: int, m: int, r: int) -> list:
    """The loop of R M + S - 1 ticks: each tick every stage runs `stage` on what the stage
    before it computed the tick before (the first stage on a new microbatch of `inputs`);
    each stage's outputs per tick, [T, S, ...]."""
    stage_ids = jnp.arange(s)
    # Per tick and stage, [T, S, ...] split over the stage axis, laid out before the loop:
    # the first stage's input (zeros elsewhere) and the streamed constants of the microbatch
    # each stage computes. Inside the loop each stage reads its own (no collective), and the
    # gradient of the first stage's inputs leaves the loop as one [T, S, ...] value.
    valid, index, round_index, fresh = passes(s, m, r)
    first = [per_stage(jnp.where(lead_mask(stage_ids == 0, x.ndim - 1), x[index], 0))
             for x in inputs]
    streamed_xs = {i: per_stage(v[index]) for i, v in streamed.items()}
    examples_xs = None if examples is None else per_stage(examples[index])
    delay = m - s  # ticks a pass waits between the last stage and the first's next round

    def tick(carried: tuple, xs: tuple) -> tuple[tuple, list]:
        state, waiting = carried
        first_t, streamed_t, valid_t, round_t, fresh_t, examples_t = xs
        if r > 1:  # round the stages: the last stage's output reaches the first, which
            moved = [per_stage(rotate(x), 0) for x in state]  # takes it `delay` ticks later
            back = [w[:, 0] for w in waiting] if delay else moved
            waiting = [jnp.concatenate([w[:, 1:], v[:, None]], axis=1)
                       for w, v in zip(waiting, moved)] if delay else waiting
            first_t = [jnp.where(fresh_t, f, b) for f, b in zip(first_t, back)]
        else:
            moved = [shift(x) for x in state]
        shifted = [jnp.where(lead_mask(stage_ids == 0, f.ndim - 1), f, x)
                   for f, x in zip(first_t, moved)]
        new = jax.vmap(stage, in_axes=(0, None, 0, 0, 0, 0, 0))(
            layers, fixed, [per_stage(x, 0) for x in shifted], streamed_t, valid_t, round_t,
            examples_t)
        new = [per_stage(x, 0) for x in new]
        return (new, waiting), new

    state = [per_stage(jnp.zeros((s, *x.shape[1:]), x.dtype), 0) for x in inputs]
    waiting = [per_stage(jnp.zeros((s, delay, *x.shape[1:]), x.dtype), 0) for x in inputs
               ] if r > 1 and delay else []
    return jax.lax.scan(tick, (state, waiting),
                        (first, streamed_xs, valid, round_index, fresh, examples_xs))[1]


def _evaluate(jaxpr: Any, consts: list, args: list, stack: Any, run_stack: Callable) -> list:
    """`jaxpr` evaluated equation by equation, `stack`'s outputs from `run_stack`."""
    env = dict(zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args]))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        outs = run_stack(values) if eqn is stack else bind_equation(eqn, values)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _used_after(jaxpr: Any) -> set[int]:
    """The ids of the variables some equation or the output reads."""
    used = {id(v) for v in jaxpr.outvars if not isinstance(v, Literal)}
    for eqn in jaxpr.eqns:
        used |= {id(v) for v in eqn.invars if not isinstance(v, Literal)}
    return used
