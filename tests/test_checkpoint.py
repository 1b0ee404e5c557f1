"""Sharded checkpoints (orbax): a plan's state saved and restored into another mesh, another
strategy, a pipelined layout and back, and training goes on equal to an uninterrupted run on
one device."""
import jax
import models
import numpy as np
import optax
import pytest
from helpers import copy_tree, global_relative_error, run_steps
from jax.sharding import PartitionSpec as P

import autopar


def reference_run(step, state, batch, steps):
    return run_steps(jax.jit(step), copy_tree(state), batch, steps)


def resumed(tmp_path, step, state, batch, first, then, name="ckpt"):
    """2 steps under `first`, saved; restored into `then`'s layout; 2 more steps there."""
    trained, losses = run_steps(first, copy_tree(state), batch, 2)
    path = tmp_path / name
    autopar.save_checkpoint(path, trained, first.plan(trained, batch))
    layout = then.input_shardings(state, batch)[0][0]
    restored = autopar.restore_checkpoint(path, state, layout)
    for leaf, sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(layout)):
        assert leaf.sharding == sharding
    final, more = run_steps(then, restored, batch, 2)
    return final, losses + more


@pytest.mark.slow
@pytest.mark.parametrize("target", ["4x2", "data parallel"])
def test_restore_into_another_mesh_and_strategy(tmp_path, target):
    step, state, batch = models.gpt_setup()
    first = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 2, "model": 4}),
                                  donate_argnums=0)
    if target == "4x2":
        then = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 4, "model": 2}),
                                     donate_argnums=0)
    else:  # what a user pins by hand: state replicated, the batch split 8 ways
        then = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 8}),
                                     annotations={"state/.*": P(), "batch/.*": P("data")},
                                     donate_argnums=0)
    final, losses = resumed(tmp_path, step, state, batch, first, then)
    expected, expected_losses = reference_run(step, state, batch, 4)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert global_relative_error(expected, final) < 1e-4
    saved = autopar.checkpoint_plan(tmp_path / "ckpt")
    assert saved == first.plan(state, batch)
    if target == "data parallel":
        assert all(s.spec == P() for s in jax.tree.leaves(then.input_shardings(state, batch)[0][0]))


@pytest.mark.slow
def test_restore_a_pipelined_layout_into_an_unpipelined_one_and_back(tmp_path):
    config = dict(vocab=64, d_model=32, heads=4, layers=4, scan=True)
    _, state, batch = models.gpt_setup(batch=16, seq=16, **config)
    step = models.linen_step(models.GPT(**config), models.token_loss, optax.adamw(1e-3),
                             autopar.value_and_grad)
    pipelined = autopar.auto_parallel(step, mesh=autopar.make_mesh({"stage": 2, "data": 4}),
                                      donate_argnums=0, microbatches=4, pipeline=2)
    flat = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 2, "model": 4}),
                                 donate_argnums=0)
    kernel = pipelined.input_shardings(state, batch)[0][0][0]["params"]["layers"]["Block_0"]
    assert kernel["mlp_in"]["kernel"].spec[0] == "stage"  # the layers split over stages
    middle, losses = resumed(tmp_path, step, state, batch, pipelined, flat, "to_flat")
    path = tmp_path / "back"
    autopar.save_checkpoint(path, middle)
    back = autopar.restore_checkpoint(path, state, pipelined.input_shardings(state, batch)[0][0])
    final, more = run_steps(pipelined, back, batch, 1)
    expected, expected_losses = reference_run(step, state, batch, 5)
    np.testing.assert_allclose(losses + more, expected_losses, rtol=1e-5)
    assert global_relative_error(expected, final) < 1e-4
    assert autopar.checkpoint_plan(path) is None  # saved without a plan


def test_checkpoint_errors_name_the_problem(tmp_path):
    step, state, batch = models.mlp_setup()
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 2, "model": 4}))
    layout = sharded.input_shardings(state, batch)[0][0]
    autopar.save_checkpoint(tmp_path / "c", state)
    with pytest.raises(autopar.AutoparError, match="exists. Fix"):
        autopar.save_checkpoint(tmp_path / "c", state)
    autopar.save_checkpoint(tmp_path / "c", state, overwrite=True)
    with pytest.raises(autopar.AutoparError, match="no checkpoint at"):
        autopar.restore_checkpoint(tmp_path / "missing", state, layout)
    wider = jax.tree.map(lambda x: np.zeros(np.shape(x) + (2,)) if np.ndim(x) == 2 else x, state)
    with pytest.raises(autopar.AutoparError, match=r"has shape \(\d+, \d+\), and the target"):
        autopar.restore_checkpoint(tmp_path / "c", wider, layout)
    with pytest.raises(autopar.AutoparError, match="no sharding for"):
        autopar.restore_checkpoint(tmp_path / "c", jax.tree.map(np.asarray, state))
    with pytest.raises(autopar.AutoparError, match="do not match the tree"):
        autopar.restore_checkpoint(tmp_path / "c", state, {"x": layout})
