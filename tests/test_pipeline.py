"""Pipeline parallelism (pipeline=S, microbatches=M): the loss's layer stack run as S stages of
GPipe in one program, equal to one device; the loop moves activations by collective-permutes;
what cannot be pipelined is refused with an AutoparError."""
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from helpers import check_against_single_device

import autopar
from autopar.cost.hlo import collectives, compiled_memory_bytes


def gpt_case(layers=4, batch=16, **config):
    config = dict(vocab=64, d_model=32, heads=4, layers=layers, scan=True, **config)
    _, state, data = models.gpt_setup(batch=batch, seq=16, **config)
    step = models.linen_step(models.GPT(**config), models.token_loss, optax.adamw(1e-3),
                             autopar.value_and_grad)
    return step, state, data


def in_loops(step, state, data, mesh, **options):
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(mesh), **options)
    return [c for c in collectives(sharded.lower(state, data).compile().as_text())
            if c.executions > 1]


@pytest.mark.slow
@pytest.mark.parametrize("mesh, microbatches", [
    ({"stage": 2, "data": 4}, 4), ({"stage": 4, "data": 2}, 4), ({"stage": 4, "data": 2}, 2),
    ({"stage": 2, "data": 2, "model": 2}, 8)])
def test_pipelined_gpt_equals_one_device(mesh, microbatches):
    step, state, data = gpt_case()
    plan = check_against_single_device(step, state, data, autopar.make_mesh(mesh),
                                       donate_argnums=0, microbatches=microbatches,
                                       pipeline=mesh["stage"])
    assert plan.pipeline_stages == mesh["stage"] and plan.microbatches == microbatches
    assert f"pipelined over {mesh['stage']} stages" in plan.summary()
    again = autopar.Plan.from_json(plan.to_json())
    assert (again.pipeline_stages, again.microbatches) == (mesh["stage"], microbatches)
    assert again.schedule == plan.schedule  # the four settings, one record
    # the stacked layers are split over the stage axis, each stage holding its own
    kernel = plan.input_specs[0][0]["params"]["layers"]["Block_0"]["mlp_in"]["kernel"]
    assert kernel[0] == "stage", kernel
    # what the pipeline's rewrite adds names the user's line, never one of autopar's own
    assert any(o.primitive == "autopar_shard" for o in plan.ops)
    made = [r.where for r in plan.redistributions] + [o.source for o in plan.ops]
    assert not [w for w in made if f"{os.sep}autopar{os.sep}" in w]


@pytest.mark.slow
def test_eight_stages_and_a_saved_plan_apply():
    step, state, data = gpt_case(layers=8)
    mesh = autopar.make_mesh({"stage": 8})
    plan = check_against_single_device(step, state, data, mesh, donate_argnums=0,
                                       microbatches=4, pipeline=8)
    saved = autopar.auto_parallel(step, mesh=mesh, plan=autopar.Plan.from_json(plan.to_json()))
    (_, loss), (_, expected) = saved(state, data), jax.jit(step)(state, data)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    assert saved.plan(state, data).pipeline_stages == 8


@pytest.mark.slow
def test_the_loop_only_shifts_activations():
    """Planned for h100 (the small model keeps each stage whole): inside the loops, one
    collective-permute forward and one backward per tick, no gradient reduction, no gather."""
    step, state, data = gpt_case()
    found = in_loops(step, state, data, {"stage": 2, "data": 4}, microbatches=4, pipeline=2,
                     hardware="h100")
    assert sorted(c.kind for c in found) == ["collective-permute"] * 2, found
    assert all(c.executions == 4 + 2 - 1 for c in found)


@pytest.mark.slow
def test_more_microbatches_keep_no_more_memory():
    """Weights larger than the activations (d_model 128, 8 tokens an example): the backward
    pass keeps each tick's activations, not a copy of the stage's layers per tick, so 16
    microbatches (17 ticks) compile to less memory than 4 (5 ticks), not more (with a copy
    per tick: 22.2 MiB at 4, 41.0 at 16)."""
    config = dict(vocab=64, d_model=128, heads=4, layers=4, scan=True)
    _, state, data = models.gpt_setup(batch=32, seq=8, **config)
    step = models.linen_step(models.GPT(**config), models.token_loss, optax.adamw(1e-3),
                             autopar.value_and_grad)
    memory = {}
    for m in (4, 16):
        sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh({"stage": 2, "data": 4}),
                                        microbatches=m, pipeline=2, donate_argnums=0,
                                        hardware="h100")
        memory[m] = compiled_memory_bytes(sharded.lower(state, data).compile())
    assert memory[16] < memory[4], memory


class Normalised(nn.Module):
    """x / |x| per example: NaN on the zeros a stage computes in the bubble."""

    @nn.compact
    def __call__(self, x, _):
        x = nn.Dense(x.shape[-1])(x)
        return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True)), None


class Stack(nn.Module):
    layers: int = 4

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        x, _ = nn.scan(Normalised, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=self.layers)(name="stack")(x, None)
        return nn.Dense(4)(x)


def mlp_case(model, batch=16):
    k = jax.random.split(jax.random.key(1), 3)
    x, y = jax.random.normal(k[0], (batch, 8)), jax.random.normal(k[1], (batch, 4))
    params = model.init(k[2], x)
    tx = optax.adamw(1e-2)
    step = models.linen_step(model, models.mse, tx, autopar.value_and_grad)
    return step, (params, tx.init(params)), {"inputs": x, "targets": y}


@pytest.mark.slow
def test_the_bubble_leaks_no_nan():
    step, state, data = mlp_case(Stack())
    plan = check_against_single_device(step, state, data,
                                       autopar.make_mesh({"stage": 4, "data": 2}),
                                       microbatches=2, pipeline=4)
    assert plan.pipeline_stages == 4


@pytest.mark.slow
def test_a_lax_scan_over_stacked_weights_is_a_stack():
    def loss(params, x, y):
        def layer(h, w):
            return jnp.tanh(h @ w), None
        h, _ = jax.lax.scan(layer, x @ params["w_in"], params["layers"])
        return jnp.mean((h @ params["w_out"] - y) ** 2)

    def step(params, batch):
        value, grads = autopar.value_and_grad(loss)(params, *batch)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), value

    k = jax.random.split(jax.random.key(2), 5)
    params = {"w_in": jax.random.normal(k[0], (8, 32)) / 3,
              "layers": jax.random.normal(k[1], (6, 32, 32)) / 6,
              "w_out": jax.random.normal(k[2], (32, 2)) / 6}
    batch = (jax.random.normal(k[3], (12, 8)), jax.random.normal(k[4], (12, 2)))
    plan = check_against_single_device(step, params, batch,
                                       autopar.make_mesh({"stage": 2, "data": 4}),
                                       microbatches=3, pipeline=2)
    assert plan.input_specs[0]["layers"][0] == "stage"


@pytest.mark.slow
def test_what_cannot_be_pipelined_is_refused():
    step, state, data = gpt_case()
    with pytest.raises(autopar.AutoparError, match="axis named 'stage' of size 2"):
        autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 8}), microbatches=4,
                              pipeline=2)
    with pytest.raises(autopar.AutoparError, match="microbatches=M, M >= 2"):
        autopar.auto_parallel(step, mesh=autopar.make_mesh({"stage": 2, "data": 4}),
                              pipeline=2)
    with pytest.raises(autopar.AutoparError, match="3 stages do not divide 4 layers"):
        autopar.plan(step, state, data, mesh={"stage": 3}, microbatches=4, pipeline=3)


class BatchStatistics(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        x = nn.Dense(x.shape[-1])(x)
        return x - x.mean(axis=0), None  # the batch's mean: not per example


@pytest.mark.slow
def test_a_stack_that_mixes_examples_is_refused():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x, _ = nn.scan(BatchStatistics, variable_axes={"params": 0},
                           split_rngs={"params": True}, length=2)()(nn.Dense(16)(x), None)
            return nn.Dense(4)(x)

    step, state, data = mlp_case(Model())
    with pytest.raises(autopar.AutoparError, match="BatchStatistics.*batch statistic"):
        autopar.plan(step, state, data, mesh={"stage": 2, "data": 4}, microbatches=2,
                     pipeline=2)


@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [2, 4])
def test_accumulation_over_a_scanned_stack_equals_the_full_batch(microbatches):
    step, state, data = gpt_case(layers=2)
    check_against_single_device(step, state, data, autopar.make_mesh({"data": 2, "model": 4}),
                                donate_argnums=0, microbatches=microbatches)
