"""One tick of the pipeline's loop (gpipe.py): which pass each stage computes, a stage's
layers on its microbatch, the shift of values to the next stage, and the bubble's guard."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from autopar.primitives.stack_read import is_stored, stack_read
from autopar.rewrite.microbatch import run_equations
from autopar.rewrite.separable import Separability
from autopar.trace.jaxpr import open_jaxpr
from autopar.trace.shard import shard

STAGE_AXIS = "stage"


def passes(stages: int, microbatches: int, rounds: int) -> tuple[Any, Any, Any, Any]:
    """Per tick and stage [T, S]: whether the stage computes a pass (not the bubble), the
    pass's microbatch and its round; per tick [T]: whether the first stage takes a new
    microbatch. Stage s computes at tick t the (t-s)-th of the R M passes: microbatch
    (t-s) mod M, in round (t-s) div M."""
    done = (jnp.arange(rounds * microbatches + stages - 1)[:, None]
            - jnp.arange(stages)[None, :])
    held = jnp.clip(done, 0, rounds * microbatches - 1)
    fresh = done[:, 0] < microbatches
    return ((done >= 0) & (done < rounds * microbatches), held % microbatches,
            held // microbatches, fresh)


def stage_step(body: Callable, const_kinds: list, carry_kinds: list, ncarry: int,
               rounds: int = 1) -> Callable:
    """One stage's computation at one tick (of one share): its layers in turn on its
    microbatch (carries with the batch dimension first), the stack's fixed constants `fixed`
    ({position: value}), the streamed ones its microbatch's, `examples` its examples' indices
    in the batch (`body` takes them first); `valid` False in the bubble.
    With `rounds` R > 1 the stage holds R chunks of layers, [R, L/(S R), ...], and runs the
    chunk of the pass's round (`round_index`)."""
    def stage(layers_s: list, fixed: dict, carry_s: list, streamed_s: dict, valid: Any,
              round_index: Any, examples: Any) -> list:
        if rounds > 1:
            layers_s = [jax.lax.dynamic_index_in_dim(x, round_index, 0, keepdims=False)
                        for x in layers_s]
        layers_s = [bubble_cut(x, valid) for x in layers_s]
        carry_s = [bubble_cut(c, valid) for c in carry_s]
        consts_s = [jnp.moveaxis(streamed_s[i], 0, kind.batch) if i in streamed_s
                    else fixed[i] for i, kind in enumerate(const_kinds)]

        def layer(c: list, x: list) -> tuple[list, None]:
            c = [jnp.moveaxis(v, 0, k.batch) for v, k in zip(c, carry_kinds)]
            out = body(examples, *consts_s, *c, *x)[:ncarry]
            return [jnp.moveaxis(v, k.batch, 0) for v, k in zip(out, carry_kinds)], None
        return jax.lax.scan(layer, carry_s, layers_s)[0]
    if rounds > 1:
        return jax.checkpoint(stage, policy=jax.checkpoint_policies.dots_saveable)
    return stage


def drawing_body(eqn: Any, micro: Any, analysis: Separability) -> Callable:
    """The stack's layer at one microbatch, its random draws the full batch's bits at the
    microbatch's examples (a function of those indices, then the layer's operands)."""
    body_f, _ = open_jaxpr(eqn.params["jaxpr"])
    body_m, consts = open_jaxpr(micro.params["jaxpr"])

    def body(examples: Any, *args: Any) -> list:
        return run_equations(body_f, body_m, consts, list(args), analysis, examples=examples,
                             scope=(id(eqn),))
    return body


@jax.custom_vjp
def bubble_cut(x: Any, valid: Any) -> Any:
    """`x` itself, its gradient zero where `valid` is False (a tick of the bubble), whatever
    it is there (a NaN, say). Written as `where(valid, x, stop_gradient(x))`, the forward pass
    makes a new value every tick, and the backward pass keeps each tick's copy of the
    stage's layers, its memory growing with the microbatches (docs/decisions.md, "The
    bubble's guard kept a copy of the layers per tick"); returned as it came in, the layers
    stay one loop constant and the loop keeps only `valid` per tick."""
    return x


def _bubble_cut_forward(x: Any, valid: Any) -> tuple[Any, Any]:
    return x, valid


def _bubble_cut_backward(valid: Any, grad: Any) -> tuple[Any, None]:
    return jnp.where(valid, grad, jnp.zeros_like(grad)), None


bubble_cut.defvjp(_bubble_cut_forward, _bubble_cut_backward)


def stage_layers(x: Any, stages: int, rounds: int, index: int) -> Any:
    """The stack's per-layer input `index`, [L, ...], as each stage holds it: [S, L/S, ...],
    layers s L/S .. of stage s; with R rounds [S, R, L/(S R), ...], chunk r of stage s the
    layers of the (r S + s)-th of the S R consecutive chunks (the circular schedule's
    placement). There its read is marked, for the planning to find whether it may be stored
    in that placement, and where it is (stored.py) it is read as stored."""
    length, rest = x.shape[0], x.shape[1:]
    if rounds > 1:
        x = stack_read(x, index)
    if rounds == 1 or is_stored(index):
        return jnp.reshape(x, (stages, *([rounds] if rounds > 1 else []),
                               length // (stages * rounds), *rest))
    chunks = jnp.reshape(x, (rounds, stages, length // (stages * rounds), *rest))
    return jnp.swapaxes(chunks, 0, 1)


def shift(x: Any) -> Any:
    """Stage s's value moved to stage s+1 (zeros into the first): one pad by (1, -1), which
    XLA compiles to a collective-permute where a concatenation of slices becomes two
    all-to-alls (XLA CPU, jax 0.10.2)."""
    return jax.lax.pad(x, jnp.zeros((), x.dtype), [(1, -1, 0)] + [(0, 0, 0)] * (x.ndim - 1))


def per_stage(x: Any, dim: int = 1) -> Any:
    """`x` with its dimension `dim` (the stages') split over the stage axis, those before it
    whole, and those after it placed by the search: a microbatch's examples (or shares) split
    over 'data' stay so from one tick to the next. (Pinned whole, every tick gathered the
    stages' outputs over 'data' and shifted them whole, moving more bytes between stages:
    docs/decisions.md, "A pipeline's ticks pin the stage dimension alone".)"""
    free = [PartitionSpec.UNCONSTRAINED] * (jnp.ndim(x) - dim - 1)
    return shard(x, PartitionSpec(*[None] * dim, STAGE_AXIS, *free))


def lead_mask(mask: Any, trailing: int) -> Any:
    """`mask` with `trailing` unit dimensions after it, to broadcast against values."""
    return jnp.reshape(mask, (*mask.shape, *[1] * trailing))
