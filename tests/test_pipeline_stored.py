"""keep_placement=True: the circular schedule's stacked layers and their optimizer state stay
in its placement between steps. Trains equal to one device (after autopar.unpack), moves no
layer outside the loop, and leaves what the step reads in layer order where it is."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import copy_tree, global_relative_error, run_steps
from test_pipeline import gpt_case, mlp_case, Stack
from test_pipeline_circular import by_kind

import autopar
from autopar.cost.hlo import collectives

MESH = {"stage": 2, "data": 4}
CIRCULAR = dict(microbatches=4, pipeline=2, pipeline_repeats=2, hardware="h100")


@pytest.mark.slow
def test_stored_placement_trains_equal_to_one_device_and_moves_no_layer():
    step, state, data = gpt_case()
    mesh = autopar.make_mesh(MESH)
    ref_state, ref_losses = run_steps(jax.jit(step), copy_tree(state), data, 3)
    sharded = autopar.auto_parallel(step, mesh=mesh, keep_placement=True, donate_argnums=0,
                                    **CIRCULAR)
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.AutoparWarning)
        placed, losses = run_steps(sharded, copy_tree(state), data, 2)
        # a plain tree (a restored checkpoint, say) is put into the placement on the way in
        new_state, loss = sharded(autopar.unpack(placed), data)
    np.testing.assert_allclose(losses + [float(loss)], ref_losses, rtol=1e-5)
    assert isinstance(new_state, autopar.Placed)
    assert global_relative_error(ref_state, autopar.unpack(new_state)) < 1e-4
    with pytest.raises(autopar.AutoparError, match="autopar.unpack"):
        new_state[0]

    plan = sharded.plan(new_state, data)
    stored = plan.stored
    # the stack's 16 leaves, and Adam's two moments of each
    assert len(stored.inputs) == 48 and stored.inputs == stored.outputs, stored
    assert "stored in the circular placement between steps: 48 leaves" in plan.summary()
    again = autopar.Plan.from_json(plan.to_json())
    assert again.stored == stored

    # The layers' move into the placement (read in layer order, an all-gather over 'stage' of
    # 203,264 bytes outside the loop; docs/decisions.md) is gone; every kind's bytes,
    # predicted, equal the compiled program's.
    found = collectives(sharded.lower(new_state, data).compile().as_text())
    outside = by_kind([c for c in found if c.executions == 1])
    assert "all-gather" not in outside, outside
    predicted = {k[:-len("_bytes")]: v for k, v in plan.cost.items()
                 if k.endswith("_bytes") and k != "peak_memory_bytes" and v}
    assert predicted == by_kind(found)

    # the saved plan applied again stores the same leaves and trains the same
    saved = autopar.auto_parallel(step, mesh=mesh, plan=again)
    again_state, again_loss = saved(new_state, data)
    follow_state, follow_loss = sharded(new_state, data)
    np.testing.assert_allclose(float(again_loss), float(follow_loss), rtol=1e-6)
    assert saved.plan(new_state, data).stored == stored
    assert global_relative_error(autopar.unpack(follow_state),
                                 autopar.unpack(again_state)) < 1e-6


@pytest.mark.slow
def test_what_the_step_reads_in_layer_order_stays_there(tmp_path):
    """A step that also returns the first layer's kernel reads the stack in order: that leaf
    (and its optimizer state) stays in layer order, with a warning naming why; the rest is
    stored, and the step still trains equal to one device."""
    step, state, data = mlp_case(Stack(layers=4))

    def watched(state, batch):
        new_state, loss = step(state, batch)
        first = new_state[0]["params"]["stack"]["Dense_0"]["kernel"][0]
        return new_state, loss + 0.0 * jnp.sum(first)

    ref_state, ref_losses = run_steps(jax.jit(watched), copy_tree(state), data, 3)
    sharded = autopar.auto_parallel(watched, mesh=autopar.make_mesh(MESH), keep_placement=True,
                                    microbatches=2, pipeline=2, pipeline_repeats=2)
    with pytest.warns(autopar.AutoparWarning, match="Dense_0/kernel.*slice"):
        new_state, losses = run_steps(sharded, copy_tree(state), data, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert global_relative_error(ref_state, autopar.unpack(new_state)) < 1e-4
    stored = sharded.plan(new_state, data).stored
    paths = [p.path for p in sharded.plan(new_state, data).inputs]
    kept = [paths[k] for k in stored.inputs]
    assert kept and not any("Dense_0/kernel" in p for p in kept), kept
    assert any("Dense_0/bias" in p for p in kept), kept
    # a checkpoint holds the user's tree, and goes back into the step as one
    autopar.save_checkpoint(tmp_path / "ckpt", new_state)
    restored = autopar.restore_checkpoint(tmp_path / "ckpt", autopar.unpack(new_state))
    assert global_relative_error(autopar.unpack(new_state), restored) == 0
    _, loss = sharded(restored, data)
    _, ref_loss = jax.jit(watched)(ref_state, data)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    # a step planned without the placement takes the Placed state in layer order
    flat = autopar.auto_parallel(watched, mesh=autopar.make_mesh(MESH))
    _, flat_loss = flat(new_state, data)
    np.testing.assert_allclose(float(flat_loss), float(ref_loss), rtol=1e-5)


@pytest.mark.slow
def test_stored_placement_in_shares_equals_one_device():
    """Each stage's microbatch split over 'data' as shares (per-share copies of the stored
    layers, reduced once after the loop), the layers kept in place."""
    step, state, data = gpt_case(batch=64)
    ref_state, ref_losses = run_steps(jax.jit(step), copy_tree(state), data, 3)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESH), keep_placement=True,
                                    donate_argnums=0, microbatches=4, pipeline=2,
                                    pipeline_repeats=2)
    new_state, losses = run_steps(sharded, copy_tree(state), data, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert global_relative_error(ref_state, autopar.unpack(new_state)) < 1e-4
    plan = sharded.plan(new_state, data)
    assert plan.microbatch_groups == 4 and len(plan.stored.inputs) == 48


@pytest.mark.slow
def test_keep_placement_without_rounds_changes_nothing():
    """GPipe's placement is the layer order: nothing to store, the state comes back plain."""
    step, state, data = mlp_case(Stack(layers=4))
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESH), keep_placement=True,
                                    microbatches=2, pipeline=2)
    new_state, _ = sharded(state, data)
    assert isinstance(new_state, tuple) and sharded.plan(state, data).stored is None


def _stored_paths(fn, *args):
    from autopar.placement.storable import storage
    from autopar.trace.tracer import trace
    graph = trace(fn, args)[0]
    found = storage(graph)
    return sorted(graph.tensors[graph.inputs[k]].path for k in found.inputs), found.refused


def test_storable_follows_the_layer_dimension():
    """The analysis on small steps: the stack's leaf and whatever updates it elementwise are
    stored; a read that moves the layers out of dimension 0 keeps the group in order."""
    from autopar.primitives.stack_read import stack_read
    w, m = jnp.ones((4, 3)), jnp.zeros((4, 3))

    def update(state):
        w, m = state
        g = stack_read(w, 0) * 2.0
        m = 0.9 * m + g + jnp.zeros((4, 3))  # a value broadcast along the layers joins nothing
        return (w - 0.1 * m / (jnp.sqrt(jnp.sum(m * m)) + 1.0), m)

    paths, refused = _stored_paths(update, (w, m))
    assert paths == ["state/0", "state/1"] and not refused

    def moved(state):
        w, m = update(state)
        return (w, m + jnp.broadcast_to(w.T[None], (4, 3, 4)).sum(-1))  # layers on dim 2

    paths, refused = _stored_paths(moved, (w, m))
    assert paths == [] and "transpose" in refused[0], refused


def test_storable_asks_each_operators_rule():
    """Each operator's sharding rule says whether it keeps the layers as independent rows: a
    product over the other dimensions does, and a maximum over the layers is the same in any
    order; a running sum along the layers, or a shift along them, reads them in order."""
    from autopar.primitives.stack_read import stack_read
    w, m = jnp.ones((4, 3)), jnp.zeros((4, 3))
    mix = jnp.arange(9.0).reshape(3, 3)

    def step(reads):
        def update(state):
            w, m = state
            g = stack_read(w, 0) * 2.0
            return (w - 0.1 * reads(g), m + g)
        return update

    kept = {"a product over the other dimensions": lambda g: g @ mix,
            "a maximum over the layers": lambda g: g / (1.0 + jnp.max(g))}
    for what, reads in kept.items():
        paths, refused = _stored_paths(step(reads), (w, m))
        assert paths == ["state/0", "state/1"] and not refused, what
    in_order = {"cumsum": lambda g: jnp.cumsum(g, axis=0),
                "pad": lambda g: jax.lax.pad(g, 0.0, ((1, -1, 0), (0, 0, 0)))}
    for name, reads in in_order.items():
        paths, refused = _stored_paths(step(reads), (w, m))
        assert paths == [] and name in refused[0], (name, refused)
