"""A grammar of small random train steps for property-based testing of autopar.

`specs()` is a hypothesis strategy drawing a `Spec`: a plain, printable description of a model
(input stem, residual blocks, layer stacking, head, dtypes, optimizer). `build(spec)` turns it
into `(step, state, batch)`: an ordinary single-device train step (loss, value_and_grad,
optax update) with concrete inputs. The step takes its gradient with `autopar.value_and_grad`,
which is `jax.value_and_grad` everywhere but in a step autopar accumulates over microbatches or
pipelines, so that the fuzzer can draw those schedules too. A failing case is therefore reproduced from its printed
Spec alone: `build(Spec(...))`.

Every model is tiny (widths 8 to 32, batch 8 or 16) so that one case compiles in seconds, and
is kept well-conditioned so that a single-device run and a sharded run differ by rounding only:
inputs are standard normal, every block is residual (optionally pre-normalised), dropout is
mild, and learning rates are small enough that two steps stay near the initial point yet large
enough that the update is visible in the state (a wrong gradient moves it by far more than the
state tolerance).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import strategies as st

import autopar

VOCAB = 32    # token ids for the embedding stem and the tied head
CLASSES = 8   # labels of the untied classification head
LAYERS = 2    # stacked layers under nn.scan / lax.scan
IMAGE = 4     # image side (4x4x3) for the convolutional stem

# Residual blocks over (batch, tokens, width). "mixer" mixes tokens through a transpose;
# "heads" reshapes features into heads and mixes within each head by einsum; "conv" and
# "depthwise" convolve along the tokens (the latter one feature group per channel).
BLOCKS = ("dense", "attention", "einsum_attention", "mixer", "heads", "conv", "depthwise")


@dataclasses.dataclass(frozen=True)
class Spec:
    batch: int = 8
    seq: int = 4                       # tokens (the image stem sets its own)
    width: int = 8
    heads: int = 2
    inputs: str = "features"           # "features" | "tokens" | "image"
    strided: bool = False              # image stem: a second, stride-2 convolution
    blocks: tuple[str, ...] = ()
    norm: str = "none"                 # pre-norm in each block: "none" | "layer" | "rms"
    dropout: bool = False              # nn.Dropout after each block, rng key from the batch
    remat: bool = False                # nn.remat on blocks, jax.checkpoint on the lax.scan body
    stack: str = "none"                # "none" | "nn_scan" (blocks as one scanned layer) |
    #                                    "python_loop" (LAYERS copies, one after the other)
    lax_scan: bool = False             # then a lax.scan over stacked tanh layers
    pool: str = "none"                 # reduce over tokens before the head: "none"|"mean"|"sum"|"max"
    head: str = "classes"              # "classes" | "tied" (embed.attend) | "regression"
    dtype: str = "float32"             # "float32" | "bf16_params" | "bf16_compute" | "bf16"
    optimizer: str = "sgd"             # "sgd" | "adamw"
    seed: int = 0

    @property
    def uses_bf16(self) -> bool:
        return self.dtype != "float32"


@st.composite
def specs(draw) -> Spec:
    """A random Spec; every choice lists its simplest option first, for shrinking.

    A choice that cannot matter (heads without attention, stacking without blocks) keeps its
    default, so that different draws do not build the same model twice."""
    inputs = draw(st.sampled_from(["features", "tokens", "image"]))
    width = draw(st.sampled_from([8, 16, 32]))
    blocks = tuple(draw(st.lists(st.sampled_from(BLOCKS), min_size=0, max_size=2)))
    lax_scan = draw(st.booleans())
    dtype = draw(st.sampled_from(["float32", "bf16_params", "bf16_compute", "bf16"]))
    default = Spec()
    return Spec(
        batch=draw(st.sampled_from([8, 16])),
        seq=default.seq if inputs == "image" else draw(st.sampled_from([4, 8])),
        width=width,
        heads=(draw(st.sampled_from([h for h in (2, 4) if width // h >= 2]))
               if {"attention", "einsum_attention", "heads"} & set(blocks) else default.heads),
        inputs=inputs,
        strided=inputs == "image" and draw(st.booleans()),
        blocks=blocks,
        norm=draw(st.sampled_from(["none", "layer", "rms"])) if blocks else "none",
        dropout=bool(blocks) and draw(st.booleans()),
        remat=bool(blocks or lax_scan) and draw(st.booleans()),
        stack=draw(st.sampled_from(["none", "nn_scan", "python_loop"])) if blocks else "none",
        lax_scan=lax_scan,
        pool=draw(st.sampled_from(["none", "mean", "sum", "max"])),
        # The tied head projects onto the embedding table, so it needs the token stem.
        head=draw(st.sampled_from(["classes", "regression"] +
                                  (["tied"] if inputs == "tokens" else []))),
        dtype=dtype,
        # Adam normalises each gradient element by its own size, so where an element is
        # smaller than bf16's rounding of the sums that make it (a few ulps of 2**-8), the
        # rounding decides the update: with bf16 activations the sharded and single-device
        # updates then differ by a sizeable fraction of the update itself. SGD's update is
        # proportional to the gradient, so its differences stay at bf16's rounding.
        optimizer=("sgd" if dtype in ("bf16_compute", "bf16")
                   else draw(st.sampled_from(["sgd", "adamw"]))),
        seed=draw(st.integers(0, 3)),
    )


def _dtypes(spec: Spec) -> tuple[Any, Any]:
    """(computation dtype, parameter dtype) of the blocks; stems and heads stay float32."""
    return {"float32": (None, jnp.float32), "bf16_params": (None, jnp.bfloat16),
            "bf16_compute": (jnp.bfloat16, jnp.float32),
            "bf16": (jnp.bfloat16, jnp.bfloat16)}[spec.dtype]


def _norm(kind: str, dtype: Any, param_dtype: Any):
    if kind == "layer":
        return nn.LayerNorm(dtype=dtype, param_dtype=param_dtype)
    if kind == "rms":
        return nn.RMSNorm(dtype=dtype, param_dtype=param_dtype)
    return lambda x: x


class Block(nn.Module):
    """x + f(norm(x)) for one kind of f, optionally followed by dropout."""

    spec: Spec
    kind: str

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s = self.spec
        dtype, param_dtype = _dtypes(s)
        dense = lambda n, **kw: nn.Dense(n, dtype=dtype, param_dtype=param_dtype, **kw)
        y = _norm(s.norm, dtype, param_dtype)(x)
        if self.kind == "dense":
            y = dense(s.width)(nn.gelu(dense(2 * s.width)(y)))
        elif self.kind == "attention":
            y = nn.MultiHeadDotProductAttention(num_heads=s.heads, dtype=dtype,
                                                param_dtype=param_dtype)(y, y)
        elif self.kind == "einsum_attention":
            y = _einsum_attention(y, s, dense)
        elif self.kind == "mixer":
            # Mix along tokens: the token axis becomes the features of a Dense.
            y = jnp.swapaxes(dense(y.shape[1])(jnp.swapaxes(y, 1, 2)), 1, 2)
        elif self.kind in ("conv", "depthwise"):
            groups = s.width if self.kind == "depthwise" else 1
            y = nn.Conv(s.width, (3,), feature_group_count=groups, dtype=dtype,
                        param_dtype=param_dtype)(y)
        elif self.kind == "heads":
            b, t, d = y.shape
            y = y.reshape(b, t, s.heads, d // s.heads)
            w = self.param("mix", nn.initializers.lecun_normal(batch_axis=(0,)),
                           (s.heads, d // s.heads, d // s.heads), param_dtype)
            y = jnp.einsum("bthd,hde->bthe", y, w.astype(dtype or w.dtype)).reshape(b, t, d)
        else:
            raise ValueError(self.kind)
        if s.dropout:
            y = nn.Dropout(rate=0.1, deterministic=False)(y)
        # The residual stream keeps the input's dtype (float32): bf16 lives inside the block.
        return x + y.astype(x.dtype)


def _einsum_attention(y: jax.Array, s: Spec, dense) -> jax.Array:
    """Causal multi-head attention written with einsums over (batch, tokens, heads, dim)."""
    b, t, d = y.shape
    head_dim = d // s.heads
    q, k, v = (dense(d, name=n)(y).reshape(b, t, s.heads, head_dim) for n in "qkv")
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(q.dtype)
    causal = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
    return dense(d, name="out")(out)


class Layer(nn.Module):
    """The drawn blocks in order, with the (carry, x) -> (carry, y) signature of nn.scan."""

    spec: Spec

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
        block = nn.remat(Block) if self.spec.remat else Block
        for i, kind in enumerate(self.spec.blocks):
            x = block(self.spec, kind, name=f"{kind}_{i}")(x)
        return x, None


class LaxStack(nn.Module):
    """LAYERS tanh layers with stacked weights, applied by jax.lax.scan over the stack."""

    spec: Spec

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s = self.spec
        dtype, param_dtype = _dtypes(s)
        w = self.param("w", nn.initializers.lecun_normal(batch_axis=(0,)),
                       (LAYERS, s.width, s.width), param_dtype)
        b = self.param("b", nn.initializers.zeros, (LAYERS, s.width), param_dtype)

        def body(h, wb):
            w, b = wb
            cdt = dtype or jnp.promote_types(h.dtype, w.dtype)
            y = jnp.tanh(h.astype(cdt) @ w.astype(cdt) + b.astype(cdt))
            return h + y.astype(h.dtype), None

        if s.remat:
            body = jax.checkpoint(body)
        return jax.lax.scan(body, x, (w, b))[0]


class Model(nn.Module):
    spec: Spec

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        s = self.spec
        embed = None
        if s.inputs == "tokens":
            embed = nn.Embed(VOCAB, s.width)
            x = embed(inputs)
        elif s.inputs == "image":
            x = nn.relu(nn.Conv(s.width, (3, 3))(inputs))
            if s.strided:
                x = nn.relu(nn.Conv(s.width, (3, 3), strides=(2, 2))(x))
            x = x.reshape(x.shape[0], -1, s.width)  # pixels become tokens
        else:
            x = nn.Dense(s.width)(inputs)
        if s.blocks:
            if s.stack == "nn_scan":
                stack = nn.scan(Layer, variable_axes={"params": 0},
                                split_rngs={"params": True, "dropout": True}, length=LAYERS)
                x, _ = stack(s, name="layers")(x, None)
            elif s.stack == "python_loop":
                for i in range(LAYERS):
                    x, _ = Layer(s, name=f"layers_{i}")(x)
            else:
                x, _ = Layer(s, name="layers")(x)
        if s.lax_scan:
            x = LaxStack(s)(x)
        if s.pool != "none":
            x = {"mean": jnp.mean, "sum": jnp.sum, "max": jnp.max}[s.pool](x, axis=1)
        # The head's input is normalised whatever came before: a sum over tokens (or blocks
        # without norms) would otherwise scale the logits, and the loss's curvature with them,
        # until two SGD steps overshoot and amplify rounding differences.
        x = nn.LayerNorm()(x)
        if s.head == "tied":
            out = embed.attend(x)
        else:
            out = nn.Dense(CLASSES)(x)
        return out.astype(jnp.float32)  # the loss is float32 whatever the blocks computed in


def _loss(spec: Spec, out: jax.Array, targets: jax.Array) -> jax.Array:
    if spec.head == "regression":
        return jnp.mean((out - targets) ** 2)
    # Cross-entropy with integer labels, gathered with take_along_axis.
    logp = jax.nn.log_softmax(out, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def _optimizer(spec: Spec) -> optax.GradientTransformation:
    """Two steps move the state by roughly 10% to 100% of its norm: far above the tests'
    state tolerance, small enough that rounding differences are not amplified."""
    if spec.optimizer == "sgd":
        return optax.sgd(0.02, momentum=0.9)
    # Adam divides by |g| + eps. Some gradients are zero in exact arithmetic (an attention key
    # bias: softmax ignores a shift shared by all keys) and only rounding noise (~1e-9) in
    # floating point, so at the default eps=1e-8 the noise's sign becomes a sizeable update
    # that differs with the summation order. eps=1e-6 scales such noise down to ~1e-3 of the
    # learning rate and leaves the real gradients (~1e-4 and up) unaffected.
    return optax.adamw(1e-2, eps=1e-6, weight_decay=1e-4)


def build(spec: Spec):
    """(step, state, batch) for `spec`: state = (params, opt_state)."""
    model = Model(spec)
    # Data from numpy, initialisation and optimizer state under one jit each: building a case
    # op by op would compile more small programs than the case itself.
    rng = np.random.default_rng(spec.seed)
    if spec.inputs == "tokens":
        inputs = rng.integers(0, VOCAB, (spec.batch, spec.seq), dtype=np.int32)
    elif spec.inputs == "image":
        inputs = rng.standard_normal((spec.batch, IMAGE, IMAGE, 3), dtype=np.float32)
    else:
        inputs = rng.standard_normal((spec.batch, spec.seq, spec.width), dtype=np.float32)
    # The rbg generator initialises in one XLA op; threefry's hash, unrolled once per
    # parameter, would double the case's compile time. Dropout keeps the default threefry key.
    k_init = jax.random.key(spec.seed, impl="rbg")
    k_drop = jax.random.PRNGKey(spec.seed)
    params = jax.jit(model.init)({"params": k_init, "dropout": k_drop}, inputs)
    out_shape = jax.eval_shape(lambda: model.apply(params, inputs, rngs={"dropout": k_drop})).shape
    if spec.head == "regression":
        targets = rng.standard_normal(out_shape, dtype=np.float32)
    else:
        targets = rng.integers(0, out_shape[-1], out_shape[:-1], dtype=np.int32)
    batch = {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets)}
    if spec.dropout:
        batch["dropout"] = k_drop
    tx = _optimizer(spec)

    def step(state, batch):
        params, opt_state = state

        def loss_fn(p):
            rngs = {"dropout": batch["dropout"]} if "dropout" in batch else {}
            return _loss(spec, model.apply(p, batch["inputs"], rngs=rngs), batch["targets"])

        loss, grads = autopar.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, (params, jax.jit(tx.init)(params)), batch
