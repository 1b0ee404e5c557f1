"""`python -m autopar show|explain|diff`: saved plans read from the shell."""
import subprocess
import sys

import models
import pytest

import autopar
from autopar.__main__ import main

MESH = {"data": 2, "model": 4}
KERNEL = "state/0/params/Dense_0/kernel"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    step, state, batch = models.mlp_setup()
    free = autopar.plan(step, state, batch, mesh=MESH)
    lean = autopar.plan(step, state, batch, mesh=MESH, memory_limit=60_000)
    free.save(folder / "free.json")
    lean.save(folder / "lean.json")
    return folder, free, lean


def test_show_explain_and_diff_print_what_the_api_gives(saved, capsys):
    folder, free, lean = saved
    assert main(["show", str(folder / "free.json")]) == 0
    assert capsys.readouterr().out.strip() == autopar.load_plan(folder / "free.json").summary()
    assert main(["explain", str(folder / "lean.json"), KERNEL]) == 0
    out = capsys.readouterr().out
    spec = next(t.partition_spec for t in lean.inputs if t.path == KERNEL)
    assert f"{KERNEL} " in out and str(spec) in out and "decided by: not known" in out
    assert main(["diff", str(folder / "free.json"), str(folder / "lean.json")]) == 0
    assert capsys.readouterr().out.strip() == str(autopar.diff(free, lean))
    assert main(["html", str(folder / "lean.json"), str(folder / "lean.html")]) == 0
    assert f"{lean.cost['total_s'] * 1e3:.3f} ms" in (folder / "lean.html").read_text()


def test_errors_go_to_stderr_with_status_2(saved, capsys, tmp_path):
    folder, _, _ = saved
    assert main(["explain", str(folder / "free.json"), "nope"]) == 2
    err = capsys.readouterr().err
    assert "autopar: the plan has no input, nor operators of scope, 'nope'" in err
    (tmp_path / "cut.json").write_text('{"format_version": 2, "mesh"')
    assert main(["show", str(tmp_path / "cut.json")]) == 2
    assert "does not parse" in capsys.readouterr().err


@pytest.mark.slow
def test_the_module_runs_from_the_shell(saved):
    folder, _, _ = saved
    done = subprocess.run([sys.executable, "-m", "autopar", "show", str(folder / "free.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "predicted per step" in done.stdout
