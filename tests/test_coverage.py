"""Which primitives real training steps emit, and that docs/coverage.md accounts for each.

Representative steps (forward, jax.value_and_grad backward and optimizer update): the jax.nn
functions, optax's common optimizers, and small versions of Flax's examples (lm1b, wmt, gemma,
imagenet, seq2seq, mnist and the NNX toy examples). Each is traced with jax.make_jaxpr on
abstract shapes (no compile) and its primitives are collected recursively, into jit, custom
derivative, remat, scan, while and cond bodies. Every primitive found must be in the doc's
tables: a primitive autopar has a rule for, one the tracer takes apart (calls, scan), or one
that runs replicated. The rules are checked on autopar's own graph of each step, with the
step's actual shapes and params: an operator whose rule lookup fails is replicated (and
warned about) by autopar, so its primitive must be in the doc's replicated table, and one
listed there must indeed have no rule.

The steps under OUTSIDE are not from the surveyed libraries; they pin the doc's list of
common jax.numpy and jax.scipy primitives that run replicated.
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_flax_examples as flax_examples
from flax import nnx
from flax.training import common_utils, train_state
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun, jaxprs_in_params

from autopar.rules.table import RULES, rule_for
from autopar.trace.tracer import CALL_PRIMITIVES, trace

DOC = Path(__file__).resolve().parents[1] / "docs" / "coverage.md"
GOLDEN = Path(__file__).resolve().parent / "data" / "rules.txt"  # see the golden-table test
# Primitives the tracer handles itself: calls are inlined, a scan's body is planned once,
# checkpoint_name ("name") passes its operand through.
TRACER = set(CALL_PRIMITIVES) | {"scan", "name"}

S = jax.ShapeDtypeStruct
f32, i32 = jnp.float32, jnp.int32


# -- collecting ----------------------------------------------------------------------------

def collect(jaxpr, found: set[str]) -> set[str]:
    """The primitives of `jaxpr` and of every jaxpr in its equations' params. While and cond
    bodies are included although autopar does not plan them (the loop or conditional runs
    whole under its own rule): the doc lists what the steps emit."""
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for sub in jaxprs_in_params(eqn.params):
            collect(sub, found)
    return found


def rule_lookups(closed: ClosedJaxpr, args: tuple
                 ) -> tuple[dict[str, int], set[str], set[str]]:
    """Rule lookups on autopar's graph of the step, with each operator's shapes and params:
    how many operators of each primitive have no rule (autopar replicates them and warns),
    which primitives have an operator that has one, and each such rule as
    `primitive: notation`."""
    graph, _, _ = trace(jaxpr_as_fun(closed), jax.tree_util.tree_leaves(args))
    missing: dict[str, int] = {}
    ruled: set[str] = set()
    printed: set[str] = set()
    for op in graph.ops:
        ins = [graph.tensors[t].shape for t in op.inputs]
        outs = [graph.tensors[t].shape for t in op.outputs]
        rule = rule_for(op.primitive, ins, outs, op.params)
        if rule is None:
            missing[op.primitive] = missing.get(op.primitive, 0) + 1
        else:
            ruled.add(op.primitive)
            printed.add(f"{op.primitive}: {rule.notation()}")
    return missing, ruled, printed


@functools.cache
def doc_tables() -> dict[str, set[str]]:
    """Backticked primitive names in the first column of each table of docs/coverage.md,
    by section: 'rule', 'tracer' or 'replicated' (from the section's heading)."""
    tables: dict[str, set[str]] = {"rule": set(), "tracer": set(), "replicated": set()}
    section = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            heading = line.lower()
            section = ("replicated" if "replicated" in heading else
                       "tracer" if "tracer" in heading else
                       "rule" if "with a rule" in heading else None)
        elif section and line.startswith("|") and not set(line) <= set("|-: "):
            first = line.split("|")[1]
            tables[section].update(re.findall(r"`([^`]+)`", first))
    return tables


# -- steps ---------------------------------------------------------------------------------

def abstract(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda x: S(np.shape(x), jnp.result_type(x)), tree)


def optax_step(loss_fn: Callable, tx: optax.GradientTransformation) -> Callable:
    """step((params, opt_state), batch) -> (new state, loss): the plain optax loop."""
    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss
    return step


def optax_setup(loss_fn: Callable, params: Any, batch: Any, tx) -> tuple[Callable, tuple]:
    state = (params, jax.eval_shape(tx.init, params))
    return optax_step(loss_fn, tx), (state, batch)


# Two dense layers; the first kernel is big enough for adafactor to factor its second
# moments (it factors matrices whose two largest dims are 128 or more).
MLP_PARAMS = {"w1": S((128, 128), f32), "b1": S((128,), f32), "w2": S((128, 16), f32)}
MLP_BATCH = {"x": S((32, 128), f32), "y": S((32, 16), f32)}


def mlp_loss(p, batch):
    h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)


def optimizer_case(tx_fn: Callable[[], optax.GradientTransformation]):
    return lambda: optax_setup(mlp_loss, MLP_PARAMS, MLP_BATCH, tx_fn())


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.01),
    "adafactor": lambda: optax.adafactor(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "lamb": lambda: optax.lamb(1e-3),
    "rmsprop": lambda: optax.rmsprop(1e-3, momentum=0.9),
    "adagrad": lambda: optax.adagrad(1e-2),
    "clip_by_global_norm": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                               optax.sgd(0.1)),
    # The usual chain: clipping, adamw with decay masked off the biases, warmup and cosine.
    "chain": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100),
                    mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p))),
}


def jax_nn_activations():
    acts = [jax.nn.relu, jax.nn.relu6, jax.nn.sigmoid, jax.nn.softplus, jax.nn.sparse_plus,
            jax.nn.soft_sign, jax.nn.silu, jax.nn.log_sigmoid, jax.nn.leaky_relu,
            jax.nn.hard_sigmoid, jax.nn.hard_silu, jax.nn.hard_tanh, jax.nn.elu, jax.nn.celu,
            jax.nn.selu, jax.nn.gelu, functools.partial(jax.nn.gelu, approximate=False),
            jax.nn.squareplus, jax.nn.mish, jax.nn.tanh, jax.nn.sparse_sigmoid]

    def loss(p, batch):
        h = batch["x"] @ p["w1"] + p["b1"]
        h = sum(a(h) for a in acts) + jax.nn.glu(jnp.concatenate([h, h], -1))
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    return optax_setup(loss, MLP_PARAMS, MLP_BATCH, optax.sgd(0.1))


def jax_nn_softmax():
    """softmax (also masked), log_softmax, logsumexp (weighted), standardize, one_hot."""
    def loss(p, batch):
        logits = batch["x"] @ p["w1"]
        probs = jax.nn.softmax(logits) + jax.nn.softmax(logits, where=logits > 0)
        h = jax.nn.standardize(probs, axis=-1) @ p["w2"]
        labels = jax.nn.one_hot(batch["label"], 16)
        nll = -jnp.sum(labels * jax.nn.log_softmax(h), -1)
        return jnp.mean(nll + jax.nn.logsumexp(h, -1) + jax.nn.logsumexp(h, -1, b=labels + 1))

    batch = {"x": MLP_BATCH["x"], "label": S((32,), i32)}
    return optax_setup(loss, MLP_PARAMS, batch, optax.sgd(0.1))


def jax_nn_attention():
    """dot_product_attention's XLA implementation: causal; with a bias and a mask; grouped
    query heads with sequence lengths; a local window."""
    b, t, h, d = 4, 16, 4, 8
    params = {"wq": S((32, h, d), f32), "wk": S((32, 2, d), f32), "wv": S((32, 2, d), f32),
              "bias": S((1, h, t, t), f32)}

    def loss(p, batch):
        x = batch["x"]
        q, k, v = (jnp.einsum("btm,mhd->bthd", x, p[w]) for w in ("wq", "wk", "wv"))
        full = lambda a: jnp.repeat(a, 2, axis=2)  # noqa: E731
        out = jax.nn.dot_product_attention(q, full(k), full(v), is_causal=True)
        out += jax.nn.dot_product_attention(q, full(k), full(v), bias=p["bias"],
                                            mask=batch["mask"])
        out += jax.nn.dot_product_attention(q, k, v, query_seq_lengths=batch["lengths"],
                                            key_value_seq_lengths=batch["lengths"])
        out += jax.nn.dot_product_attention(q, full(k), full(v), local_window_size=(4, 0))
        return jnp.mean(out ** 2)

    batch = {"x": S((b, t, 32), f32), "mask": S((b, 1, t, t), jnp.bool_),
             "lengths": S((b,), i32)}
    return optax_setup(loss, params, batch, optax.adam(1e-3))


def optax_losses():
    """The losses the examples use, and their usual neighbours."""
    def loss(p, batch):
        logits = batch["x"] @ p["w1"] @ p["w2"]
        labels = jax.nn.one_hot(batch["label"], 16)
        return jnp.mean(
            optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
            + optax.softmax_cross_entropy(logits, optax.smooth_labels(labels, 0.1))
            + jnp.sum(optax.sigmoid_binary_cross_entropy(logits, labels), -1)
            + jnp.sum(optax.l2_loss(logits, batch["y"]) + optax.huber_loss(logits, batch["y"]),
                      -1))

    batch = {**MLP_BATCH, "label": S((32,), i32)}
    return optax_setup(loss, MLP_PARAMS, batch, optax.sgd(0.1))


# lm1b and wmt: linen transformers, pre-LayerNorm, dropout everywhere, sinusoidal positions
# indexed by packed-example positions, segment masks, label-smoothed cross-entropy, adamw on a
# warmup + rsqrt schedule, the dropout key folded with the step count.

def sinusoids(length: int, features: int) -> np.ndarray:
    position = np.arange(length)[:, None]
    scale = np.exp(np.arange(features // 2) * -np.log(10_000.0) / (features // 2 - 1))
    return np.concatenate([np.sin(position * scale), np.cos(position * scale)], -1)


def shift_right(x: jax.Array) -> jax.Array:
    padded = jnp.pad(x, [(0, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2))
    return jax.lax.dynamic_slice_in_dim(padded, 0, x.shape[1], axis=1)


class TransformerBlock(nn.Module):
    heads: int
    mlp: int
    dropout: float
    train: bool

    @nn.compact
    def __call__(self, x, mask, encoded=None, cross_mask=None):
        drop = lambda y: nn.Dropout(self.dropout)(y, deterministic=not self.train)  # noqa: E731
        attention = functools.partial(
            nn.MultiHeadDotProductAttention, num_heads=self.heads, use_bias=False,
            broadcast_dropout=False, dropout_rate=self.dropout, deterministic=not self.train)
        h = nn.LayerNorm()(x)
        x = x + drop(attention()(h, mask=mask))
        if encoded is not None:
            x = x + drop(attention()(nn.LayerNorm()(x), encoded, mask=cross_mask))
        h = drop(nn.relu(nn.Dense(self.mlp)(nn.LayerNorm()(x))))
        return x + drop(nn.Dense(x.shape[-1])(h))


class Transformer(nn.Module):
    """lm1b's decoder-only TransformerLM (encoder_layers 0), or wmt's encoder-decoder with a
    shared embedding and logits through it."""

    vocab: int = 32
    d_model: int = 16
    heads: int = 2
    mlp: int = 32
    layers: int = 2
    encoder_layers: int = 0
    dropout: float = 0.1
    max_len: int = 32
    train: bool = True

    def tower(self, x, positions, mask, n, name, encoded=None, cross_mask=None):
        x = x + jnp.asarray(sinusoids(self.max_len, self.d_model), f32)[positions]
        x = nn.Dropout(self.dropout)(x, deterministic=not self.train)
        for i in range(n):
            x = TransformerBlock(self.heads, self.mlp, self.dropout, self.train,
                                 name=f"{name}_{i}")(x, mask, encoded, cross_mask)
        return nn.LayerNorm(name=f"{name}_norm")(x)

    @nn.compact
    def __call__(self, batch):
        embed = nn.Embed(self.vocab, self.d_model, name="embed")
        targets, segments = batch["targets"], batch["targets_segmentation"]
        causal = nn.combine_masks(
            nn.make_attention_mask(targets > 0, targets > 0),
            nn.make_causal_mask(targets),
            nn.make_attention_mask(segments, segments, jnp.equal))
        # Packed examples: each starts from 0, not from the one before's last token.
        inputs = shift_right(targets) * (segments == shift_right(segments))
        if not self.encoder_layers:
            y = self.tower(embed(inputs), batch["targets_position"], causal, self.layers,
                           "decoder")
            return nn.Dense(self.vocab, name="logits")(y)
        sources, source_segments = batch["inputs"], batch["inputs_segmentation"]
        encoded = self.tower(
            embed(sources), batch["inputs_position"],
            nn.combine_masks(nn.make_attention_mask(sources > 0, sources > 0),
                             nn.make_attention_mask(source_segments, source_segments,
                                                    jnp.equal)),
            self.encoder_layers, "encoder")
        cross = nn.combine_masks(nn.make_attention_mask(targets > 0, sources > 0),
                                 nn.make_attention_mask(segments, source_segments, jnp.equal))
        y = self.tower(embed(inputs), batch["targets_position"], causal, self.layers,
                       "decoder", encoded, cross)
        return embed.attend(y) / jnp.sqrt(self.d_model)


def smoothed_cross_entropy(logits, targets, weights, smoothing: float):
    vocab = logits.shape[-1]
    confidence, low = 1.0 - smoothing, smoothing / (vocab - 1)
    soft = common_utils.onehot(targets, vocab, on_value=confidence, off_value=low)
    loss = -jnp.sum(soft * nn.log_softmax(logits), -1)
    return jnp.sum(loss * weights) / jnp.sum(weights)


def warmup_rsqrt(peak: float, warmup: int):
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup),
         lambda count: peak * (count + warmup) ** -0.5 * warmup ** 0.5],
        [warmup])


def transformer_setup(encoder_layers: int, smoothing: float, b: int = 4, t: int = 16):
    model = Transformer(encoder_layers=encoder_layers)
    tokens = {"targets": S((b, t), i32), "targets_position": S((b, t), i32),
              "targets_segmentation": S((b, t), i32)}
    if encoder_layers:
        tokens.update(inputs=S((b, t), i32), inputs_position=S((b, t), i32),
                      inputs_segmentation=S((b, t), i32))
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    state = jax.eval_shape(lambda: train_state.TrainState.create(
        apply_fn=model.apply, params=params,
        tx=optax.adamw(warmup_rsqrt(1e-3, 100), b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)))

    def step(state, batch):
        targets = batch["targets"]
        weights = jnp.where(targets > 0, 1.0, 0.0)
        dropout = jax.random.fold_in(batch["dropout_rng"], state.step)

        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch, rngs={"dropout": dropout})
            return smoothed_cross_entropy(logits, targets, weights, smoothing), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        accuracy = jnp.sum((jnp.argmax(logits, -1) == targets) * weights)
        return state.apply_gradients(grads=grads), (loss, accuracy)

    return step, (state, {**tokens, "dropout_rng": S((), jax.random.key(0).dtype)})


# gemma: NNX, RMSNorm, einsum projections with grouped key/value heads, RoPE, a sliding
# window on every other layer, soft-capped attention and final logits, a gated gelu MLP,
# tied embedding, dropout from rngs forked per step, adamw.

class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.zeros((dim,)))

    def __call__(self, x):
        x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
        return x * (1.0 + self.scale[...])


def rope(x, positions, max_wavelength: int = 10_000):
    half = x.shape[-1] // 2
    timescale = max_wavelength ** (2 * jnp.arange(half) / x.shape[-1])
    angle = (positions[..., None] / timescale)[..., None, :]
    first, second = jnp.split(x, 2, axis=-1)
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], -1)


class GemmaAttention(nnx.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int, window: int | None,
                 softcap: float, *, rngs: nnx.Rngs):
        self.q = nnx.Einsum("BTD,NDH->BTNH", (heads, d, head_dim), rngs=rngs)
        self.kv = nnx.Einsum("BTD,CKDH->CBTKH", (2, kv_heads, d, head_dim), rngs=rngs)
        self.out = nnx.Einsum("BTNH,NHD->BTD", (heads, head_dim, d), rngs=rngs)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.window, self.softcap = window, softcap
        self.dropout = nnx.Dropout(0.1)

    def __call__(self, x, positions, mask, rngs):
        q = rope(self.q(x), positions) * self.head_dim ** -0.5
        k, v = self.kv(x)
        k = rope(k, positions)
        b, t = x.shape[:2]
        groups = self.heads // self.kv_heads
        q = q.reshape(b, t, self.kv_heads, groups, self.head_dim)
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", q, k).reshape(b, t, self.heads, t)
        logits = jnp.tanh(logits / self.softcap) * self.softcap
        if self.window is not None:
            ones = jnp.ones(mask.shape, mask.dtype)
            mask = mask * jnp.triu(ones, 1 - self.window) * jnp.tril(ones, self.window - 1)
        logits = jnp.where(mask[:, :, None, :], logits, -2.3819763e38)  # the example's K_MASK
        probs = self.dropout(jax.nn.softmax(logits, axis=-1), rngs=rngs)
        probs = probs.reshape(b, t, self.kv_heads, groups, t)
        encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, v)
        return self.out(encoded.reshape(b, t, self.heads, self.head_dim))


class GemmaBlock(nnx.Module):
    def __init__(self, d: int, hidden: int, window: int | None, *, rngs: nnx.Rngs):
        self.pre_attention_norm = RMSNorm(d, rngs=rngs)
        self.attention = GemmaAttention(d, 4, 2, 8, window, 50.0, rngs=rngs)
        self.post_attention_norm = RMSNorm(d, rngs=rngs)
        self.pre_ffw_norm = RMSNorm(d, rngs=rngs)
        self.gate = nnx.Linear(d, hidden, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d, hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(hidden, d, use_bias=False, rngs=rngs)
        self.post_ffw_norm = RMSNorm(d, rngs=rngs)

    def __call__(self, x, positions, mask, rngs):
        x = x + self.post_attention_norm(
            self.attention(self.pre_attention_norm(x), positions, mask, rngs))
        h = self.pre_ffw_norm(x)
        return x + self.post_ffw_norm(self.down(nnx.gelu(self.gate(h)) * self.up(h)))


class Gemma(nnx.Module):
    def __init__(self, vocab: int = 32, d: int = 16, hidden: int = 32, *, rngs: nnx.Rngs):
        self.embedder = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([GemmaBlock(d, hidden, window, rngs=rngs)
                                for window in (4, None)])  # local, then global
        self.final_norm = RMSNorm(d, rngs=rngs)
        self.final_dropout = nnx.Dropout(0.1)

    def __call__(self, tokens, positions, mask, rngs):
        x = self.embedder(tokens) * jnp.sqrt(self.embedder.features)
        for layer in self.layers:
            x = layer(x, positions, mask, rngs)
        x = self.final_dropout(self.final_norm(x), rngs=rngs)
        return jnp.tanh(self.embedder.attend(x) / 30.0) * 30.0


def gemma_setup(b: int = 4, t: int = 16):
    def objects():
        model = Gemma(rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(warmup_rsqrt(1e-3, 100), b1=0.9,
                                                     b2=0.98, eps=1e-9, weight_decay=0.1),
                                  wrt=nnx.Param)
        return nnx.split((model, optimizer, nnx.Rngs(dropout=1)))

    graphdef, state = nnx.eval_shape(objects)

    def step(state, batch):
        model, optimizer, rngs = nnx.merge(graphdef, state)
        inputs, targets = batch["inputs"], batch["targets"]
        input_mask = inputs > 0
        # Positions count the real tokens (0 for the leading padding).
        positions = jnp.cumsum(input_mask, axis=-1)
        positions = positions - (positions >= 1)
        causal = jnp.tril(jnp.ones((t, t), jnp.bool_))
        mask = input_mask[:, None, :] * causal[None]
        weights = input_mask.astype(f32)

        def loss_fn(model, rngs):
            logits = model(inputs, positions, mask, rngs)
            soft = jax.nn.one_hot(targets, logits.shape[-1]) * 0.9 + 0.1 / 31
            loss = -jnp.sum(soft * nnx.log_softmax(logits), -1) * weights
            return jnp.mean(loss.sum(1) * len(loss) / weights.sum()), logits

        # The example's nnx_train_step (its jax.value_and_grad variant cannot draw from the
        # forked stream inside the gradient: the stream's count belongs to the outer trace).
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, _), grads = grad_fn(model, rngs.fork())
        optimizer.update(model, grads)
        return nnx.state((model, optimizer, rngs)), loss

    return step, (state, {"inputs": S((b, t), i32), "targets": S((b, t), i32)})


# imagenet: linen ResNet v1.5 (7x7 stem, batch norm with running statistics, 3x3 max pool,
# residual blocks), cross-entropy plus an L2 penalty, SGD with Nesterov momentum on a warmup
# + cosine schedule.

class ResNetBlock(nn.Module):
    filters: int
    strides: int = 1
    bottleneck: bool = False
    dtype: Any = f32

    @nn.compact
    def __call__(self, x):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=False, momentum=0.9,
                                 epsilon=1e-5, dtype=self.dtype)
        s = (self.strides, self.strides)
        if self.bottleneck:
            y = nn.relu(norm()(conv(self.filters, (1, 1))(x)))
            y = nn.relu(norm()(conv(self.filters, (3, 3), s)(y)))
            y = norm(scale_init=nn.initializers.zeros_init())(conv(4 * self.filters, (1, 1))(y))
        else:
            y = nn.relu(norm()(conv(self.filters, (3, 3), s)(x)))
            y = norm(scale_init=nn.initializers.zeros_init())(conv(self.filters, (3, 3))(y))
        if x.shape != y.shape:
            x = norm(name="norm_proj")(conv(y.shape[-1], (1, 1), s, name="conv_proj")(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    bottleneck: bool = False
    dtype: Any = f32

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False,
                    dtype=self.dtype)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, epsilon=1e-5,
                                 dtype=self.dtype)(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, filters in enumerate((8, 16)):
            x = ResNetBlock(filters, 2 if i else 1, self.bottleneck, self.dtype)(x)
        return nn.Dense(10, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))


def resnet_setup(bottleneck: bool = False, dtype: Any = f32, b: int = 8):
    model = ResNet(bottleneck, dtype)
    image = S((b, 32, 32, 3), f32)
    variables = jax.eval_shape(model.init, jax.random.key(0), image)
    schedule = optax.join_schedules([optax.linear_schedule(0.0, 0.1, 50),
                                     optax.cosine_decay_schedule(0.1, 500)], [50])
    tx = optax.sgd(schedule, momentum=0.9, nesterov=True)
    state = (variables, jax.eval_shape(tx.init, variables["params"]))

    def step(state, batch):
        variables, opt_state = state

        def loss_fn(params):
            logits, new_stats = model.apply({**variables, "params": params}, batch["image"],
                                            mutable=["batch_stats"])
            labels = common_utils.onehot(batch["label"], 10)
            loss = jnp.mean(optax.softmax_cross_entropy(logits, labels))
            l2 = sum(jnp.sum(x ** 2) for x in jax.tree_util.tree_leaves(params) if x.ndim > 1)
            return loss + 0.0001 * 0.5 * l2, new_stats

        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            variables["params"])
        updates, opt_state = tx.update(grads, opt_state, variables["params"])
        params = optax.apply_updates(variables["params"], updates)
        return ({**new_stats, "params": params}, opt_state), loss

    return step, (state, {"image": image, "label": S((b,), i32)})


def mnist_case():
    step, _, state, batches = flax_examples.mnist_setup(abstract=True)
    return step, (state, abstract(batches[0]))


def seq2seq_case():
    step, state, batches = flax_examples.seq2seq_setup(abstract=True)
    return step, (state, abstract(batches[0]))


# The NNX toy examples (examples/nnx_toy_examples).

class Count(nnx.Variable):
    pass


class CountingMLP(nnx.Module):
    """01/03: a Count variable the forward pass increments, split apart from the params."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.count = Count(jnp.array(0))
        self.w1 = nnx.Param(jax.random.uniform(rngs.params(), (1, 32)))
        self.b1 = nnx.Param(jnp.zeros((32,)))
        self.w2 = nnx.Param(jax.random.uniform(rngs.params(), (32, 1)))

    def __call__(self, x):
        self.count[...] += 1
        return jax.nn.relu(x @ self.w1[...] + self.b1[...]) @ self.w2[...]


def nnx_functional_setup():
    graphdef, params, counts = nnx.eval_shape(
        lambda: nnx.split(CountingMLP(rngs=nnx.Rngs(0)), nnx.Param, Count))

    def step(state, batch):
        params, counts = state

        def loss_fn(params):
            model = nnx.merge(graphdef, params, counts, copy=True)  # fresh, mutable here
            loss = jnp.mean((batch["y"] - model(batch["x"])) ** 2)
            return loss, nnx.state(model, Count)

        (loss, counts), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        params = jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, params, grads)
        return (params, counts), loss

    return step, ((params, counts), {"x": S((32, 1), f32), "y": S((32, 1), f32)})


class KLLoss(nnx.Variable):
    pass


class VAE(nnx.Module):
    """05: the encoder samples its latent with the module's own noise stream and leaves its
    KL term in a variable the loss pops."""

    def __init__(self, din: int = 784, hidden: int = 64, latent: int = 8, *, rngs: nnx.Rngs):
        self.enc = nnx.Linear(din, hidden, rngs=rngs)
        self.mean = nnx.Linear(hidden, latent, rngs=rngs)
        self.std = nnx.Linear(hidden, latent, rngs=rngs)
        self.dec1 = nnx.Linear(latent, hidden, rngs=rngs)
        self.dec2 = nnx.Linear(hidden, din, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        h = jax.nn.relu(self.enc(x.reshape(x.shape[0], -1)))
        mean, std = self.mean(h), jnp.exp(self.std(h))
        self.kl_loss = KLLoss(jnp.mean(
            0.5 * jnp.mean(-jnp.log(std ** 2) - 1.0 + std ** 2 + mean ** 2, axis=-1)))
        z = mean + std * jax.random.normal(self.rngs.noise(), mean.shape)
        return self.dec2(jax.nn.relu(self.dec1(z))).reshape(x.shape)


def nnx_vae_setup():
    def objects():
        model = VAE(rngs=nnx.Rngs(0, noise=1))
        return nnx.split((model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)))

    graphdef, state = nnx.eval_shape(objects)

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        x = batch["x"]

        def loss_fn(model):
            logits = model(x)
            kl = sum(jax.tree_util.tree_leaves(nnx.pop(model, KLLoss)), 0.0)
            return jnp.mean(optax.sigmoid_binary_cross_entropy(logits, x)) + 0.1 * kl

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return step, (state, {"x": S((16, 28, 28), f32)})


class ScanBlock(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.bn = nnx.BatchNorm(dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return jax.nn.gelu(self.dropout(self.bn(self.linear(x))))


class ScanMLP(nnx.Module):
    """06: layers made with vmap (one stacked state) and applied with nnx.scan."""

    def __init__(self, dim: int, layers: int, *, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=layers)
        @nnx.vmap(axis_size=layers)
        def create(rngs: nnx.Rngs):
            return ScanBlock(dim, rngs=rngs)

        self.layers = create(rngs)

    def __call__(self, x):
        @nnx.scan
        def apply(x, block):
            return block(x), None

        return apply(x, self.layers)[0]


def nnx_scan_setup():
    def objects():
        model = ScanMLP(16, 3, rngs=nnx.Rngs(0))
        return nnx.split((model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)))

    graphdef, state = nnx.eval_shape(objects)

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return step, (state, {"x": S((32, 16), f32), "y": S((32, 16), f32)})


class MomentumSGD(nnx.Pytree):
    """10: a hand-written optimizer, its momentum as variables beside the params."""

    def __init__(self, params: nnx.State, lr: float = 0.01, decay: float = 0.9):
        self.lr, self.decay = lr, decay
        self.params = nnx.data(params)
        self.momentum = nnx.data(jax.tree_util.tree_map(
            lambda v: nnx.Variable(jnp.zeros_like(v[...])), params,
            is_leaf=lambda x: isinstance(x, nnx.Variable)))

    def update(self, grads: nnx.State):
        def update(param, momentum, grad):
            momentum[...] = self.decay * momentum[...] + (1 - self.decay) * grad[...]
            param[...] -= self.lr * momentum[...]

        jax.tree_util.tree_map(update, self.params, self.momentum, grads,
                               is_leaf=lambda x: isinstance(x, nnx.Variable))


class TwoLayer(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(init(rngs.params(), (1, 32)))
        self.b1 = nnx.Param(jnp.zeros((32,)))
        self.w2 = nnx.Param(init(rngs.params(), (32, 1)))

    def __call__(self, x):
        return nnx.relu(x @ self.w1 + self.b1) @ self.w2


def nnx_custom_optimizer_setup():
    def objects():
        model = TwoLayer(rngs=nnx.Rngs(0))
        return nnx.split((model, MomentumSGD(nnx.variables(model, nnx.Param))))

    graphdef, state = nnx.eval_shape(objects)

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            return jnp.mean((batch["y"] - model(batch["x"])) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(grads)
        return nnx.state((model, optimizer)), loss

    return step, (state, {"x": S((32, 1), f32), "y": S((32, 1), f32)})


# -- outside the survey: common jax.numpy / jax.scipy primitives without a rule -----------

def stack_tile():
    """jnp.stack (and its transpose unstack), jnp.tile, jnp.searchsorted's comparisons."""
    def loss(p, batch):
        h = jnp.tanh(batch["x"] @ p["w1"])
        both = jnp.stack([h, 2 * h], axis=-1).sum(-1)
        tiled = jnp.tile(h, (1, 2))[:, :128]
        bins = jnp.linspace(-1, 1, 8)
        edges = (jnp.searchsorted(bins, h) + jnp.searchsorted(bins, h, side="right")).astype(f32)
        return jnp.mean(((both + tiled + edges) @ p["w2"] - batch["y"]) ** 2)

    return optax_setup(loss, MLP_PARAMS, MLP_BATCH, optax.sgd(0.1))


def linear_algebra():
    """Whitening with a Cholesky factor, a QR, an eigendecomposition, an SVD and an FFT."""
    def loss(p, batch):
        h = jnp.tanh(batch["x"] @ p["w1"])[:, :16]
        cov = h.T @ h / h.shape[0] + jnp.eye(16)
        white = jax.scipy.linalg.solve_triangular(jnp.linalg.cholesky(cov), h.T, lower=True)
        q, _ = jnp.linalg.qr(h)
        eigenvalues = jnp.linalg.eigh(cov)[0]
        singular = jnp.linalg.svd(h, compute_uv=False)
        spectrum = jnp.abs(jnp.fft.rfft(h, axis=-1))
        return (jnp.mean(white ** 2) + jnp.mean(q ** 2) + jnp.mean(eigenvalues)
                + jnp.mean(singular) + jnp.mean(spectrum))

    return optax_setup(loss, MLP_PARAMS, MLP_BATCH, optax.sgd(0.1))


def special_random_host():
    """Special functions, gamma variates, raw rng_bit_generator bits, approximate top-k, a
    debug print and a sharding constraint written into the step."""
    mesh = jax.sharding.AbstractMesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def loss(p, batch):
        h = jnp.tanh(batch["x"] @ p["w1"])
        h = jax.lax.with_sharding_constraint(
            h, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
        jax.debug.print("mean activation {m}", m=h.mean())
        positive = jnp.abs(h) + 1.0
        special = (jax.scipy.special.gammainc(2.0, positive)
                   + jax.scipy.special.polygamma(1, positive) + jax.scipy.special.i0e(h))
        noise = jax.random.gamma(batch["key"], 2.0, h.shape)
        bits = jax.lax.rng_bit_generator(batch["rbg_key"], h.shape)[1]
        top = jax.lax.approx_max_k(h, 16)[0]
        h = special * noise + bits.astype(f32) / 2.0 ** 32
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2) + jnp.mean(top)

    batch = {**MLP_BATCH, "key": S((), jax.random.key(0).dtype), "rbg_key": S((4,), jnp.uint32)}
    return optax_setup(loss, MLP_PARAMS, batch, optax.sgd(0.1))


SURVEY: dict[str, Callable[[], tuple[Callable, tuple]]] = {
    "jax.nn activations": jax_nn_activations,
    "jax.nn softmax family": jax_nn_softmax,
    "jax.nn dot_product_attention": jax_nn_attention,
    "optax losses": optax_losses,
    **{f"optax {name}": optimizer_case(tx) for name, tx in OPTIMIZERS.items()},
    "flax lm1b": lambda: transformer_setup(encoder_layers=0, smoothing=0.0),
    "flax wmt": lambda: transformer_setup(encoder_layers=1, smoothing=0.1),
    "flax gemma": gemma_setup,
    "flax imagenet": resnet_setup,
    "flax imagenet bottleneck bf16": lambda: resnet_setup(bottleneck=True, dtype=jnp.bfloat16),
    "flax mnist": mnist_case,
    "flax seq2seq": seq2seq_case,
    "nnx functional api": nnx_functional_setup,
    "nnx vae": nnx_vae_setup,
    "nnx scan over layers": nnx_scan_setup,
    "nnx custom optimizer": nnx_custom_optimizer_setup,
}
OUTSIDE: dict[str, Callable[[], tuple[Callable, tuple]]] = {
    "jnp stack, tile, searchsorted": stack_tile,
    "linear algebra and fft": linear_algebra,
    "special functions, random, host and sharding calls": special_random_host,
}


@functools.cache
def surveyed(name: str) -> tuple[set[str], dict[str, int], set[str], set[str]]:
    """(primitives found, replicated operators, primitives with a rule, the rules printed)
    of one step."""
    step, args = {**SURVEY, **OUTSIDE}[name]()
    closed = jax.make_jaxpr(step)(*args)
    return collect(closed.jaxpr, set()), *rule_lookups(closed, args)


# -- tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [*SURVEY, *OUTSIDE])
def test_primitives_accounted_for(name):
    found, replicated, ruled, _ = surveyed(name)
    tables = doc_tables()
    missing = sorted(found - set().union(*tables.values()))
    assert not missing, f"{name}: primitives not in {DOC.name}: {missing}"
    tracer = {p for p in found if p in TRACER}
    assert tracer <= tables["tracer"], f"{name}: add to the tracer table: {tracer}"
    # Autopar replicates these (and warns): the doc must say so ...
    unlisted = sorted(set(replicated) - tables["replicated"])
    assert not unlisted, f"{name}: operators without a rule, not in the replicated table: " \
                         f"{ {p: replicated[p] for p in unlisted} }"
    # ... and must not call replicated a primitive that has got a rule since.
    stale = sorted(tables["replicated"] & ruled)
    assert not stale, f"{name}: {stale} have a rule now: move them to the rule table"


@pytest.mark.slow
def test_surveyed_steps_have_no_replicated_operator():
    """The survey proper (jax.nn, optax, Flax's examples) has a rule for every operator."""
    replicated = {name: surveyed(name)[1] for name in SURVEY}
    assert not {k: v for k, v in replicated.items() if v}


@pytest.mark.slow
def test_every_rule_the_survey_uses_prints_as_its_golden_table():
    """Every distinct rule the surveyed steps' operators get, printed (`Rule.notation`), is
    the golden table's: a change of what a primitive means to the planner shows here, line
    by line. AUTOPAR_GOLDEN=write rewrites the table after a change meant to make."""
    printed = sorted(set().union(*(surveyed(name)[3] for name in [*SURVEY, *OUTSIDE])))
    if os.environ.get("AUTOPAR_GOLDEN") == "write":
        GOLDEN.write_text("\n".join(printed) + "\n")
    golden = GOLDEN.read_text().splitlines()
    assert len(golden) > 100 and len({line.split(":")[0] for line in golden}) > 50
    assert printed == golden, (f"rules changed; gone: {sorted(set(golden) - set(printed))}, "
                               f"new: {sorted(set(printed) - set(golden))}")


def test_doc_tables_agree_with_the_rule_table():
    tables = doc_tables()
    assert tables["rule"] <= set(RULES), sorted(tables["rule"] - set(RULES))
    assert tables["tracer"] <= TRACER, sorted(tables["tracer"] - TRACER)
    assert not tables["replicated"] & set(RULES), sorted(tables["replicated"] & set(RULES))
