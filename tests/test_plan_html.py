"""Plan.to_html: one self-contained page, rendered by headless Chromium with no console error,
holding the plan's key figures: mesh, specs, collectives, the memory peak, compiled beside
predicted."""
import os
import re
import shutil
import subprocess

import models
import pytest

import autopar

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    step, state, batch = models.mlp_setup()
    stepper = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 2, "model": 4}),
                                    memory_limit=60_000)  # close enough to be compiled
    plan = stepper.plan(state, batch)
    path = tmp_path_factory.mktemp("html") / "plan.html"
    plan.to_html(str(path), title="mlp plan")
    return plan, path


def test_the_page_holds_the_plans_figures(page):
    plan, path = page
    text = path.read_text()
    assert "<script" not in text and "http" not in text.replace("http-equiv", "")  # offline
    assert f"{plan.cost['total_s'] * 1e3:.3f} ms" in text
    assert f"{plan.memory['compiled_bytes'] / 2**20:,.2f} MiB" in text  # compiled, beside
    assert f"{plan.cost['peak_memory_bytes'] / 2**20:,.2f} MiB" in text  # predicted
    kernel = next(t for t in plan.inputs if t.path.endswith("params/Dense_1/kernel"))
    assert re.search(re.escape(kernel.path) + r"</td><td>[^<]*</td><td>"
                     + re.escape(str(kernel.partition_spec).replace("'", "&#x27;")), text)
    assert all(f"<h3>Dense_{i}</h3>" in text for i in range(3))
    assert text.count("<rect ") == 8  # the mesh's devices
    assert "class='peak'" in text and f"limit {60_000 / 2**20:,.2f} MiB" in text
    kinds = {"all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute"}
    assert any(f"<td>{k}</td>" in text for k in kinds)


def test_a_plan_from_json_makes_a_page_too(page, tmp_path):
    plan, _ = page
    loaded = autopar.Plan.from_json(plan.to_json())
    loaded.to_html(str(tmp_path / "loaded.html"))
    text = (tmp_path / "loaded.html").read_text()
    assert "holds no operators" in text and f"{plan.cost['total_s'] * 1e3:.3f} ms" in text


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs chromium: `make test` installs it")
def test_chromium_renders_it_without_a_console_error(page, tmp_path):
    plan, path = page
    run = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
         "--v=0", f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom",
         f"file://{path}"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "CONSOLE" not in run.stderr and "Uncaught" not in run.stderr, run.stderr[-2000:]
    dom = run.stdout
    assert "mlp plan" in dom and f"{plan.cost['total_s'] * 1e3:.3f} ms" in dom
    assert "<svg" in dom and "Dense_1" in dom
