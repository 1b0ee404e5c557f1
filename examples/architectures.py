"""More model families for the benchmark suite: mixture of experts, ResNet-style CNNs (basic
blocks, and ResNet-50's bottlenecks), and an encoder-decoder with cross attention. Each
`*_setup` returns (step, state, batch) like those in models.py, each `*_abstract` the same as
ShapeDtypeStructs (realistic sizes, nothing allocated), and each module names its layers so that
hand-written rules can find them.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from models import Block, linen_step, mse, token_loss


class MoE(nn.Module):
    """A top-k routed mixture of experts with a fixed capacity per expert (GShard-style
    dispatch and combine tensors), over flattened tokens."""

    experts: int = 4
    k: int = 2
    hidden: int = 128
    capacity_factor: float = 1.25

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape, d = x.shape, x.shape[-1]
        tokens = x.reshape(-1, d)
        n = tokens.shape[0]
        capacity = int(self.capacity_factor * self.k * n / self.experts)
        probs = jax.nn.softmax(nn.Dense(self.experts, name="router")(tokens))
        gate, expert = jax.lax.top_k(probs, self.k)  # (n, k)
        chosen = jax.nn.one_hot(expert, self.experts)  # (n, k, e)
        # Each token's slot in its expert's buffer: how many earlier choices went there.
        flat = chosen.reshape(n * self.k, self.experts)
        slot = (jnp.cumsum(flat, axis=0) - 1.0) * flat
        kept = flat * (slot < capacity)
        dispatch = (jax.nn.one_hot(slot.astype(jnp.int32), capacity) * kept[..., None]).reshape(
            n, self.k, self.experts, capacity)
        combine = (dispatch * gate[:, :, None, None]).sum(axis=1)  # (n, e, c)
        dispatch = dispatch.sum(axis=1)
        init = nn.initializers.lecun_normal()
        w_in = self.param("w_in", init, (self.experts, d, self.hidden))
        w_out = self.param("w_out", init, (self.experts, self.hidden, d))
        expert_in = jnp.einsum("nec,nd->ecd", dispatch, tokens)
        hidden = nn.gelu(jnp.einsum("ecd,edh->ech", expert_in, w_in))
        expert_out = jnp.einsum("ech,ehd->ecd", hidden, w_out)
        return jnp.einsum("nec,ecd->nd", combine, expert_out).reshape(shape)


class MoEStack(nn.Module):
    layers: int = 2
    d_model: int = 64
    out: int = 32
    experts: int = 4
    hidden: int = 128  # each expert's hidden width

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(self.d_model, name="embed")(x)
        for i in range(self.layers):
            x = x + MoE(self.experts, hidden=self.hidden, name=f"moe_{i}")(nn.LayerNorm()(x))
        return nn.Dense(self.out, name="head")(x)


class ResidualBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.relu(nn.GroupNorm(num_groups=4)(nn.Conv(self.channels, (3, 3), name="conv_in")(x)))
        y = nn.Conv(self.channels, (3, 3), name="conv_out")(y)
        if x.shape[-1] != self.channels:
            x = nn.Conv(self.channels, (1, 1), name="project")(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """A stem, residual blocks of two 3x3 convolutions with GroupNorm, pooling, classifier."""

    channels: tuple[int, ...] = (32, 64)
    classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(self.channels[0], (3, 3), name="stem")(x))
        for i, c in enumerate(self.channels):
            x = ResidualBlock(c, name=f"block_{i}")(x)
            x = nn.avg_pool(x, (2, 2), (2, 2))
        return nn.Dense(self.classes, name="head")(x.mean(axis=(1, 2)))


class DecoderBlock(nn.Module):
    d_model: int
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array, memory: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="self_attention")(
            y, y, mask=mask)
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="cross_attention")(
            y, memory)
        y = nn.Dense(4 * self.d_model, name="mlp_in")(nn.LayerNorm()(x))
        return x + nn.Dense(self.d_model, name="mlp_out")(nn.gelu(y))


class EncoderDecoder(nn.Module):
    vocab: int = 64
    d_model: int = 64
    heads: int = 4
    layers: int = 1

    @nn.compact
    def __call__(self, source: jax.Array, target: jax.Array) -> jax.Array:
        embed = nn.Embed(self.vocab, self.d_model)
        memory = embed(source)
        for i in range(self.layers):
            memory = Block(self.d_model, self.heads, name=f"encoder_{i}")(memory)
        memory = nn.LayerNorm()(memory)
        x = embed(target)
        for i in range(self.layers):
            x = DecoderBlock(self.d_model, self.heads, name=f"decoder_{i}")(x, memory)
        return embed.attend(nn.LayerNorm()(x))


def moe_setup(batch: int = 8, seq: int = 16, features: int = 32, seed: int = 0, **config):
    model = MoEStack(**config)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(k1, (batch, seq, features))
    y = jax.random.normal(k2, (batch, seq, model.out))
    params = model.init(k3, x)
    tx = optax.adamw(1e-3)
    return linen_step(model, mse, tx), (params, tx.init(params)), {"inputs": x, "targets": y}


def resnet_setup(batch: int = 16, size: int = 16, seed: int = 0, **config):
    model = ResNet(**config)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(k1, (batch, size, size, 3))
    y = jax.random.randint(k2, (batch,), 0, model.classes)
    params = model.init(k3, x)
    tx = optax.adamw(1e-3)
    return linen_step(model, token_loss, tx), (params, tx.init(params)), {"inputs": x, "targets": y}


def encdec_setup(batch: int = 8, seq: int = 16, seed: int = 0, **config):
    model = EncoderDecoder(**config)
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(seed), 4)
    source = jax.random.randint(k1, (batch, seq), 0, model.vocab)
    target = jax.random.randint(k2, (batch, seq), 0, model.vocab)
    labels = jax.random.randint(k3, (batch, seq), 0, model.vocab)
    params = model.init(k4, source, target)
    tx = optax.adamw(1e-3)
    return (encdec_step(model, tx), (params, tx.init(params)),
            {"source": source, "target": target, "labels": labels})


class Bottleneck(nn.Module):
    """ResNet-50's bottleneck: a 1x1 convolution down to `mid` channels, a 3x3 one, a 1x1 one
    up to `out`, GroupNorm after each (no batch statistics to carry), a projected shortcut
    where the width changes."""

    mid: int
    out: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.relu(nn.GroupNorm(32)(nn.Conv(self.mid, (1, 1), name="conv_in")(x)))
        y = nn.relu(nn.GroupNorm(32)(nn.Conv(self.mid, (3, 3), name="conv_mid")(y)))
        y = nn.GroupNorm(32)(nn.Conv(self.out, (1, 1), name="conv_out")(y))
        if x.shape[-1] != self.out:
            x = nn.Conv(self.out, (1, 1), name="project")(x)
        return nn.relu(x + y)


class BottleneckResNet(nn.Module):
    """ResNet-50's widths (stages of 256 to 2,048 channels) with `blocks` bottlenecks per
    stage; a 3x3 stem stands in for the 7x7 stride-2 stem and max-pool, so a 56x56 input has
    ResNet-50's spatial sizes (56, 28, 14, 7) in its four stages."""

    stages: tuple[tuple[int, int], ...] = ((64, 256), (128, 512), (256, 1024), (512, 2048))
    blocks: int = 1
    classes: int = 1000

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(self.stages[0][0], (3, 3), name="stem")(x))
        for i, (mid, out) in enumerate(self.stages):
            if i:
                x = nn.avg_pool(x, (2, 2), (2, 2))
            for j in range(self.blocks):
                x = Bottleneck(mid, out, name=f"stage{i}_block{j}")(x)
        return nn.Dense(self.classes, name="head")(x.mean(axis=(1, 2)))


def encdec_step(model: EncoderDecoder, tx: optax.GradientTransformation):
    """The encoder-decoder's train step: batch holds source, target and labels."""
    def step(state, batch):
        params, opt_state = state

        def loss_fn(p):
            return token_loss(model.apply(p, batch["source"], batch["target"]), batch["labels"])

        value, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value
    return step


# Abstract variants: (step, state, batch) as ShapeDtypeStructs, for compiling realistic sizes
# without allocating them (jax.eval_shape of the initialisation).

def _abstract_state(model: nn.Module, tx: optax.GradientTransformation, *inputs):
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), *inputs)
    return params, jax.eval_shape(tx.init, params)


def moe_abstract(batch: int, seq: int, features: int = 32, **config):
    """moe_setup's (step, state, batch) as ShapeDtypeStructs."""
    model = MoEStack(**config)
    x = jax.ShapeDtypeStruct((batch, seq, features), jnp.float32)
    y = jax.ShapeDtypeStruct((batch, seq, model.out), jnp.float32)
    tx = optax.adamw(1e-3)
    return linen_step(model, mse, tx), _abstract_state(model, tx, x), {"inputs": x, "targets": y}


def bottleneck_resnet_abstract(batch: int, size: int = 56, **config):
    """A BottleneckResNet's (step, state, batch) as ShapeDtypeStructs."""
    model = BottleneckResNet(**config)
    x = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32)
    y = jax.ShapeDtypeStruct((batch,), jnp.int32)
    tx = optax.adamw(1e-3)
    return (linen_step(model, token_loss, tx), _abstract_state(model, tx, x),
            {"inputs": x, "targets": y})


def encdec_abstract(batch: int, seq: int, **config):
    """encdec_setup's (step, state, batch) as ShapeDtypeStructs."""
    model = EncoderDecoder(**config)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    tx = optax.adamw(1e-3)
    return (encdec_step(model, tx), _abstract_state(model, tx, tokens, tokens),
            {"source": tokens, "target": tokens, "labels": tokens})
