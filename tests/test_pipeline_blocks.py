"""Pipelining a Python loop of blocks: the loss's repeated layers, written one after the other
(`for i in range(L): x = Block(...)(x)`, a list of NNX layers), found in its jaxpr and run as
the stages' loop (autopar/rewrite/blocks.py), equal to one device."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import models
import optax
import pytest
from flax import nnx
from helpers import check_against_single_device, dropout_setup

import autopar
from autopar.cost.hlo import collectives
from autopar.rewrite.blocks import find_blocks, rolled

pytestmark = pytest.mark.slow  # the slow tier: `make test-fast` leaves it out


def loop_gpt(layers=4, batch=16):
    """The example GPT with its blocks in a Python loop and its embedding tied to the head."""
    config = dict(vocab=64, d_model=32, heads=4, layers=layers, scan=False)
    _, state, data = models.gpt_setup(batch=batch, seq=16, **config)
    step = models.linen_step(models.GPT(**config), models.token_loss, optax.adamw(1e-3),
                             autopar.value_and_grad)
    return step, state, data


@pytest.mark.parametrize("mesh, microbatches", [
    ({"stage": 2, "data": 4}, 4), ({"stage": 4, "data": 2}, 2)])
def test_a_python_loop_of_blocks_is_pipelined_equal_to_one_device(mesh, microbatches):
    step, state, data = loop_gpt()
    plan = check_against_single_device(step, state, data, autopar.make_mesh(mesh),
                                       donate_argnums=0, microbatches=microbatches,
                                       pipeline=mesh["stage"])
    assert plan.pipeline_stages == mesh["stage"] and plan.microbatches == microbatches
    assert f"pipelined over {mesh['stage']} stages" in plan.summary()
    # the plan names each stage's layers and sub-mesh, and prices the tick loops
    per = 4 // mesh["stage"]
    assert plan.pipeline["stage_layers"] == [[[s * per, s * per + per - 1]]
                                             for s in range(mesh["stage"])]
    assert plan.pipeline["sub_mesh"] == {"data": mesh["data"]}
    assert 0 < plan.pipeline["tick_loops_s"] < plan.cost["total_s"]
    assert "stage 1: layers " in plan.summary()
    assert autopar.Plan.from_json(plan.to_json()).pipeline == plan.pipeline


def test_the_loop_of_a_python_stack_only_shifts_activations():
    """Planned for h100: the layers are stacked before the loop, so inside it only the
    activations move (one collective-permute forward, one back per tick)."""
    step, state, data = loop_gpt()
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh({"stage": 2, "data": 4}),
                                    microbatches=4, pipeline=2, hardware="h100")
    found = [c for c in collectives(sharded.lower(state, data).compile().as_text())
             if c.executions > 1]
    assert sorted(c.kind for c in found) == ["collective-permute"] * 2, found
    assert all(c.executions == 4 + 2 - 1 for c in found)


def test_the_blocks_are_found_and_rolled_into_one_loop():
    config = dict(vocab=64, d_model=32, heads=4, layers=4, scan=False)
    model = models.GPT(**config)
    _, (params, _), data = models.gpt_setup(batch=8, seq=16, **config)

    def loss(p):
        return models.token_loss(model.apply(p, data["inputs"]), data["targets"])
    closed = jax.make_jaxpr(loss)(params)
    blocks = find_blocks(closed.jaxpr)
    assert blocks.count == 4 and len(blocks.carries) == 1  # the residual stream
    # every block's 16 weights are stacked; the embedding (tied) is read before and after
    assert len(blocks.layers) == 16
    loop = rolled(closed, blocks)
    assert [e.primitive.name for e in loop.jaxpr.eqns].count("scan") == 1
    flat = jax.tree_util.tree_leaves(params)
    (want,), (got,) = (jax.core.eval_jaxpr(c.jaxpr, c.consts, *flat) for c in (closed, loop))
    assert jnp.allclose(want, got, rtol=1e-6), (want, got)


class Residual(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 2 * width, rngs=rngs)
        self.down = nnx.Linear(2 * width, width, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


class NnxStack(nnx.Module):
    def __init__(self, layers: int, rngs: nnx.Rngs):
        self.embed = nnx.Linear(8, 16, rngs=rngs)
        self.layers = nnx.List([Residual(16, rngs) for _ in range(layers)])
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def nnx_stack_case(tx):
    """A train step of NnxStack (4 layers) with the optimizer `tx`: step, state, batch."""
    graphdef, params = nnx.split(NnxStack(4, nnx.Rngs(0)), nnx.Param)
    k = jax.random.split(jax.random.key(3), 2)
    data = {"inputs": jax.random.normal(k[0], (16, 8)), "targets": jax.random.normal(k[1], (16, 4))}

    def step(state, batch):
        p, opt_state = state

        def loss(p):
            return models.mse(nnx.merge(graphdef, p)(batch["inputs"]), batch["targets"])
        value, grads = autopar.value_and_grad(loss)(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return (optax.apply_updates(p, updates), opt_state), value

    return step, (params, tx.init(params)), data


def test_nnx_layers_in_a_python_loop_are_pipelined():
    step, state, data = nnx_stack_case(optax.adamw(1e-2))
    plan = check_against_single_device(step, state, data,
                                       autopar.make_mesh({"stage": 4, "data": 2}),
                                       microbatches=4, pipeline=4)
    assert plan.pipeline_stages == 4


def plain_layers_case(seed):
    """No Flax: a list of 4 weight dicts, one residual tanh layer each, in a Python loop: the
    loss, its parameters and a batch."""
    def loss(params, x, y):
        h = x @ params["w_in"]
        for layer in params["layers"]:
            h = h + jnp.tanh(h @ layer["w"] + layer["b"])
        return jnp.mean((h @ params["w_out"] - y) ** 2)

    k = jax.random.split(jax.random.key(seed), 12)
    params = {"w_in": jax.random.normal(k[0], (8, 32)) / 3,
              "layers": [{"w": jax.random.normal(k[1 + i], (32, 32)) / 6,
                          "b": jax.random.normal(k[7 + i], (32,)) / 6} for i in range(4)],
              "w_out": jax.random.normal(k[5], (32, 2)) / 6}
    batch = (jax.random.normal(k[6], (16, 8)), jax.random.normal(k[11], (16, 2)))
    return loss, params, batch


def test_a_plain_jax_loop_over_a_list_of_layers_is_pipelined():
    """No Flax: a list of weight dicts, one residual tanh layer each, in a Python loop."""
    loss, params, batch = plain_layers_case(4)

    def step(params, batch):
        value, grads = autopar.value_and_grad(loss)(params, *batch)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), value

    plan = check_against_single_device(step, params, batch,
                                       autopar.make_mesh({"stage": 2, "data": 4}),
                                       microbatches=4, pipeline=2)
    assert plan.pipeline_stages == 2


class Collecting(nn.Module):
    """Each block's output kept for the loss: the blocks are no chain of layers alone."""

    @nn.compact
    def __call__(self, x):
        outs = []
        for i in range(4):
            x = jnp.tanh(nn.Dense(16, name=f"block_{i}")(x))
            outs.append(x)
        return nn.Dense(4)(sum(outs))


def test_a_python_loop_that_cannot_be_pipelined_is_refused():
    step, state, data = loop_gpt(layers=3)
    with pytest.raises(autopar.AutoparError, match="2 stages do not divide 3 layers"):
        autopar.plan(step, state, data, mesh={"stage": 2, "data": 4}, microbatches=4,
                     pipeline=2)
    x, y = jnp.ones((16, 8)), jnp.ones((16, 4))
    model = Collecting()
    params = model.init(jax.random.key(0), x)
    tx = optax.sgd(0.1)
    step = models.linen_step(model, models.mse, tx, autopar.value_and_grad)
    with pytest.raises(autopar.AutoparError, match="no stack autopar can pipeline"):
        autopar.plan(step, (params, tx.init(params)), {"inputs": x, "targets": y},
                     mesh={"stage": 2, "data": 4}, microbatches=4, pipeline=2)


class DropoutBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jax.nn.gelu(nn.Dense(16)(nn.LayerNorm()(x)))
        return x + nn.Dropout(0.3, deterministic=False)(h)


class DropoutLoop(nn.Module):
    """Blocks with dropout in a Python loop: each block folds its own constant (a hash of its
    name) into the dropout key, so the copies differ in one literal each. Checkpointed
    (`remat`), each block is one `remat2` equation, the constant inside its body."""
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16)(x)
        block = nn.remat(DropoutBlock) if self.remat else DropoutBlock
        for i in range(4):
            x = block(name=f"block_{i}")(x)
        return nn.Dense(3)(x).mean(1)


@pytest.mark.parametrize("mesh, stages, remat", [({"stage": 2, "data": 4}, 2, False),
                                                 ({"stage": 4, "data": 2}, 4, False),
                                                 ({"stage": 2, "data": 4}, 2, True)])
def test_a_python_loop_of_blocks_with_dropout_is_pipelined_equal_to_one_device(mesh, stages,
                                                                               remat):
    step, state, data = dropout_setup(DropoutLoop(remat=remat))
    key = jax.random.key(7)
    ref_state, ref_loss = jax.jit(step)(state, data, key)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(mesh), microbatches=4,
                                    pipeline=stages, batch_argnums=1)
    assert sharded.plan(state, data, key).pipeline_stages == stages
    new_state, loss = sharded(state, data, key)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    for a, b in zip(jax.tree_util.tree_leaves(ref_state[0]),
                    jax.tree_util.tree_leaves(new_state[0])):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-6 + 1e-5 * float(jnp.max(jnp.abs(a)))
