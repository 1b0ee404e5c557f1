"""Calling conventions as jax.jit has them: donation only when asked, keyword and static
arguments, jax.make_mesh meshes, and clear errors for arguments that cannot be traced."""
import functools

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest
from jax.sharding import NamedSharding

import autopar
from helpers import check_against_single_device, copy_tree, global_relative_error, run_steps

MESH = {"data": 2, "model": 4}


def host(tree):
    return jax.tree_util.tree_map(np.array, tree)


def assert_alive_and_unchanged(arrays, values):
    for (path, x), want in zip(jax.tree_util.tree_flatten_with_path(arrays)[0],
                               jax.tree_util.tree_leaves(values)):
        assert not x.is_deleted(), f"{jax.tree_util.keystr(path)} was deleted"
        np.testing.assert_array_equal(np.asarray(x), want)


@pytest.mark.slow
def test_default_call_deletes_none_of_the_callers_arrays():
    step, state, batch = models.mlp_setup()
    state = copy_tree(state)  # single-device arrays, as a user has them
    before = host(state)
    counts = [x for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
              if "count" in jax.tree_util.keystr(p)]
    assert counts and counts[0].shape == ()  # optax's scalar count: replicated, so aliased
    ref_state, ref_losses = run_steps(jax.jit(step), copy_tree(state), batch, 2)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESH))
    first, loss0 = sharded(state, batch)
    second, loss1 = sharded(first, batch)  # mesh arrays in the plan's shardings: not donated
    assert_alive_and_unchanged(state, before)
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(first))
    np.testing.assert_allclose([float(loss0), float(loss1)], ref_losses, rtol=1e-5)
    assert global_relative_error(ref_state, second) < 1e-4


def test_an_output_shaped_like_an_argument_does_not_donate_it():
    """argsort's result has its argument's shape and dtype, which autopar once took for
    state and donated."""
    def step(x):
        return jnp.argsort(x)

    x = jax.random.randint(jax.random.PRNGKey(0), (64,), 0, 1000)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESH))
    spec = sharded.plan(x).input_specs[0]
    on_mesh = jax.device_put(x, NamedSharding(sharded.mesh(x), spec))  # nothing to move
    got = sharded(on_mesh)
    assert not on_mesh.is_deleted() and not x.is_deleted()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(step)(x)))


@pytest.mark.parametrize("option", [{"donate_argnums": 0}, {"donate_argnames": "state"}])
def test_donated_state_on_the_mesh_is_deleted_and_trains_right(option):
    step, state, batch = models.mlp_setup()
    state = copy_tree(state)
    before = host(state)
    ref_state, ref_losses = run_steps(jax.jit(step), copy_tree(state), batch, 3)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESH), **option)
    new, loss = sharded(state, batch)
    # moved onto the mesh: only autopar's copies were donated (the scalar count included)
    assert_alive_and_unchanged(state, before)
    losses = [float(loss)]
    for _ in range(2):
        old = new
        new, loss = sharded(old, batch)
        losses.append(float(loss))
        assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(old))
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(batch))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert global_relative_error(ref_state, new) < 1e-4
    # the donated state passed again: named, where XLA CPU would crash the process
    with pytest.raises(autopar.AutoparError, match=r"were deleted, e\.g\. \['state/"):
        sharded(old, batch)


@pytest.mark.slow
def test_keyword_arguments_are_traced_like_positional_ones():
    step, state, batch = models.mlp_setup()
    ref_state, ref_loss = jax.jit(step)(copy_tree(state), batch=batch)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESH))
    new, loss = sharded(state, batch=batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert global_relative_error(ref_state, new) < 1e-4
    _, loss = sharded(state=state, batch=batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert {"batch/inputs", "state/0/params/Dense_0/kernel"} <= set(
        sharded.plan(state, batch=batch).specs)


def flagged_step():
    """A step whose bool `train` flag changes the computation: Python control flow on it."""
    step, state, batch = models.mlp_setup()

    def flagged(state, batch, train):
        new_state, loss = step(state, batch)
        if train:
            return new_state, loss
        return state, 2.0 * loss

    return flagged, state, batch


@pytest.mark.slow
@pytest.mark.parametrize("option", [{"static_argnums": 2}, {"static_argnames": "train"}])
def test_static_flag_gives_one_plan_per_value(option):
    step, state, batch = flagged_step()
    reference = jax.jit(step, **option)
    traced = []

    @functools.wraps(step)
    def counted(*args, **kwargs):
        traced.append(1)
        return step(*args, **kwargs)

    sharded = autopar.auto_parallel(counted, mesh=autopar.make_mesh(MESH), **option)
    for train in (True, False):
        ref_state, ref_loss = reference(copy_tree(state), batch, train=train)
        for new, loss in (sharded(state, batch, train), sharded(state, batch, train=train)):
            np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
            assert global_relative_error(ref_state, new) < 1e-4
    positional, keyword = (sharded.plan(state, batch, False), sharded.plan(state, batch, train=False))
    assert positional.specs == keyword.specs
    assert len(positional.ops) != len(sharded.plan(state, batch, True).ops)
    # one plan per value and way of passing it (as jax.jit caches), none made twice
    assert len(traced) == 4
    assert sharded.plan(state, batch, train=True) is sharded.plan(state, batch, train=True)
    # the functional form takes the same options
    assert autopar.plan(step, state, batch, False, mesh=MESH, **option).specs == keyword.specs


@pytest.mark.slow
def test_jax_make_mesh_trains_as_one_device():
    step, state, batch = models.mlp_setup()
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes, JAX's default
    check_against_single_device(step, state, batch, mesh)
    sharded = autopar.auto_parallel(step, mesh=mesh)
    # inputs the caller placed on their Explicit mesh are taken as they are
    placed = jax.device_put(batch, NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    _, loss = sharded(copy_tree(state), placed)
    np.testing.assert_allclose(float(loss), float(jax.jit(step)(state, batch)[1]), rtol=1e-5)
    assert sharded.mesh(state, batch).devices.tolist() == mesh.devices.tolist()


def test_arguments_that_cannot_be_traced_are_named_with_the_fix():
    step, state, batch = models.mlp_setup()

    def moded(state, batch, mode):
        return step(state, batch)

    sharded = autopar.auto_parallel(moded, mesh=autopar.make_mesh(MESH))
    with pytest.raises(autopar.AutoparError) as err:
        sharded(state, batch, "train")
    text = str(err.value)
    assert "argument 2 ('mode')" in text and "'mode'" in text and "str" in text
    assert "static_argnums=2" in text
    with pytest.raises(autopar.AutoparError) as err:
        sharded.plan(state, {**batch, "name": "mnist"}, mode=1)
    text = str(err.value)
    assert "'batch/name'" in text and "static_argnums=1" in text and "out of the pytree" in text
    with pytest.raises(autopar.AutoparError, match="not hashable"):
        autopar.auto_parallel(moded, mesh=autopar.make_mesh(MESH), static_argnames="mode")(
            state, batch, mode={"a": 1})
    with pytest.raises(autopar.AutoparError, match="both static and donated"):
        autopar.auto_parallel(moded, mesh=autopar.make_mesh(MESH), static_argnums=2,
                              donate_argnames="mode")
    # with the flag static, the same step plans and runs as on one device
    fixed = autopar.auto_parallel(moded, mesh=autopar.make_mesh(MESH), static_argnums=2)
    _, loss = fixed(state, batch, "train")
    np.testing.assert_allclose(float(loss), float(jax.jit(step)(state, batch)[1]), rtol=1e-5)


def test_a_branch_on_a_traced_python_bool_names_the_argument_and_the_fix():
    def step(params, x, train=True):
        if train:  # a Python branch on a value jax traces
            x = x * 2
        return jnp.sum(x @ params)

    stepped = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 2, "model": 4}))
    params, x = jnp.ones((8, 4)), jnp.ones((4, 8))
    with pytest.raises(autopar.AutoparError, match=r"'train'.*static_argnames=\('train',\)"
                       ) as raised:
        stepped(params, x, train=False)
    line = step.__code__.co_firstlineno + 1  # the `if train:`
    assert f"step ({__file__}:{line})" in str(raised.value)
    fixed = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 2, "model": 4}),
                                  static_argnames="train")
    assert float(fixed(params, x, train=False)) == float(jnp.sum(x @ params))
