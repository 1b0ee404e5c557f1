"""Several processes (JAX's distributed runtime, 2 processes x 4 CPU devices on localhost, gloo
collectives): the same decorated step trains as it does on one device, the processes' plans
are byte-identical, each loads only its rows of the batch, a sharded checkpoint restores into
another mesh, a calibration gives every process the same profile, and an input that differs
between processes stops every process with the same AutoparError. The processes are
examples/multihost.py's."""
import json
import os
import subprocess
import sys

import jax
import models
import numpy as np
import pytest
from helpers import copy_tree, float_leaves, global_relative_error, run_steps
from jax.sharding import NamedSharding, PartitionSpec as P

import autopar
from autopar.distributed import disagreement

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "multihost.py")


def run_processes(out, *argv):
    """examples/multihost.py's launcher: 2 processes, 60 s each at most."""
    done = subprocess.run([sys.executable, EXAMPLE, "--out", str(out), *argv],
                          capture_output=True, text=True, timeout=150)
    results = []
    for i in range(2):
        path = out / f"process_{i}.json"
        assert path.exists(), done.stdout[-3000:] + done.stderr[-3000:]
        results.append(json.loads(path.read_text()))
    return done.returncode, results


@pytest.mark.slow
def test_two_processes_train_as_one_device(tmp_path):
    code, (p0, p1) = run_processes(tmp_path)
    assert code == 0
    assert (p0["devices"], p1["devices"]) == (8, 8)
    # the processes planned the same program, to the byte
    assert p0["plan_json"] == p1["plan_json"]
    assert p0["losses"] == p1["losses"]
    # each loaded its own half of the batch (the data axis spans the processes)
    assert (p0["rows"], p1["rows"]) == ([0, 8], [8, 16])
    assert p0["restored_equal"] and p1["restored_equal"]
    # calibrated together, the processes plan with the same profile: process 0's numbers
    assert p0["calibrated"] == p1["calibrated"]
    links = autopar.Hardware.from_json(p0["calibrated"]).levels
    assert {lv.name for lv in links} == {"axis:data", "axis:model"}
    assert all(lv.latency > 0 and lv.bandwidth > 0 for lv in links)

    step, state, batch = models.gpt_setup(batch=16, seq=16, vocab=128, d_model=32, heads=4,
                                          layers=2)
    reference, losses = run_steps(jax.jit(step), copy_tree(state), batch, len(p0["losses"]))
    np.testing.assert_allclose(p0["losses"], losses, rtol=1e-5)
    for i in range(2):
        with np.load(tmp_path / f"state_{i}.npz") as saved:
            trained = [saved[f"arr_{k}"] for k in range(len(saved.files))]
        reference_leaves = jax.tree.leaves(reference)
        assert [a.shape for a in trained] == [np.shape(a) for a in reference_leaves]
        floats = [a for a, r in zip(trained, reference_leaves)
                  if np.issubdtype(np.asarray(r).dtype, np.floating)]
        assert global_relative_error(float_leaves(reference), floats) < 1e-4
    # one process of 8 devices plans the same bytes and trains the same
    one_process = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 2, "model": 4}),
                                        donate_argnums=0)
    state_8, losses_8 = run_steps(one_process, copy_tree(state), batch, len(p0["losses"]))
    assert one_process.plan(state, batch).to_json() == p0["plan_json"]
    np.testing.assert_allclose(p0["losses"], losses_8, rtol=1e-6)
    assert global_relative_error(float_leaves(state_8), floats) < 1e-4  # reduction order
    assert autopar.checkpoint_plan(tmp_path / "multihost_checkpoint").mesh == (
        ("data", 2), ("model", 4))


@pytest.mark.slow
@pytest.mark.parametrize("differ, shows", [
    ("shape", "'batch/inputs' differs (process 0: int32[16, 16]; process 1: int32[8, 16])"),
    ("values", "'batch/inputs' differs (process 0: values with digest")])
def test_a_different_input_stops_every_process(tmp_path, differ, shows):
    code, results = run_processes(tmp_path, "--differ", differ)
    assert code == 3
    for result in results:
        assert shows in result["error"], result["error"]
        assert "Fix:" in result["error"]
    assert results[0]["error"] == results[1]["error"]


def test_disagreement_names_the_first_differing_item():
    message = disagreement("the step's call", [
        {"jax version": "0.10.2", "state/w": "float32[4, 4]"},
        {"jax version": "0.10.2", "state/w": "float32[4, 8]", "extra": "int32[2]"}])
    assert "'state/w' differs (process 0: float32[4, 4]; process 1: float32[4, 8])" in message
    missing = disagreement("x", [{"a": "1"}, {"a": "1", "b": "2"}])
    assert "'b' differs (process 0: (absent); process 1: 2)" in missing


def test_process_rows_and_global_batch_in_one_process():
    mesh = autopar.make_mesh({"data": 2, "model": 4})
    split = NamedSharding(mesh, P("data"))
    # one process holds every device: it loads every row
    assert autopar.process_rows(split, 16) == slice(0, 16)
    local = {"x": np.arange(32.0).reshape(16, 2)}
    made = autopar.global_batch(local, {"x": split})
    assert made["x"].sharding == split
    np.testing.assert_array_equal(np.asarray(made["x"]), local["x"])
    with pytest.raises(autopar.AutoparError, match="NamedSharding for every leaf"):
        autopar.global_batch(local, {"x": None})
    with pytest.raises(autopar.AutoparError, match="jax Sharding"):
        autopar.process_rows(P("data"), 16)


def test_input_shardings_follow_the_plan():
    step, state, batch = models.mlp_setup()
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 2, "model": 4}))
    (state_shardings, batch_shardings), keywords = sharded.input_shardings(state, batch)
    assert keywords == {}
    plan = sharded.plan(state, batch)
    specs = jax.tree.leaves(plan.input_specs[1], is_leaf=lambda x: isinstance(x, P))
    assert [s.spec for s in jax.tree.leaves(batch_shardings)] == specs
    assert jax.tree.structure(state_shardings) == jax.tree.structure(state)
