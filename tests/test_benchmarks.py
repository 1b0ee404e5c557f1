"""Smoke runs of the benchmark suites at tiny sizes."""
import pytest

from autopar.schedule import Schedule
from benchmarks import planning, planning_targets, propagation


def test_planning_benchmark_smoke():
    row = planning.plan_case(layers=1, devices=8, search="recursive_programming", d_model=64,
                             seq=8, batch=16)
    assert row["ops"] > 0 and row["total_s"] >= row["search_s"] > 0
    assert row["trace_s"] >= row["jax_trace_s"] > 0  # JAX's own trace, inside autopar's
    dp = planning.plan_case(layers=1, devices=8, search="dynamic_programming", d_model=64,
                            seq=8, batch=16)
    table = planning.markdown({"planning": [row, dp], "first_call": []})
    assert "| 1 | 8 | recursive_programming |" in table and "| JAX trace s |" in table
    auto = {"flat": 0.5, "one schedule": 1.0, "auto": 2.5, "schedules": 5, "rounds": 1,
            "kept": Schedule(microbatches=8, stages=4)}
    assert ("| 0.50 | 1.00 | 2.50 | 5 | 4 stages x 8 microbatches | 2.50x |"
            in planning_targets.pipeline_markdown(auto))


@pytest.mark.slow
def test_propagation_benchmark_smoke():
    tiny = [("tiny GPT", dict(batch=8, seq=8, vocab=32, d_model=32, heads=4, layers=1),
             {"data": 2, "model": 4}, "cpu")]
    result = propagation.run(tiny, log=lambda line: None)
    rows = result["propagation"]
    assert len(rows) == 2 * len(propagation.ALGORITHMS)
    # DP under the same annotations is the reference of each group.
    assert all(r["over_dp"] == 1.0 for r in rows if r["search"] == "dynamic_programming")
    assert "| tiny GPT | 2x4 | megatron | sharding_propagation |" in propagation.markdown(result)


@pytest.mark.slow
def test_fidelity_suite_smoke():
    import models
    from benchmarks import fidelity
    tiny = {"tiny-mlp": (lambda k: models.mlp_setup(batch=16 * k, features=8, hidden=16, out=8),
                         "mlp")}
    result = fidelity.run(["tiny-mlp"], ["2x4"], repeats=1, log=lambda line: None, zoo=tiny)
    rows = result["quality"]
    assert {r["plan"] for r in rows} == {*fidelity.OURS, "data_parallel", "fsdp", "megatron",
                                         "megatron_2d"}
    for r in rows:
        assert r["compiled_peak_memory_bytes"] > 0 and r["step_ms_simulated"] > 0
    # Every pinned baseline pins the inputs, and the search is exact here: ours is at least as
    # good.
    (headline,) = fidelity.headlines(rows)
    assert headline["estimated_over_best"] <= 1 + 1e-9
    assert "| tiny-mlp | 2x4 | data_parallel (pinned)" in fidelity.markdown(result)


@pytest.mark.slow
def test_quality_suite_judges_experts_and_ours():
    """Experts are plain jax.jit programs judged from their HLO: the data-parallel one
    all-reduces exactly the gradients (and the loss), nothing else; every program computes
    the single-device step."""
    import math

    import jax
    import models
    from benchmarks import quality, quality_report
    from benchmarks.zoo import Case
    tiny = {"tiny-mlp": Case(lambda: models.mlp_setup(batch=16, features=8, hidden=16, out=8),
                             "mlp", False, "tiny MLP")}
    result = quality.run(["tiny-mlp"], ["2x4"], ("h100",), ("dynamic_programming",),
                         memory_matched=True, log=lambda line: None, zoo=tiny)
    rows = {r["plan"]: r for r in result["quality"]}
    assert set(rows) == {"data_parallel", "fsdp", "megatron", "megatron_dp",
                         "dynamic_programming"}
    params = tiny["tiny-mlp"].setup()[1][0]
    gradient_bytes = sum(4 * math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))
    dp = rows["data_parallel"]
    assert dp["collective_bytes"] == {"all-reduce": gradient_bytes + 4}  # + the f32 loss
    assert set(dp["collectives_by_axes"]) == {"all-reduce over data/model"}
    for r in rows.values():
        assert r["step_ms"] > 0 and r["memory_bytes"] > 0 and r["flops"] > 0
        assert math.isclose(r["step_ms"], r["compute_ms"] + r["collective_ms"])
        assert r["loss_rel_err"] < 1e-6 and r["state_rel_err"] < 1e-5
    (matched,) = result["memory_matched"]
    assert matched["fits_limit"], matched
    (head,) = quality_report.headlines(result["quality"])
    assert head["best_expert"] in rows and head["over_best"]["dynamic_programming"] > 0
    assert "| tiny-mlp (small) | 2x4 | h100 |" in quality_report.markdown(result)


@pytest.mark.slow
def test_memory_suite_smoke():
    import models
    from benchmarks import memory
    tiny = {"tiny-mlp": lambda: models.mlp_setup(batch=16, features=32, hidden=64, out=32)}
    result = memory.run(tiny, {"data": 8}, (1.0, 0.3, 0.001), log=lambda line: None)
    free, tight, impossible = result["memory"]
    assert free["predicted_bytes"] <= free["limit_bytes"]
    assert "error" not in tight and tight["predicted_bytes"] <= tight["limit_bytes"]
    assert "no plan fits" in impossible["error"]
    assert "| tiny-mlp | 0.3 |" in memory.markdown(result)


@pytest.mark.slow
def test_accumulation_suite_smoke():
    from benchmarks import accumulation
    result = accumulation.run({"gpt batch 32": (32, (2,))}, ({"data": 8},), log=lambda line: None)
    (row,) = [r for r in result["accumulation"] if r["program"] == "autopar"]
    assert row["groups"] == 8 and row["in_loops_bytes"] == 0
    assert row["compiled_collective_bytes"] == row["predicted_collective_bytes"] > 0
    assert "| gpt batch 32 | 8 | 2 | autopar | once (8 shares) |" in accumulation.markdown(result)


@pytest.mark.slow
def test_pipeline_suite_smoke():
    from benchmarks import pipeline
    cases = {"2 stages": ({"stage": 2, "data": 4}, 4, 2, 1, True, False),
             "circular": ({"stage": 2, "data": 4}, 4, 2, 2, True, True)}
    result = pipeline.run(cases, batch=16, config=dict(d_model=32, layers=4, vocab=64),
                          log=lambda line: None)
    row, expert, circular = result["pipeline"]
    assert row["permutes_in_loops"] >= 2 * (4 + 2 - 1) and row["permute_bytes"] > 0
    assert row["bubble"] == 1 / 5 and row["compiled_memory_bytes"] > 0
    assert expert["program"] == "2 stages, hand-written GPipe" and expert["permute_bytes"] > 0
    assert circular["permutes_in_loops"] == 2 * (2 * 4 + 2 - 1) and circular["bubble"] == 1 / 9
    table = pipeline.markdown(result)
    assert "| 2 stages | 2x4 | 4 | 2 | 1 | 1 | 20% |" in table
    assert "| 2 stages, hand-written GPipe | 2x4 | 4 | 2 | 1 | 1 | 20% |" in table
    assert "| circular | 2x4 | 4 | 2 | 2 | 1 | 11% |" in table


@pytest.mark.slow
def test_pipeline_choice_suite_smoke():
    from benchmarks import pipeline
    result = pipeline.choice((1e9,), config=dict(vocab=64, d_model=32, heads=4, layers=4),
                             batch=16, seq=16, log=lambda line: None)
    (row,) = result["choice"]
    assert row["tried"][0]["stages"] == 1 and row["stages"] in (1, 4)
    assert row["chosen"]["memory_bytes"] > 0 and row["flat"]["memory_bytes"] > 0
    table = pipeline.choice_markdown(result)
    assert "| 1 | **1x1: " in table or ("| 1 | 1x1: " in table and "| 4 stages x" in table)


@pytest.mark.slow
def test_pipeline_choice_within_a_memory_limit_smoke():
    from benchmarks import pipeline
    result = pipeline.choice_within((2**30,), (1e9,), config=dict(vocab=64, d_model=32,
                                                                  heads=4, layers=4),
                                    batch=16, seq=16, log=lambda line: None)
    (row,) = result["choice_within"]
    assert row["estimated_memory_bytes"] <= row["limit_bytes"] and row["compiled_memory_bytes"]
    assert "| 1 | 1 | " in pipeline.within_markdown(result)


@pytest.mark.slow
def test_hand_written_gpipe_equals_one_device():
    """The pipeline suite's baseline computes the model's own step."""
    import jax
    import models
    import numpy as np
    import optax
    from helpers import copy_tree

    import autopar
    from benchmarks import pipeline_expert
    config = dict(vocab=64, d_model=32, heads=4, layers=4, scan=True)
    step, state, data = models.gpt_setup(batch=16, seq=16, **config)
    mesh = autopar.make_mesh({"stage": 2, "data": 4})
    expert = pipeline_expert.gpipe_jit(config, 2, 4, mesh, state, optax.adamw(1e-3))
    (_, loss), (_, expected) = expert(copy_tree(state), data), jax.jit(step)(state, data)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)


@pytest.mark.slow
def test_device_suite_smoke():
    """On the CPU the 'chip' is the host: its program and the host's are one program."""
    import models
    from benchmarks import device
    from benchmarks.zoo import Case
    tiny = {"tiny-mlp": Case(lambda: models.mlp_setup(batch=16, features=8, hidden=16, out=8),
                             "mlp", False, "tiny MLP")}
    result = device.run(repeats=1, log=lambda line: None, zoo=tiny)
    rows = result["device"]
    assert [r["batch_share"] for r in rows] == ["full", "1/8"]
    for r in rows:
        assert "error" not in r and "estimate_error" not in r, r
        assert r["measured_ms"] > 0 and r["host_flops"] == r["chip_flops"] > 0
    assert rows[1]["chip_flops"] < rows[0]["chip_flops"]  # an eighth of the batch
    assert "| tiny-mlp | 1/8 |" in device.markdown(result)


@pytest.mark.slow
def test_tpu_suite_names_a_memory_matched_row_that_found_no_plan():
    """Ours planned within a limit no mesh meets: the row keeps its name and limit, says why
    each mesh refused, and the table shows it."""
    from benchmarks import tpu_experts, tpu_models, tpu_suite
    work = tpu_models.setup("llama-tiny", batch=16, seq=128)
    row = tpu_suite._ours(work, tpu_experts.tpu_devices("v5e:2x4"), 2**16, lambda line: None)
    assert row["program"] == "ours, memory-matched" and row["error"] == "no mesh planned"
    assert row["memory_limit"] == 2**16 and set(row["refused_by_mesh"]) == {"8", "4 x 2",
                                                                             "2 x 4"}
    assert all("no plan fits" in why for why in row["refused_by_mesh"].values())
    case = {"model": "llama-tiny", "overrides": {}, "batch": 16, "seq": 128,
            "topology": "v5e:2x4", "devices": 8, "rows": [row]}
    table = tpu_suite.markdown({"cases": {"tiny": case}})
    assert "| ours, memory-matched |  | no mesh planned within 0.00 GiB |" in table
