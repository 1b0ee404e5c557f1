"""Transformer workloads in the manner of MaxText, for benchmarks on TPU programs.

Models: a Llama-2/3-class decoder (RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU), the same decoder with Mixtral-style mixture-of-experts MLPs, and a ViT encoder.
Parameters are float32, compute bfloat16. Every parameter carries logical axis names
('embed', 'vocab', 'mlp', 'heads', 'kv_heads', 'kv', 'norm', 'exp', 'layers') and every main
activation a flax logical constraint ('activation_batch', 'activation_embed', ...). Those
constraints only act inside `nn.logical_axis_rules(...)` with a mesh set (`jax.set_mesh`):
traced plainly, the train step holds no sharding constraint, so one step function serves a
planner that wants a single-device program and the experts that jit it with rules. (The
legacy `with mesh:` does not set the mesh flax looks up, jax's abstract mesh: under it alone
the constraints stay no-ops too.) The layers are in `tpu_layers`, the experts' MLP in
`tpu_moe`.

`llama`, `mixtral`, `vit` and `setup` build a `Workload`: the train step, the abstract state
(params, adamw state) and batch, their logical axis names, and an `init` for real arrays.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from benchmarks.tpu_layers import Config, Decoder, ViT

_LLAMA2_7B = dict(vocab=32000, embed=4096, heads=32, kv_heads=32, head_dim=128, mlp=11008,
                  layers=32)
CONFIGS: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(family="llama", **_LLAMA2_7B),
    "llama2-13b": dict(family="llama", vocab=32000, embed=5120, heads=40, kv_heads=40,
                       head_dim=128, mlp=13824, layers=40),
    "llama3-8b": dict(family="llama", vocab=128256, embed=4096, heads=32, kv_heads=8,
                      head_dim=128, mlp=14336, layers=32, rope_theta=500000.0),
    "mixtral-8x7b": dict(family="mixtral", vocab=32000, embed=4096, heads=32, kv_heads=8,
                         head_dim=128, mlp=14336, layers=32, experts=8, top_k=2,
                         rope_theta=1e6),
    "vit-large": dict(family="vit", embed=1024, heads=16, kv_heads=16, head_dim=64, mlp=4096,
                      layers=24, image=224, patch=16, classes=1000),
    # Tiny versions for tests: same structure, compiles in seconds.
    "llama-tiny": dict(family="llama", vocab=256, embed=64, heads=4, kv_heads=2, head_dim=16,
                       mlp=128, layers=2, remat="none"),
    "mixtral-tiny": dict(family="mixtral", vocab=256, embed=64, heads=4, kv_heads=2,
                         head_dim=16, mlp=128, layers=2, experts=8, top_k=2, group_size=16,
                         remat="none"),
    "vit-tiny": dict(family="vit", embed=64, heads=4, kv_heads=4, head_dim=16, mlp=128,
                     layers=2, image=32, patch=8, classes=10, remat="none"),
}

Names = tuple  # a leaf's logical axis names, one per dimension (None: unnamed)


class Workload(NamedTuple):
    """A benchmark train step and its abstract inputs.

    step(state, batch) -> (new_state, loss), with state = (params, opt_state): plain arrays.
    state, batch: pytrees of jax.ShapeDtypeStruct (nothing allocated).
    logical: (state_names, batch_names), pytrees of the same structure as state and batch
      whose leaves are tuples of logical axis names (optimizer moments mirror their
      parameter's; scalars get ()). Test leaves with `is_names`.
    init(rng) -> a concrete state of the same structure (for small models run for real).
    config: the model's Config.
    """
    step: Callable[[Any, Any], tuple[Any, jax.Array]]
    state: Any
    batch: Any
    logical: tuple[Any, Any]
    init: Callable[[jax.Array], Any]
    config: Config


def is_names(x: Any) -> bool:
    """Whether `x` is a leaf of a logical-names tree: a plain tuple of str/None."""
    return type(x) is tuple and all(e is None or isinstance(e, str) for e in x)


def config(name: str, **overrides: Any) -> Config:
    """The named configuration (`CONFIGS`), fields overridden (remat, scan_layers, ...)."""
    fields = dict(CONFIGS[name])
    fields.update(overrides)
    return Config(**fields)


def _names(boxed: Any) -> Any:
    """Logical names of every leaf of a tree holding `nn.Partitioned` boxes."""
    def one(leaf: Any) -> Names:
        if isinstance(leaf, nn.Partitioned):
            return tuple(leaf.names)
        return (None,) * len(leaf.shape)
    return jax.tree.map(one, boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def optimizer(learning_rate: float) -> optax.GradientTransformation:
    """MaxText's defaults: global-norm clipping at 1, then adamw (b2 0.95, decay 0.1)."""
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=0.1))


def _workload(model: nn.Module, cfg: Config, batch: dict[str, Any],
              batch_names: dict[str, Names], loss_fn: Callable, learning_rate: float,
              input_key: str) -> Workload:
    """Assemble the step, abstract state and names for `model` fed `batch[input_key]`."""
    tx = optimizer(learning_rate)

    def boxed_init(rng: jax.Array, inputs: Any) -> Any:
        return model.init(rng, inputs)["params"]

    @jax.jit  # one compile rather than an op-by-op run of every initializer
    def init(rng: jax.Array) -> Any:
        params = nn.meta.unbox(boxed_init(rng, jnp.zeros(batch[input_key].shape,
                                                          batch[input_key].dtype)))
        return params, tx.init(params)

    boxed = jax.eval_shape(boxed_init, jax.random.key(0), batch[input_key])
    # adamw's moments are built by tree_map over the params, so they keep the boxes.
    boxed_opt = jax.eval_shape(tx.init, boxed)
    state = (nn.meta.unbox(boxed), nn.meta.unbox(boxed_opt))
    logical = ((_names(boxed), _names(boxed_opt)), batch_names)

    def step(state: Any, batch: Any) -> tuple[Any, jax.Array]:
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return Workload(step, state, batch, logical, init, cfg)


def _decoder(cfg: Config, batch: int, seq: int, learning_rate: float) -> Workload:
    model = Decoder(cfg)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    names = ("activation_batch", "activation_length")

    def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        logits, aux = model.apply({"params": params}, batch["inputs"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        return jnp.mean(ce) + cfg.aux_coef * aux

    return _workload(model, cfg, {"inputs": tokens, "targets": tokens},
                     {"inputs": names, "targets": names}, loss_fn, learning_rate, "inputs")


def llama(name: str = "llama3-8b", batch: int = 8, seq: int = 2048, *,
          learning_rate: float = 3e-4, **overrides: Any) -> Workload:
    """A Llama decoder's next-token train step on int32 [batch, seq] inputs and targets."""
    return _decoder(config(name, **overrides), batch, seq, learning_rate)


def mixtral(name: str = "mixtral-8x7b", batch: int = 8, seq: int = 2048, *,
            learning_rate: float = 3e-4, **overrides: Any) -> Workload:
    """The decoder with mixture-of-experts MLPs; the loss adds aux_coef * load balancing."""
    cfg = config(name, **overrides)
    if cfg.experts < 2:
        raise ValueError(f"{name} has no experts")
    return _decoder(cfg, batch, seq, learning_rate)


def vit(name: str = "vit-large", batch: int = 8, *, learning_rate: float = 3e-4,
        **overrides: Any) -> Workload:
    """A ViT classifier's train step on float32 [batch, image, image, 3] images and int32
    [batch] labels."""
    cfg = config(name, **overrides)
    model = ViT(cfg)
    images = jax.ShapeDtypeStruct((batch, cfg.image, cfg.image, cfg.channels), jnp.float32)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def loss_fn(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        logits = model.apply({"params": params}, batch["images"])
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits,
                                                                         batch["labels"]))

    names = {"images": ("activation_batch", None, None, None), "labels": ("activation_batch",)}
    return _workload(model, cfg, {"images": images, "labels": labels}, names, loss_fn,
                     learning_rate, "images")


def setup(name: str, batch: int = 8, seq: int = 2048, **overrides: Any) -> Workload:
    """The named configuration's workload, whatever its family (ViT ignores `seq`)."""
    family = CONFIGS[name]["family"]
    if family == "vit":
        return vit(name, batch, **overrides)
    return (mixtral if family == "mixtral" else llama)(name, batch, seq, **overrides)

