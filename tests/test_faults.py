"""Faults: a job preempted and resumed, a process killed, a save cut short, a save left to the
background at exit, and checkpoint directories that hold no checkpoint. The multi-process
cases are examples/preemptible.py's (2 processes x 2 CPU devices on localhost)."""
import json
import os
import signal
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest

import autopar

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "preemptible.py")
HEARTBEAT_S = 3  # what the killed-process case gives jax.distributed.initialize


def _example(tmp_path, *argv):
    return subprocess.run([sys.executable, EXAMPLE, "--dir", str(tmp_path / "ckpt"), "--out",
                           str(tmp_path), *argv], capture_output=True, text=True,
                          timeout=400)


def _results(tmp_path, name):
    return [json.loads((tmp_path / f"{name}_{i}.json").read_text()) for i in range(2)]


@pytest.mark.slow
def test_a_preempted_job_saves_at_one_step_and_resumes_exactly(tmp_path, reliability):
    done = _example(tmp_path, "--steps", "40", "--sigterm-after", "1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    preempted, resumed = _results(tmp_path, "preempted"), _results(tmp_path, "process")
    # both processes stopped at the same step, after the signal and before the end, and saved
    stopped = preempted[0]["stopped_at"]
    assert preempted[1]["stopped_at"] == stopped and 2 <= stopped < 40
    assert autopar.latest_checkpoint(tmp_path / "ckpt")[0] == stopped
    assert autopar.checkpoint_plan(tmp_path / "ckpt" / f"step_{stopped}").mesh == (
        ("data", 2), ("model", 2))
    # resumed there, and equal to the bit to the same steps run without a stop
    for first, then in zip(preempted, resumed):
        assert then["start"] == stopped and then["stopped_at"] is None
        assert first["losses"] + then["losses"] == then["uninterrupted_losses"]
        assert then["state_equal"]
    lost = stopped - autopar.latest_checkpoint(tmp_path / "ckpt")[0]
    reliability("a 2-process job sent SIGTERM mid-run, then restarted",
                {"saved at one step and resumed bit-identical": 1}, f"{lost} steps",
                {"steps from the signal to the stop": stopped - 1})


@pytest.mark.slow
def test_a_killed_process_stops_the_others_within_the_heartbeat(tmp_path, reliability):
    done = _example(tmp_path, "--steps", "1000", "--sigkill-after", "2", "--heartbeat",
                    str(HEARTBEAT_S))
    killed = json.loads((tmp_path / "killed.json").read_text())
    survivor, victim = killed["exit_codes"]
    assert victim == -9 and survivor is not None and survivor != 0, done.stdout[-2000:]
    assert killed["stopped_s"] < HEARTBEAT_S + 10  # not hung in its next collective
    log = (tmp_path / "stderr_0.txt").read_text()
    assert "another task died" in log or "stopped sending heartbeats" in log, log[-2000:]
    reliability(f"one of 2 processes killed (SIGKILL) mid-run, heartbeat {HEARTBEAT_S} s",
                {f"the other stopped by JAX's error (exit {survivor})": 1},
                "the steps since the last checkpoint (this run saved none)",
                {"seconds from the kill to the other's exit": killed["stopped_s"]})


SAVER = r"""
import os, signal, sys
import jax, numpy as np
import autopar
mesh = autopar.make_mesh({"data": 8})
layout = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
state = {f"w{i}": jax.device_put(np.random.default_rng(i).standard_normal((1024, 8192),
                                                                          np.float32), layout)
         for i in range(4)}
directory, then = sys.argv[1], sys.argv[2]
autopar.save_checkpoint(os.path.join(directory, "step_1"), state)
autopar.save_checkpoint(os.path.join(directory, "step_2"), state, wait=False)
if then == "killed":  # mid-save: once orbax's thread has begun writing the 128 MB
    import time
    cut = os.path.join(directory, "step_2.orbax-checkpoint-tmp")
    deadline = time.monotonic() + 60
    while not os.path.exists(cut) and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _like():
    mesh = autopar.make_mesh({"data": 4, "model": 2})
    layout = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model", "data"))
    return {f"w{i}": jax.ShapeDtypeStruct((1024, 8192), np.float32, sharding=layout)
            for i in range(4)}


def _equal_to_saved(state):
    return all(np.array_equal(np.asarray(state[f"w{i}"]), np.random.default_rng(i)
                              .standard_normal((1024, 8192), np.float32)) for i in range(4))


def _saver(tmp_path, then):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", SAVER, str(tmp_path), then], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_cut_save_leaves_the_previous_checkpoint(tmp_path, reliability):
    done = _saver(tmp_path, "killed")
    assert done.returncode == -9, done.stderr[-2000:]
    with pytest.warns(autopar.AutoparWarning, match=r"step_2\.orbax-checkpoint-tmp"):
        step, path = autopar.latest_checkpoint(tmp_path)
    assert step == 1 and _equal_to_saved(autopar.restore_checkpoint(path, _like()))
    cut = str(tmp_path / "step_2")
    with pytest.raises(autopar.AutoparError, match=r"cut short.*step_2\.orbax-checkpoint-tmp"):
        autopar.restore_checkpoint(cut, _like())
    with pytest.raises(autopar.AutoparError, match="not a complete checkpoint"):
        autopar.restore_checkpoint(cut + ".orbax-checkpoint-tmp", _like())
    reliability("a save killed (SIGKILL) while writing",
                {"previous checkpoint restored, the cut one refused by name": 1},
                "the cut save; step 1 restored equal")


@pytest.mark.slow
def test_a_background_save_completes_before_the_process_exits(tmp_path, reliability):
    done = _saver(tmp_path, "exits")
    assert done.returncode == 0, done.stderr[-2000:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no cut save left behind
        step, path = autopar.latest_checkpoint(tmp_path)
    assert step == 2 and _equal_to_saved(autopar.restore_checkpoint(path, _like()))
    reliability("a process exits right after a background save (wait=False)",
                {"checkpoint complete and restored equal": 1})


def test_directories_without_a_checkpoint_are_refused(tmp_path, reliability):
    like, outcomes = _like(), {}
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "file").write_text("x")
    for name in ("empty", "junk", "file", "missing"):
        with pytest.raises(autopar.AutoparError, match=str(tmp_path / name)):
            autopar.restore_checkpoint(tmp_path / name, like)
        with pytest.raises(autopar.AutoparError, match=str(tmp_path / name)):
            autopar.checkpoint_plan(tmp_path / name)
        outcomes[f"{name}: refused"] = 1
    assert autopar.latest_checkpoint(tmp_path / "missing") is None
    assert autopar.latest_checkpoint(tmp_path) is None
    reliability("checkpoint directories that hold none", outcomes)


def test_one_process_stops_at_the_step_after_a_sigterm():
    previous = signal.getsignal(signal.SIGTERM)
    with autopar.Preemption() as preemption:
        assert not preemption.reached(0)
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the test goes on
        assert preemption.reached(1) and not preemption.reached(2)  # True once
        preemption.request()
        assert preemption.reached(3)
    assert signal.getsignal(signal.SIGTERM) == previous  # put back
