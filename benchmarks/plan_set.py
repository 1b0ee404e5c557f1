"""A fixed set of plans, written as JSON, to check that a change to the planner leaves its
plans as they were: `python -m benchmarks.plan_set DIR` before and after, then `diff -r`.

The set: small GPTs, an MLP, an nnx MLP and a CNN on one-, two- and three-axis meshes of 8
abstract devices; both searches; the cpu, h100 and tpu_v5p profiles; plans within a memory
limit; accumulated microbatches (the loss's separability), GPipe and a circular pipeline.
Wall-clock figures are not in a plan's JSON, so equal plans write equal bytes.
"""
from __future__ import annotations

import pathlib
import sys
from typing import Any, Callable

import optax

import autopar

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import models  # noqa: E402  (examples/models.py)

MESHES = {"8": {"data": 8}, "2x4": {"data": 2, "model": 4}, "2x2x2": {"a": 2, "b": 2, "c": 2}}


def _setups() -> dict[str, Callable[[], tuple]]:
    return {
        "gpt1": lambda: models.gpt_setup(batch=8, seq=16, layers=1),
        "gpt2": lambda: models.gpt_setup(batch=8, seq=16, layers=2),
        "mlp": lambda: models.mlp_setup(),
        "nnx": lambda: models.nnx_setup(),
        "cnn": lambda: models.cnn_setup(),
        # the same steps with autopar's value_and_grad, which accumulation and pipelines need
        "gpt2a": lambda: _seen(models.gpt_setup(batch=8, seq=16, layers=2),
                               models.GPT(layers=2), models.token_loss),
        "mlpa": lambda: _seen(models.mlp_setup(), models.MLP(), models.mse),
        "cnna": lambda: _seen(models.cnn_setup(), models.CNN(), models.token_loss),
    }


def _seen(setup: tuple, model: Any, loss: Callable) -> tuple:
    _, state, batch = setup
    return models.linen_step(model, loss, optax.adamw(1e-3), autopar.value_and_grad), state, batch


def cases() -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (model, autopar.plan options)."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for model in ("gpt1", "gpt2", "mlp", "nnx", "cnn"):
        for mesh in MESHES:
            for search in ("dynamic_programming", "recursive_programming"):
                out[f"{model}-{mesh}-{search[:3]}"] = (model, dict(mesh=MESHES[mesh],
                                                                    search=search))
    for hw in ("h100", "tpu_v5p"):
        for model in ("gpt2", "cnn"):
            out[f"{model}-2x4-{hw}"] = (model, dict(mesh=MESHES["2x4"], hardware=hw))
    for mesh in ("8", "2x4"):
        out[f"gpt2-{mesh}-limit"] = ("gpt2", dict(mesh=MESHES[mesh], memory_limit=2 * 2**20))
        out[f"gpt2-{mesh}-micro2"] = ("gpt2a", dict(mesh=MESHES[mesh], microbatches=2))
    out["mlp-8-micro4"] = ("mlpa", dict(mesh=MESHES["8"], microbatches=4))
    out["cnn-2x4-micro2"] = ("cnna", dict(mesh=MESHES["2x4"], microbatches=2))
    out["gpt2-2x4-gpipe"] = ("gpt2a", dict(mesh={"stage": 2, "data": 4}, pipeline=2,
                                          microbatches=4))
    out["gpt2-2x4-circular"] = ("gpt2a", dict(mesh={"stage": 2, "data": 4}, pipeline=2,
                                             microbatches=4, pipeline_repeats=1,
                                             keep_placement=True))
    return out


def write(directory: str) -> None:
    root = pathlib.Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    built: dict[str, tuple] = {}
    setups = _setups()
    for name, (model, options) in cases().items():
        if model not in built:
            built[model] = setups[model]()
        step, state, batch = built[model]
        try:
            text = autopar.plan(step, state, batch, **options).to_json()
        except autopar.AutoparError as e:
            text = f"AutoparError: {e}\n"
        (root / f"{name}.json").write_text(text)
        print(name, flush=True)


if __name__ == "__main__":
    write(sys.argv[1])
