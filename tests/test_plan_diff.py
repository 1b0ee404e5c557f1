"""autopar.diff: the inputs two plans shard differently, and what each plan predicts."""
import models
import pytest

import autopar

MESH = {"data": 2, "model": 4}


@pytest.fixture(scope="module")
def plans():
    step, state, batch = models.mlp_setup()
    free = autopar.plan(step, state, batch, mesh=MESH)
    lean = autopar.plan(step, state, batch, mesh=MESH, memory_limit=60_000)
    return free, lean


def test_a_plan_against_itself_and_its_json(plans):
    free, _ = plans
    d = autopar.diff(free, autopar.Plan.from_json(free.to_json()))
    assert d.same_specs and not d.changed and d.cost_a == d.cost_b
    assert "every input has the same spec" in str(d)


def test_a_memory_limit_shows_what_it_sharded_and_what_that_costs(plans):
    free, lean = plans
    d = autopar.diff(free, lean)
    want = {t.path: str(t.partition_spec) for t in lean.inputs}
    have = {t.path: str(t.partition_spec) for t in free.inputs}
    assert {c.path for c in d.changed} == {p for p in want if want[p] != have[p]} != set()
    assert all(c.b == want[c.path] and c.a == have[c.path] for c in d.changed)
    assert d.cost_b["peak_memory_bytes"] == lean.cost["peak_memory_bytes"]
    text = str(d)
    assert f"{len(d.changed)} inputs sharded differently" in text
    ratio = lean.cost["total_s"] / free.cost["total_s"]
    assert f"({ratio:.3f}x)" in text.splitlines()[1]
    kinds = d.collectives()
    assert all(kinds[k] == (free.cost.get(f"{k}_bytes", 0.0), lean.cost.get(f"{k}_bytes", 0.0))
               for k in kinds)


def test_paths_one_plan_lacks_and_bad_arguments(plans):
    free, _ = plans
    step, state, batch = models.nnx_setup()
    other = autopar.plan(step, state, batch, mesh={"data": 8})
    d = autopar.diff(free, other)
    assert set(d.only_a) == {t.path for t in free.inputs} - {t.path for t in other.inputs}
    assert d.only_b and "only in plan b" in str(d)
    with pytest.raises(autopar.AutoparError, match="plan b is a str"):
        autopar.diff(free, "plan.json")
