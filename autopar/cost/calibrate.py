"""Calibration: a hardware profile measured on the mesh's own devices.

Each mesh axis gets its own link, fitted to the cost model's own formulas
(`model.collective_time`: alpha + MOVED[kind](n) * result bytes / beta) from timed collectives
over that axis alone, so that the planner charges collectives what they cost here.
"""
from __future__ import annotations

import datetime
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from autopar.cost.hardware import PROFILES, Hardware, LinkLevel, default_profile_name
from autopar.cost.model import MOVED
from autopar.errors import AutoparError

# Bytes each device holds before the collective: small enough that all of them take a few
# seconds on 8 simulated CPU devices, large enough that bandwidth, not latency, dominates the
# largest. On GPUs and TPUs pass larger sizes (e.g. up to 256 MiB) to reach full bandwidth.
DEFAULT_SIZES = (4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20)
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


class Fit(NamedTuple):
    latency: float  # alpha, seconds
    bandwidth: float  # beta, bytes per second
    note: str = ""  # what was assumed where the measurements could not say


class Sample(NamedTuple):
    axis: str
    kind: str
    nbytes: int  # what each device holds before the collective
    result_bytes: int  # what it holds after: the unit collective_time is charged in
    seconds: float  # best of the repeats, launch included


@dataclass(frozen=True)
class Calibration:
    """Everything `measure` found; `hardware` is what the planner uses."""

    hardware: Hardware
    samples: tuple[Sample, ...]
    axis_fits: dict[str, Fit]  # all kinds jointly: the links of `hardware`
    kind_fits: dict[tuple[str, str], Fit]  # (axis, kind): each kind alone, for inspection
    flops: dict[str, float]  # matmul flop/s of one device (all working at once), per dtype
    memory_bandwidth: float
    launch_seconds: float  # an empty program's time, taken off every collective's alpha


def calibrate(mesh: Mesh, *, sizes: Sequence[int] | None = None, repeats: int = 5,
              dtypes: Sequence[str] = ("float32", "bfloat16"), progress: bool = True,
              path: str | os.PathLike | None = None) -> Hardware:
    """A profile measured on `mesh`'s devices, usable as `hardware=`; saved as JSON at `path`.

    For each axis of size > 1: all-reduce, all-gather, reduce-scatter, all-to-all and a ring
    collective-permute over that axis alone at each of `sizes` (bytes per device), best of
    `repeats`; alpha and beta fitted to the cost model's formulas, one link level per axis
    ('axis:<name>', innermost axis first, which is the order the default placement fills
    levels in for other meshes). `flops` is the best matmul rate among `dtypes`: the dtype
    one would train in (bfloat16 on GPUs and TPUs, float32 on CPUs, where bfloat16 is
    emulated). Every process runs the measurements (they are collective) and gets process 0's
    numbers; only process 0 prints progress and writes `path`.
    """
    result = measure(mesh, sizes=sizes, repeats=repeats, dtypes=dtypes, progress=progress)
    if path is not None and jax.process_index() == 0:
        result.hardware.save(path)
    return result.hardware


def measure(mesh: Mesh, *, sizes: Sequence[int] | None = None, repeats: int = 5,
            dtypes: Sequence[str] = ("float32", "bfloat16"), progress: bool = True) -> Calibration:
    """`calibrate`'s measurements and fits in full: samples, per-kind fits, flops per dtype."""
    sizes, dtypes = _checked(mesh, sizes, repeats, dtypes)
    axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
    bar = _Progress(len(axes) * len(KINDS) * len(sizes) + len(dtypes) + 2,
                    progress and jax.process_index() == 0)
    timer = _Timer(mesh, repeats)
    bar.step("launch overhead")
    launch = timer.time(lambda x: x * 2, DEFAULT_SIZES[0] // 4, jnp.float32)
    samples = []
    for axis in axes:
        n = mesh.shape[axis]
        for kind in KINDS:
            for nbytes in sizes:
                bar.step(f"{axis} {kind} {_human(nbytes)}")
                elems = max(n, nbytes // 4 // n * n)  # float32, divisible for scatters
                seconds = timer.time(_collective(kind, axis, n), elems, jnp.float32)
                result = {"all-gather": n * elems, "reduce-scatter": elems // n}.get(kind, elems)
                samples.append(Sample(axis, kind, elems * 4, result * 4, seconds))
    flops = {}
    k = 512 if mesh.devices.flat[0].platform == "cpu" else 4096
    for dtype in dtypes:
        bar.step(f"matmul {dtype}")
        flops[dtype] = 2 * k**3 / timer.time(lambda a: a @ a, (k, k), dtype)
    bar.step("memory copy")
    copy_bytes = (16 if mesh.devices.flat[0].platform == "cpu" else 256) * 2**20
    memory_bandwidth = 2 * copy_bytes / timer.time(lambda x: x * 2, copy_bytes // 4, jnp.float32)
    bar.done()
    # Every process plans with the same numbers: process 0's.
    times = _agree(np.array([launch, *(s.seconds for s in samples), *flops.values(),
                             memory_bandwidth]))
    launch, memory_bandwidth = float(times[0]), float(times[-1])
    samples = [s._replace(seconds=float(t)) for s, t in zip(samples, times[1:])]
    flops = dict(zip(flops, map(float, times[1 + len(samples):-1])))
    axis_fits = {a: fit([s for s in samples if s.axis == a], mesh.shape[a], launch) for a in axes}
    kind_fits = {(a, kind): fit([s for s in samples if s.axis == a and s.kind == kind],
                                mesh.shape[a], launch) for a in axes for kind in KINDS}
    hardware = _hardware(mesh, axes, axis_fits, kind_fits, flops, memory_bandwidth, launch,
                         sizes, repeats)
    return Calibration(hardware, tuple(samples), axis_fits, kind_fits, flops, memory_bandwidth,
                       launch)


def fit(samples: Sequence[Sample], n: int, launch: float) -> Fit:
    """Alpha and beta of seconds = alpha + MOVED[kind](n) * result_bytes / beta, by least
    squares of the relative error (plain least squares would let the largest messages decide
    alone, and latency is what the small ones measure); alpha less the `launch` time that a
    compiled step pays once, not per collective. Non-positive values mean the measurements are
    noise there: beta then falls back to the largest message's effective rate, alpha to the
    default profile's, and the note says so."""
    moved = np.array([MOVED[s.kind](n) * s.result_bytes for s in samples], float)
    seconds = np.array([s.seconds for s in samples], float)
    rows = np.stack([1 / seconds, moved / seconds], axis=1)
    (alpha, inverse_beta), *_ = np.linalg.lstsq(rows, np.ones_like(seconds), rcond=None)
    notes = []
    if inverse_beta <= 0:
        largest = int(np.argmax(moved))
        inverse_beta = seconds[largest] / moved[largest]
        notes.append("time did not grow with size: beta is the largest message's rate")
        alpha = float(np.min(seconds))
    elif alpha <= 0:  # refit through the origin: the slope alone
        inverse_beta = float(np.sum(moved / seconds) / np.sum((moved / seconds) ** 2))
    alpha -= launch
    if alpha <= 0:
        alpha = PROFILES[default_profile_name()].link_latency
        notes.append("no latency beyond the launch: alpha is the default profile's")
    return Fit(float(alpha), float(1 / inverse_beta), "; ".join(notes))


def _hardware(mesh: Mesh, axes: list[str], axis_fits: dict[str, Fit],
              kind_fits: dict[tuple[str, str], Fit], flops: dict[str, float],
              memory_bandwidth: float, launch: float, sizes: Sequence[int],
              repeats: int) -> Hardware:
    base = PROFILES[default_profile_name()]
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()][0]
    stats = local.memory_stats() or {}
    levels, spanned = [], 1
    for axis in reversed(axes):  # innermost first; the outermost joins any number of devices
        spanned *= mesh.shape[axis]
        level_devices = spanned if axis != axes[0] else 0
        f = axis_fits[axis]
        levels.append(LinkLevel(f"axis:{axis}", level_devices, f.bandwidth, f.latency))
    fastest = max(levels, key=lambda lv: lv.bandwidth, default=None)
    lines = [
        f"calibrated by autopar.calibrate() on {mesh.devices.size} {local.device_kind} "
        f"devices ({local.platform}, {jax.process_count()} process(es)), jax {jax.__version__}, "
        f"{datetime.date.today().isoformat()}; mesh {dict(mesh.shape)}; float32 collectives "
        f"of {_human(min(sizes))}..{_human(max(sizes))} per device, best of {repeats}, alpha "
        f"less a {launch * 1e6:.0f} us program launch."]
    for axis in axes:
        f = axis_fits[axis]
        each = ", ".join(f"{kind} {kf.latency:.2e} s {kf.bandwidth:.2e} B/s"
                         for (a, kind), kf in kind_fits.items() if a == axis)
        lines.append(f"axis {axis} (n={mesh.shape[axis]}): alpha {f.latency:.2e} s, beta "
                     f"{f.bandwidth:.2e} B/s{' (' + f.note + ')' if f.note else ''}; "
                     f"each kind alone: {each}.")
    best = max(flops, key=flops.get)
    lines.append("matmul " + ", ".join(f"{d} {v:.2e} flop/s" for d, v in flops.items())
                 + f" per device, all devices at once (flops: {best}'s, the fastest); copy "
                 f"{memory_bandwidth:.2e} B/s.")
    if not axes:
        lines.append(f"No mesh axis of size > 1: links are the {base.name!r} profile's.")
    if "bytes_limit" not in stats:
        lines.append(f"memory_bytes: the {base.name!r} profile's (the runtime gives none).")
    return Hardware(
        "calibrated", flops=flops[best], memory_bandwidth=memory_bandwidth,
        link_bandwidth=fastest.bandwidth if fastest else base.link_bandwidth,
        link_latency=fastest.latency if fastest else base.link_latency,
        memory_bytes=int(stats.get("bytes_limit") or base.memory_bytes), source="\n".join(lines),
        levels=tuple(levels), axis_levels=tuple((a, f"axis:{a}") for a in axes),
        platform=local.platform)


def _collective(kind: str, axis: str, n: int) -> Callable:
    """One collective over `axis` on each device's (1, elems) block."""
    return {
        "all-reduce": lambda x: jax.lax.psum(x, axis),
        "all-gather": lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True),
        "reduce-scatter": lambda x: jax.lax.psum_scatter(x, axis, scatter_dimension=1, tiled=True),
        "all-to-all": lambda x: jax.lax.all_to_all(x, axis, 1, 1, tiled=True),
        "collective-permute": lambda x: jax.lax.ppermute(
            x, axis, [(i, (i + 1) % n) for i in range(n)]),
    }[kind]


class _Timer:
    """Best-of-`repeats` seconds of a per-device function over the whole mesh, compiled once
    and warmed up; inputs made sharded by a jitted constructor, so it works across processes."""

    def __init__(self, mesh: Mesh, repeats: int) -> None:
        self.mesh, self.repeats = mesh, repeats
        self.every = P(tuple(mesh.axis_names))

    def time(self, body: Callable, block: int | tuple[int, int], dtype) -> float:
        """`block`: each device's elements (a (1, block) row) or its (rows, columns)."""
        rows, columns = (1, block) if isinstance(block, int) else block
        shape = (self.mesh.devices.size * rows, columns)
        x = jax.jit(lambda: jnp.ones(shape, dtype),
                    out_shardings=NamedSharding(self.mesh, self.every))()
        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=self.every,
                                  out_specs=self.every))
        f(x).block_until_ready()
        best = math.inf
        for _ in range(self.repeats):
            start = time.perf_counter()
            f(x).block_until_ready()
            best = min(best, time.perf_counter() - start)
        return best


def _agree(values: np.ndarray) -> np.ndarray:
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.broadcast_one_to_all(values))


class _Progress:
    def __init__(self, total: int, on: bool) -> None:
        self.total, self.on, self.done_steps = total, on, 0

    def step(self, label: str) -> None:
        self.done_steps += 1
        if self.on:
            print(f"\r[calibrate] {label:<36} {self.done_steps}/{self.total}", end="",
                  file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.on:
            print(f"\r[calibrate] done{' ' * 36} {self.total}/{self.total}", file=sys.stderr)


def _human(nbytes: int) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def _checked(mesh, sizes, repeats, dtypes) -> tuple[tuple[int, ...], tuple]:
    if not isinstance(mesh, Mesh):
        raise AutoparError(
            f"calibrate needs a jax Mesh of real devices, got {type(mesh).__name__} {mesh!r}. "
            "Fix: pass autopar.make_mesh({'data': 2, 'model': 4}) (an AbstractMesh or a dict "
            "has no devices to time).")
    sizes = tuple(DEFAULT_SIZES if sizes is None else sizes)
    if len(set(sizes)) < 2 or any(not isinstance(s, int) or s < 4 for s in sizes):
        raise AutoparError(
            f"calibrate sizes={sizes!r}: a line needs at least two distinct message sizes. Fix: "
            "pass integers of at least 4 bytes per device, e.g. (4096, 65536, 1048576).")
    if not isinstance(repeats, int) or repeats < 1:
        raise AutoparError(f"calibrate repeats={repeats!r}. Fix: pass a positive integer.")
    try:
        kinds = tuple(jnp.dtype(d) for d in dtypes)
    except TypeError as e:
        raise AutoparError(f"calibrate dtypes={dtypes!r}: {e}. Fix: use names such as "
                           "'float32', 'bfloat16'.") from None
    if not kinds or any(not jnp.issubdtype(d, jnp.floating) for d in kinds):
        raise AutoparError(f"calibrate dtypes={dtypes!r}. Fix: give at least one floating "
                           "dtype, such as 'float32' or 'bfloat16'.")
    return tuple(sorted(sizes)), tuple(d.name for d in kinds)
