"""Annotations (regex over input paths, autopar.shard, saved plans) and sharding propagation."""
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import autopar
from helpers import check_against_single_device

MESH = {"data": 2, "model": 4}
MEGATRON = {
    r"batch/": P("data"),
    r"params/.*/mlp_in/kernel": P(None, "model"),  # column parallel
    r"params/.*/mlp_out/kernel": P("model", None),  # row parallel
    r"params/.*/(query|key|value)/kernel": P(None, "model", None),  # heads split
    r"params/.*/MultiHeadDotProductAttention_0/out/kernel": P("model", None, None),
}


def forward_all_reduces(plan, scope_part):
    return [o for o in plan.ops
            if not o.backward and scope_part in o.scope and "model" in o.partial_axes]


@pytest.mark.slow
def test_megatron_from_kernel_annotations():
    step, state, batch = models.gpt_setup()
    plan = check_against_single_device(step, state, batch, autopar.make_mesh(MESH),
                                       search="sharding_propagation", annotations=MEGATRON)
    for block in ("block_0", "block_1"):
        # One all-reduce over 'model' per MLP and per attention in the forward pass: the row
        # parallel matmuls' partial sums, nothing else.
        mlp = forward_all_reduces(plan, f"{block}/mlp_")
        attention = forward_all_reduces(plan, f"{block}/MultiHeadDotProductAttention_0")
        assert [o.scope.split("/")[-1] for o in mlp] == ["mlp_out"]
        assert [o.scope.split("/")[-1] for o in attention] == ["out"]
        # The hidden activation is split over 'model' on its features, the attention logits on
        # their heads (batch, heads, query, key).
        hidden = [o for o in plan.ops if not o.backward and o.primitive == "dot_general"
                  and o.scope.endswith(f"{block}/mlp_in")]
        assert hidden and all(o.out_specs[0][-1] == ("model",) for o in hidden)
        logits = [o for o in plan.ops if not o.backward and o.primitive == "dot_general"
                  and f"{block}/MultiHeadDotProductAttention_0" in o.scope
                  and len(o.out_shapes[0]) == 4 and o.out_shapes[0][-1] == o.out_shapes[0][-2]]
        assert logits and all(o.out_specs[0][1] == ("model",) for o in logits)
    specs = plan.specs
    assert specs["state/0/params/block_0/mlp_in/bias"] == P("model")
    assert specs["state/0/params/block_1/mlp_out/kernel"] == P("model")
    assert not [r for r in plan.redistributions if r.annotated], "these seeds agree"
    assert plan.search_stats["reached"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("search", ["dynamic_programming", "recursive_programming"])
def test_searches_keep_annotations(search):
    step, state, batch = models.mlp_setup()
    annotations = {r"params/Dense_0/kernel": P(None, "model"), r"params/Dense_1/kernel": P()}
    plan = check_against_single_device(step, state, batch, autopar.make_mesh(MESH),
                                       search=search, annotations=annotations)
    assert plan.specs["state/0/params/Dense_0/kernel"] == P(None, "model")
    assert plan.specs["state/0/params/Dense_1/kernel"] == P()
    # Adam's moments of that kernel match the regex too (re.search): they are annotated alike.
    assert plan.specs["state/1/0/mu/params/Dense_0/kernel"] == P(None, "model")


class ShardedMLP(nn.Module):
    """An MLP with its hidden activation annotated in the model code."""
    spec: P = P("data", "model")
    hidden: int = 64

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(self.hidden)(x))
        h = autopar.shard(h, self.spec)
        return nn.Dense(16)(h)


def sharded_mlp_setup(spec=P("data", "model"), batch=32, features=24, hidden=64):
    model = ShardedMLP(spec, hidden)
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, features))
    y = jax.random.normal(jax.random.PRNGKey(2), (batch, 16))
    params = model.init(jax.random.PRNGKey(3), x)
    tx = optax.adamw(1e-3)
    return models.linen_step(model, models.mse, tx), (params, tx.init(params)), \
        {"inputs": x, "targets": y}


@pytest.mark.slow
@pytest.mark.parametrize("search", ["sharding_propagation", "dynamic_programming",
                                    "recursive_programming"])
def test_a_pin_may_leave_dimensions_to_the_search(search):
    """P.UNCONSTRAINED pins nothing on its dimension: in model code and in annotations the
    other dimensions are fixed, and the search places that one."""
    free = P.UNCONSTRAINED
    size = dict(batch=2048, features=256, hidden=512)
    step, state, batch = sharded_mlp_setup(P(free, "model"), **size)
    annotations = {r"batch/inputs": P(free, free), r"params/Dense_1/kernel": P("model", free)}
    plan = check_against_single_device(step, state, batch, autopar.make_mesh(MESH),
                                       search=search, annotations=annotations)
    marks = [o for o in plan.ops if o.primitive == "autopar_shard"]
    assert len(marks) == 1 and marks[0].out_specs[0][1] == ("model",)
    assert plan.specs["state/0/params/Dense_1/kernel"][0] == "model"
    if search != "sharding_propagation":  # propagation spreads the pins, it weighs no others
        # The searches split the batch over 'data', which pins with those dimensions whole
        # (None) forbid, and find the step faster so.
        whole = autopar.plan(*sharded_mlp_setup(P(None, "model"), **size), mesh=MESH,
                             search=search, annotations={r"batch/inputs": P(),
                                                         r"params/Dense_1/kernel": P("model")})
        assert plan.specs["batch/inputs"] == P("data")
        assert marks[0].out_specs[0][0] == ("data",)
        assert plan.cost["total_s"] < whole.cost["total_s"]


def test_shard_is_a_no_op_outside_autopar():
    def f(x):
        return jnp.sum(autopar.shard(jnp.tanh(x), P("data", None)) ** 2)

    def g(x):
        return jnp.sum(jnp.tanh(x) ** 2)

    x = jnp.arange(12.0).reshape(4, 3) / 10
    for transform in (lambda h: h, jax.jit, jax.grad, lambda h: jax.jit(jax.grad(h))):
        np.testing.assert_array_equal(transform(f)(x), transform(g)(x))
    np.testing.assert_array_equal(jax.vmap(f)(x[None]), jax.vmap(g)(x[None]))


@pytest.mark.slow
@pytest.mark.parametrize("search", ["sharding_propagation", "dynamic_programming",
                                    "recursive_programming"])
def test_shard_in_model_code(search):
    step, state, batch = sharded_mlp_setup()
    plan = check_against_single_device(step, state, batch, autopar.make_mesh(MESH),
                                       search=search)
    marks = [o for o in plan.ops if o.primitive == "autopar_shard"]
    assert len(marks) == 1 and marks[0].out_specs == ((("data",), ("model",)),)


@pytest.mark.slow
def test_conflicting_seeds_are_redistributed():
    step, state, batch = sharded_mlp_setup()
    # The step's input arrives split over 'model' on its batch dimension; the model wants the
    # hidden activation split over 'data' on it: they cannot both hold without resharding.
    annotations = {r"batch/inputs": P("model"), r"params/Dense_0/kernel": P()}
    for search in ("sharding_propagation", "dynamic_programming"):
        plan = check_against_single_device(step, state, batch, autopar.make_mesh(MESH),
                                           search=search, annotations=annotations)
        assert plan.specs["batch/inputs"] == P("model")
        conflicts = [r for r in plan.redistributions if r.annotated]
        assert conflicts, plan.summary()
        assert all(r.to_spec != r.from_spec and r.cost_s >= 0 for r in conflicts)
        assert "redistributions at annotations" in plan.summary()
        assert any(c.tensor != "batch/inputs" or c.from_spec == (("model",), ())
                   for c in conflicts)
        again = autopar.Plan.from_json(plan.to_json())
        assert again.redistributions == plan.redistributions


@pytest.mark.slow
def test_saved_plan_seeds_a_search(tmp_path):
    step, state, batch = models.mlp_setup()
    mesh = autopar.make_mesh(MESH)
    saved = autopar.plan(step, state, batch, mesh=mesh)
    path = tmp_path / "plan.json"
    saved.save(str(path))
    # Whole plan: every input is seeded, propagation fills in the operators.
    whole = check_against_single_device(step, state, batch, mesh, search="sharding_propagation",
                                        annotations=autopar.load_plan(str(path)))
    assert [t.spec for t in whole.inputs] == [t.spec for t in saved.inputs]
    # Partial plan: a JSON file with only the mesh and two inputs.
    body = json.loads(path.read_text())
    keep = [t for t in body["inputs"] if t["path"].endswith("Dense_1/kernel")
            or t["path"] == "batch/inputs"]
    keep[0]["spec"] = [["model"] if k == len(keep[0]["shape"]) - 1 else []
                       for k in range(len(keep[0]["shape"]))]
    partial_path = tmp_path / "partial.json"
    partial_path.write_text(json.dumps({"format_version": 1, "mesh": body["mesh"],
                                        "inputs": keep}))
    partial = autopar.plan(step, state, batch, mesh=mesh, search="sharding_propagation",
                           annotations=autopar.load_plan(str(partial_path)))
    for entry in keep:
        assert partial.specs[entry["path"]] == autopar.TensorPlan(
            entry["path"], (), "", tuple(tuple(a) for a in entry["spec"]), 0).partition_spec


def message_of(fn):
    with pytest.raises(autopar.AutoparError) as info:
        fn()
    return str(info.value)


def test_annotation_errors_name_path_shape_mesh_and_fix():
    step, state, batch = models.mlp_setup()
    bad = {
        r"^state/0/params/Dense_0/kernel$": P(None, None, "model"),  # rank 2, three entries
        r"^state/0/params/Dense_1/kernel$": P(None, "tensor"),  # no such axis
        r"params/Dense_2/kernel$": P(None, "model"),  # 16 features over 4: fine
        r"^state/0/params/Dense_2/bias$": P(("model", "data")),  # out of mesh order
        r"batch/inputs": P(None, "model"),  # 24 features over 4: fine
        r"batch/targets": P("data", "model"),  # 16 over 4 fine, 32 over 2 fine
        r"params/Dense_7/": P("data"),  # matches nothing
    }
    text = message_of(lambda: autopar.plan(step, state, batch, mesh=MESH, annotations=bad))
    assert "{'data': 2, 'model': 4}" in text and text.count("Fix:") == 4
    assert "input state/0/params/Dense_0/kernel" in text and "(24, 64)" in text
    assert "3 entries for a tensor of rank 2" in text
    assert "names axis 'tensor', which the mesh does not have" in text
    assert "out of mesh order" in text and "('data', 'model')" in text
    assert "'params/Dense_7/' matches no input path" in text

    indivisible = {r"batch/targets": P(None, "model")}  # 16 over 3
    text = message_of(lambda: autopar.plan(step, state, batch, mesh={"data": 2, "model": 3},
                                           annotations=indivisible))
    assert "input batch/targets" in text and "(32, 16)" in text and "'model': 3" in text
    assert "dimension 1 has size 16, which ('model',) (3 devices) does not divide" in text

    def bad_shard(x):
        return jnp.sum(autopar.shard(x, P("nowhere")) ** 2)

    text = message_of(lambda: autopar.plan(bad_shard, jnp.ones((8, 4)), mesh=MESH))
    assert "autopar.shard at" in text and "test_annotations.py" in text and "(8, 4)" in text
    assert "'nowhere'" in text and "Fix:" in text

    text = message_of(lambda: autopar.plan(step, state, batch, mesh=MESH,
                                           search="sharding_propagation"))
    assert "has none" in text and "annotations=" in text
    text = message_of(lambda: autopar.auto_parallel(step, mesh=8, plan=autopar.plan(
        step, state, batch, mesh=8), annotations={"batch/": P("data")}))
    assert "both plan=" in text
    text = message_of(lambda: autopar.plan(step, state, batch, mesh=MESH, annotations=3))
    assert "annotations=3 is not understood" in text


def test_device_count_keeps_meshes_the_annotations_fit():
    step, state, batch = models.mlp_setup()
    plan = autopar.plan(step, state, batch, mesh=8,
                        annotations={r"params/Dense_0/kernel": P(None, "model")})
    assert "model" in dict(plan.mesh)
    assert plan.specs["state/0/params/Dense_0/kernel"] == P(None, "model")


def test_shard_inside_a_scan_body():
    """An annotation in a loop body fixes the body's planned operator; the loop runs whole,
    under grad too."""
    def step(w, x):
        def loss_fn(v):
            def body(h, _):
                return autopar.shard(jnp.tanh(h @ v), P("data", "model")), None

            h, _ = jax.lax.scan(body, x, None, length=3)
            return jnp.mean(h ** 2)

        loss, grad = jax.value_and_grad(loss_fn)(w)
        return w - 0.1 * grad, loss

    w = jax.random.normal(jax.random.PRNGKey(0), (16, 16)) / 4
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 16))
    reference = jax.jit(step)(w, x)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESH))
    got = sharded(jnp.array(w), x)
    np.testing.assert_allclose(got[1], reference[1], rtol=1e-5)
    np.testing.assert_allclose(got[0], reference[0], rtol=1e-5, atol=1e-6)
    marks = [o for o in sharded.plan(w, x).ops if o.primitive == "autopar_shard"]
    assert marks and all(o.out_specs == ((("data",), ("model",)),) for o in marks)


@pytest.mark.slow
def test_propagation_plans_compile_without_xla_warnings(capfd):
    """Reshardings XLA's partitioner has no pattern for make it gather a whole tensor and log
    "Involuntary full rematerialization". The cost model prices them as such, so the plans
    avoid them: the propagation GPT's programs (batch annotated, and Megatron) compile
    silently. The same partitioner given such a resharding by hand does log it, which shows
    the check can see the warning."""
    from jax.sharding import NamedSharding

    step, state, batch = models.gpt_setup(batch=16, seq=32, vocab=256, d_model=64, heads=4,
                                          layers=2)
    mesh = autopar.make_mesh({"data": 4, "model": 2})
    for annotations in ({r"^batch/": P("data")}, MEGATRON):
        autopar.auto_parallel(step, mesh=mesh, search="sharding_propagation",
                              annotations=annotations).lower(state, batch).compile()
    assert "Involuntary full rematerialization" not in capfd.readouterr().err

    def unpatterned(x):  # an axis moves to another dimension while another leaves it
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(("data", "model"))))
        return jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P(None, "data")))

    jax.jit(unpatterned).lower(jax.ShapeDtypeStruct((16, 64), jnp.float32)).compile()
    assert "Involuntary full rematerialization" in capfd.readouterr().err


@pytest.mark.slow
def test_an_axis_moving_while_another_leaves_compiles_without_xla_warnings(capfd):
    """Found by the fuzzer: a propagation plan of attention blocks in an nn.scan stack on
    {a: 2, b: 4} reduce-scatters the output projection's gradient over ('a', 'b') on its last
    dimension and reads it split over 'a' on its first. Given those two ends XLA gathered the
    whole tensor, logging "Involuntary full rematerialization"; the lowering now gathers 'b'
    and then moves 'a' (cost.resharding.reshard_stops). The step stays equal to one device."""
    import fuzz_models

    spec = fuzz_models.Spec(batch=16, seq=8, width=8, heads=2, inputs="tokens",
                            blocks=("attention", "dense"), norm="layer", stack="nn_scan",
                            lax_scan=True, head="tied", optimizer="adamw", seed=1)
    step, state, batch = fuzz_models.build(spec)
    check_against_single_device(step, state, batch, autopar.make_mesh({"a": 2, "b": 4}),
                                search="sharding_propagation",
                                annotations={r"^batch/(inputs|targets)$": P("b")})
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
