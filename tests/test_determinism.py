"""The same step, mesh and options give byte-identical plans: across fresh interpreters with
different hash seeds (PYTHONHASHSEED), and across a save and load of the plan. (Across
processes of one job: tests/test_multiprocess.py compares their plans' JSON.)"""
import json
import os
import subprocess
import sys

import pytest

import autopar

PLANNER = r"""
import json, sys
import jax, optax
import autopar, models
config = dict(vocab=128, d_model=32, heads=4, layers=2)
abstract = jax.eval_shape(lambda: models.gpt_setup(batch=8, seq=16, **config)[1:])
step = models.linen_step(models.GPT(**config), models.token_loss, optax.adamw(1e-3))
plans = {}
for search, mesh in (("dynamic_programming", {"data": 2, "model": 4}),
                     ("recursive_programming", {"data": 4, "model": 2}),
                     ("dynamic_programming", 8)):
    plan = autopar.plan(step, *abstract, mesh=mesh, search=search, memory_limit="64MiB")
    plans[f"{search} {mesh}"] = plan.to_json(detail=True)
print(json.dumps(plans))
"""


def _plans_in_fresh_interpreters(seeds: tuple[int, ...]) -> list[dict[str, str]]:
    """The plans PLANNER makes, in one fresh interpreter per hash seed, side by side."""
    examples = os.path.join(os.path.dirname(__file__), "..", "examples")
    running = [subprocess.Popen([sys.executable, "-c", PLANNER], cwd=examples, text=True,
                                env={**os.environ, "PYTHONHASHSEED": str(seed),
                                     "JAX_PLATFORMS": "cpu"},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for seed in seeds]
    plans = []
    for process in running:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        plans.append(json.loads(out.strip().splitlines()[-1]))
    return plans


@pytest.mark.slow
def test_plans_are_byte_identical_across_hash_seeds_and_a_save(tmp_path, reliability):
    first, second = _plans_in_fresh_interpreters((1, 2))
    assert list(first) == list(second) and len(first) == 3
    for name in first:
        assert first[name] == second[name], name
        # read back and written again, the same bytes; saved and loaded, an equal plan
        plan = autopar.Plan.from_json(first[name])
        assert plan.to_json(detail=True) == first[name]
        path = tmp_path / "plan.json"
        plan.save(str(path), detail=True)
        assert path.read_text() == first[name]
        assert autopar.load_plan(str(path)) == plan
        assert json.loads(first[name])["search_stats"]  # not an empty plan
    reliability("plans made in fresh interpreters with other hash seeds, compared byte for "
                "byte", {"identical": len(first)})
