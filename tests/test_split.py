"""`jnp.split` and `bitcast_convert_type`: their rules, and a fused q/k/v projection split three
ways that stays sharded."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autopar
from autopar.rules import rule_for
from helpers import copy_tree


def test_split_rule_keeps_every_dim_but_the_split_one():
    rule = rule_for("split", [(8, 16, 96)], [(8, 16, 32)] * 3, {"sizes": (32, 32, 32), "axis": -1})
    (operand,), results = rule.operands, rule.results
    assert operand[0] and operand[1] and operand[2] is None
    assert results == (operand,) * 3


def test_bitcast_convert_type_rule():
    same = rule_for("bitcast_convert_type", [(4, 8)], [(4, 8)], {"new_dtype": jnp.float32})
    assert same.operands[0] == same.results[0] and None not in same.results[0]
    # uint32 -> uint8 adds a trailing dimension of 4 bytes, which stays whole; back removes it.
    wider = rule_for("bitcast_convert_type", [(4, 8)], [(4, 8, 4)], {"new_dtype": jnp.uint8})
    assert wider.results[0][:2] == wider.operands[0] and wider.results[0][2] is None
    narrower = rule_for("bitcast_convert_type", [(4, 8, 4)], [(4, 8)], {"new_dtype": jnp.uint32})
    assert narrower.operands[0][:2] == narrower.results[0] and narrower.operands[0][2] is None


def attention_step(heads=4):
    def loss_fn(w, batch):
        x = batch["x"]
        b, t, d = x.shape
        q, k, v = jnp.split(x @ w["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
        att = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / (d // heads) ** 0.5)
        out = jnp.einsum("bhts,bshd->bthd", att, v).reshape(b, t, d) @ w["out"]
        return jnp.mean((out - batch["y"]) ** 2)

    def step(w, batch):
        loss, grads = jax.value_and_grad(loss_fn)(w, batch)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, w, grads), loss

    return step


@pytest.mark.slow
def test_fused_qkv_split():
    b, t, d = 16, 16, 64
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    w = {"qkv": jax.random.normal(ks[0], (d, 3 * d)) / d ** 0.5,
         "out": jax.random.normal(ks[1], (d, d)) / d ** 0.5}
    batch = {"x": jax.random.normal(ks[2], (b, t, d)), "y": jax.random.normal(ks[3], (b, t, d))}
    step = attention_step()
    ref_w, ref_loss = jax.jit(step)(copy_tree(w), batch)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 2, "model": 4}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", autopar.AutoparWarning)
        new_w, loss = sharded(copy_tree(w), batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for key in w:
        np.testing.assert_allclose(np.asarray(new_w[key]), np.asarray(ref_w[key]),
                                   rtol=1e-5, atol=1e-6)
    plan = sharded.plan(w, batch)
    splits = [o for o in plan.ops if o.primitive == "split" and not o.backward]
    assert splits and all(o.in_specs[0][-1] == () for o in splits), "the split dim stays whole"
    assert all(any(axes for axes in o.in_specs[0]) for o in splits), [o.in_specs for o in splits]
    projection = [o for o in plan.ops if o.primitive == "dot_general" and not o.backward
                  and o.in_shapes[1] == (d, 3 * d)]
    assert projection, "the fused projection is planned"
    for o in projection:
        used = {a for spec in (*o.in_specs, *o.out_specs) for axes in spec for a in axes}
        assert used == {"data", "model"}, (o.in_specs, o.out_specs)
        # The split reads the projection as it is made: nothing gathered in between (without
        # a rule for split, the projection was made sharded and gathered whole for it).
        assert o.out_specs[0] == splits[0].in_specs[0], (o.out_specs, splits[0].in_specs)
