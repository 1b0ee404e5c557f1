"""Checkpoints of a plan's sharded state (orbax), restorable into any other plan or mesh.

- `save_checkpoint(path, state, plan)`: every process writes its own shards of every array
  (orbax's StandardCheckpointer; nothing is gathered on one device) and process 0 writes the
  plan's JSON beside them, `path/autopar_plan.json`.
- `restore_checkpoint(path, like, shardings)`: every process reads the pieces its own devices
  hold under `shardings`, whatever plan or mesh wrote them: a (2, 4) plan's state restores into
  a (4, 2) plan, a data-parallel one, or a pipelined one and back (a pipelined plan keeps the
  state's tree and shapes; only its shardings differ). This is MindSpore's distributed
  checkpoint transformation, done by tensorstore's reads of array slices.
- `checkpoint_plan(path)`: the plan saved beside, to apply again (`auto_parallel(plan=...)`).
"""
from __future__ import annotations

import os
from typing import Any

import jax

from autopar.distributed import is_main_process
from autopar.errors import AutoparError
from autopar.plan import Plan, load_plan
from autopar.schedule.stored import unpack
from autopar.trace.tracer import path_to_str

PLAN_FILE = "autopar_plan.json"


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise AutoparError("checkpoints need orbax. Fix: pip install 'autopar[checkpoint]' "
                           "(orbax-checkpoint).") from e
    return ocp


def save_checkpoint(path: str | os.PathLike, state: Any, plan: Plan | None = None, *,
                    overwrite: bool = False) -> None:
    """Save `state` (a pytree of arrays, sharded as the plan left it) to the directory `path`,
    and `plan`'s JSON beside it. Every process must call it (each writes its own shards); it
    returns when the checkpoint is complete. An existing checkpoint is replaced only with
    `overwrite=True`. A state kept in the circular placement (autopar.Placed) is saved as
    your tree, its layers in your order (autopar.unpack)."""
    ocp = _orbax()
    state = unpack(state)
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise AutoparError(f"checkpoint directory {path} exists. Fix: save to a new path (one "
                           "per step, say), or pass overwrite=True.")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, state, force=overwrite)
    checkpointer.wait_until_finished()
    if plan is not None and is_main_process():
        plan.save(os.path.join(path, PLAN_FILE))


def restore_checkpoint(path: str | os.PathLike, like: Any, shardings: Any = None) -> Any:
    """The state saved at `path`, laid out as `shardings` (a pytree of jax Shardings matching
    `like`, e.g. `step.input_shardings(state, batch)[0][0]` for a step's first argument).
    `like` gives the tree, shapes and dtypes (arrays or ShapeDtypeStructs); without
    `shardings` its leaves' own shardings are used. Each process reads only its shards."""
    ocp = _orbax()
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise AutoparError(f"no checkpoint at {path}. Fix: pass the directory save_checkpoint "
                           "wrote.")
    leaves, tree = jax.tree_util.tree_flatten_with_path(like)
    chosen = ([None] * len(leaves) if shardings is None else _matching_leaves(like, shardings))
    targets = []
    for (keys, leaf), sharding in zip(leaves, chosen):
        sharding = sharding if sharding is not None else getattr(leaf, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding):
            raise AutoparError(f"restore_checkpoint has no sharding for {path_to_str(keys)!r} "
                               f"(shape {tuple(leaf.shape)}). Fix: pass shardings=, e.g. "
                               "step.input_shardings(state, batch)[0][0].")
        targets.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding))
    checkpointer = ocp.StandardCheckpointer()
    _check_matches(path, like, checkpointer)
    return checkpointer.restore(path, jax.tree_util.tree_unflatten(tree, targets))


def _matching_leaves(like: Any, shardings: Any) -> list[Any]:
    """`shardings`' leaves in `like`'s order, or an AutoparError where the trees differ."""
    tree = jax.tree_util.tree_structure(like)
    try:
        return tree.flatten_up_to(shardings)
    except (ValueError, TypeError) as e:
        raise AutoparError(f"restore_checkpoint's shardings do not match the tree of `like` "
                           f"({e}). Fix: pass the shardings of the same argument, e.g. "
                           "step.input_shardings(state, batch)[0][0].") from e


def _check_matches(path: str, like: Any, checkpointer: Any) -> None:
    """The saved arrays' paths and shapes against `like`'s: a clear error before orbax's."""
    saved = checkpointer.metadata(path)
    saved = getattr(saved, "item_metadata", saved)
    shapes = {path_to_str(k): tuple(getattr(m, "shape", ()))
              for k, m in jax.tree_util.tree_flatten_with_path(saved)[0]}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(like)[0]:
        name = path_to_str(keys)
        if name not in shapes:
            raise AutoparError(f"the checkpoint at {path} has no array {name!r} (it has "
                               f"{len(shapes)}, e.g. {sorted(shapes)[:3]}). Fix: restore into "
                               "the state tree that was saved.")
        if shapes[name] != tuple(leaf.shape):
            raise AutoparError(f"the checkpoint's {name!r} has shape {shapes[name]}, and the "
                               f"target wants {tuple(leaf.shape)}. Fix: restore into the model "
                               "configuration that was saved.")


def checkpoint_plan(path: str | os.PathLike) -> Plan | None:
    """The plan saved beside the checkpoint at `path`, None if it was saved without one."""
    file = os.path.join(os.fspath(path), PLAN_FILE)
    return load_plan(file) if os.path.exists(file) else None
