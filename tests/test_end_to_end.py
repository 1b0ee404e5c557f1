"""Sharded runs equal single-device runs: losses per step, the whole state, output shardings."""
import warnings

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest

import autopar
from helpers import check_against_single_device

MESHES = {"8": {"data": 8}, "2x4": {"data": 2, "model": 4}, "2x2x2": {"x": 2, "y": 2, "z": 2}}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_linen_mlp(mesh):
    step, state, batch = models.mlp_setup()
    check_against_single_device(step, state, batch, autopar.make_mesh(MESHES[mesh]))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(MESHES))
def test_linen_gpt(mesh):
    step, state, batch = models.gpt_setup()
    plan = check_against_single_device(step, state, batch, autopar.make_mesh(MESHES[mesh]))
    assert plan.cost["total_s"] > 0
    # The plan's totals are the search's objective: both are the same cost model.
    assert plan.cost["total_s"] == pytest.approx(plan.search_stats["objective_s"], rel=1e-9)


def test_nnx_split_merge():
    step, state, batch = models.nnx_setup()
    check_against_single_device(step, state, batch, autopar.make_mesh(MESHES["2x4"]))


@pytest.mark.slow
def test_scanned_layers_are_sharded():
    step, state, batch = models.gpt_setup(scan=True, layers=2)
    plan = check_against_single_device(step, state, batch, autopar.make_mesh(MESHES["8"]))
    body_ops = [o for o in plan.ops if o.primitive == "dot_general"]
    assert body_ops, "the scan body's operators are planned"
    split = [o for o in body_ops if any(axes for spec in o.in_specs for axes in spec)]
    assert split, "a scanned stack of layers must not fall back to full replication"
    stacked = [t for t in plan.inputs if "/layers/" in t.path and "state/0/" in t.path]
    assert stacked and all(t.spec[0] == () for t in stacked), \
        "the layer dimension of stacked parameters is never split"


def test_second_call_reuses_executable():
    step, state, batch = models.mlp_setup()
    traces = []

    def counted(state, batch):
        traces.append(1)
        return step(state, batch)

    sharded = autopar.auto_parallel(counted, mesh=autopar.make_mesh(MESHES["2x4"]))
    state = jax.tree_util.tree_map(jnp.array, state)
    state, _ = sharded(state, batch)
    n = len(traces)
    state, _ = sharded(state, batch)
    assert len(traces) == n, "a second call with the same shapes must not trace again"


def test_inputs_placed_for_the_user():
    step, state, batch = models.mlp_setup()
    mesh = autopar.make_mesh(MESHES["8"])
    sharded = autopar.auto_parallel(step, mesh=mesh)
    numpy_batch = jax.tree_util.tree_map(np.asarray, batch)  # host arrays, no sharding at all
    state = jax.tree_util.tree_map(jnp.array, state)
    _, loss = sharded(state, numpy_batch)
    assert np.isfinite(float(loss))


@pytest.mark.slow
def test_linen_cnn():
    step, state, batch = models.cnn_setup()
    check_against_single_device(step, state, batch, autopar.make_mesh(MESHES["2x4"]))


def test_while_and_cond():
    def step(w, x):
        def body(carry):
            i, h = carry
            return i + 1, jnp.tanh(h @ w)
        _, h = jax.lax.while_loop(lambda carry: carry[0] < 3, body, (0, x))
        h = jax.lax.cond(h.sum() > 0, lambda h: h * 2.0, lambda h: h - 1.0, h)
        loss = (h ** 2).mean()
        return w - 0.1 * jax.grad(lambda w: (jnp.tanh(x @ w) ** 2).mean())(w), loss

    w = jax.random.normal(jax.random.PRNGKey(0), (16, 16)) * 0.3
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 16))
    ref_w, ref_loss = jax.jit(step)(w, x)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESHES["2x4"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.AutoparWarning)
        new_w, loss = sharded(jnp.array(w), x)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(new_w), np.asarray(ref_w), rtol=1e-5, atol=1e-6)
    plan = sharded.plan(new_w, x)
    assert {"while", "cond"} <= {o.primitive for o in plan.ops}
