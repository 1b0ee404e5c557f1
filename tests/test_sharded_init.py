"""Sharded initialisation: `step.init(init_fn, ...)` creates the state already in the plan's
layout (no device holds all of it), equal to the single-device init, and training from it
computes what the single-device step computes."""
import jax
import models
import numpy as np
import optax
import pytest

import autopar
from helpers import copy_tree, global_relative_error, run_steps

MESH = {"data": 2, "model": 4}


def linen_init(model, tx, x):
    """A linen model's parameters and `tx`'s state from a key, for inputs like `x`."""
    def init(key):
        params = model.init(key, jax.numpy.zeros(x.shape, x.dtype))
        return params, tx.init(params)
    return init


def gpt_init():
    model = models.GPT(vocab=256, d_model=64, heads=4, layers=2)
    tx = optax.adamw(1e-3)
    tokens = jax.ShapeDtypeStruct((8, 16), np.int32)
    init = linen_init(model, tx, tokens)
    step = models.linen_step(model, models.token_loss, tx)
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    batch = {"inputs": jax.random.randint(k1, tokens.shape, 0, 256),
             "targets": jax.random.randint(k2, tokens.shape, 0, 256)}
    return step, init, batch


@pytest.mark.slow
def test_init_lays_the_state_out_as_planned_and_trains_as_one_device():
    step, init, batch = gpt_init()
    key = jax.random.PRNGKey(0)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESH))
    state = sharded.init(init, key, step_args=(batch,))
    reference = jax.jit(init)(key)
    # the same random bits (partitionable threefry); the scaling rounds as partitioned
    assert global_relative_error(reference, state) < 1e-6
    wanted = sharded.input_shardings(state, batch)[0][0]
    for leaf, want in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(wanted)):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
    # a device holds what the plan says, not the whole state
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(state))
    plan = sharded.plan(state, batch)
    assert held == sum(t.bytes_per_device for t in plan.inputs if t.path.startswith("state/"))
    assert held < 0.7 * total
    ref_state, ref_losses = run_steps(jax.jit(step), copy_tree(reference), batch, 2)
    new_state, losses = run_steps(sharded, state, batch, 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert global_relative_error(ref_state, new_state) < 1e-4


def test_init_refuses_a_state_position_outside_the_arguments():
    step, init, batch = gpt_init()
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESH))
    with pytest.raises(autopar.AutoparError, match="state_argnum=3"):
        sharded.init(init, jax.random.PRNGKey(0), step_args=(batch,), state_argnum=3)


def test_a_state_three_times_a_devices_memory_is_made_in_parts():
    """An MLP whose parameters and Adam state (144 MiB) are three times what a device may
    hold (48 MiB): made by init in the plan's layout, each device computing and holding its
    part; the whole never exists on one device."""
    limit = 48 * 2**20
    model = models.MLP(hidden=2048, out=2048)
    tx = optax.adamw(1e-3)
    x = jax.ShapeDtypeStruct((64, 2048), np.float32)
    init = linen_init(model, tx, x)
    step = models.linen_step(model, models.mse, tx)
    batch = {"inputs": x, "targets": jax.ShapeDtypeStruct((64, 2048), np.float32)}
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 8}),
                                    memory_limit=limit)
    state = sharded.init(init, jax.random.PRNGKey(0), step_args=(batch,))
    total = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    assert total > 2.9 * limit
    for d in range(8):
        held = sum(leaf.addressable_shards[d].data.nbytes
                   for leaf in jax.tree_util.tree_leaves(state))
        assert held <= limit / 2
    shardings = sharded.input_shardings(state, batch)[0][0]
    compiled = jax.jit(init, out_shardings=shardings).lower(jax.random.PRNGKey(0)).compile()
    assert compiled.memory_analysis().output_size_in_bytes <= limit / 2


@pytest.mark.slow
def test_an_nnx_model_constructed_in_the_plans_layout():
    """NNX: the module constructed inside init (nnx.split of its parameters), with optax's
    state: equal to the single-device construction, laid out as planned, and it trains."""
    from flax import nnx
    step, state, batch = models.nnx_setup()
    tx = optax.adamw(1e-3)

    def init(key):
        model = models.NnxMLP(24, 64, 16, nnx.Rngs(key))
        params = nnx.split(model, nnx.Param)[1]
        return params, tx.init(params)

    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESH))
    made = sharded.init(init, jax.random.key(0), step_args=(batch,))
    assert global_relative_error(state, made) < 1e-6
    wanted = sharded.input_shardings(made, batch)[0][0]
    for leaf, want in zip(jax.tree_util.tree_leaves(made), jax.tree_util.tree_leaves(wanted)):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
    ref_state, ref_losses = run_steps(jax.jit(step), copy_tree(state), batch, 2)
    new_state, losses = run_steps(sharded, made, batch, 2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
