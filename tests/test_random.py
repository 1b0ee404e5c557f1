"""Random numbers in a step: dropout (linen and nnx), sampling, per-example keys.

Key arrays (raw uint32 keys and typed `jax.random.key`s) are inputs, outputs and
intermediates; the random bits split like the values that use them, and the sharded step draws
the same numbers as one device (threefry is partitionable: each bit hashes its own index).
"""
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import autopar
from helpers import copy_tree, run_steps

MESHES = {"8": {"data": 8}, "2x4": {"data": 2, "model": 4}}
KEYS = {"raw": lambda seed: jax.random.PRNGKey(seed), "typed": lambda seed: jax.random.key(seed)}


def train_both(step, state, batch, mesh, steps=2):
    """`steps` steps single-device and sharded (no operator may fall back to replication):
    (reference state, reference losses, sharded state, sharded losses, plan)."""
    ref_state, ref_losses = run_steps(jax.jit(step), copy_tree(state), batch, steps)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(mesh))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.AutoparWarning)
        new_state, losses = run_steps(sharded, copy_tree(state), batch, steps)
    return ref_state, ref_losses, new_state, losses, sharded.plan(new_state, batch)


def assert_equal_trees(reference, other):
    """Floats within rtol 1e-5, integers and key data exactly."""
    for want, got in zip(jax.tree_util.tree_leaves(reference), jax.tree_util.tree_leaves(other),
                         strict=True):
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            assert got.dtype == want.dtype
            want, got = jax.random.key_data(want), jax.random.key_data(got)
        if jnp.issubdtype(want.dtype, jnp.floating):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def sharded_ops(plan, primitive):
    """The plan's decisions for `primitive`, and whether each splits its first result."""
    ops = [o for o in plan.ops if o.primitive == primitive]
    return ops, [any(axes for axes in o.out_specs[0]) for o in ops]


class DropoutBlock(nn.Module):
    """A residual MLP block over (batch, tokens, features) with dropout on its hidden units."""

    hidden: int = 64

    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.gelu(nn.Dense(self.hidden)(x))
        h = nn.Dropout(rate=0.1)(h, deterministic=not train)
        return nn.LayerNorm()(x + nn.Dense(x.shape[-1])(h))


def linen_dropout_setup(key, batch=16, tokens=8, features=16):
    model = DropoutBlock()
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(k1, (batch, tokens, features))
    y = jax.random.normal(k2, (batch, tokens, features))
    params = model.init(k3, x, train=False)
    tx = optax.sgd(0.1, momentum=0.9)

    def make_step(train):
        def step(state, batch):
            params, opt_state = state

            def loss_fn(p):
                out = model.apply(p, batch["inputs"], train=train,
                                  rngs={"dropout": batch["dropout"]})
                return jnp.mean((out - batch["targets"]) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss
        return step

    batch = {"inputs": x, "targets": y, "dropout": key}
    return make_step, (params, tx.init(params)), batch


@pytest.mark.slow
@pytest.mark.parametrize("key,mesh", [("raw", "8"), ("typed", "2x4")])
def test_linen_dropout(key, mesh):
    make_step, state, batch = linen_dropout_setup(KEYS[key](7))
    ref_state, ref_losses, new_state, losses, plan = train_both(
        make_step(train=True), state, batch, MESHES[mesh])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_equal_trees(ref_state, new_state)
    # Dropout is on: the loss is not the deterministic one.
    _, plain_loss = jax.jit(make_step(train=False))(copy_tree(state), batch)
    assert abs(ref_losses[0] - float(plain_loss)) > 1e-3 * abs(float(plain_loss))
    # The mask is drawn sharded: each device makes the bits of its own block.
    bits, split = sharded_ops(plan, "random_bits")
    assert bits and all(o.out_shapes[0] == (16, 8, 64) for o in bits)
    assert all(split), [o.out_specs for o in bits]
    key_input = next(t for t in plan.inputs if t.path == "batch/dropout")
    assert key_input.dtype == ("key<fry>" if key == "typed" else "uint32")
    assert key_input.bytes_per_device == 8  # a threefry key: 2 x uint32, typed or raw
    assert autopar.Plan.from_json(plan.to_json()) == plan


class NnxDropoutMLP(nnx.Module):
    def __init__(self, features, hidden, out, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(features, hidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, out, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.dropout(nnx.relu(self.fc1(x))))


@pytest.mark.slow
def test_nnx_dropout_rngs_in_state():
    """The NNX performance guide's loop: model, optimizer and their rng streams split into one
    state that goes through the step and comes back, key and count included."""
    model = NnxDropoutMLP(16, 128, 8, nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    k1, k2 = jax.random.split(jax.random.PRNGKey(2))
    batch = {"inputs": jax.random.normal(k1, (64, 16)), "targets": jax.random.normal(k2, (64, 8))}

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            return jnp.mean((model(batch["inputs"]) - batch["targets"]) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    leaves = jax.tree_util.tree_leaves(state)
    assert any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) for x in leaves)
    ref_state, ref_losses, new_state, losses, plan = train_both(step, state, batch,
                                                                MESHES["2x4"])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # Parameters, optimizer state and the rng streams (key data and count) as on one device.
    assert_equal_trees(ref_state, new_state)
    counts = [x for x in jax.tree_util.tree_leaves(new_state) if x.dtype == jnp.uint32]
    assert counts and any(int(c) > 0 for c in counts), "the dropout stream was drawn from"
    bits, split = sharded_ops(plan, "random_bits")
    assert bits and all(o.out_shapes[0] == (64, 128) for o in bits)
    assert all(split), [o.out_specs for o in bits]


@pytest.mark.slow
def test_categorical_sampling():
    """Policy-gradient style: sample actions from the logits, then train on them."""
    def step(w, batch):
        logits = jnp.tanh(batch["obs"] @ w["hidden"]) @ w["out"]
        actions = jax.random.categorical(batch["key"], logits, axis=-1)

        def loss_fn(w):
            logits = jnp.tanh(batch["obs"] @ w["hidden"]) @ w["out"]
            chosen = jnp.take_along_axis(jax.nn.log_softmax(logits), actions[:, None], axis=-1)
            return -jnp.mean(chosen[:, 0] * batch["reward"])

        loss, grads = jax.value_and_grad(loss_fn)(w)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, w, grads), (loss, actions)

    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    w = {"hidden": jax.random.normal(ks[0], (16, 64)) * 0.3,
         "out": jax.random.normal(ks[1], (64, 32)) * 0.3}
    batch = {"obs": jax.random.normal(ks[2], (64, 16)), "reward": jax.random.normal(ks[3], (64,)),
             "key": jax.random.key(11)}
    ref_w, (ref_loss, ref_actions) = jax.jit(step)(copy_tree(w), batch)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESHES["8"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.AutoparWarning)
        new_w, (loss, actions) = sharded(copy_tree(w), batch)
    assert len(np.unique(np.asarray(ref_actions))) > 4, "a real sample, not a constant"
    np.testing.assert_array_equal(np.asarray(actions), np.asarray(ref_actions))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_equal_trees(ref_w, new_w)
    plan = sharded.plan(w, batch)
    bits, split = sharded_ops(plan, "random_bits")
    assert bits and all(o.out_shapes[0] == (64, 32) for o in bits)
    assert all(split), [o.out_specs for o in bits]


def test_per_example_keys():
    """Keys split per example (a key array as an intermediate, annotated to be split over the
    batch, and an output) and vmapped noise drawn from them."""
    def step(w, batch):
        keys = jax.random.split(batch["key"], batch["x"].shape[0])
        keys = autopar.shard(keys, P("data"))
        noise = jax.vmap(lambda k: jax.random.normal(k, (w.shape[0],)))(keys)

        def loss_fn(w):
            return jnp.mean(jnp.tanh((batch["x"] + 0.1 * noise) @ w) ** 2)

        loss, grad = jax.value_and_grad(loss_fn)(w)
        return w - 0.1 * grad, (loss, keys)

    w = jax.random.normal(jax.random.PRNGKey(0), (32, 32)) * 0.3
    batch = {"x": jax.random.normal(jax.random.PRNGKey(1), (64, 32)), "key": jax.random.key(5)}
    ref_w, (ref_loss, ref_keys) = jax.jit(step)(jnp.array(w), batch)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESHES["2x4"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.AutoparWarning)
        new_w, (loss, keys) = sharded(jnp.array(w), batch)
    assert keys.shape == (64,)
    assert_equal_trees((ref_w, ref_loss, ref_keys), (new_w, loss, keys))
    plan = sharded.plan(w, batch)
    bits, split = sharded_ops(plan, "random_bits")
    # The noise is drawn from keys split over the batch (not gathered first).
    assert bits and all("data" in o.in_specs[0][0] for o in bits), [o.in_specs for o in bits]
    assert all(split) and sharded_ops(plan, "random_split")[0]
    assert keys.sharding.is_equivalent_to(NamedSharding(sharded.mesh(w, batch), P("data")), 1)
