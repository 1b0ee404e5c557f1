"""keep_placement=True on a Python loop of blocks: the layers' leaves, and the optimizer's
state of them, are kept stacked on their stages between steps (autopar/placement/lanes.py).
Trains equal to one device (after autopar.unpack), stacks no layer outside the pipeline's loop,
and leaves a family the step reads a layer of on its own as the user's leaves, with a
warning."""
import warnings

import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from helpers import copy_tree, global_relative_error, run_steps
from test_pipeline_blocks import loop_gpt, nnx_stack_case, plain_layers_case
from test_pipeline_circular import by_kind

import autopar
from autopar.cost.hlo import collectives

pytestmark = pytest.mark.slow  # the slow tier: `make test-fast` leaves it out

MESH = {"stage": 2, "data": 4}
GPIPE = dict(microbatches=4, pipeline=2, hardware="h100")


def compiled_collectives(sharded, state, data):
    found = collectives(sharded.lower(state, data).compile().as_text())
    return by_kind([c for c in found if c.executions == 1]), by_kind(found)


def predicted_collectives(plan):
    return {k[:-len("_bytes")]: v for k, v in plan.cost.items()
            if k.endswith("_bytes") and k != "peak_memory_bytes" and v}


def test_a_python_loops_layers_stay_stacked_and_train_equal_to_one_device():
    """The circular schedule (2 rounds): the stacks kept in its placement too. GPipe's
    stacking is the same with the placement in layer order (the tests below)."""
    rounds = 2
    step, state, data = loop_gpt()
    mesh = autopar.make_mesh(MESH)
    ref_state, ref_losses = run_steps(jax.jit(step), copy_tree(state), data, 3)
    sharded = autopar.auto_parallel(step, mesh=mesh, keep_placement=True, donate_argnums=0,
                                    pipeline_repeats=rounds, **GPIPE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.AutoparWarning)
        placed, losses = run_steps(sharded, copy_tree(state), data, 2)
        # your own tree (a restored checkpoint, say) is stacked on the way in
        new_state, loss = sharded(autopar.unpack(placed), data)
    np.testing.assert_allclose(losses + [float(loss)], ref_losses, rtol=1e-5)
    assert isinstance(new_state, autopar.Placed)
    unpacked = autopar.unpack(new_state)
    assert jax.tree_util.tree_structure(unpacked) == jax.tree_util.tree_structure(ref_state)
    assert global_relative_error(ref_state, unpacked) < 1e-4
    with pytest.raises(autopar.AutoparError, match="autopar.unpack"):
        new_state[0]

    plan = sharded.plan(new_state, data)
    # each block's 16 weights and Adam's two moments of each: 48 stacks of 4 layers
    assert plan.lanes.families == 48 and plan.lanes.layers == 4
    assert len(plan.stored.inputs) == 48  # the stacks themselves in the circular placement
    assert "Python loop's layers stored stacked between steps: 48 families" in plan.summary()
    # stage s holds chunks s, s+S, ... of the 4 layers
    assert plan.pipeline["stage_layers"] == [[[0, 0], [2, 2]], [[1, 1], [3, 3]]]
    # Stacking the leaves every step moved the layers to their stages (an all-gather outside
    # the loop, in the plan that keeps the leaves); stored stacked, nothing moves them, and
    # every kind's bytes, predicted, equal the compiled program's.
    outside, every = compiled_collectives(sharded, new_state, data)
    assert "all-gather" not in outside, outside
    assert predicted_collectives(plan) == every
    leaves = autopar.auto_parallel(step, mesh=mesh, pipeline_repeats=rounds, **GPIPE)
    moved, _ = compiled_collectives(leaves, state, data)
    assert moved.get("all-gather", 0) > 0, moved

    # the saved plan applied again stacks the same leaves and trains the same
    again = autopar.Plan.from_json(plan.to_json())
    assert again.lanes == plan.lanes
    saved = autopar.auto_parallel(step, mesh=mesh, plan=again)
    saved_state, saved_loss = saved(new_state, data)
    next_state, next_loss = sharded(new_state, data)
    assert float(saved_loss) == pytest.approx(float(next_loss), rel=1e-6)
    assert global_relative_error(autopar.unpack(next_state), autopar.unpack(saved_state)) < 1e-6


def test_nnx_layers_with_a_global_norm_stay_stacked():
    """A list of NNX layers, optax's global-norm clipping before adamw: the norm's per-layer
    sums are read one layer at a time (four scalars a family move), everything else runs
    over the stacks."""
    step, state, data = nnx_stack_case(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)))
    ref_state, ref_losses = run_steps(jax.jit(step), copy_tree(state), data, 3)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh({"stage": 4, "data": 2}),
                                    keep_placement=True, microbatches=4, pipeline=4,
                                    hardware="h100")
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.AutoparWarning)
        placed, losses = run_steps(sharded, copy_tree(state), data, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert global_relative_error(ref_state, autopar.unpack(placed)) < 1e-4
    assert sharded.plan(placed, data).lanes.families == 18  # 6 weights, and their moments
    outside, _ = compiled_collectives(sharded, placed, data)
    # the layers' rows of the norm's sums: 4 floats per family, gathered
    assert outside.get("all-gather", 0) <= 18 * 4 * 4, outside


def test_a_layer_read_on_its_own_stays_the_users_leaf_with_a_warning():
    """The loss penalises block 0's kernel alone: that kernel (and its moments) stay the
    user's leaves, stacked every step; the other families are stored."""
    config = dict(vocab=64, d_model=32, heads=4, layers=4, scan=False)
    _, state, data = models.gpt_setup(batch=16, seq=16, **config)
    model, tx = models.GPT(**config), optax.adamw(1e-3)

    def step(state, batch):
        params, opt_state = state

        def loss(p):
            penalty = 1e-3 * jnp.sum(p["params"]["block_0"]["mlp_in"]["kernel"] ** 2)
            return models.token_loss(model.apply(p, batch["inputs"]), batch["targets"]) + penalty
        value, grads = autopar.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), value

    ref_state, ref_losses = run_steps(jax.jit(step), copy_tree(state), data, 3)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESH), keep_placement=True,
                                    **GPIPE)
    with pytest.warns(autopar.AutoparWarning, match=r"3 families .*block_0/mlp_in/kernel "
                      r"\(a layer is read on its own by integer_pow at .*test_pipeline_lanes"):
        placed, losses = run_steps(sharded, copy_tree(state), data, 3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert global_relative_error(ref_state, autopar.unpack(placed)) < 1e-4
    assert sharded.plan(placed, data).lanes.families == 45


def test_a_stacked_plan_shards_each_layer_as_its_row_and_unpacks_for_other_steps():
    step, state, data = loop_gpt()
    mesh = autopar.make_mesh(MESH)
    sharded = autopar.auto_parallel(step, mesh=mesh, keep_placement=True, **GPIPE)
    placed, _ = sharded(copy_tree(state), data)
    # a layer's leaf is sharded as its row of the stack (the way a checkpoint is restored)
    (shardings, _), _ = sharded.input_shardings(placed, data)
    plan = sharded.plan(placed, data)
    stacked = {t.path: t.partition_spec for t in plan.inputs}
    kernel = shardings[0]["params"]["block_2"]["mlp_in"]["kernel"]
    stack_spec = stacked["state/0/params/block_0..block_3/mlp_in/kernel"]
    assert tuple(kernel.spec) == tuple(stack_spec)[1:len(kernel.spec) + 1]
    assert len(jax.tree_util.tree_leaves(shardings)) == len(jax.tree_util.tree_leaves(state))
    # a step planned otherwise (no pipeline) takes the stacked state as the user's leaves
    flat = autopar.auto_parallel(step, mesh=mesh)
    ref_state, ref_loss = jax.jit(step)(autopar.unpack(placed), data)
    _, loss = flat(placed, data)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)


def test_plain_jax_layers_with_sgd_momentum_and_a_metric_of_the_gradient_stay_stacked():
    """Plain JAX: a list of layers, optax's SGD with momentum, and two metrics of the
    gradient that each square every layer's gradient again (one group, twice per layer)."""
    tx = optax.sgd(0.05, momentum=0.9)
    loss, params, batch = plain_layers_case(5)

    def step(state, batch):
        params, opt_state = state
        value, grads = autopar.value_and_grad(loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        size = sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads))
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree_util.tree_leaves(grads)))
        return (optax.apply_updates(params, updates), opt_state), (value, size + norm)

    state = (params, tx.init(params))

    def two_steps(step_fn):
        s, metrics = copy_tree(state), []
        for _ in range(2):
            s, (value, size) = step_fn(s, batch)
            metrics.append((float(value), float(size)))
        return s, metrics
    ref_state, ref_metrics = two_steps(jax.jit(step))
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESH), keep_placement=True,
                                    **GPIPE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.AutoparWarning)
        placed, metrics = two_steps(sharded)
    np.testing.assert_allclose(metrics, ref_metrics, rtol=1e-5)
    assert global_relative_error(ref_state, autopar.unpack(placed)) < 1e-4
    plan = sharded.plan(placed, batch)
    assert plan.lanes.families == 4  # w, b and their momenta
    # the metrics' squares run over the stacks too: no layer's gradient is read alone, only
    # each layer's sum of squares (a scalar row of a [4] stack)
    rows = [op for op in plan.ops if op.primitive == "slice" and op.in_shapes[0][0] == 4]
    assert rows and all(op.in_shapes[0] == (4,) for op in rows), rows
