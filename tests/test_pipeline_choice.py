"""The pipeline chosen with the plan (pipeline="auto"), stage-local data parallelism with the
gradient reduced once, and the shift between stages priced as the collective-permute XLA
compiles it to."""
import dataclasses

import jax

import models
import optax
import pytest
from helpers import check_against_single_device
from test_pipeline import gpt_case, in_loops

import autopar
from autopar.cost.hardware import get_profile
from autopar.planning.driver import Planning

pytestmark = pytest.mark.slow  # the slow tier: `make test-fast` leaves it out

MB = 1e6


def test_stage_local_data_parallel_reduces_the_gradient_once():
    """Each stage's microbatch split over 'data' as shares: equal to one device, and inside
    the loops the shift and no gradient reduction; any gather there is priced."""
    step, state, data = gpt_case(batch=64)
    mesh = {"stage": 2, "data": 4}
    plan = check_against_single_device(step, state, data, autopar.make_mesh(mesh),
                                       donate_argnums=0, microbatches=4, pipeline=2)
    assert plan.microbatch_groups == 4, plan.search_stats.get("reduced_per_microbatch")
    assert "each stage's microbatch in 4 shares" in plan.summary()
    found = in_loops(step, state, data, mesh, microbatches=4, pipeline=2, donate_argnums=0)
    kinds = {c.kind for c in found}
    assert "collective-permute" in kinds
    assert not kinds & {"all-reduce", "reduce-scatter"}, kinds
    # Each shift moves a device's share of its stage's microbatch activations (16 examples x
    # 16 positions x 32 float32 over 4 'data' devices): the shares stay split between ticks.
    shifted = {c.result_bytes for c in found if c.kind == "collective-permute"}
    assert shifted == {16 * 16 * 32 * 4 // 4}, shifted
    gathered = sum(c.result_bytes * c.executions for c in found if c.kind == "all-gather")
    assert gathered <= plan.cost.get("all-gather_bytes", 0), (gathered, plan.cost)


@pytest.mark.parametrize("hardware, planned", [(None, [4]), ("h100", [4, 1])])
def test_shares_that_split_the_loop_over_data_are_planned_alone(monkeypatch, hardware,
                                                                 planned):
    """On (stage, data) the microbatches are planned as shares of 'data' first. Where that
    plan splits every product of the loop over 'data' and its loop computes longer than it
    communicates (this machine's profile), it is kept and nothing else is planned; where it
    is bound by its links (the h100 profile, for which this model is too small), the
    microbatches reducing in each are planned too, and kept as the faster."""
    shares = []
    plan = Planning.plan

    def recorded(self, *args, **kwargs):
        shares.append(self.schedule.shares)
        return plan(self, *args, **kwargs)
    monkeypatch.setattr(Planning, "plan", recorded)
    step, state, data = gpt_case(batch=64)
    options = {"hardware": hardware} if hardware else {}
    kept = autopar.plan(step, state, data, mesh={"stage": 2, "data": 4}, microbatches=4,
                        pipeline=2, **options)
    assert shares == planned
    assert kept.microbatch_groups == planned[-1], kept.search_stats
    if len(planned) > 1:
        assert "in 4 shares it is estimated slower" in kept.search_stats[
            "reduced_per_microbatch"]


def test_the_shift_is_priced_as_the_collective_permute_xla_compiles():
    step, state, data = gpt_case()
    mesh = {"stage": 2, "data": 4}
    options = dict(microbatches=4, pipeline=2, hardware="h100")
    plan = autopar.plan(step, state, data, mesh=mesh, **options)
    compiled = sum(c.result_bytes * c.executions
                   for c in in_loops(step, state, data, mesh, **options)
                   if c.kind == "collective-permute")
    # one stage's activations forward and their gradient backward, every tick
    assert plan.cost["collective-permute_bytes"] == compiled > 0


def slow_devices(network_bandwidth: float, slower: float = 1000):
    """h100 links with two devices per node and the network at `network_bandwidth`, and
    `slower` times fewer flops: compute weighs as it does for a model that much larger."""
    h100 = get_profile("h100")
    nvlink, network = h100.levels
    return dataclasses.replace(
        h100, name=f"slow-{network_bandwidth:g}", flops=h100.flops / slower,
        levels=(dataclasses.replace(nvlink, devices=2),
                dataclasses.replace(network, bandwidth=network_bandwidth)))


@pytest.mark.parametrize("mesh", [{"stage": 4, "data": 2}, {"stage": 8}])
def test_auto_pipelines_where_the_network_is_slow_and_not_where_it_is_fast(mesh):
    """A GPT of 8 layers at d_model 512 with few tokens (25M parameters, 1 MB of activations
    per batch) on 4 nodes of 2 devices, as 4 stages of a node each or 8 stages of a device
    each. By hand: data parallel over the nodes all-reduces ~100 MB of gradients over the
    network, keeping the stages' layers on their nodes moves only activations (a few MB),
    and leaving the nodes' work replicated computes 4x. So at 1 GB/s the pipeline wins, and
    at NVLink's speed data parallelism (no bubble) does."""
    config = dict(vocab=512, d_model=512, heads=8, layers=8, scan=True)
    _, state, data = models.gpt_abstract(batch=32, seq=16, **config)
    step = models.linen_step(models.GPT(**config), models.token_loss, optax.adamw(1e-3),
                             autopar.value_and_grad)
    params = sum(x.size for x in jax.tree_util.tree_leaves(state[0]))
    assert 4 * params > 90 * MB and 32 * 16 * 512 * 4 < 1.1 * MB  # the hand calculation's sizes
    stages = mesh["stage"]
    chosen = {}
    for bandwidth in (1e9, 450e9):
        plan = autopar.plan(step, state, data, mesh=mesh, hardware=slow_devices(bandwidth),
                            pipeline="auto", donate_argnums=0)
        tried = plan.search_stats["schedules_tried"]
        assert tried[0]["stages"] == 1 and any(t["stages"] == stages for t in tried[1:])
        best = min(t["total_ms"] for t in tried if "total_ms" in t)
        assert abs(plan.cost["total_s"] * 1e3 - best) < 1e-6  # the fastest one is kept
        chosen[bandwidth] = plan.pipeline_stages
        if plan.pipeline_stages > 1:
            assert plan.microbatches >= 8 and f"pipelined over {stages} stages" in plan.summary()
        # the JSON keeps what was weighed, and the summary shows it
        again = autopar.Plan.from_json(plan.to_json()).summary()
        assert "schedules weighed (pipeline='auto'): no pipeline: " in again
        assert f"{stages} stages x {tried[1]['microbatches']} microbatches: " in again
    assert chosen == {1e9: stages, 450e9: 1}, chosen


def test_auto_on_a_mesh_without_a_stage_axis_says_why_it_did_not_pipeline():
    step, state, data = gpt_case()
    plan = autopar.plan(step, state, data, mesh={"data": 8}, pipeline="auto")
    assert plan.pipeline_stages == 1
    (flat, why), = [plan.search_stats["schedules_tried"]]
    assert flat["stages"] == 1 and "no 'stage' axis" in why["left_out"]
    assert "a pipeline: left out (the mesh has no 'stage' axis" in plan.summary()


def test_auto_trains_equal_to_one_device_on_what_it_chose():
    """Weights much larger than a batch's activations (d_model 128, 4 tokens an example) and
    a hundred-thousandth of h100's flops on 0.1 GB/s between nodes: the pipeline is kept."""
    config = dict(vocab=64, d_model=128, heads=4, layers=4, scan=True)
    _, state, data = models.gpt_setup(batch=16, seq=4, **config)
    step = models.linen_step(models.GPT(**config), models.token_loss, optax.adamw(1e-3),
                             autopar.value_and_grad)
    plan = check_against_single_device(step, state, data,
                                       autopar.make_mesh({"stage": 4, "data": 2}),
                                       donate_argnums=0, pipeline="auto",
                                       hardware=slow_devices(1e8, slower=1e5))
    assert plan.pipeline_stages == 4, plan.search_stats["schedules_tried"]


def test_auto_with_a_device_count_weighs_each_stage_count():
    step, state, data = gpt_case(layers=4, batch=32)
    plan = autopar.plan(step, state, data, mesh=8, pipeline="auto", hardware="h100")
    tried = plan.search_stats["schedules_tried"]
    assert {t["stages"] for t in tried} == {1, 2, 4, 8}
    eight = [t for t in tried if t["stages"] == 8]
    assert len(eight) == 1 and "8 stages do not divide 4 layers" in eight[0]["left_out"]
    assert any(t["mesh"] == "{'stage': 2, 'data': 4}" and "total_ms" in t for t in tried)
