"""GPipe as a JAX user writes it by hand in plain `jax.jit`, the baseline for autopar's
pipelines.

The loop of the JAX pipelining write-ups and MaxText's pipeline layer, without their
shard_map: MaxText and praxis move the gradient reductions out of the loop by hand (shard_map,
`pcast`), which this baseline does not, so it is the plain-jit user's pipeline, not theirs.
the nn.scan stack's stacked weights [L, ...] reshaped [S, L/S, ...] (split over 'stage' on the
first dimension, so the reshape moves nothing), one stage body vmapped over the stages, a
`lax.scan` of M+S-1 ticks whose state [S, microbatch, ...] is rolled one stage on per tick
(`jnp.roll`, one collective-permute), the first stage fed the next microbatch, the last
stage's outputs collected; embedding and head on the full batch outside. Shardings: the state
in (and out) with the stack's leaves `P('stage')` and the rest replicated, the batch over
'data' (where the mesh has it), the loop's state constrained to `P('stage', 'data')`; XLA propagates everything else,
the gradient reductions included (no shard_map: where they land is XLA's choice).

Stages in the bubble compute on zeros or on stale activations and their outputs are dropped:
the GPT's layers make no NaN of them, so the expert needs no guard.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import models
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def gpipe_step(config: dict, stages: int, microbatches: int, mesh: Mesh,
               tx: optax.GradientTransformation) -> Callable:
    """The hand-written GPipe train step of models.GPT(**config, scan=True):
    step(state, batch) -> (state, loss), the same loss as the model's own step."""
    s, m, layers = stages, microbatches, config["layers"]
    data = "data" if "data" in mesh.axis_names else None
    block = models.Block(config["d_model"], config["heads"])
    embed, norm = nn.Embed(config["vocab"], config["d_model"]), nn.LayerNorm()

    def constrain(x: Any, *spec: Any) -> Any:
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    def stage(weights: Any, h: jax.Array) -> jax.Array:  # this stage's L/S layers in turn
        def layer(h: jax.Array, w: Any) -> tuple[jax.Array, None]:
            return block.apply({"params": w}, h), None
        return jax.lax.scan(layer, h, weights)[0]

    def loss_fn(params: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        p = params["params"]
        x = embed.apply({"params": p["Embed_0"]}, tokens)
        size = x.shape[0]
        # microbatch j: examples j, j+M, ...: each keeps its share of the 'data' split
        micro = jnp.swapaxes(x.reshape(size // m, m, *x.shape[1:]), 0, 1)
        weights = jax.tree_util.tree_map(
            lambda w: w.reshape(s, layers // s, *w.shape[1:]), p["layers"]["Block_0"])
        first = (jnp.arange(s) == 0)[:, None, None, None]

        def tick(state: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
            fed = jnp.where(first, micro[jnp.minimum(t, m - 1)][None], jnp.roll(state, 1, 0))
            state = constrain(jax.vmap(stage)(weights, constrain(fed, "stage", data)),
                              "stage", data)
            return state, state[s - 1]

        start = constrain(jnp.zeros((s, *micro.shape[1:]), x.dtype), "stage", data)
        _, outs = jax.lax.scan(tick, start, jnp.arange(m + s - 1))
        y = jnp.swapaxes(outs[s - 1:], 0, 1).reshape(x.shape)
        y = norm.apply({"params": p["LayerNorm_0"]}, y)
        logits = embed.apply({"params": p["Embed_0"]}, y, method="attend")
        return models.token_loss(logits, targets)

    def step(state: Any, batch: dict) -> tuple[Any, jax.Array]:
        params, opt_state = state
        value, grads = jax.value_and_grad(loss_fn)(params, batch["inputs"], batch["targets"])
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value
    return step


def gpipe_jit(config: dict, stages: int, microbatches: int, mesh: Mesh, state: Any,
              tx: optax.GradientTransformation) -> Any:
    """The jitted expert step: the stack's leaves (parameters and their moments, whose paths
    run through 'layers') split over 'stage', everything else replicated, the batch over
    'data', the state donated."""
    def spec(path: Any, leaf: Any) -> NamedSharding:
        stacked = any(getattr(k, "key", None) == "layers" for k in path) and leaf.ndim > 0
        return NamedSharding(mesh, P("stage") if stacked else P())

    state_shardings = jax.tree_util.tree_map_with_path(spec, state)
    batch = NamedSharding(mesh, P("data" if "data" in mesh.axis_names else None))
    return jax.jit(gpipe_step(config, stages, microbatches, mesh, tx),
                   in_shardings=(state_shardings, batch),
                   out_shardings=(state_shardings, NamedSharding(mesh, P())), donate_argnums=0)
