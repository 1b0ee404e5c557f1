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


def gpt_init():
    model = models.GPT(vocab=256, d_model=64, heads=4, layers=2)
    tx = optax.adamw(1e-3)
    tokens = jax.ShapeDtypeStruct((8, 16), np.int32)

    def init(key):
        params = model.init(key, jax.numpy.zeros(tokens.shape, tokens.dtype))
        return params, tx.init(params)

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
    ref_state, ref_losses = run_steps(jax.jit(step), copy_tree(reference), batch, 3)
    new_state, losses = run_steps(sharded, state, batch, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert global_relative_error(ref_state, new_state) < 1e-4


def test_init_refuses_a_state_position_outside_the_arguments():
    step, init, batch = gpt_init()
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESH))
    with pytest.raises(autopar.AutoparError, match="state_argnum=3"):
        sharded.init(init, jax.random.PRNGKey(0), step_args=(batch,), state_argnum=3)
