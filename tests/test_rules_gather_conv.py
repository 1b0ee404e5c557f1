"""Gather and scatter with batching dims (take_along_axis), vocabulary-parallel embedding, and
grouped (depthwise) convolutions: their factors, and sharded steps equal to one device."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import check_against_single_device
from jax.sharding import PartitionSpec as P

import autopar
from autopar import lower
from autopar.cost.hlo import collective_counts
from autopar.mesh import MeshShape
from autopar.rules import enumerate_strategies, rule_for, strategy
from autopar.rules.factors import scattered

MESH = MeshShape(("data", "model"), (2, 4))
B, T, V, D = 8, 4, 32, 16
VOCAB = 256  # an embedding table larger than its lookups: vocabulary-parallel pays


# Inputs from numpy: jax.random would compile a program per shape, slower than the tests.
def normal(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    return jnp.asarray(scale * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def integers(seed: int, shape: tuple[int, ...], high: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, high, shape), jnp.int32)


def equations(fn: Callable, *args: Any, names: tuple[str, ...]) -> list[Any]:
    """Every equation of `fn`'s jaxpr, inner jaxprs (jit, custom_jvp) included, whose primitive
    is in `names`."""
    found = []

    def walk(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in names:
                found.append(eqn)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def rule_of(eqn: Any):
    rule = rule_for(eqn.primitive.name, [tuple(v.aval.shape) for v in eqn.invars],
                    [tuple(v.aval.shape) for v in eqn.outvars], eqn.params)
    assert rule is not None, eqn
    return rule


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_take_along_axis_gather_and_scatter_share_batch_factors():
    logits = jnp.zeros((B, T, V))
    labels = jnp.zeros((B, T), jnp.int32)
    eqns = equations(jax.grad(cross_entropy), logits, labels,
                     names=("gather", "scatter", "scatter-add"))
    batching = [e for e in eqns if e.params["dimension_numbers"].operand_batching_dims]
    assert {e.primitive.name for e in batching} == {"gather", "scatter-add"}
    for eqn in eqns:  # every gather and scatter of the loss and its gradient splits B and T
        rule = rule_of(eqn)
        result = rule.results[0]
        assert result[0] and result[1], (eqn.primitive, rule)
    for eqn in batching:
        rule = rule_of(eqn)
        operand, indices = rule.operands[:2]
        b, t, v = operand
        assert b and t and v and len({b, t, v}) == 3
        assert indices[:2] == (b, t) and rule.results[0][:2] == (b, t)
        if eqn.primitive.name == "gather":
            # the class dim, looked up one entry at a time: vocabulary-parallel loss
            assert rule.reduction_factors == {v}
        else:
            assert rule.operands[2][:2] == (b, t)
            assert rule.results[0] == operand and not rule.reduction_factors
        data_parallel = strategy(rule, MESH, {b: ("data",), t: ("model",)})
        assert data_parallel.partial_axes == ()
        assert data_parallel.in_specs[1][:2] == (("data",), ("model",))


def test_embedding_gather_vocab_is_a_reduction_factor():
    table = jnp.zeros((V, D))
    ids = jnp.zeros((B, T), jnp.int32)
    (gather,) = equations(lambda t: t[ids].sum(), table, names=("gather",))
    rule = rule_of(gather)
    (vocab, d), idx = rule.operands
    assert rule.reduction_factors == {vocab}
    assert rule.results[0] == (*idx[:2], d)
    vocab_parallel = [s for s in enumerate_strategies(rule, MESH)
                      if dict(s.assignment) == {vocab: ("model",), idx[0]: ("data",)}]
    assert vocab_parallel, "a strategy with the table's rows split and the batch split"
    s = vocab_parallel[0]
    assert s.partial_axes == ("model",)
    assert s.in_specs[0] == (("model",), ()) and s.out_specs[0] == (("data",), (), ())

    (scatter,) = equations(jax.grad(lambda t: (t[ids] ** 2).sum()), table,
                           names=("scatter-add",))
    rule = rule_of(scatter)
    vocab, d = rule.operands[0]
    assert vocab and rule.results[0] == (vocab, d)
    assert vocab not in rule.operands[1] + rule.operands[2], "updates land in their own rows"
    s = strategy(rule, MESH, {vocab: ("model",)})
    assert s.out_specs[0] == (("model",), ()) and s.partial_axes == ()


def test_scatter_with_other_combiners_has_no_reduction_factor():
    x = jnp.zeros((V, D))
    idx = jnp.zeros((B,), jnp.int32)
    u = jnp.zeros((B, D))
    for name in ("max", "min", "mul"):
        (eqn,) = equations(lambda x: getattr(x.at[idx], name)(u), x, names=(f"scatter-{name}",))
        rule = rule_of(eqn)
        vocab, d = rule.operands[0]
        assert vocab and d and rule.results[0] == (vocab, d)
        assert not rule.reduction_factors


def depthwise(x: jax.Array, kernel: jax.Array) -> jax.Array:
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        feature_group_count=x.shape[-1])


def test_grouped_conv_group_factor():
    x = jnp.zeros((4, 6, 6, 8))
    kernel = jnp.zeros((3, 3, 1, 16))  # depthwise, channel multiplier 2
    loss = lambda x, k: (depthwise(x, k) ** 2).sum()
    forward, kernel_grad, input_grad = equations(jax.grad(loss, argnums=(0, 1)), x, kernel,
                                                 names=("conv_general_dilated",))
    rule = rule_of(forward)
    (n, _, _, c), (_, _, i, o), out = rule.operands + rule.results
    assert c == o == out[3] and rule.sizes[c] == 8 and i is None and out[0] == n
    assert not rule.reduction_factors

    # batch_group_count 8: the groups are the lhs batch dim (x's channels); the lhs feature dim
    # (x's batch) is summed over
    assert kernel_grad.params["batch_group_count"] == 8
    rule = rule_of(kernel_grad)
    (summed, _, _, g), (batch, _, _, o) = rule.operands
    assert g == o == rule.results[0][3] and rule.sizes[g] == 8
    assert rule.reduction_factors == {summed} and batch == summed

    assert input_grad.params["feature_group_count"] == 8
    rule = rule_of(input_grad)
    g = rule.operands[0][3]
    assert g and rule.results[0][3] == g and rule.sizes[g] == 8


def test_grouped_conv_explicit_reduce_scatter_holds_local_groups():
    """A grouped kernel gradient whose partial sums the lowering writes out under shard_map
    (a reduce-scatter) binds each device's shards with its own share of the groups."""
    mesh = autopar.make_mesh({"model": 4, "data": 2})
    shape = MeshShape(("model", "data"), (4, 2))
    x = normal(0, (4, 6, 6, 8))
    kernel = normal(1, (3, 3, 1, 16))
    cotangent = normal(2, (4, 6, 6, 16))
    (eqn,) = [e for e in equations(jax.grad(lambda x, k: (depthwise(x, k) * cotangent).sum(),
                                            argnums=1), x, kernel,
                                   names=("conv_general_dilated",))
              if e.params["batch_group_count"] > 1]
    rule = rule_of(eqn)
    summed, g = rule.operands[0][0], rule.operands[0][3]
    (st,) = [v for v in scattered(strategy(rule, shape, {g: ("model",), summed: ("data",)}),
                                  rule, shape) if v.out_specs[0][3] == ("model", "data")]
    how = lower.explicit_collectives("conv_general_dilated", st)
    assert how is not None and how[2] == ("data",), "written out as a reduce-scatter"
    params = eqn.primitive.get_bind_params(eqn.params)
    want = eqn.primitive.bind(x, cotangent, **params)
    got = jax.jit(lambda a, b: lower.bind_explicit(mesh, eqn.primitive, params, [a, b], *how)
                  )(x, cotangent)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_depthwise_kernel_gradient_split_over_one_axis_of_two_equals_one_device():
    """The depthwise kernel's gradient (a batch-grouped convolution) with the batch split over
    'b' of a 4x2 mesh and 'a' unused: XLA's partitioner, given the shardings alone, computes
    it wrongly (jax 0.10.2), so the lowering writes its sum out under shard_map."""
    x, kernel = normal(1, (16, 4, 16)), normal(0, (3, 1, 16))

    def step(k: jax.Array, batch: dict) -> jax.Array:
        k = autopar.shard(k, P())  # the channels stay whole: only the batch is split
        conv = lambda k: jax.lax.conv_general_dilated(  # noqa: E731
            batch["x"], k, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"),
            feature_group_count=16)
        return k - 0.1 * jax.grad(lambda k: (conv(k) ** 2).sum())(k)

    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh({"a": 4, "b": 2}),
                                    annotations={r"^batch/": P("b")})
    (grad_op,) = [o for o in sharded.plan(kernel, {"x": x}).ops
                  if o.primitive == "conv_general_dilated" and o.partial_axes]
    assert grad_op.partial_axes == ("b",) and grad_op.in_specs[0] == (("b",), (), ())
    np.testing.assert_allclose(np.asarray(sharded(kernel, {"x": x})),
                               np.asarray(jax.jit(step)(kernel, {"x": x})), rtol=1e-5, atol=1e-4)


# End to end: sharded steps equal to one device.

def adam_step(loss_fn: Callable) -> Callable:
    tx = optax.adam(1e-2)

    def step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step


def init_state(params: dict) -> tuple:
    return params, optax.adam(1e-2).init(params)


def compiled_text(step: Callable, state: Any, batch: Any, mesh: Any, **options: Any) -> str:
    sharded = autopar.auto_parallel(step, mesh=mesh, **options)
    return sharded.lower(state, batch).compile().as_text()


@pytest.mark.slow
def test_cross_entropy_split_over_batch_and_sequence():
    def loss_fn(params, batch):
        return cross_entropy(batch["x"] @ params["w"], batch["y"])

    step = adam_step(loss_fn)
    state = init_state({"w": normal(0, (D, V), 0.1)})
    batch = {"x": normal(1, (B, T, D)), "y": integers(2, (B, T), V)}
    mesh = autopar.make_mesh({"data": 2, "model": 4})
    annotations = {r"batch/": P("data", "model")}
    plan = check_against_single_device(step, state, batch, mesh, annotations=annotations)
    assert plan.specs["batch/y"] == P("data", "model")
    gathers = [o for o in plan.ops if o.primitive in ("gather", "scatter-add")
               and o.in_shapes[0] == (B, T, V)]
    assert len(gathers) == 2, "the loss's gather and its gradient's scatter-add"
    for op in gathers:
        assert op.in_specs[0] == (("data",), ("model",), ()), op
        assert op.out_specs[0][:2] == (("data",), ("model",)) and not op.partial_axes
    text = compiled_text(step, state, batch, mesh, annotations=annotations)
    assert "all-gather" not in collective_counts(text), "the logits are never gathered"


def embedding_setup() -> tuple[Callable, tuple, dict]:
    def loss_fn(params, batch):
        h = jnp.take(params["embedding"], batch["tokens"], axis=0)
        return jnp.mean((jnp.tanh(h @ params["w"]) - batch["y"]) ** 2)

    state = init_state({"embedding": normal(0, (VOCAB, D)), "w": normal(3, (D, D), 0.3)})
    batch = {"tokens": integers(1, (B, T), VOCAB), "y": normal(2, (B, T, D))}
    return adam_step(loss_fn), state, batch


def test_vocab_parallel_embedding_trains_as_one_device():
    step, state, batch = embedding_setup()
    mesh = autopar.make_mesh({"data": 2, "model": 4})
    annotations = {r"embedding": P("model", None)}
    plan = check_against_single_device(step, state, batch, mesh, annotations=annotations)
    (lookup,) = [o for o in plan.ops if o.primitive == "gather"]
    assert lookup.in_specs[0] == (("model",), ()) and "model" in lookup.partial_axes
    assert lookup.out_specs[0][2] == (), "rows are looked up where they live, then summed"
    (grad,) = [o for o in plan.ops if o.primitive == "scatter-add"]
    assert grad.out_specs[0] == (("model",), ()), "the table's gradient keeps its rows split"
    counts = collective_counts(compiled_text(step, state, batch, mesh, annotations=annotations))
    assert "all-gather" not in counts and counts.get("all-reduce", 0) >= 1


def test_vocab_parallel_embedding_with_data_parallel_batch():
    step, state, batch = embedding_setup()
    mesh = autopar.make_mesh({"data": 2, "model": 4})
    annotations = {r"embedding": P("model", None), r"batch/": P("data")}
    plan = check_against_single_device(step, state, batch, mesh, annotations=annotations)
    (lookup,) = [o for o in plan.ops if o.primitive == "gather"]
    assert lookup.in_specs == ((("model",), ()), (("data",), (), ()))
    assert lookup.partial_axes == ("model",)
    (grad,) = [o for o in plan.ops if o.primitive == "scatter-add"]
    assert grad.out_specs[0] == (("model",), ()) and grad.partial_axes == ("data",)


@pytest.mark.slow
def test_depthwise_conv_split_over_channels():
    def loss_fn(params, batch):
        h = depthwise(jnp.tanh(depthwise(batch["x"], params["k1"])), params["k2"])
        return jnp.mean((h - batch["y"]) ** 2)

    step = adam_step(loss_fn)
    state = init_state({"k1": normal(0, (3, 3, 1, 16), 0.3),
                        "k2": normal(1, (3, 3, 1, 16), 0.3)})
    batch = {"x": normal(2, (4, 6, 6, 8)), "y": normal(3, (4, 6, 6, 16))}
    mesh = autopar.make_mesh({"data": 2, "model": 4})
    annotations = {r"/k\d": P(None, None, None, "model"), r"batch/": P("data")}
    plan = check_against_single_device(step, state, batch, mesh, annotations=annotations)
    convs = [o for o in plan.ops if o.primitive == "conv_general_dilated"]
    assert len(convs) == 5  # two forward, two kernel gradients, one input gradient
    for op in convs:
        assert op.in_specs[0][3] == ("model",), "channels stay split through every conv"
    assert "all-gather" not in collective_counts(
        compiled_text(step, state, batch, mesh, annotations=annotations))


def test_scatter_add_partial_sums_priced_as_compiled():
    """A scatter-add whose updates are split over two axes on two dimensions compiles to one
    all-reduce of the whole result per dimension (never a reduce-scatter); over both axes on
    one dimension, to one. Predicted bytes equal the compiled program's, and the step equals
    one device."""
    def step(table, ids, upd):
        return table + jnp.zeros_like(table).at[ids].add(upd)

    table, upd = normal(0, (512, 128)), normal(1, (64, 64, 128))
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 512, (64, 64)), jnp.int32)
    for spec, all_reduce in ((P("data", "model"), 2 * 512 * 128 * 4),
                             (P(("data", "model")), 512 * 128 * 4)):
        sharded = autopar.auto_parallel(
            step, mesh=autopar.make_mesh({"data": 2, "model": 4}), hardware="h100",
            annotations={"ids": spec, "upd": spec, "table": P()})
        plan = sharded.plan(table, ids, upd)
        compiled = sharded.lower(table, ids, upd).compile().as_text()
        assert collective_counts(compiled) == {"all-reduce": 1 + (len(spec) == 2)}, spec
        predicted = {k: v for k, v in plan.cost.items()
                     if k.endswith("_bytes") and k != "peak_memory_bytes" and v}
        assert predicted == {"all-reduce_bytes": all_reduce}, (spec, predicted)
        np.testing.assert_allclose(np.asarray(sharded(table, ids, upd)),
                                   np.asarray(step(table, ids, upd)), rtol=1e-5, atol=1e-5)
