"""plan.explain(path): the spec, its reshardings, the alternatives planned around, and what
decided: checked against plans made with those pins directly."""
import models
import pytest
from jax.sharding import PartitionSpec as P

import autopar

MESH = {"data": 2, "model": 4}
KERNEL = "state/0/params/Dense_0/kernel"


@pytest.fixture(scope="module")
def mlp():
    return models.mlp_setup()


def test_alternatives_are_the_plans_pinned_so(mlp):
    step, state, batch = mlp
    plan = autopar.plan(step, state, batch, mesh=MESH, hardware="h100")
    why = plan.explain(KERNEL, alternatives=3)
    chosen = next(t for t in plan.inputs if t.path == KERNEL)
    assert why.tensor == chosen and len(why.alternatives) == 3
    assert chosen.partition_spec not in {a.spec for a in why.alternatives}
    for alt in why.alternatives:  # each is what planning with that pin gives
        direct = autopar.plan(step, state, batch, mesh=MESH, hardware="h100",
                              annotations={f"^{KERNEL}$": alt.spec})
        assert alt.total_s == pytest.approx(direct.cost["total_s"], rel=1e-12)
    if all(a.total_s >= plan.cost["total_s"] for a in why.alternatives):
        assert why.decided_by.startswith("the cost model")
    text = str(why)
    assert KERNEL in text and "decided by:" in text and "alternatives" in text


def test_an_annotation_decides(mlp):
    step, state, batch = mlp
    plan = autopar.plan(step, state, batch, mesh=MESH, annotations={"Dense_0/kernel": P("model")})
    why = plan.explain(KERNEL)
    assert why.decided_by == f"your annotation 'Dense_0/kernel': {P('model')}"
    assert why.alternatives == ()


def test_the_memory_limit_decides_where_a_faster_spec_does_not_fit():
    step, state, batch = models.mlp_setup(features=256)
    free = autopar.plan(step, state, batch, mesh={"data": 8})
    limit = int(0.8 * free.cost["peak_memory_bytes"])
    plan = autopar.plan(step, state, batch, mesh={"data": 8}, memory_limit=limit)
    why = plan.explain("state/0/params/Dense_0/kernel", alternatives=4)
    unfit = [a for a in why.alternatives if a.unlimited_s is not None]
    assert unfit and all(a.total_s is None for a in unfit)
    faster = min(unfit, key=lambda a: a.unlimited_s)
    assert faster.unlimited_s < plan.cost["total_s"]
    assert why.decided_by.startswith(f"the memory limit: {faster.spec}")
    with pytest.raises(autopar.MemoryLimitError):
        autopar.plan(step, state, batch, mesh={"data": 8}, memory_limit=limit,
                     annotations={"^state/0/params/Dense_0/kernel$": faster.spec})
    assert "does not fit memory_limit" in str(why)


def test_a_plan_from_json_and_an_unknown_path(mlp):
    step, state, batch = mlp
    plan = autopar.plan(step, state, batch, mesh=MESH)
    loaded = autopar.Plan.from_json(plan.to_json())
    assert loaded.explain(KERNEL).decided_by.startswith("not known")
    with pytest.raises(autopar.AutoparError, match="nor operators of scope, 'kernel'"):
        plan.explain("kernel")


def test_an_intermediate_scope_shows_its_operators(mlp):
    step, state, batch = mlp
    plan = autopar.plan(step, state, batch, mesh=MESH, memory_limit=60_000)
    scope = next(o.scope for o in plan.ops if o.primitive == "dot_general")
    why = plan.explain(scope)
    assert isinstance(why, autopar.explain.ScopeExplanation)
    assert why.ops == tuple(o for o in plan.ops if o.scope == scope)
    text = str(why)
    for o in why.ops:
        assert f"compute {o.compute_s * 1e3:.4f} ms" in text
    summed = [o for o in why.ops if o.communication_s and o.partial_axes]
    assert all(f"collectives {o.communication_s * 1e3:.4f} ms" in text for o in summed)
    assert "annotations pin inputs, not intermediates" in why.decided_by
    with pytest.raises(autopar.AutoparError, match="nor operators of scope"):
        plan.explain("MLP/nowhere")
