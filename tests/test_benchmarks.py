"""A smoke run of the planning benchmark at a tiny size."""
from benchmarks import planning, propagation


def test_planning_benchmark_smoke():
    row = planning.plan_case(layers=1, devices=8, backend="recursive_programming", d_model=64,
                             seq=8, batch=16)
    assert row["ops"] > 0 and row["total_s"] >= row["search_s"] > 0
    dp = planning.plan_case(layers=1, devices=8, backend="dynamic_programming", d_model=64,
                            seq=8, batch=16)
    table = planning.markdown({"planning": [row, dp], "overhead": []})
    assert "| 1 | 8 | recursive_programming |" in table


def test_propagation_benchmark_smoke():
    tiny = [("tiny GPT", dict(batch=8, seq=8, vocab=32, d_model=32, heads=4, layers=1),
             {"data": 2, "model": 4}, "cpu")]
    result = propagation.run(tiny, log=lambda line: None)
    rows = result["propagation"]
    assert len(rows) == 2 * len(propagation.BACKENDS)
    # DP under the same annotations is the reference of each group.
    assert all(r["over_dp"] == 1.0 for r in rows if r["backend"] == "dynamic_programming")
    assert "| tiny GPT | 2x4 | megatron | sharding_propagation |" in propagation.markdown(result)


def test_quality_suite_smoke():
    import models
    from benchmarks import quality
    tiny = {"tiny-mlp": (lambda k: models.mlp_setup(batch=16 * k, features=8, hidden=16, out=8),
                         "mlp")}
    result = quality.run(["tiny-mlp"], ["2x4"], repeats=1, log=lambda line: None, zoo=tiny)
    rows = result["quality"]
    assert {r["plan"] for r in rows} == {*quality.OURS, "data_parallel", "fsdp", "megatron",
                                         "megatron_2d"}
    for r in rows:
        assert r["compiled_peak_memory_bytes"] > 0 and r["step_ms_simulated"] > 0
    # Every baseline pins the inputs, and the search is exact here: ours is at least as good.
    (headline,) = quality.headlines(rows)
    assert headline["estimated_over_best"] <= 1 + 1e-9
    assert "| tiny-mlp | 2x4 | dynamic_programming |" in quality.markdown(result)


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
