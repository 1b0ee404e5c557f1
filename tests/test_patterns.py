"""Megatron's patterns are found where they are optimal, judged by spec and by the collectives
of the compiled step (weights large against a small batch on a tensor-parallel axis, the h100
profile)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import copy_tree, global_relative_error
from jax.sharding import PartitionSpec as P

import autopar
from autopar.cost.hlo import collectives

pytestmark = pytest.mark.slow  # the slow tier: `make test-fast` leaves it out


class BertLayer(nn.Module):
    d_model: int = 512
    heads: int = 8

    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(x + nn.MultiHeadDotProductAttention(self.heads, name="attn")(x))
        h = nn.gelu(nn.Dense(4 * self.d_model, name="mlp_in")(x))
        return nn.LayerNorm()(x + nn.Dense(self.d_model, name="mlp_out")(h))


def _sgd_step(model):
    def step(params, batch):
        grads = jax.grad(lambda p: jnp.mean((model.apply(p, batch["x"]) - batch["y"]) ** 2))(
            params)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)
    return step


def test_bert_layer_gets_one_all_reduce_per_attention_and_per_mlp():
    model, x = BertLayer(), jnp.asarray(np.random.default_rng(0).normal(size=(2, 64, 512)),
                                        jnp.float32)
    batch = {"x": x, "y": jnp.flip(x, axis=1)}
    params = model.init(jax.random.PRNGKey(0), x)
    mesh = autopar.make_mesh({"model": 8})
    sharded = autopar.auto_parallel(_sgd_step(model), mesh=mesh, hardware="h100")
    plan = sharded.plan(params, batch)
    specs = plan.specs
    for name in ("query", "key", "value"):  # heads split: column parallel
        assert specs[f"params/params/attn/{name}/kernel"] == P(None, "model")
    assert specs["params/params/attn/out/kernel"] == P("model")  # row parallel
    assert specs["params/params/mlp_in/kernel"] == P(None, "model")
    assert specs["params/params/mlp_out/kernel"] == P("model")
    found = collectives(sharded.lower(params, batch).compile().as_text())
    # The forward pass all-reduces once after attention and once after the MLP; the backward
    # pass once, the MLP's input gradient (the data needs none); nothing is gathered.
    assert sorted(c.kind for c in found) == ["all-reduce"] * 3
    assert {c.result_bytes for c in found} == {x.nbytes}
    reference = jax.jit(_sgd_step(model))(params, batch)
    got = sharded(copy_tree(params), batch)
    assert global_relative_error(got, reference) < 1e-5


def _grouped_moe(groups: int, tokens: int, d: int, experts: int, hidden: int):
    """A GShard-style top-1 MoE layer: tokens in groups, each group with its own capacity per
    expert, so dispatching is local to a group and tokens reach their experts by an
    all-to-all of the group and expert dimensions."""
    capacity = 2 * tokens // experts

    def apply(p, x):
        logits = jnp.einsum("gsd,de->gse", x, p["router"])
        onehot = jax.nn.one_hot(jnp.argmax(logits, -1), experts)
        slot = (jnp.cumsum(onehot, axis=1) - 1.0) * onehot  # place in its group's buffer
        dispatch = jax.nn.one_hot(slot.astype(jnp.int32), capacity) * (
            onehot * (slot < capacity))[..., None]  # (group, token, expert, capacity)
        gate = jnp.max(jax.nn.softmax(logits), -1)
        h = jax.nn.gelu(jnp.einsum("egcd,edh->egch",
                                   jnp.einsum("gsec,gsd->egcd", dispatch, x), p["w_in"]))
        out = jnp.einsum("egch,ehd->egcd", h, p["w_out"])
        return jnp.einsum("gsec,egcd->gsd", dispatch * gate[..., None, None], out)

    rng = np.random.default_rng(2)
    params = {"router": rng.normal(size=(d, experts)),
              "w_in": rng.normal(size=(experts, d, hidden)) / d ** 0.5,
              "w_out": rng.normal(size=(experts, hidden, d)) / hidden ** 0.5}
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    x = jnp.asarray(rng.normal(size=(groups, tokens, d)), jnp.float32)
    return apply, params, {"x": x, "y": jnp.tanh(x)}


def test_moe_gets_expert_parallelism_with_all_to_alls():
    # enough tokens per group that moving them beats summing every expert's output (at 256
    # tokens of width 512 the plan keeps tokens whole and all-reduces: cheaper there)
    apply, params, batch = _grouped_moe(groups=8, tokens=512, d=512, experts=8, hidden=1024)

    def step(p, batch):
        grads = jax.grad(lambda p: jnp.mean((apply(p, batch["x"]) - batch["y"]) ** 2))(p)
        return jax.tree.map(lambda w, g: w - 0.01 * g, p, grads)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh({"model": 8}),
                                    hardware="h100")
    specs = sharded.plan(params, batch).specs
    assert specs["p/w_in"] == P("model") and specs["p/w_out"] == P("model")  # an expert each
    kinds = [c.kind for c in collectives(sharded.lower(params, batch).compile().as_text())]
    assert kinds.count("all-to-all") >= 2  # tokens to their experts and back
    reference = jax.jit(step)(params, batch)
    assert global_relative_error(reference, sharded(copy_tree(params), batch)) < 1e-5
