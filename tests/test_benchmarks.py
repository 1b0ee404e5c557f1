"""A smoke run of the planning benchmark at a tiny size."""
from benchmarks import planning


def test_planning_benchmark_smoke():
    row = planning.plan_case(layers=1, devices=8, backend="recursive_programming", d_model=64,
                             seq=8, batch=16)
    assert row["ops"] > 0 and row["total_s"] >= row["search_s"] > 0
    dp = planning.plan_case(layers=1, devices=8, backend="dynamic_programming", d_model=64,
                            seq=8, batch=16)
    table = planning.markdown({"planning": [row, dp], "overhead": []})
    assert "| 1 | 8 | recursive_programming |" in table
