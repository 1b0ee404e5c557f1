"""Checkpoints of a plan's sharded state (orbax), restorable into any other plan or mesh.

- `save_checkpoint(path, state, plan=None, *, overwrite=False, wait=True)`: every process
  writes its own shards, with the plan's JSON. `path` appears only once complete.
  `wait=False` returns once the arrays are off the devices; `wait_for_checkpoints()` and the
  interpreter's exit wait for the rest.
- `restore_checkpoint(path, like, shardings=None)`: each process reads its own pieces under
  `shardings`, whatever plan or mesh wrote them.
- `checkpoint_plan(path)`: the plan saved with it, or None.
- `latest_checkpoint(directory)`: (n, path) of the newest complete `directory/step_<n>`, or
  None; cut saves left out with an AutoparWarning.
AutoparError: no orbax; an existing `path` without `overwrite=True`; an incomplete
checkpoint; a leaf without a sharding; `like` of another tree or shape.

Design and rationale: docs/internals-planning.md, "autopar/checkpoint.py".
"""
from __future__ import annotations

import functools
import glob
import os
import re
import threading
import warnings
from typing import Any

import jax

from autopar.errors import AutoparError, AutoparWarning
from autopar.placement.stored import unpack
from autopar.plan import Plan, load_plan
from autopar.trace.tracer import path_to_str

PLAN_FILE = "autopar_plan.json"  # where checkpoints of earlier versions kept the plan
PLAN_KEY = "autopar_plan"  # the plan's JSON in the checkpoint's custom metadata
CUT = ".orbax-checkpoint-tmp"  # what orbax writes into until the save is complete
METADATA = "_METADATA"  # the tree's metadata, written at the end: restore needs it
STEP = re.compile(r"step_(\d+)$")
_pending: list[Any] = []  # checkpointers whose saves may still be writing


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise AutoparError("checkpoints need orbax. Fix: pip install 'autopar[checkpoint]' "
                           "(orbax-checkpoint).") from e
    return ocp


def save_checkpoint(path: str | os.PathLike, state: Any, plan: Plan | None = None, *,
                    overwrite: bool = False, wait: bool = True) -> None:
    """Save `state` (a pytree of arrays, sharded as the plan left it) to the directory `path`,
    and `plan`'s JSON with it. Every process must call it (each writes its own shards). It
    returns when the checkpoint is complete, or with `wait=False` as soon as the arrays are
    copied to host memory (the rest is written in the background: `wait_for_checkpoints()`;
    the interpreter waits for it at exit). `path` appears only once complete. An existing
    checkpoint is replaced only with `overwrite=True`. A state kept in the circular
    placement (autopar.Placed) is saved as your tree, its layers in your order
    (autopar.unpack)."""
    ocp = _orbax()
    wait_for_checkpoints()  # one save at a time: the previous one finishes first
    state = unpack(state)
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise AutoparError(f"checkpoint directory {path} exists. Fix: save to a new path (one "
                           "per step, say), or pass overwrite=True.")
    checkpointer = ocp.StandardCheckpointer()
    metadata = {PLAN_KEY: plan.to_json()} if plan is not None else None
    checkpointer.save(path, state, force=overwrite, custom_metadata=metadata)
    _pending.append(checkpointer)
    if wait:
        wait_for_checkpoints()
    else:
        _wait_at_exit()


@functools.cache
def _wait_at_exit() -> None:
    """Wait for the saves before the interpreter's exit stops their threads. atexit is too
    late: by then concurrent.futures has refused new work (its own hook, one of threading's,
    runs first) and orbax's background writes fail, leaving only the `.orbax-checkpoint-tmp`
    directory. threading's exit hooks run last-registered first, so this one, registered
    after orbax started its executors, runs before theirs."""
    threading._register_atexit(wait_for_checkpoints)  # type: ignore[attr-defined]


def wait_for_checkpoints() -> None:
    """Return once every checkpoint this process started saving is complete."""
    while _pending:
        checkpointer = _pending.pop(0)
        checkpointer.wait_until_finished()
        checkpointer.close()


def latest_checkpoint(directory: str | os.PathLike) -> tuple[int, str] | None:
    """(n, path) of the newest complete checkpoint `directory/step_<n>` (the largest n), or
    None where there is none. A save that was cut short is left out, with an AutoparWarning
    naming it."""
    directory = os.path.abspath(os.fspath(directory))
    cut = sorted(glob.glob(os.path.join(glob.escape(directory), f"step_*{CUT}*")))
    if cut:
        warnings.warn(f"left out {len(cut)} checkpoint save(s) that did not complete: "
                      f"{', '.join(cut)} (a process stopped while writing them; they can be "
                      "deleted)", AutoparWarning, stacklevel=2)
    steps = []
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        found = STEP.match(name)
        if found and _complete(os.path.join(directory, name)):
            steps.append((int(found.group(1)), name))
    if not steps:
        return None
    step, name = max(steps)
    return step, os.path.join(directory, name)


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA))


def _check_complete(path: str) -> None:
    """An AutoparError where `path` holds no complete checkpoint, naming a cut save."""
    cut = sorted(glob.glob(glob.escape(path) + CUT + "*"))
    if not os.path.isdir(path):
        why = (f"; the save to it was cut short, and {cut[0]} holds what it wrote"
               if cut else "")
        raise AutoparError(f"no checkpoint at {path}{why}. Fix: pass the directory "
                           "save_checkpoint wrote (autopar.latest_checkpoint(directory) finds "
                           "the newest complete one).")
    if not _complete(path):
        raise AutoparError(f"{path} is not a complete checkpoint (it has no {METADATA}, which "
                           "a save writes last). Fix: restore an earlier checkpoint "
                           "(autopar.latest_checkpoint(directory)), or pass the directory "
                           "save_checkpoint wrote.")


def restore_checkpoint(path: str | os.PathLike, like: Any, shardings: Any = None) -> Any:
    """The state saved at `path`, laid out as `shardings` (a pytree of jax Shardings matching
    `like`, e.g. `step.input_shardings(state, batch)[0][0]` for a step's first argument).
    `like` gives the tree, shapes and dtypes (arrays or ShapeDtypeStructs); without
    `shardings` its leaves' own shardings are used. Each process reads only its shards."""
    ocp = _orbax()
    path = os.path.abspath(os.fspath(path))
    _check_complete(path)
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
    try:
        _check_matches(path, like, checkpointer)
        return checkpointer.restore(path, jax.tree_util.tree_unflatten(tree, targets))
    finally:
        checkpointer.close()


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
    """The plan saved with the checkpoint at `path`, None if it was saved without one."""
    path = os.path.abspath(os.fspath(path))
    _check_complete(path)
    checkpointer = _orbax().StandardCheckpointer()
    try:
        saved = checkpointer.metadata(path)
    finally:
        checkpointer.close()
    text = (getattr(saved, "custom_metadata", None) or {}).get(PLAN_KEY)
    if text is not None:
        return Plan.from_json(text)
    file = os.path.join(path, PLAN_FILE)
    return load_plan(file) if os.path.exists(file) else None
