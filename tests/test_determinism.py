"""The same step, mesh and options give byte-identical plans: in a fresh interpreter with
another hash seed (PYTHONHASHSEED) as in this one, and across a save and load of the plan.
(Across the processes of one job: tests/test_multiprocess.py compares their plans' JSON.)"""
import json
import os
import subprocess
import sys

import jax
import models
import optax
import pytest

import autopar

HERE = os.path.dirname(os.path.abspath(__file__))


def plans() -> dict[str, str]:
    """A small GPT planned three ways (two searches, two meshes, a device count), each plan's
    detailed JSON; and this interpreter's hash of a string, which its hash seed decides."""
    config = dict(vocab=128, d_model=32, heads=4, layers=2)
    abstract = jax.eval_shape(lambda: models.gpt_setup(batch=8, seq=16, **config)[1:])
    step = models.linen_step(models.GPT(**config), models.token_loss, optax.adamw(1e-3))
    out = {"hash": str(hash("autopar"))}
    for search, mesh in (("dynamic_programming", {"data": 2, "model": 4}),
                         ("recursive_programming", {"data": 4, "model": 2}),
                         ("dynamic_programming", 8)):
        plan = autopar.plan(step, *abstract, mesh=mesh, search=search, memory_limit="64MiB")
        out[f"{search} {mesh}"] = plan.to_json(detail=True)
    return out


def _in_fresh_interpreter(seed: int) -> subprocess.Popen:
    paths = [HERE, os.path.join(HERE, "..", "examples")]
    code = (f"import json, sys; sys.path[:0] = {paths!r}; import test_determinism; "
            "print(json.dumps(test_determinism.plans()))")
    return subprocess.Popen([sys.executable, "-c", code], text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONHASHSEED": str(seed), "JAX_PLATFORMS": "cpu"})


@pytest.mark.slow
def test_plans_are_byte_identical_across_hash_seeds_and_a_save(tmp_path, reliability):
    running = _in_fresh_interpreter(1)  # plans there while this process plans here
    here = plans()
    out, err = running.communicate(timeout=300)
    assert running.returncode == 0, err[-3000:]
    there = json.loads(out.strip().splitlines()[-1])
    if there["hash"] == here["hash"]:  # this interpreter runs with seed 1 too: take another
        out, _ = _in_fresh_interpreter(2).communicate(timeout=300)
        there = json.loads(out.strip().splitlines()[-1])
    assert there.pop("hash") != here.pop("hash")  # two hash seeds were compared
    assert list(here) == list(there) and len(here) == 3
    for name, text in here.items():
        assert text == there[name], name
        # read back and written again, the same bytes; saved and loaded, an equal plan
        plan = autopar.Plan.from_json(text)
        assert plan.to_json(detail=True) == text
        path = tmp_path / "plan.json"
        plan.save(str(path), detail=True)
        assert path.read_text() == text
        assert autopar.load_plan(str(path)) == plan
        assert json.loads(text)["search_stats"]  # not an empty plan
    reliability("plans made in fresh interpreters with other hash seeds, compared byte for "
                "byte", {"identical": len(here)})
