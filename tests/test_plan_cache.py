"""The on-disk plan cache: a hit applies the stored plan without searching, and computes what
the single-device step computes; other options are other entries; a corrupt or stale entry is
planned again with a warning; a new process reads what another wrote."""
import logging
import os
import subprocess
import sys
import textwrap

import models
import pytest

import autopar
from autopar import plan_cache
from helpers import check_against_single_device
from test_plan import same_decisions

MESH = {"data": 2, "model": 4}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.delenv(plan_cache.ENV, raising=False)
    autopar.set_plan_cache_dir(tmp_path / "plans")
    yield tmp_path / "plans"
    autopar.set_plan_cache_dir(None)


def entries(folder):
    return sorted(p.name for p in folder.glob("*.plan.json")) if folder.exists() else []


def no_search(monkeypatch):
    def searched(*args, **kwargs):
        raise AssertionError("searched, though the plan cache holds this plan")
    monkeypatch.setattr("autopar.planner.plan_call", searched)
    monkeypatch.setattr("autopar.stepper.plan_call", searched)


def test_cache_is_off_by_default(monkeypatch):
    monkeypatch.delenv(plan_cache.ENV, raising=False)
    assert autopar.plan_cache_dir() is None
    monkeypatch.setenv(plan_cache.ENV, "/somewhere")
    assert autopar.plan_cache_dir() == "/somewhere"


def test_plan_is_read_back_without_search(cache, monkeypatch):
    step, state, batch = models.mlp_setup()
    first = autopar.plan(step, state, batch, mesh=MESH)
    assert len(entries(cache)) == 1
    no_search(monkeypatch)
    again = autopar.plan(step, state, batch, mesh=MESH)
    assert again == first and same_decisions(again, first)
    assert again.cost == first.cost
    # other options, another entry (and a search)
    monkeypatch.undo()
    autopar.set_plan_cache_dir(cache)
    autopar.plan(step, state, batch, mesh=MESH, search="recursive_programming")
    autopar.plan(step, state, batch, mesh={"data": 8})
    assert len(entries(cache)) == 3


@pytest.mark.slow
def test_cached_plan_trains_as_the_single_device_step(cache, monkeypatch):
    step, state, batch = models.mlp_setup()
    mesh = autopar.make_mesh(MESH)
    searched = check_against_single_device(step, state, batch, mesh, steps=2)
    assert len(entries(cache)) == 1
    no_search(monkeypatch)
    cached = check_against_single_device(step, state, batch, mesh, steps=2)
    assert same_decisions(cached, searched) and cached.specs == searched.specs


def test_a_corrupt_entry_is_planned_again_with_a_warning(cache):
    step, state, batch = models.mlp_setup()
    first = autopar.plan(step, state, batch, mesh=MESH)
    (entry,) = cache.glob("*.plan.json")
    entry.write_text(entry.read_text()[:200])  # cut short
    with pytest.warns(autopar.AutoparWarning, match="does not read.*planning again"):
        again = autopar.plan(step, state, batch, mesh=MESH)
    assert again == first
    assert autopar.Plan.from_json(entry.read_text()) == first  # replaced


def test_a_stale_entry_is_planned_again_with_a_warning(cache, monkeypatch):
    """An entry whose plan does not fit the step (another step's plan under this key)."""
    step, state, batch = models.mlp_setup()
    first = autopar.plan(step, state, batch, mesh=MESH)
    (entry,) = cache.glob("*.plan.json")
    nnx_step, nnx_state, nnx_batch = models.nnx_setup()
    monkeypatch.setattr(plan_cache, "_directory", [None])  # the other step's plan, uncached
    other = autopar.plan(nnx_step, nnx_state, nnx_batch, mesh=MESH)
    monkeypatch.setattr(plan_cache, "_directory", [str(cache)])
    entry.write_text(other.to_json())
    with pytest.warns(autopar.AutoparWarning, match="does not fit this step.*planning again"):
        again = autopar.plan(step, state, batch, mesh=MESH)
    assert again == first
    assert autopar.Plan.from_json(entry.read_text()) == first


def test_an_unwritable_folder_warns_and_plans(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    autopar.set_plan_cache_dir(blocker / "plans")  # below a file: cannot be made
    try:
        step, state, batch = models.mlp_setup()
        with pytest.warns(autopar.AutoparWarning, match="cannot write"):
            plan = autopar.plan(step, state, batch, mesh=MESH)
    finally:
        autopar.set_plan_cache_dir(None)
    assert plan.search_stats["ops"] > 0


def test_the_key_follows_the_step_and_its_constants(cache):
    """A closed-over array is part of the step: other values, another entry."""
    import jax.numpy as jnp
    import numpy as np
    step, state, batch = models.mlp_setup()

    def scaled(scale):
        def loss_step(state, batch):
            new_state, loss = step(state, batch)
            return new_state, loss * jnp.asarray(scale)
        return loss_step

    autopar.plan(scaled(np.ones(3, np.float32)), state, batch, mesh=MESH)
    autopar.plan(scaled(np.ones(3, np.float32)), state, batch, mesh=MESH)
    assert len(entries(cache)) == 1
    autopar.plan(scaled(np.full(3, 2, np.float32)), state, batch, mesh=MESH)
    assert len(entries(cache)) == 2


@pytest.mark.slow
def test_a_new_process_reads_the_plan_another_wrote(tmp_path):
    script = textwrap.dedent("""
        import logging, os, sys
        sys.path.insert(0, %r)
        import models, autopar
        logging.basicConfig(level=logging.DEBUG, format="%%(name)s %%(message)s")
        step, state, batch = models.mlp_setup()
        plan = autopar.plan(step, state, batch, mesh={"data": 2, "model": 4})
        print("COST", plan.cost["total_s"])
    """ % os.path.join(os.path.dirname(__file__), "..", "examples"))
    env = {**os.environ, plan_cache.ENV: str(tmp_path / "plans")}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    costs = [line for run in runs for line in run.stdout.splitlines() if line.startswith("COST")]
    assert len(costs) == 2 and costs[0] == costs[1]
    assert "read from the plan cache" not in runs[0].stderr
    assert "read from the plan cache" in runs[1].stderr


def test_progress_reports_long_planning(monkeypatch):
    """Planning past DELAY_S logs its stages on the "autopar" logger; AUTOPAR_PROGRESS=0
    silences it."""
    from autopar import progress
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    monkeypatch.setattr(progress, "MIN_INTERVAL_S", 0.0)
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(level=logging.INFO)
    logger = logging.getLogger("autopar")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        step, state, batch = models.mlp_setup()
        autopar.plan(step, state, batch, mesh=8)
        said = "\n".join(records)
        assert "planning step: tracing" in said
        assert "mesh {'data': 2, 'model': 4} (2 of 4)" in said
        assert records[-1].startswith("planning step: done in")
        records.clear()
        autopar.plan(step, state, batch, mesh=MESH, memory_limit=60_000)
        assert "memory round 2: price" in "\n".join(records)
        records.clear()
        monkeypatch.setenv("AUTOPAR_PROGRESS", "0")
        autopar.plan(step, state, batch, mesh=8)
        assert records == []
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
