"""The on-disk plan cache: a plan searched once is applied, not searched, the next time the
same step is planned, in any process.

An entry is the plan's compact JSON, named by a hash of everything the plan depends on: the
step's jaxpr (its constants' bytes included) with its input paths and donations, the planning
options (mesh, search, hardware profile, annotations, memory limit, schedule), the compiling
platform, the versions of jax and jaxlib, and autopar's own source. A change to any of them
is a different entry. Off unless a directory is given, as JAX's compilation cache is:
`autopar.set_plan_cache_dir(path)` or the AUTOPAR_PLAN_CACHE_DIR environment variable.

An entry that does not read, or does not fit the step it is applied to, is planned again
with an AutoparWarning, and replaced.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
import tempfile
import warnings
from typing import Any, Callable, TypeVar

import jax
import numpy as np

import autopar_search
from autopar import progress
from autopar.calling import Call, function_name
from autopar.errors import AutoparError, AutoparWarning
from autopar.plan import Plan

T = TypeVar("T")
ENV = "AUTOPAR_PLAN_CACHE_DIR"
_directory: list[str | None] = [None]  # set_plan_cache_dir's value, over the environment's


def set_plan_cache_dir(path: str | os.PathLike | None) -> None:
    """Keep searched plans in `path` (created where missing) and apply them, rather than
    search again, when the same step is planned with the same options. None: back to the
    AUTOPAR_PLAN_CACHE_DIR environment variable, no cache where it is unset."""
    _directory[0] = None if path is None else os.fspath(path)


def plan_cache_dir() -> str | None:
    """The cache directory in use: set_plan_cache_dir's, else AUTOPAR_PLAN_CACHE_DIR's, else
    None (no cache)."""
    return _directory[0] or os.environ.get(ENV) or None


def through_cache(kind: str, call: Call, options: dict[str, Any], platform: str,
                  apply: Callable[[Plan], T], search: Callable[[], T],
                  plan_of: Callable[[T], Plan]) -> T:
    """`search()`'s result for `call` planned by `kind` with `options`, or, where the cache
    holds that plan, `apply(plan)`'s; a searched plan (`plan_of` the result) is stored."""
    if plan_cache_dir() is None:
        return search()
    key = entry_key(kind, call, options, platform)
    cached = _cached_plan(key)
    if cached is not None:
        try:
            made = apply(cached)
        except AutoparError as e:
            _stale(key, e)
        else:
            progress.logger.debug("the plan of %s read from the plan cache: %s",
                                  function_name(call.fn), _entry(key))
            return made
    made = search()
    _store_plan(key, plan_of(made))
    return made


def entry_key(kind: str, call: Call, options: dict[str, Any], platform: str) -> str:
    """The hash naming the entry of `call` planned by `kind` ("auto_parallel" or "plan") with
    `options`."""
    closed = call.jaxpr[0]
    digest = hashlib.sha256()
    for part in (kind, _source_fingerprint(), jax.__version__, jax.lib.__version__, platform,
                 str(closed), repr(call.paths), repr(sorted(call.donated)),
                 repr(sorted((k, _option_text(v)) for k, v in options.items()))):
        digest.update(part.encode())
        digest.update(b"\0")
    for const in closed.consts:  # a closed-over array's values, which the jaxpr's text omits
        digest.update(np.asarray(const).tobytes())
    return digest.hexdigest()


def _cached_plan(key: str) -> Plan | None:
    """The plan stored under `key`, or None: no entry, or one that does not read (warned)."""
    path = _entry(key)
    if path is None or not path.exists():
        return None
    try:
        return Plan.from_json(path.read_text())
    except (AutoparError, OSError, UnicodeDecodeError) as e:
        warnings.warn(f"the plan cache entry {path} does not read ({_first_line(e)}); "
                      "planning again, and replacing it", AutoparWarning, stacklevel=3)
        return None


def _stale(key: str, error: Exception) -> None:
    """Warn that the entry under `key` does not fit the step it was found for."""
    warnings.warn(f"the plan cache entry {_entry(key)} does not fit this step "
                  f"({_first_line(error)}); planning again, and replacing it", AutoparWarning,
                  stacklevel=3)


def _store_plan(key: str, plan: Plan) -> None:
    """Write `plan` under `key`, atomically (a reader never sees half an entry); a directory
    that cannot be written is warned about, and planning goes on."""
    path = _entry(key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{key[:16]}.",
                                         suffix=".tmp", delete=False) as f:
            f.write(plan.to_json())
        os.replace(f.name, path)
    except OSError as e:
        warnings.warn(f"the plan cache cannot write {path} ({e}); the plan is not cached",
                      AutoparWarning, stacklevel=3)


def _entry(key: str) -> pathlib.Path | None:
    directory = plan_cache_dir()
    return None if directory is None else pathlib.Path(directory) / f"{key}.plan.json"


def _option_text(value: Any) -> str:
    """An option as stable text: a Plan by its JSON (its repr holds unordered detail), a
    dataclass field by field, the rest by repr."""
    if isinstance(value, Plan):
        return value.to_json()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return repr(dataclasses.asdict(value))
    if isinstance(value, jax.sharding.Mesh):
        return repr((value.axis_names, value.devices.shape, value.devices.flat[0].platform))
    return repr(value)


@functools.cache
def _source_fingerprint() -> str:
    """A hash of autopar's and its search's source: plans from other code are other
    entries, whatever the version number says."""
    digest = hashlib.sha256()
    for package in (pathlib.Path(__file__).parent, pathlib.Path(autopar_search.__file__).parent):
        for source in sorted(package.rglob("*.py")):
            digest.update(str(source.relative_to(package.parent)).encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
