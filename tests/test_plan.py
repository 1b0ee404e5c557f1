"""Plans: JSON round trip, reuse without search, abstract planning, errors."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import autopar
from autopar.plan import Repeat
from autopar.name_ranges import collapse, expand
from helpers import check_against_single_device, copy_tree, global_relative_error


def abstract(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


@pytest.mark.slow
def test_json_round_trip(tmp_path):
    step, state, batch = models.gpt_setup()
    plan = autopar.plan(step, state, batch, mesh={"data": 2, "model": 4})
    text = plan.to_json()
    again = autopar.Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text
    plan.save(tmp_path / "plan.json")
    assert autopar.load_plan(tmp_path / "plan.json") == plan
    body = json.loads(text)
    assert body["format_version"] == 2
    assert body["mesh"] == {"axis_names": ["data", "model"], "axis_sizes": [2, 4]}
    assert {"compute_s", "communication_s", "total_s", "peak_memory_bytes"} <= set(body["cost"])
    assert all("bytes_per_device" in t for t in body["inputs"])
    assert "ops" not in body  # per-operator detail is opt-in
    detailed = plan.to_json(detail=True)
    op = json.loads(detailed)["ops"][0]
    assert {"primitive", "source", "in_shapes", "in_specs", "out_specs", "compute_s"} <= set(op)
    assert autopar.Plan.from_json(detailed).ops == plan.ops


@pytest.mark.slow
def test_paths_and_pytree_specs():
    step, state, batch = models.gpt_setup()
    plan = autopar.plan(step, state, batch, mesh={"data": 8})
    specs = plan.specs
    assert "state/0/params/Embed_0/embedding" in specs
    assert "batch/inputs" in specs and "batch/targets" in specs
    assert all(isinstance(s, P) for s in specs.values())
    tree = plan.input_specs
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, P))
    assert len(leaves) == len(jax.tree_util.tree_leaves((state, batch)))
    assert isinstance(tree[0][0]["params"]["Embed_0"]["embedding"], P)


@pytest.mark.slow
def test_saved_plan_is_reused_without_search(tmp_path):
    step, state, batch = models.mlp_setup()
    mesh = autopar.make_mesh({"data": 2, "model": 4})
    plan = autopar.plan(step, state, batch, mesh=mesh)
    plan.save(tmp_path / "p.json")
    loaded = autopar.load_plan(tmp_path / "p.json")
    reused = check_against_single_device(step, state, batch, mesh, plan=loaded)
    assert reused.specs == plan.specs
    assert [o.in_specs for o in reused.ops] == [o.in_specs for o in plan.ops]


@pytest.mark.slow
def test_saved_plan_runs_without_assembling_its_plan(monkeypatch):
    """A saved plan's step needs its decisions alone: costs, memory and per-operator detail
    are assembled only when the plan is asked for."""
    step, state, batch = models.mlp_setup()
    mesh = autopar.make_mesh({"data": 2, "model": 4})
    saved = autopar.Plan.from_json(autopar.plan(step, state, batch, mesh=mesh).to_json())
    assembled = []
    from autopar import applying
    real = applying.assemble
    monkeypatch.setattr(applying, "assemble",
                        lambda *a, **k: assembled.append(1) or real(*a, **k))
    stepper = autopar.auto_parallel(step, mesh=mesh, plan=saved)
    ref_state, ref_loss = jax.jit(step)(copy_tree(state), batch)
    new_state, loss = stepper(copy_tree(state), batch)
    assert not assembled
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert global_relative_error(ref_state, new_state) < 1e-5
    assert stepper.plan(state, batch).specs == saved.specs and assembled == [1]


def test_plan_option_takes_a_saved_plans_path(tmp_path):
    step, state, batch = models.mlp_setup()
    mesh = autopar.make_mesh({"data": 8})
    plan = autopar.plan(step, state, batch, mesh=mesh)
    plan.save(tmp_path / "p.json")
    for path in (tmp_path / "p.json", str(tmp_path / "p.json")):
        assert autopar.auto_parallel(step, mesh=mesh, plan=path).plan(state, batch).specs == \
            plan.specs
    with pytest.raises(autopar.AutoparError, match="autopar.Plan or the path"):
        autopar.auto_parallel(step, mesh=mesh, plan={"mesh": {"data": 8}})


def test_saved_plan_for_another_step_is_refused():
    step, state, batch = models.mlp_setup()
    mesh = autopar.make_mesh({"data": 8})
    plan = autopar.plan(step, state, batch, mesh=mesh)
    other_step, other_state, other_batch = models.mlp_setup(hidden=32)
    sharded = autopar.auto_parallel(other_step, mesh=mesh, plan=plan)
    with pytest.raises(autopar.AutoparError, match="does not fit this step"):
        sharded(copy_tree(other_state), other_batch)


def test_plan_abstract_mesh_without_devices():
    step, state, batch = models.gpt_abstract(batch=8, seq=16)  # nothing made or compiled
    plan = autopar.plan(step, state, batch, mesh={"data": 16, "model": 4})
    assert dict(plan.mesh) == {"data": 16, "model": 4}
    assert len(plan.inputs) == len(jax.tree_util.tree_leaves((state, batch)))


def test_lower_gives_aot_object():
    step, state, batch = models.mlp_setup()
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 8}))
    lowered = sharded.lower(state, batch)
    assert "sharding" in lowered.as_text()
    assert lowered.compile() is not None


def test_errors_are_clear():
    step, state, batch = models.mlp_setup()
    with pytest.raises(autopar.AutoparError, match="needs 64 devices"):
        autopar.make_mesh({"data": 64})
    with pytest.raises(autopar.AutoparError, match="unknown search"):
        autopar.plan(step, state, batch, mesh={"data": 8}, search="simulated_annealing")
    with pytest.raises(autopar.AutoparError, match="needs a jax Mesh"):
        autopar.auto_parallel(step, mesh={"data": 8})
    with pytest.raises(autopar.AutoparError, match="not a valid autopar plan"):
        autopar.Plan.from_json('{"format_version": 1}')


def test_unsupported_primitive_warns_and_runs_replicated():
    def step(w, x):  # eigenvalues (a custom call XLA runs whole): no rule
        y = jnp.tanh(x @ w)
        values = jnp.linalg.eigh(y.T @ y + jnp.eye(8))[0]
        return w - 0.1 * values.mean() * w, (values ** 2).sum()

    w = jnp.ones((16, 8)) * 0.1
    x = jnp.arange(32 * 16, dtype=jnp.float32).reshape(32, 16) / 100
    ref_w, ref_loss = jax.jit(step)(w, x)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 8}))
    with pytest.warns(autopar.AutoparWarning, match="no sharding rule for primitive 'eigh'"):
        new_w, loss = sharded(jnp.array(w), x)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(new_w), np.asarray(ref_w), rtol=1e-5)


@pytest.mark.slow  # the three-axis plan's bound takes 5-8 s on 2 cores
def test_search_stats_are_honest_about_exactness():
    """One exact plan, and one on three axes where exact tables do not fit: its lower bound
    is below its cost, and the gap between them is the one reported."""
    step, state, batch = models.gpt_abstract(batch=32, seq=64, vocab=512, d_model=128,
                                             heads=4, layers=1)
    exact = []
    for mesh in ({"data": 8}, {"data": 2, "model": 2, "inner": 2}):
        stats = autopar.plan(step, state, batch, mesh=mesh, hardware="tpu_v5p").search_stats
        assert stats["space"] in ("full", "one axis at a time", "shortlisted by the dual")
        exact.append(stats["exact"])
        if not stats["exact"]:
            assert 0 < stats["lower_bound"] < stats["objective_s"]
            assert stats["gap"] == pytest.approx(1 - stats["lower_bound"] / stats["objective_s"])
    assert exact == [True, False]


# -- compact plans (saved.py, plan_json.py) ---------------------------------------------------------
MESH = {"data": 2, "model": 4}
# Megatron-style splits, so that followers carry model-parallel specs a rebuild must get right
MEGATRON = {r"^state/0/params/.*/mlp_in/kernel": P(None, "model"),
            r"^state/0/params/.*/mlp_out/kernel": P("model", None), r"^batch/": P("data")}


def listed(text, key):
    """The entries of the list `key` of a plan's JSON, one per line as written."""
    lines = text.splitlines()
    start = lines.index(f'"{key}": [')
    end = min(k for k in range(start, len(lines)) if lines[k] in ("]", "],"))
    return [json.loads(line.strip().rstrip(",")) for line in lines[start + 1:end]]


def same_decisions(a, b):
    return ([(o.primitive, o.in_specs, o.out_specs, o.partial_axes) for o in a.ops]
            == [(o.primitive, o.in_specs, o.out_specs, o.partial_axes) for o in b.ops])


def format_1(plan):
    """The JSON autopar wrote before compact plans: specs as lists, every operator, indent=1."""
    def spec(s):
        return [list(axes) for axes in s]

    def tensor(t):
        return {"path": t.path, "shape": list(t.shape), "dtype": t.dtype, "spec": spec(t.spec),
                "partition_spec": str(t.partition_spec), "bytes_per_device": t.bytes_per_device}

    ops = [{**dataclasses.asdict(o), "in_specs": [spec(s) for s in o.in_specs],
            "out_specs": [spec(s) for s in o.out_specs]} for o in plan.ops]
    moves = [{"where": r.where, "tensor": r.tensor, "shape": list(r.shape),
              "from_spec": spec(r.from_spec), "to_spec": spec(r.to_spec), "from": "", "to": "",
              "cost_s": r.cost_s, "annotated": r.annotated} for r in plan.redistributions]
    return json.dumps({
        "format_version": 1, "mesh": {"axis_names": [n for n, _ in plan.mesh],
                                      "axis_sizes": [s for _, s in plan.mesh]},
        "search": plan.search, "hardware": plan.hardware,
        "inputs": [tensor(t) for t in plan.inputs], "outputs": [tensor(t) for t in plan.outputs],
        "ops": ops, "cost": dict(plan.cost), "search_stats": dict(plan.search_stats),
        "redistributions": moves, "memory": plan.memory, "recompute": list(plan.recompute)},
        indent=1)


@pytest.mark.slow
def test_compact_json_is_small_and_reads_top_down():
    step, state, batch = models.gpt_setup()
    plan = autopar.plan(step, state, batch, mesh=MESH)
    text, detailed = plan.to_json(), plan.to_json(detail=True)
    # 1,226 operators in detail, 44 decisions; inputs (108, one line each) are half of it
    assert len(text) < 0.06 * len(detailed), (len(text), len(detailed))
    assert len(text.splitlines()) < 200
    assert list(json.loads(text)) == ["format_version", "mesh", "search", "hardware", "inputs",
                                      "outputs", "decisions", "cost", "memory", "search_stats",
                                      "recompute", "redistributions"]
    inputs = listed(text, "inputs")
    assert [t["path"] for t in inputs] == [t.path for t in plan.inputs]
    assert text.count('"path": ') == len(plan.inputs) + 1  # and the loss
    batch_line = next(t for t in inputs if t["path"] == "batch/inputs")
    want = next(t for t in plan.inputs if t.path == "batch/inputs")
    assert batch_line["spec"] == [list(axes) for axes in want.spec] and batch_line["shape"] == [8, 16]
    # the new state is the old one handed back: one line; the loss its own
    outputs = listed(text, "outputs")
    assert len(outputs) == 2 and outputs[0]["count"] == len(plan.outputs) - 1
    decisions = listed(text, "decisions")
    assert len(decisions) == len(plan.decisions) < len(plan.ops) / 10
    assert {"layers": "GPT/block_1", "same_as": "GPT/block_0"} in decisions
    assert not any(d.get("scope", "").startswith("GPT/block_1") for d in decisions)
    assert {d["primitive"] for d in decisions if "op" in d} >= {"dot_general", "gather"}


def test_cost_and_search_stats_are_records_that_read_as_the_jsons_mappings():
    """Code reads the fields; users and the JSON read the same flat mappings as before."""
    flat = {"compute_s": 1e-3, "communication_s": 2e-3, "total_s": 3e-3, "recompute_s": 0.0,
            "peak_memory_bytes": 1024, "all_reduce_bytes": 64.0}
    cost = autopar.Cost.of(flat)
    assert cost.total_s == 3e-3 and cost.collective_bytes == {"all_reduce": 64.0}
    assert cost == flat and list(cost) == list(flat) and json.loads(json.dumps(dict(cost))) == flat
    assert cost.predicted and not autopar.Cost.of({"total_s": 1.0}).predicted
    stats = autopar.SearchStats.of({"exact": False, "objective_s": 2.0, "lower_bound": 1.5,
                                    "gap": 0.25, "memory_price_s_per_byte": 0.0,
                                    "search_s": 0.4, "nodes": 12})
    assert stats.bounded and stats.budgeted and stats.gap == 0.25
    assert stats.seconds == {"search_s": 0.4} and stats.details == {"nodes": 12}
    assert stats["nodes"] == 12 and "kept_bytes" not in stats and stats.get("bound") is None
    assert "search_s" in stats and "search_s" not in stats.stable()
    noted = stats.noting(compile_checks=2, shortlist=3)
    assert noted.compile_checks == 2 and noted.details == {"nodes": 12, "shortlist": 3}
    assert not autopar.SearchStats().budgeted and not autopar.SearchStats().bounded
    with pytest.raises(TypeError):
        hash(cost)


def test_a_plan_says_how_long_each_stage_of_its_planning_took():
    """Tracing, searching and bounding are timed, kept in the plan made in this process and
    said by its summary; never in the JSON, which the same problem reproduces byte for byte."""
    step, state, batch = models.gpt_abstract(batch=16, seq=32, vocab=256, d_model=64,
                                             heads=4, layers=1)
    plan = autopar.plan(step, state, batch, mesh={"data": 2, "model": 4})
    spent = plan.search_stats.planning_seconds
    assert {"tracing", "searching", "bounding", "total"} <= set(spent)
    assert 0 < sum(s for stage, s in spent.items() if stage != "total") <= spent["total"]
    assert f"planned in {spent['total']:.2f} s: tracing" in plan.summary()
    again = autopar.Plan.from_json(plan.to_json())
    assert "planning_seconds" not in plan.to_json() and not again.search_stats.planning_seconds
    assert "planned in" not in again.summary()


def test_compact_plan_round_trips_and_applies_its_repeated_layers():
    step, state, batch = models.gpt_setup()
    mesh = autopar.make_mesh(MESH)
    plan = autopar.plan(step, state, batch, mesh=mesh)
    text = plan.to_json()
    again = autopar.Plan.from_json(text)
    assert again.ops == ()
    for field in ("mesh", "search", "inputs", "outputs", "decisions", "cost", "memory",
                  "recompute", "redistributions"):
        assert getattr(again, field) == getattr(plan, field), field
    # wall-clock seconds stay out: the same problem gives the same bytes in every process
    assert again.search_stats == plan.stable_stats() != plan.search_stats
    assert "search_s" in plan.search_stats and "search_s" not in again.search_stats
    # read back as the same typed records
    assert isinstance(again.cost, autopar.Cost) and isinstance(again.search_stats,
                                                               autopar.SearchStats)
    assert again.cost.total_s == plan.cost.total_s == plan.cost["total_s"]
    assert again.search_stats.exact is plan.search_stats.exact is plan.search_stats["exact"]
    assert any(isinstance(d, Repeat) for d in again.decisions)
    assert again == plan and again.to_json() == text
    with pytest.raises(autopar.AutoparError, match="holds no per-operator detail"):
        again.to_json(detail=True)
    # block_1 is rebuilt from block_0's decisions
    assert same_decisions(autopar.auto_parallel(step, mesh=mesh, plan=again).plan(state, batch),
                          plan)


@pytest.mark.slow
def test_compact_plan_applies_with_the_same_decisions_and_numerics(tmp_path):
    step, state, batch = models.gpt_setup()
    mesh = autopar.make_mesh(MESH)
    plan = autopar.plan(step, state, batch, mesh=mesh, annotations=MEGATRON)
    assert any(("model",) in o.out_specs[0] for o in plan.ops if o.out_specs)
    plan.save(tmp_path / "plan.json")
    reused = check_against_single_device(step, state, batch, mesh,
                                         plan=autopar.load_plan(tmp_path / "plan.json"))
    assert same_decisions(reused, plan)
    assert reused.specs == plan.specs and reused.cost == plan.cost


@pytest.mark.parametrize("search", ["dynamic_programming", "recursive_programming"])
def test_compact_plan_with_shard_marks_applies(search):
    from test_annotations import sharded_mlp_setup  # autopar.shard in the model
    step, state, batch = sharded_mlp_setup()
    mesh = autopar.make_mesh(MESH)
    plan = autopar.plan(step, state, batch, mesh=mesh, search=search)
    loaded = autopar.Plan.from_json(plan.to_json())
    assert any(d.primitive == "autopar_shard" for d in loaded.decisions)
    reused = autopar.auto_parallel(step, mesh=mesh, plan=loaded).plan(state, batch)
    assert same_decisions(reused, plan)


def test_detailed_and_format_1_json_still_apply():
    step, state, batch = models.mlp_setup()
    mesh = autopar.make_mesh(MESH)
    plan = autopar.plan(step, state, batch, mesh=mesh)
    detailed = autopar.Plan.from_json(plan.to_json(detail=True))
    old = autopar.Plan.from_json(format_1(plan))
    assert detailed.ops == old.ops == plan.ops and old == plan
    reused = autopar.auto_parallel(step, mesh=mesh, plan=detailed).plan(state, batch)
    assert same_decisions(reused, plan)
    assert same_decisions(check_against_single_device(step, state, batch, mesh, plan=old), plan)


@pytest.mark.slow
def test_compact_plan_that_does_not_fit_is_refused():
    step, state, batch = models.gpt_setup()
    mesh = autopar.make_mesh(MESH)
    body = json.loads(autopar.plan(step, state, batch, mesh=mesh).to_json())

    def refused(edit, match):
        changed = json.loads(json.dumps(body))
        edit(changed)
        sharded = autopar.auto_parallel(step, mesh=mesh,
                                        plan=autopar.Plan.from_json(json.dumps(changed)))
        with pytest.raises(autopar.AutoparError, match=match):
            sharded.plan(state, batch)

    first = next(k for k, d in enumerate(body["decisions"]) if "op" in d)
    repeat = next(k for k, d in enumerate(body["decisions"]) if "same_as" in d)
    refused(lambda b: b["decisions"][first].update(op=10**6), "which this step does not have")
    refused(lambda b: b["decisions"][first].update(primitive="conv_general_dilated"),
            "here but conv_general_dilated")
    refused(lambda b: b["decisions"][repeat].update(layers="GPT/block_7"),
            "GPT/block_7 decide as GPT/block_0")
    refused(lambda b: b["decisions"].pop(first), "records no decision for it")
    refused(lambda b: b["mesh"].update(axis_sizes=[4, 2]), "plan again for this mesh")


@pytest.mark.slow
def test_summary_shows_every_input_grouped_by_layer():
    step, state, batch = models.gpt_setup(layers=4)
    plan = autopar.plan(step, abstract(state), abstract(batch), mesh={"data": 8})
    assert len(plan.inputs) > 40
    text = plan.summary()
    assert "more" not in text
    rows = text.splitlines()[1:text.splitlines().index(
        next(line for line in text.splitlines() if line.startswith("predicted per step")))]
    assert "block_{0..3}" in text
    assert any(row.startswith("batch/inputs ") for row in rows)
    assert any(row.startswith("batch/targets ") for row in rows)
    shown = [name for row in rows for name in expand(row.split()[0])]
    assert sorted(shown) == sorted(t.path for t in plan.inputs)
    assert len(rows) < len(plan.inputs) / 2


def test_layer_patterns_expand_to_exactly_their_names():
    names = ["a/block_0/k", "a/block_1/k", "a/block_2/k", "a/block_5/k", "b/x_0/y_0",
             "b/x_1/y_1", "c/l_01", "c/l_02", "d/e_3"]
    patterns = collapse(names)
    assert "a/block_{0..2,5}/k" in patterns and "d/e_3" in patterns
    assert sorted(n for p in patterns for n in expand(p)) == sorted(names)


def test_compact_plan_names_an_operator_it_cannot_rebuild():
    def step(w, x, s):
        # iota is a constant and s is not: the product decides in the search, and its operands
        # of its result's shape being constants is what a saved plan cannot see
        pos = jnp.arange(64.0) * s
        return w * 0.9, (jnp.tanh(x @ w).sum(1) * pos).sum()

    w, x, s = jnp.ones((16, 32)) * 0.1, jnp.ones((64, 16)), jnp.float32(0.5)
    mesh = autopar.make_mesh({"data": 8})
    plan = autopar.plan(step, w, x, s, mesh=mesh)
    compact = autopar.auto_parallel(step, mesh=mesh, plan=autopar.Plan.from_json(plan.to_json()))
    with pytest.raises(autopar.AutoparError, match=r"operator \d+ \(mul at .*detail=True"):
        compact.plan(w, x, s)
    detailed = autopar.Plan.from_json(plan.to_json(detail=True))
    assert same_decisions(autopar.auto_parallel(step, mesh=mesh, plan=detailed).plan(w, x, s),
                          plan)
