"""Resharding: the collectives XLA's partitioner turns one sharding of a tensor into another
with, in its order, and their price (`reshard_terms`, `reshard_time`), with the stops the
lowering constrains a resharding to where the partitioner has no pattern (`reshard_stops`).
Where a platform's compiler makes gathers dearer (Hardware.gather_by_sum_from), the sequence
says so; the collectives' own prices are `model`'s."""
from __future__ import annotations

import functools
import math
from typing import Sequence

from autopar.cost.hardware import Hardware, group_link
from autopar.cost.model import MOVED, group_size
from autopar.mesh import MeshShape
from autopar.rules.factors import Spec
from autopar.trace.ir import Tensor


def gathers(src: Spec, dropped: Sequence[str], mesh: MeshShape) -> list[tuple[int, int]]:
    """The all-gathers that drop `dropped` from `src`, as XLA emits them: one per tensor
    dimension losing axes (all its dropped axes at once), the last dimension first; each as
    (the dimension, the factor by which it grows the buffer)."""
    return [(d, n) for d in reversed(range(len(src))) if src[d]
            and (n := group_size(mesh, [a for a in src[d] if a in dropped])) > 1]


@functools.lru_cache(maxsize=1 << 16)
def _changes(src: Spec, dst: Spec) -> tuple[dict, dict, list, list, bool, set]:
    """What a resharding changes: each axis's (dimension, position) in `src` and in `dst`, the
    axes that move (within or across dimensions), those dropped, whether any is added, and
    the (source, destination) dimension pairs the moving axes cross. Cached, and so shared:
    callers read it and never change it."""
    where_src = {a: (d, k) for d, axes in enumerate(src) for k, a in enumerate(axes)}
    where_dst = {a: (d, k) for d, axes in enumerate(dst) for k, a in enumerate(axes)}
    moved = [a for a in where_src if a in where_dst and where_src[a] != where_dst[a]]
    dropped = [a for a in where_src if a not in where_dst]
    added = any(a not in where_src for a in where_dst)
    across = {(where_src[a][0], where_dst[a][0]) for a in moved
              if where_src[a][0] != where_dst[a][0]}
    return where_src, where_dst, moved, dropped, added, across


@functools.lru_cache(maxsize=1 << 20)
def reshard_stops(src: Spec, dst: Spec) -> tuple[Spec, ...]:
    """The shardings a resharding from `src` to `dst` is lowered through, in order (none
    where XLA's partitioner, given the two ends, compiles it as `reshard_sequence` prices).

    Given only the two ends of three kinds of resharding, XLA's partitioner (jax 0.10.2) can
    find no pattern: it gathers the whole tensor and slices, logging "Involuntary full
    rematerialization" (on a 2x4 mesh, every one of the last two kinds and 12 of the 18 of
    the first among the reshardings of a 3-D tensor):
    - axes dropped and others added, the rest in place (layers split over 'data' on one
      dimension becoming split over 'stage' on another);
    - an axis moving to another dimension while another axis leaves the dimension it comes
      from, none added (`P(None, None, ('a', 'b'))` becoming `P('a')`);
    - axes moving from one dimension into two, or from two into one (`P(None, None, ('a',
      'b'))` becoming `P('a', 'b')`).
    Through these stops each step has a pattern: the axes dropped (and, in the last two, the
    moving axes but one dimension's) are gathered, that dimension's axes move in one
    all-to-all (before the gathers where they are the minor axes of their dimension), and the
    axes left to add are sliced locally. Measured on XLA CPU, 8 devices (a, b) = (2, 4): the
    second example on a (2, 4, 8) tensor gathered 256 bytes per device at once, and in steps
    gathers 128 and moves 128 in an all-to-all, without the warning."""
    where_src, where_dst, moved, dropped, added, across = _changes(src, dst)
    if not moved:
        return ((tuple(tuple(a for a in axes if a not in dropped) for axes in src),)
                if dropped and added else ())
    if not ((not added and any(p == where_src[b][0] for p, _ in across for b in dropped))
            or any(p != q and (p[0] == q[0] or p[1] == q[1]) for p in across for q in across)):
        return ()
    p, q = min(across)  # the axes moving from dimension p to q move in one all-to-all
    carried = tuple(a for a in src[p] if a in moved and where_dst[a][0] == q)
    left = [k for k, a in enumerate(src[p]) if a not in carried]
    if left and min(left) < where_src[carried[0]][1]:
        # The carried axes are minor in p: moved first, behind q's axes, the rest in place;
        # then what is left (`P(None, ('data', 'model'))` to `P('model')` on 2x4: an
        # all-to-all over 'model', then an all-gather over 'data').
        first = tuple(tuple(a for a in axes if a not in carried) + (carried if d == q else ())
                      for d, axes in enumerate(src))
        return (first, *reshard_stops(first, dst))
    # The carried axes lead in p: the axes that drop or move elsewhere are gathered first.
    kept = (where_src.keys() - set(dropped) - set(moved)) | set(carried)
    gathered = tuple(tuple(a for a in axes if a in kept) for axes in src)
    arrived = tuple(tuple(a for a in axes if a in kept) for axes in dst)
    return tuple(dict.fromkeys(s for s in (gathered, arrived) if s not in (src, dst)))


@functools.lru_cache(maxsize=1 << 20)
def reshard_sequence(src: Spec, dst: Spec, mesh: MeshShape, gather_by_sum_from: int = 0
                     ) -> tuple[tuple[str, int, float, int, tuple[str, ...]], ...]:
    """The collectives that turn `src` sharding into `dst`, in XLA's order, each as (kind,
    devices in its group, its result's share of the tensor on one device, the dimension an
    all-gather concatenates or -1, the mesh axes of its group): those of each step between
    the stops the lowering constrains to (`reshard_stops`). `gather_by_sum_from`: the
    platform's Hardware.gather_by_sum_from (see `_summed_gathers`)."""
    ends = (src, *reshard_stops(src, dst), dst)
    return tuple(c for a, b in zip(ends, ends[1:])
                 for c in _summed_gathers(_direct_sequence(a, b, mesh), mesh, gather_by_sum_from))


def _summed_gathers(steps: tuple, mesh: MeshShape, gather_by_sum_from: int) -> tuple:
    """`steps` of one resharding, where gathers over several dimensions that together span
    every device of a large enough program are one all-reduce of the gathered result: the TPU
    compiler (libtpu 0.0.42.1) merges them into one gather over all devices, made by a sum.
    On v5p 4x4x4 as (32, 2), (16, 4) and (8, 8), `P('data', 'model')` to `P()` compiles to
    one all-reduce of the whole tensor; XLA CPU gathers axis by axis
    (tests/test_tpu_scatters.py)."""
    gathered = [step for step in steps if step[0] == "all-gather"]
    if (len(gathered) < 2 or len(gathered) != len(steps)
            or not 0 < gather_by_sum_from <= mesh.size
            or math.prod(step[1] for step in gathered) != mesh.size):
        return steps
    axes = tuple(a for step in gathered for a in step[4])
    return (("all-reduce", mesh.size, gathered[-1][2], -1, axes),)


def _direct_sequence(src: Spec, dst: Spec, mesh: MeshShape
                     ) -> tuple[tuple[str, int, float, int, tuple[str, ...]], ...]:
    """`reshard_sequence` of a resharding XLA's partitioner has a pattern for.

    Axes that move (within or across dimensions) are one all-to-all, but for axes only
    reordered within their dimensions (a collective-permute); axes dropped are gathered
    (see `gathers`); axes added are free (each device keeps its slice). The all-to-all comes
    after the all-gathers where an axis changes dimension and none is added (the gathered
    shard moves: `P('data', 'model')` to `P(None, 'data')` on 4x2 compiles to an all-gather
    over 'model', then an all-to-all of the (4, 64) shard), and before them otherwise, where
    the partitioner first permutes shards within a dimension. docs/decisions.md has what
    this was measured against."""
    where_src, where_dst, moved, dropped, added, across = _changes(src, dst)
    share = 1.0 / group_size(mesh, list(where_src))
    if moved and not dropped and not across:
        # Axes reordered within their dimensions (`P('model')` to `P(('data', 'model'))`): a
        # device's new block is not inside its old one, and XLA fetches it whole from the
        # device holding it, one collective-permute of the result's shard (measured on 2x4,
        # XLA CPU, jax 0.10.2: 8 MiB for a 64 MiB tensor, where an all-to-all was priced).
        axes = tuple(a for d in {where_dst[a][0] for a in moved} for a in dst[d])
        return (("collective-permute", 2, 1.0 / group_size(mesh, list(where_dst)), -1, axes),)
    gather_first = not added and bool(across) and bool(moved)
    steps: list[tuple[str, int, float, int, tuple[str, ...]]] = []
    if moved and not gather_first:
        steps.append(("all-to-all", group_size(mesh, moved), share, -1, tuple(moved)))
    for d, n in gathers(src, dropped, mesh):
        share *= n
        steps.append(("all-gather", n, share, d, tuple(a for a in src[d] if a in dropped)))
    if moved and gather_first:
        steps.append(("all-to-all", group_size(mesh, moved), share, -1, tuple(moved)))
    return tuple(steps)


@functools.lru_cache(maxsize=1 << 20)
def reshard_terms(src: Spec, dst: Spec, mesh: MeshShape, hw: Hardware) -> tuple[float, float]:
    """(latency seconds, seconds per byte of the tensor) to turn `src` sharding into `dst`
    (see reshard_sequence), each step on its axes' link, with the layout copies it needs. The
    time is linear in the tensor's size, latency + per_byte * bytes, so these terms serve
    every tensor.
    """
    latency = per_byte = 0.0
    for kind, n, share, dim, axes in reshard_sequence(src, dst, mesh, hw.gather_by_sum_from):
        link = group_link(hw, mesh, axes)
        latency += link.latency
        # Gathering step by step moves the bytes one all-gather over all the axes would.
        if kind == "collective-permute":  # every device receives its whole new shard
            per_byte += share / link.bandwidth
        elif kind == "all-reduce" or kind == "all-gather" and gathered_by_sum(hw, n, mesh):
            per_byte += MOVED["all-reduce"](n) * share / link.bandwidth
        else:
            per_byte += (n - 1) / (2 * n if kind == "all-to-all" else n) * share / link.bandwidth
        if kind == "all-gather" and dim > 0:
            # XLA gathers another dimension than the first in a layout that makes it major,
            # then copies the result back (read and written once). Seen on XLA CPU 0.10.2,
            # where a mixture of experts' tokens gathered over the sequence dimension paid 8
            # such copies; taken to hold elsewhere until measured. A gathered tensor whose
            # leading dimensions are 1 on each device needs none: rare, not told apart.
            per_byte += 2 * share / hw.memory_bandwidth
    return latency, per_byte


def gathered_by_sum(hw: Hardware, n: int, mesh: MeshShape) -> bool:
    """Whether `hw`'s compiler makes an all-gather over `n` devices of `mesh` an all-reduce
    (over every device of a large enough program: Hardware.gather_by_sum_from)."""
    return 0 < hw.gather_by_sum_from <= n == mesh.size


def reshard_collectives(tensor: Tensor, src: Spec, dst: Spec, mesh: MeshShape, hw: Hardware
                        ) -> dict[str, float]:
    """Bytes of each collective's result on one device when `src` becomes `dst`, by kind: the
    steps of reshard_sequence on `hw`'s platform, in the units a compiled program's
    collectives are read in."""
    out: dict[str, float] = {}
    for kind, _, share, _, _ in reshard_sequence(src, dst, mesh, hw.gather_by_sum_from):
        out[kind] = out.get(kind, 0.0) + tensor.nbytes * share
    return out


def reshard_time(tensor: Tensor, src: Spec, dst: Spec, mesh: MeshShape, hw: Hardware) -> float:
    """Seconds to turn `tensor` sharded as `src` into `dst` (see reshard_terms)."""
    latency, per_byte = reshard_terms(src, dst, mesh, hw)
    return latency + per_byte * tensor.nbytes
