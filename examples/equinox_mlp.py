"""An Equinox MLP trained with optax, sharded by autopar, both ways Equinox code is written.

- Partitioned: `eqx.partition(model, eqx.is_array)` splits the arrays from the rest; the step
  takes the arrays (and the optimizer state) and merges them with the static part it closes
  over. autopar shards the arrays like any pytree.
- Whole module: the step takes the module's arrays in the module's own structure
  (`eqx.filter(model, eqx.is_array)`, as `eqx.filter_jit` passes them) and uses Equinox's
  filtered gradient and update inside. The module itself cannot be an argument of a jitted
  step, under jax.jit or autopar: its activation functions are leaves that are not arrays.

Run: `XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/equinox_mlp.py`.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import autopar  # noqa: E402


def setup(width: int = 64, batch: int = 32, seed: int = 0):
    """The model, its optimizer and a batch."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    model = eqx.nn.MLP(width, width, width, depth=2, key=k1)
    tx = optax.adamw(1e-3)
    batch = {"x": jax.random.normal(k2, (batch, width)),
             "y": jax.random.normal(k3, (batch, width))}
    return model, tx, batch


def loss(model: eqx.Module, batch: dict) -> jax.Array:
    return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)


def partitioned(model: eqx.Module, tx: optax.GradientTransformation):
    """The step on (arrays, optimizer state), the static part closed over."""
    params, static = eqx.partition(model, eqx.is_array)

    def step(state, batch):
        params, opt_state = state
        value, grads = jax.value_and_grad(
            lambda p: loss(eqx.combine(p, static), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    return step, (params, tx.init(params))


def whole(model: eqx.Module, tx: optax.GradientTransformation):
    """The step on the whole module: Equinox's filtered gradient and update, the module's
    arrays (eqx.filter) traced, its structure and functions rebuilt around them."""
    params, static = eqx.partition(model, eqx.is_array)

    def step(model_arrays, opt_state, batch):
        model = eqx.combine(model_arrays, static)
        value, grads = eqx.filter_value_and_grad(loss)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return eqx.filter(model, eqx.is_array), opt_state, value

    return step, (params, tx.init(params))


def main() -> None:
    model, tx, batch = setup()
    mesh = autopar.make_mesh({"data": 2, "model": 4})
    step, state = partitioned(model, tx)
    sharded = autopar.auto_parallel(step, mesh=mesh)
    for i in range(3):
        state, value = sharded(state, batch)
        print(f"partitioned, step {i}: loss {float(value):.5f}")
    step, (arrays, opt_state) = whole(model, tx)
    sharded = autopar.auto_parallel(step, mesh=mesh)
    for i in range(3):
        arrays, opt_state, value = sharded(arrays, opt_state, batch)
        print(f"whole module, step {i}: loss {float(value):.5f}")
    print(sharded.plan(arrays, opt_state, batch).summary(limit=5))


if __name__ == "__main__":
    main()
