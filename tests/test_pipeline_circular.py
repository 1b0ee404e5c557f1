"""The circular pipeline (pipeline=S, pipeline_repeats=R): each stage holds R chunks of the
layer stack and every microbatch goes round the stages R times, equal to one device; inside the
loop one rotation of the stages' activations each way per tick, priced as XLA compiles it."""
import pytest
from helpers import check_against_single_device
from test_pipeline import Stack, gpt_case, mlp_case
from test_pipeline_choice import slow_devices

import autopar
from autopar.cost.hlo import collectives

pytestmark = pytest.mark.slow  # the slow tier: `make test-fast` leaves it out


@pytest.mark.parametrize("mesh, microbatches, layers", [
    ({"stage": 2, "data": 4}, 4, 4),  # M > S: a pass waits M - S ticks to go round again
    ({"stage": 4, "data": 2}, 4, 8),  # M = S: it goes round at once
])
def test_circular_gpt_equals_one_device(mesh, microbatches, layers):
    step, state, data = gpt_case(layers=layers)
    stages = mesh["stage"]
    plan = check_against_single_device(step, state, data, autopar.make_mesh(mesh),
                                       donate_argnums=0, microbatches=microbatches,
                                       pipeline=stages, pipeline_repeats=2)
    assert plan.pipeline_stages == stages and plan.pipeline_repeats == 2
    ticks = 2 * microbatches + stages - 1
    assert f"circular schedule, 2 rounds through the stages: {ticks} ticks" in plan.summary()
    again = autopar.Plan.from_json(plan.to_json())
    assert (again.pipeline_stages, again.pipeline_repeats) == (stages, 2)


def by_kind(found):
    out = {}
    for c in found:
        out[c.kind] = out.get(c.kind, 0) + c.result_bytes * c.executions
    return out


def test_the_circular_loop_rotates_once_each_way_priced_as_compiled():
    """Inside the loop: one cyclic collective-permute forward and one backward per tick, no
    gradient reduction; every kind of collective's bytes, predicted, equal the compiled
    program's (the layers' per-step move into their circular placement included)."""
    step, state, data = gpt_case()
    mesh = {"stage": 2, "data": 4}
    options = dict(microbatches=4, pipeline=2, pipeline_repeats=2, hardware="h100")
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(mesh), **options)
    found = collectives(sharded.lower(state, data).compile().as_text())
    in_loop = [c for c in found if c.executions > 1]
    assert sorted(c.kind for c in in_loop) == ["collective-permute"] * 2, in_loop
    for c in in_loop:  # every device sends to the next stage's, the last to the first's
        assert c.executions == 2 * 4 + 2 - 1 and len(c.groups) == 8, c
    plan = autopar.plan(step, state, data, mesh=mesh, **options)
    predicted = {k[:-len("_bytes")]: v for k, v in plan.cost.items()
                 if k.endswith("_bytes") and k != "peak_memory_bytes" and v}
    assert predicted == by_kind(found)


def test_the_circular_bubble_leaks_no_nan():
    step, state, data = mlp_case(Stack())
    plan = check_against_single_device(step, state, data,
                                       autopar.make_mesh({"stage": 2, "data": 4}),
                                       microbatches=2, pipeline=2, pipeline_repeats=2)
    assert plan.pipeline_repeats == 2


def test_what_cannot_go_round_is_refused():
    step, state, data = gpt_case()
    mesh = {"stage": 2, "data": 4}
    with pytest.raises(autopar.AutoparError, match="pass pipeline=S too"):
        autopar.plan(step, state, data, mesh=mesh, pipeline_repeats=2)
    with pytest.raises(autopar.AutoparError, match="at least as many microbatches as stages"):
        autopar.plan(step, state, data, mesh={"stage": 4, "data": 2}, microbatches=2,
                     pipeline=4, pipeline_repeats=2)
    with pytest.raises(autopar.AutoparError, match="a count of rounds"):
        autopar.plan(step, state, data, mesh=mesh, microbatches=4, pipeline=2,
                     pipeline_repeats=0)
    with pytest.raises(autopar.AutoparError, match="2 stages x 4 repeats do not divide 4 "
                                                   "layers"):
        autopar.plan(step, state, data, mesh=mesh, microbatches=4, pipeline=2,
                     pipeline_repeats=4)


def test_auto_weighs_going_round():
    """pipeline='auto' tries the circular schedule at the best microbatch count of each stage
    count, and keeps the fastest of all it weighed."""
    step, state, data = gpt_case(layers=4, batch=32)
    plan = autopar.plan(step, state, data, mesh={"stage": 2, "data": 4}, pipeline="auto",
                        hardware=slow_devices(1e8, slower=1e5), donate_argnums=0)
    tried = plan.search_stats["schedules_tried"]
    rounds = [t for t in tried if t.get("repeats", 1) > 1]
    assert rounds and all(t["stages"] == 2 for t in rounds), tried
    best = min(t["total_ms"] for t in tried if "total_ms" in t)
    assert abs(plan.cost["total_s"] * 1e3 - best) < 1e-6
    assert f"x {rounds[0]['repeats']} rounds: " in plan.summary()


def test_circular_in_shares_equals_one_device():
    """Each stage's microbatch split over 'data' as shares, going round twice."""
    step, state, data = gpt_case(batch=64)
    plan = check_against_single_device(step, state, data,
                                       autopar.make_mesh({"stage": 2, "data": 4}),
                                       donate_argnums=0, microbatches=4, pipeline=2,
                                       pipeline_repeats=2)
    assert plan.pipeline_repeats == 2 and plan.microbatch_groups == 4, (
        plan.search_stats.get("reduced_per_microbatch"))
