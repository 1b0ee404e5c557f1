"""Flax linen layers of the benchmark transformers (`tpu_models` builds the workloads).

Conventions, as in MaxText: parameters float32 (`PARAM_DTYPE`), compute bfloat16 (`DTYPE`);
every parameter initializer wrapped in `nn.with_logical_partitioning` and every main
activation passed through `nn.with_logical_constraint`, which is the identity unless
logical-axis rules and a mesh (`jax.set_mesh`) are in context.

Remat policies (`REMAT_POLICIES`), applied to each block inside the layer scan:
- 'none': no rematerialization;
- 'full': `nothing_saveable`: the backward pass recomputes the whole block;
- 'minimal': `dots_with_no_batch_dims_saveable` (MaxText's 'minimal'): the outputs of the
  weight matmuls (dot_generals without batch dimensions: projections, MLP) are kept; the
  attention einsums, the expert einsums (batched over experts) and the elementwise work
  are recomputed.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from benchmarks.tpu_moe import DTYPE, PARAM_DTYPE, MoeMlp

EMBED = ("activation_batch", "activation_length", "activation_embed")
REMAT_POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
                  "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


@dataclasses.dataclass(frozen=True)
class Config:
    """A model's sizes and options. family: 'llama', 'mixtral' or 'vit'. experts > 1 turns
    the decoder's MLPs into mixtures of experts."""
    family: str
    embed: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    layers: int
    vocab: int = 0
    experts: int = 1
    top_k: int = 2
    capacity_factor: float = 1.25
    group_size: int = 1024
    aux_coef: float = 0.01
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    remat: str = "full"  # 'none' | 'full' | 'minimal'
    scan_layers: bool = True
    image: int = 224
    patch: int = 16
    channels: int = 3
    classes: int = 1000


def _logical(init: Any, names: tuple) -> Any:
    return nn.with_logical_partitioning(init, names)


class Dense(nn.Module):
    """x [..., *in] . kernel [*in, *features] -> [..., *features], contracting the last
    `contract` dimensions of x. `names`: the kernel's logical names; the bias (if any) takes
    the features' names."""
    features: tuple[int, ...]
    names: tuple
    contract: int = 1
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        n = self.contract
        shape = (*x.shape[x.ndim - n:], *self.features)
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                                in_axis=tuple(range(n)),
                                                out_axis=tuple(range(n, len(shape))))
        kernel = self.param("kernel", _logical(init, self.names), shape, PARAM_DTYPE)
        dims = (tuple(range(x.ndim - n, x.ndim)), tuple(range(n)))
        y = jax.lax.dot_general(x.astype(DTYPE), kernel.astype(DTYPE), (dims, ((), ())))
        if self.use_bias:
            bias = self.param("bias", _logical(nn.initializers.zeros, self.names[n:]),
                              self.features, PARAM_DTYPE)
            y = y + bias.astype(DTYPE)
        return y


class RMSNorm(nn.Module):
    """Root-mean-square normalization, computed in float32, scale named 'norm'."""
    eps: float = 1e-5

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", _logical(nn.initializers.ones, ("norm",)),
                           (x.shape[-1],), PARAM_DTYPE)
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * scale).astype(DTYPE)


def _norm(cfg: Config, name: str) -> nn.Module:
    """The block's normalization: LayerNorm for ViT, RMSNorm for the decoders."""
    if cfg.family == "vit":
        return nn.LayerNorm(cfg.norm_eps, dtype=DTYPE, param_dtype=PARAM_DTYPE,
                            scale_init=_logical(nn.initializers.ones, ("norm",)),
                            bias_init=_logical(nn.initializers.zeros, ("norm",)), name=name)
    return RMSNorm(cfg.norm_eps, name=name)


def rotary(x: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding of x [batch, length, heads, head_dim] at positions 0..L-1
    (rotating the two halves of head_dim)."""
    length, dim = x.shape[1], x.shape[-1]
    freq = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angle = jnp.arange(length, dtype=jnp.float32)[:, None] * freq[None, :]
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(DTYPE)


def dot_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    """Softmax attention with grouped queries: q [b, s, heads, d], k and v [b, t, kv_heads,
    d], heads a multiple of kv_heads -> [b, s, heads, d]. Softmax in float32."""
    b, s, heads, d = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, s, kv_heads, heads // kv_heads, d) * jnp.asarray(d ** -0.5, q.dtype)
    logits = jnp.einsum("bskgd,btkd->bkgst", q, k).astype(jnp.float32)
    if causal:
        mask = jnp.tril(jnp.ones((s, k.shape[1]), dtype=bool))
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(DTYPE)
    return jnp.einsum("bkgst,btkd->bskgd", probs, v).reshape(b, s, heads, d)


class Attention(nn.Module):
    """Multi-head (grouped-query when kv_heads < heads) self-attention; the decoders' is
    causal with rotary embeddings, ViT's bidirectional with biases."""
    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c, decoder = self.cfg, self.cfg.family != "vit"
        q_names = ("activation_batch", "activation_length", "activation_heads", "activation_kv")
        kv_names = ("activation_batch", "activation_length", "activation_kv_heads",
                    "activation_kv")
        q = Dense((c.heads, c.head_dim), ("embed", "heads", "kv"), use_bias=not decoder,
                  name="query")(x)
        k, v = (Dense((c.kv_heads, c.head_dim), ("embed", "kv_heads", "kv"),
                      use_bias=not decoder, name=name)(x) for name in ("key", "value"))
        q = nn.with_logical_constraint(q, q_names)
        k, v = (nn.with_logical_constraint(t, kv_names) for t in (k, v))
        if decoder:
            q, k = rotary(q, c.rope_theta), rotary(k, c.rope_theta)
        out = nn.with_logical_constraint(dot_attention(q, k, v, causal=decoder), q_names)
        return Dense((c.embed,), ("heads", "kv", "embed"), contract=2, use_bias=not decoder,
                     name="out")(out)


class Mlp(nn.Module):
    """SwiGLU for the decoders (wi_0, wi_1, wo); GELU with biases for ViT (wi, wo)."""
    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c, vit = self.cfg, self.cfg.family == "vit"
        if vit:
            h = nn.gelu(Dense((c.mlp,), ("embed", "mlp"), use_bias=True, name="wi")(x))
        else:
            h = (nn.silu(Dense((c.mlp,), ("embed", "mlp"), name="wi_0")(x))
                 * Dense((c.mlp,), ("embed", "mlp"), name="wi_1")(x))
        h = nn.with_logical_constraint(
            h, ("activation_batch", "activation_length", "activation_mlp"))
        return Dense((c.embed,), ("mlp", "embed"), use_bias=vit, name="wo")(h)


class Block(nn.Module):
    """A pre-norm residual block: (x, _) -> (x, aux), aux the MoE load-balancing loss (0 for
    dense MLPs), shaped so that nn.scan can stack it."""
    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, jax.Array]:
        c = self.cfg
        x = nn.with_logical_constraint(x, EMBED)
        x = x + Attention(c, name="attention")(_norm(c, "pre_attention_norm")(x))
        x = nn.with_logical_constraint(x, EMBED)
        h = _norm(c, "pre_mlp_norm")(x)
        if c.experts > 1:
            y, aux = MoeMlp(c.experts, c.top_k, c.mlp, c.group_size, c.capacity_factor,
                            name="moe")(h)
        else:
            y, aux = Mlp(c, name="mlp")(h), jnp.zeros((), jnp.float32)
        return nn.with_logical_constraint(x + y, EMBED), aux


def apply_layers(cfg: Config, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cfg.layers blocks over x, from inside a compact method: one nn.scan over stacked
    params (leading 'layers' axis) or a Python loop (params layers_0, layers_1, ...); each
    block rematerialized by cfg.remat. Returns (x, mean aux loss over layers)."""
    block = Block
    if cfg.remat != "none":
        if cfg.remat not in REMAT_POLICIES:
            raise ValueError(f"remat {cfg.remat!r}; known: none, {', '.join(REMAT_POLICIES)}")
        # Inside a scan the loop already keeps XLA from merging recomputation away.
        block = nn.remat(block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
        stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=cfg.layers, metadata_params={nn.PARTITION_NAME: "layers"})
        x, aux = stack(cfg, name="layers")(x, None)
        return x, jnp.mean(aux)
    total = jnp.zeros((), jnp.float32)
    for i in range(cfg.layers):
        x, aux = block(cfg, name=f"layers_{i}")(x, None)
        total = total + aux
    return x, total / cfg.layers


class Decoder(nn.Module):
    """Llama/Mixtral decoder: int32 tokens [b, s] -> (float32 logits [b, s, vocab], aux).
    The output head is untied from the token embedding."""
    cfg: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.cfg
        embedder = nn.Embed(c.vocab, c.embed, dtype=DTYPE, param_dtype=PARAM_DTYPE,
                            embedding_init=_logical(nn.initializers.normal(1.0),
                                                    ("vocab", "embed")), name="token_embedder")
        x = nn.with_logical_constraint(embedder(tokens).astype(DTYPE), EMBED)
        x, aux = apply_layers(c, x)
        x = RMSNorm(c.norm_eps, name="final_norm")(x)
        logits = Dense((c.vocab,), ("embed", "vocab"), name="logits")(x).astype(jnp.float32)
        names = ("activation_batch", "activation_length", "activation_vocab")
        return nn.with_logical_constraint(logits, names), aux


class ViT(nn.Module):
    """Vision transformer: float32 images [b, H, W, C] -> float32 logits [b, classes].
    Patches by reshape + dense, learned position embedding, mean pooling."""
    cfg: Config

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        c, p = self.cfg, self.cfg.patch
        b, height, width, channels = images.shape
        patches = images.reshape(b, height // p, p, width // p, p, channels)
        patches = patches.transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, p * p * channels)
        x = Dense((c.embed,), (None, "embed"), use_bias=True, name="patch_embed")(patches)
        position = self.param("position", _logical(nn.initializers.normal(0.02),
                                                   (None, "embed")),
                              (x.shape[1], c.embed), PARAM_DTYPE)
        x = nn.with_logical_constraint(x + position.astype(DTYPE), EMBED)
        x, _ = apply_layers(c, x)
        x = _norm(c, "final_norm")(jnp.mean(x, axis=1))
        return Dense((c.classes,), ("embed", None), name="head")(x).astype(jnp.float32)
