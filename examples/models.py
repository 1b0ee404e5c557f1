"""Small models and their train steps, shared by the example, the tests and the benchmarks.

Each `*_setup` returns (step, state, batch): an ordinary single-device train step
`step(state, batch) -> (new_state, loss)` with adamw, and concrete inputs for it.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx


class MLP(nn.Module):
    hidden: int = 64
    out: int = 16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(self.out)(x)


class Block(nn.Module):
    d_model: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.heads)(y, y, mask=mask)
        x = x + y
        y = nn.LayerNorm()(x)
        y = nn.Dense(4 * self.d_model, name="mlp_in")(y)
        y = nn.Dense(self.d_model, name="mlp_out")(nn.gelu(y))
        return x + y


class ScanBlock(nn.Module):
    """Block with the (carry, x) -> (carry, y) signature nn.scan wants."""

    d_model: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
        return Block(self.d_model, self.heads)(x), None


class GPT(nn.Module):
    """A decoder-only transformer: tied embedding, causal attention, pre-LayerNorm."""

    vocab: int = 64
    d_model: int = 32
    heads: int = 4
    layers: int = 2
    scan: bool = False  # layers as one nn.scan over stacked parameters

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.d_model)
        x = embed(tokens)
        if self.scan:
            stack = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=self.layers)
            x, _ = stack(self.d_model, self.heads, name="layers")(x, None)
        else:
            for i in range(self.layers):
                x = Block(self.d_model, self.heads, name=f"block_{i}")(x)
        return embed.attend(nn.LayerNorm()(x))


def linen_step(model: nn.Module, loss: Callable, tx: optax.GradientTransformation,
               value_and_grad: Callable = jax.value_and_grad) -> Callable:
    """The usual train step of a linen model: value_and_grad (jax's, or autopar's to
    accumulate over microbatches), then an optax update."""
    def step(state, batch):
        params, opt_state = state

        def loss_fn(p):
            return loss(model.apply(p, batch["inputs"]), batch["targets"])

        value, grads = value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value
    return step


def token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def mse(pred: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.mean((pred - targets) ** 2)


def gpt_setup(batch: int = 8, seq: int = 16, seed: int = 0, learning_rate: float = 1e-3,
              **config: Any):
    model = GPT(**config)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    tokens = jax.random.randint(k1, (batch, seq), 0, model.vocab)
    targets = jax.random.randint(k2, (batch, seq), 0, model.vocab)
    params = model.init(k3, tokens)
    tx = optax.adamw(learning_rate)
    state = (params, tx.init(params))
    return linen_step(model, token_loss, tx), state, {"inputs": tokens, "targets": targets}


def mlp_setup(batch: int = 32, features: int = 24, seed: int = 0, learning_rate: float = 1e-3,
              **config: Any):
    model = MLP(**config)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(k1, (batch, features))
    y = jax.random.normal(k2, (batch, model.out))
    params = model.init(k3, x)
    tx = optax.adamw(learning_rate)
    return linen_step(model, mse, tx), (params, tx.init(params)), {"inputs": x, "targets": y}


class NnxMLP(nnx.Module):
    def __init__(self, features: int, hidden: int, out: int, rngs: nnx.Rngs) -> None:
        self.fc1 = nnx.Linear(features, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, out, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(nnx.relu(self.fc1(x)))


def nnx_setup(batch: int = 32, features: int = 24, hidden: int = 64, out: int = 16, seed: int = 0,
              learning_rate: float = 1e-3):
    """An nnx model trained functionally through nnx.split / nnx.merge."""
    model = NnxMLP(features, hidden, out, nnx.Rngs(seed))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(learning_rate)
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed + 1))
    x = jax.random.normal(k1, (batch, features))
    y = jax.random.normal(k2, (batch, out))

    def step(state, batch):
        params, opt_state = state

        def loss_fn(p):
            return mse(nnx.merge(graphdef, p)(batch["inputs"]), batch["targets"])

        value, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return step, (params, tx.init(params)), {"inputs": x, "targets": y}


class CNN(nn.Module):
    """Two convolutions with pooling, then a classifier."""

    classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        return nn.Dense(self.classes)(x.reshape(x.shape[0], -1))


def cnn_setup(batch: int = 16, size: int = 8, seed: int = 0, learning_rate: float = 1e-3):
    model = CNN()
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(k1, (batch, size, size, 3))
    y = jax.random.randint(k2, (batch,), 0, model.classes)
    params = model.init(k3, x)
    tx = optax.adamw(learning_rate)
    return linen_step(model, token_loss, tx), (params, tx.init(params)), {"inputs": x, "targets": y}


def gpt_abstract(batch: int, seq: int, learning_rate: float = 1e-3, **config: Any):
    """gpt_setup's (step, state, batch) as ShapeDtypeStructs: nothing allocated at full size."""
    model = GPT(**config)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)
    tx = optax.adamw(learning_rate)
    state = (params, jax.eval_shape(tx.init, params))
    return linen_step(model, token_loss, tx), state, {"inputs": tokens, "targets": tokens}
