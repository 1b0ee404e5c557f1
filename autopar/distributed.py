"""Many processes, one program: autopar under JAX's multi-controller runtime.

- `agree(subject, items)`: one all-gather of a digest of (name, description) items (from
  `call_items`, `decisions_items`); where they differ, every process raises the same
  AutoparError naming the first item that differs. In one process it does nothing.
- `place_everywhere(leaves, shardings, moves, paths)`: the leaves as global arrays; host values
  (`is_host_value`) only after the processes agree they are equal.
- `process_rows(sharding, rows)`: the rows of a batch this process must load.
- `global_batch(local, shardings, global_shapes=None)`: global arrays from what each process
  loaded. Both raise AutoparError for a sharding other than a NamedSharding, `global_batch`
  also for a leaf that does not fit it.
- `is_main_process()`: process 0, the only one that writes files.

Design and rationale: docs/internals-planning.md, "autopar/distributed.py".
"""
from __future__ import annotations

import hashlib
import json
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Iterable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autopar.decisions import Decisions
from autopar.errors import AutoparError

MULTIPROCESS_FIX = ("Fix: call the step on every process with the same global shapes, static "
                    "values and options; pass a per-process batch as a global array built by "
                    "autopar.global_batch(local_batch, step.input_shardings(...)) (README, "
                    "'Several processes').")


def multiprocess() -> bool:
    return jax.process_count() > 1


def is_main_process() -> bool:
    """Process 0: the one that writes files and logs."""
    return jax.process_index() == 0


def agree(subject: str, items: Sequence[tuple[str, str]]) -> None:
    """Check that every process holds the same (name, description) items; where not, raise on
    every process the same AutoparError naming the first item that differs. One all-gather of
    a digest when they agree; nothing at all in a single process."""
    if not multiprocess():
        return
    items = [(str(name), str(description)) for name, description in items]
    text = json.dumps(items).encode()
    digests = _allgather(np.frombuffer(hashlib.blake2b(text, digest_size=16).digest(), np.uint8))
    if (digests == digests[0]).all():
        return
    lengths = _allgather(np.array([len(text)], np.int64))[:, 0]
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:len(text)] = np.frombuffer(text, np.uint8)
    texts = _allgather(padded)
    per_process = [dict(json.loads(bytes(row[:n]).decode()))
                   for row, n in zip(texts, lengths)]
    raise AutoparError(disagreement(subject, per_process))


def disagreement(subject: str, per_process: list[dict[str, str]]) -> str:
    """The first item whose description is not the same on every process, by process."""
    names: list[str] = []
    for items in per_process:
        names += [n for n in items if n not in names]
    for name in names:
        seen = [items.get(name) for items in per_process]
        if len(set(seen)) > 1:
            by_process = "; ".join(f"process {p}: {d if d is not None else '(absent)'}"
                                   for p, d in enumerate(seen))
            return (f"the {len(per_process)} processes disagree on {subject}: {name!r} differs "
                    f"({by_process}). Each process must plan and run the same program. "
                    f"{MULTIPROCESS_FIX}")
    return f"the processes disagree on {subject}. {MULTIPROCESS_FIX}"  # only the order differs


def _allgather(x: np.ndarray) -> np.ndarray:
    """`x` from every process, stacked along a new first axis (process order)."""
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def call_items(options: dict[str, Any], static: Iterable[tuple[str, Any]],
               leaves: Iterable[tuple[str, Any]]) -> list[tuple[str, str]]:
    """What a call's plan depends on, as (name, description) items: versions, options, static
    values (where, value), and each traced leaf (path, value) as its dtype and shape. Built
    only in several processes."""
    if not multiprocess():
        return []
    items = [("autopar version", _installed_version()), ("jax version", jax.__version__)]
    items += [(f"option {name}", _stable(value)) for name, value in options.items()]
    items += [(f"static argument {where}", repr(value)) for where, value in static]
    return items + [(path, describe(x)) for path, x in leaves]


def _installed_version() -> str:
    try:
        return version("autopar")
    except PackageNotFoundError:  # run from a source tree that was not installed
        return "not installed"


def decisions_items(decisions: Decisions) -> list[tuple[str, str]]:
    """A plan's decisions as one digest item (equal inputs must give equal decisions)."""
    if not multiprocess():
        return []
    text = repr((decisions.inputs, [(st.assignment, st.in_specs, st.out_specs, st.partial_axes)
                                    for st in decisions.ops], sorted(decisions.recompute)))
    return [("the plan's decisions (planning nondeterministic: please report it)",
             hashlib.blake2b(text.encode(), digest_size=16).hexdigest())]


def _stable(value: Any) -> str:
    """A description of an option that is the same text in every process for the same value."""
    if hasattr(value, "to_json"):  # a saved Plan, a Hardware profile
        return hashlib.blake2b(value.to_json().encode(), digest_size=16).hexdigest()
    if isinstance(value, jax.sharding.Mesh):
        return f"{dict(value.shape)} devices {[d.id for d in value.devices.flat]}"
    return repr(value)


def describe(x: Any) -> str:
    """An argument leaf's dtype and shape, e.g. float32[16, 8]."""
    return f"{jax.numpy.result_type(x)}{list(jax.numpy.shape(x))}"


def value_digest(a: np.ndarray) -> str:
    """A digest of a host array's dtype, shape and bytes."""
    h = hashlib.blake2b(f"{a.dtype}{a.shape}".encode(), digest_size=8)
    h.update(np.ascontiguousarray(a).tobytes())
    return f"values with digest {h.hexdigest()}"


def is_host_value(x: Any) -> bool:
    """A value this process holds whole: numpy, a Python number, a fully addressable array
    (typed PRNG keys excepted: numpy cannot view them, jax.device_put checks them itself)."""
    if isinstance(x, jax.Array):
        return (x.is_fully_addressable
                and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))
    return not isinstance(x, jax.ShapeDtypeStruct)


def place_everywhere(leaves: Sequence[Any], shardings: Sequence[NamedSharding],
                     moves: Sequence[int], paths: Sequence[str]) -> dict[int, jax.Array]:
    """The leaves at `moves` as global arrays under their shardings. Host values, after the
    processes agree that they are equal, are cut into each process's own shards (no transfer
    between processes); global arrays are resharded by jax.device_put."""
    host = {k: np.asarray(leaves[k]) for k in moves if is_host_value(leaves[k])}
    agree("the values of the step's arguments (a value passed from the host must be the same "
          "on every process)", [(paths[k], value_digest(a)) for k, a in host.items()])
    placed = {k: jax.make_array_from_callback(a.shape, shardings[k], lambda i, a=a: a[i])
              for k, a in host.items()}
    rest = [k for k in moves if k not in placed]
    for k, x in zip(rest, jax.device_put([leaves[k] for k in rest], [shardings[k] for k in rest])):
        placed[k] = x
    return placed


def process_rows(sharding: NamedSharding, rows: int) -> slice | np.ndarray:
    """The rows (first-dimension indices) of a `rows`-row array that this process must load
    for `sharding`, in the order `global_batch` expects them: a slice where they are
    contiguous (the usual case, the batch split over an axis that spans the processes), else
    an index array. Under a sharding that does not split the rows, every process loads them
    all. Use it to shard a dataset: `dataset[process_rows(sharding, len(global_batch))]`."""
    if not isinstance(sharding, NamedSharding):
        raise AutoparError(f"process_rows takes a jax Sharding (a NamedSharding), got "
                           f"{type(sharding).__name__}. Fix: pass one leaf of "
                           "step.input_shardings(*args).")
    first = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[:1]))  # the rows' split
    everything = np.arange(rows)
    covered = np.unique(np.concatenate(
        [everything[index[0]] for index in first.addressable_devices_indices_map((rows,))
         .values()]))
    if len(covered) and covered[-1] - covered[0] + 1 == len(covered):
        return slice(int(covered[0]), int(covered[-1]) + 1)
    return covered


def global_batch(local: Any, shardings: Any, global_shapes: Any = None) -> Any:
    """Global arrays from process-local data: each leaf of `local` holds the rows this process
    loaded (`process_rows`), and `shardings` (a matching tree of NamedSharding, e.g. the batch's
    part of `step.input_shardings(...)`) says how the global array is laid out. `global_shapes`
    (a matching tree of shapes or ShapeDtypeStructs) gives the global shapes where they cannot
    be inferred (rows split unevenly between processes). In one process this is a device_put."""
    leaves, tree = jax.tree_util.tree_flatten(local)
    specs = tree.flatten_up_to(shardings)
    shapes = ([None] * len(leaves) if global_shapes is None else
              [tuple(getattr(s, "shape", s)) for s in tree.flatten_up_to(global_shapes)])
    out = []
    for leaf, sharding, shape in zip(leaves, specs, shapes):
        if not isinstance(sharding, NamedSharding):
            raise AutoparError(f"global_batch needs a NamedSharding for every leaf, got "
                               f"{type(sharding).__name__}. Fix: pass the batch's part of "
                               "step.input_shardings(state, batch).")
        try:
            out.append(jax.make_array_from_process_local_data(sharding, np.asarray(leaf), shape))
        except ValueError as e:
            raise AutoparError(
                f"a process-local leaf of shape {np.shape(leaf)} does not make a global array "
                f"under {sharding.spec} on mesh {dict(sharding.mesh.shape)}: {e}. Fix: load the "
                "rows autopar.process_rows(sharding, global_rows) names, or pass "
                "global_shapes=.") from e
    return jax.tree_util.tree_unflatten(tree, out)
