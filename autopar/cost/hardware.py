"""Hardware profiles: data with their sources, or measured on the machine at hand.

A profile's links come in levels, fastest first: NVLink inside a node, then the network
between nodes. A mesh's axes sit on those levels, by default the innermost (last) axes on the
fastest level while the devices they span fit in it (`axis_links`); a collective over several
axes runs at the slowest of their links.
"""
from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import asdict, dataclass, fields
from typing import Any

from autopar.errors import AutoparError
from autopar.mesh import MeshShape


@dataclass(frozen=True)
class Link:
    """What a collective step costs on one kind of link: alpha and 1/beta."""

    latency: float  # seconds of fixed cost per collective step
    bandwidth: float  # bytes per second one device sends


@dataclass(frozen=True)
class LinkLevel:
    """One level of the interconnect: the devices it joins and each device's link there."""

    name: str
    devices: int  # devices joined at this level, those of the levels below included; 0: any
    bandwidth: float  # bytes per second one device sends
    latency: float  # seconds of fixed cost per collective step


@dataclass(frozen=True)
class Hardware:
    """What the cost model needs to know about one device and the links between devices.

    `link_bandwidth` and `link_latency` describe the fastest links; `levels` (fastest first)
    adds the slower ones, and `axis_levels` ((axis name, level name) pairs) places mesh axes
    on levels by hand where the default placement (innermost axes on the fastest level) is
    not how the devices are wired."""

    name: str
    flops: float  # peak floating-point operations per second of one device (training dtype)
    memory_bandwidth: float  # bytes per second between a device and its memory
    link_bandwidth: float  # bytes per second one device sends in a collective
    link_latency: float  # seconds of fixed cost per collective step (alpha)
    memory_bytes: int  # memory of one device
    source: str = ""
    levels: tuple[LinkLevel, ...] = ()
    axis_levels: tuple[tuple[str, str], ...] = ()
    # The compiler's platform ('cpu', 'gpu', 'tpu'): where no devices are at hand (an abstract
    # mesh), the memory estimate models this platform's buffers (autopar.cost.xla).
    platform: str = "cpu"
    # From this many devices on, the compiler gathers over every device of the program with
    # an all-reduce of the gathered tensor (zeros but its own shard) rather than an
    # all-gather: twice the bus bytes. 0: never. The TPU compiler does from 64 (libtpu
    # 0.0.42.1: v5p 4x4x4 and 4x4x8, v5e 8x8; 32 chips and fewer, or a group of 64 in 128,
    # all-gather; tests/test_tpu_scatters.py).
    gather_by_sum_from: int = 0
    # From this many devices on, a reduce-scatter over every device of the program is an
    # all-reduce of the whole result, sliced after: twice the bus bytes. 0: never. The TPU
    # compiler does from 8 chips on v5p and 16 on v5e and v6e, at every size tried (libtpu
    # 0.0.42.1; 4 and 8 reduce-scatter but for a few sizes; a group of fewer than all devices
    # reduce-scatters; tests/test_tpu_scatters.py). v4 is not measured (its compile-only devices are
    # cores, not chips), so 0.
    scatter_by_sum_from: int = 0
    # A reduce-scatter of bfloat16 along a result's last dimension that leaves each device
    # this many of it is an all-reduce of the whole result, sliced after. 0: never.
    # The TPU compiler does at 128, its vector lanes (libtpu 0.0.42.1: v5p 2x2x1 to 4x4x4
    # over groups of 2 to 32 chips, v5e 2x4 and 4x4, v6e 2x4; 32, 64, 256 or 512 left, float32,
    # or another dimension reduce-scatter; tests/test_tpu_scatters.py). v4 is not measured (its
    # compile-only devices are cores), so 0.
    scatter_by_sum_lanes: int = 0
    # A reduce-scatter along a dimension that the result's layout puts neither first (most
    # major) nor among its two tiled, minor-most dimensions is an all-reduce of the whole
    # result, sliced after. A dot's result is laid out batch dimensions first, then each
    # operand's free dimensions but its last, then the two last (`cost.model.result_order`).
    # The TPU compiler does so (libtpu 0.0.42.1, v5p 2x2x2, v5e 2x4, v6e 2x4: the heads of a
    # [batch, seq, heads, head_dim] projection, the kv heads and groups of a
    # [b, s, kv, groups, d] one, the heads of [b, heads, q, k] scores; a rank-3 result has
    # no dimension inside, and none tried was all-reduced but by the lanes' rule above;
    # tests/test_tpu_scatters.py). v4 is not measured (its compile-only devices are cores),
    # so False.
    scatter_by_sum_inner: bool = False
    # The element types the compiler reduce-scatters; a reduce-scatter of any other is an
    # all-reduce of the whole result, sliced after. Empty: every type. The TPU compiler
    # reduce-scatters float32 and bfloat16 alone (libtpu 0.0.42.1, v5p 2x2x2 and v5e 2x4:
    # float16, int8, int16, int32 and uint32 all-reduced whatever is left on each device, along
    # either dimension; tests/test_tpu_scatters.py).
    scatters_only: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        rates = {"flops": self.flops, "memory_bandwidth": self.memory_bandwidth,
                 "link_bandwidth": self.link_bandwidth, "memory_bytes": self.memory_bytes,
                 **{f"levels[{k}].bandwidth": lv.bandwidth for k, lv in enumerate(self.levels)}}
        delays = {"link_latency": self.link_latency,
                  **{f"levels[{k}].latency": lv.latency for k, lv in enumerate(self.levels)},
                  **{f"levels[{k}].devices": lv.devices for k, lv in enumerate(self.levels)}}
        wrong = [f"{k} = {v!r} (must be > 0)" for k, v in rates.items() if not _number(v) > 0]
        wrong += [f"{k} = {v!r} (must be >= 0)" for k, v in delays.items() if not _number(v) >= 0]
        if wrong:
            raise AutoparError(f"hardware profile {self.name!r}: {'; '.join(wrong)}. Fix: give "
                               "the device's measured or published figures (bytes, seconds, "
                               "FLOP/s), or autopar.calibrate(mesh).")

    # The cost model's caches key on the profile millions of times per plan: hash it once.
    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    def __getstate__(self) -> dict:  # a string's hash differs between processes: not pickled
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def link_levels(self) -> tuple[LinkLevel, ...]:
        """The levels, fastest first; one level of any size where the profile gives none."""
        return self.levels or (LinkLevel("link", 0, self.link_bandwidth, self.link_latency),)

    def to_json(self) -> str:
        """Every field as JSON; `Hardware.from_json` / `load_hardware` read it back equal."""
        return json.dumps({"format": HARDWARE_FORMAT, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "Hardware":
        """The profile `to_json` wrote (KeyError, TypeError, ValueError on a malformed one)."""
        body = json.loads(text)  # a hand-written profile may leave out 'format'
        if not isinstance(body, dict) or body.pop("format", HARDWARE_FORMAT) != HARDWARE_FORMAT:
            raise ValueError(f"not an autopar hardware profile ('format': {HARDWARE_FORMAT!r})")
        levels = tuple(LinkLevel(str(lv["name"]), int(lv["devices"]), float(lv["bandwidth"]),
                                 float(lv["latency"])) for lv in body.pop("levels", ()))
        placed = tuple((str(axis), str(level)) for axis, level in body.pop("axis_levels", ()))
        numbers = {k: float(body.pop(k)) for k in
                   ("flops", "memory_bandwidth", "link_bandwidth", "link_latency")}
        name, memory = body.pop("name"), body.pop("memory_bytes")
        if not isinstance(name, str) or isinstance(memory, bool) or not isinstance(memory, int):
            raise ValueError(f"name {name!r} must be a string and memory_bytes {memory!r} an "
                             "integer")
        return cls(name=name, memory_bytes=memory,
                   gather_by_sum_from=int(body.pop("gather_by_sum_from", 0)),
                   scatter_by_sum_from=int(body.pop("scatter_by_sum_from", 0)),
                   scatter_by_sum_lanes=int(body.pop("scatter_by_sum_lanes", 0)),
                   scatter_by_sum_inner=bool(body.pop("scatter_by_sum_inner", False)),
                   scatters_only=tuple(str(t) for t in body.pop("scatters_only", ())),
                   levels=levels, axis_levels=placed, **numbers,
                   **{k: str(v) for k, v in body.items()})  # source, platform; else TypeError

    def save(self, path: "str | os.PathLike") -> None:
        with open(path, "w") as f:
            f.write(self.to_json())


HARDWARE_FORMAT = "autopar.hardware/1"


def _number(v: Any) -> float:
    """`v` as a finite number; NaN (which compares false) where it is none."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) != float("inf")
    return float(v) if ok else float("nan")


def load_hardware(path: "str | os.PathLike") -> Hardware:
    """A profile saved by `Hardware.save` (or `autopar.calibrate(..., path=)`)."""
    try:
        with open(path) as f:
            return Hardware.from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise AutoparError(
            f"cannot read the hardware profile {os.fspath(path)!r}: {type(e).__name__}: {e}. "
            "Fix: pass the path of a file written by Hardware.save() or "
            "autopar.calibrate(mesh, path=...), or a profile name.") from None


@functools.lru_cache(maxsize=256)
def axis_links(hw: Hardware, mesh: MeshShape) -> tuple[Link, ...]:
    """The link of each mesh axis. Walking from the innermost axis outwards, an axis sits on
    the fastest level that still holds all the devices of the axes walked so far (8 GPUs of a
    node: a (4, 2) mesh's both axes, a (16, 8) mesh's second only); `hw.axis_levels` overrides."""
    levels = hw.link_levels()
    by_name = {level.name: level for level in levels}
    chosen = dict(hw.axis_levels)
    unknown = sorted(set(chosen.values()) - set(by_name))
    if unknown:
        raise AutoparError(
            f"hardware {hw.name!r} places mesh axes on link levels {unknown} it does not have. "
            f"Fix: use level names from {sorted(by_name)} in axis_levels.")
    out: list[Link] = []
    spanned = 1
    for name, size in reversed(list(zip(mesh.names, mesh.sizes))):
        spanned *= size
        level = by_name[chosen[name]] if name in chosen else next(
            (lv for lv in levels if lv.devices == 0 or spanned <= lv.devices), levels[-1])
        out.append(Link(level.latency, level.bandwidth))
    return tuple(reversed(out))


@functools.lru_cache(maxsize=4096)
def group_link(hw: Hardware, mesh: MeshShape, axes: tuple[str, ...]) -> Link:
    """The link of a collective over `axes`: its slowest member's (the largest latency, the
    smallest bandwidth); the fastest level's for a group of no axes."""
    links = axis_links(hw, mesh)
    chosen = [links[mesh.names.index(a)] for a in axes if mesh.axis_size(a) > 1]
    if not chosen:
        return Link(hw.link_latency, hw.link_bandwidth)
    return Link(max(k.latency for k in chosen), min(k.bandwidth for k in chosen))


TPU_SCATTERED = ("float32", "bfloat16")  # Hardware.scatters_only of the TPU profiles

PROFILES: dict[str, Hardware] = {
    "cpu": Hardware(
        "cpu", flops=5e10, memory_bandwidth=1e10, link_bandwidth=5e9, link_latency=2e-5,
        memory_bytes=4 * 2**30,
        source="Simulated host devices sharing one CPU: order-of-magnitude figures for a laptop "
               "or CI core; use measure_host() for this machine's own numbers."),
    "a100": Hardware(
        "a100", flops=312e12, memory_bandwidth=2.039e12, link_bandwidth=300e9, link_latency=5e-6,
        platform="gpu", memory_bytes=80 * 2**30,
        levels=(LinkLevel("nvlink", 8, 300e9, 5e-6), LinkLevel("network", 0, 25e9, 1e-5)),
        source="NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s dense bf16, 2,039 GB/s HBM2e, "
               "NVLink 600 GB/s bidirectional (300 GB/s each way) among the 8 GPUs of a node; "
               "DGX A100: one 200 Gb/s HDR InfiniBand port per GPU between nodes (25 GB/s)."),
    "h100": Hardware(
        "h100", flops=989e12, memory_bandwidth=3.35e12, link_bandwidth=450e9, link_latency=5e-6,
        platform="gpu", memory_bytes=80 * 2**30,
        levels=(LinkLevel("nvlink", 8, 450e9, 5e-6), LinkLevel("network", 0, 50e9, 1e-5)),
        source="NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 900 "
               "GB/s bidirectional (450 GB/s each way) among the 8 GPUs of a node; DGX H100: "
               "one 400 Gb/s NDR InfiniBand port per GPU between nodes (50 GB/s)."),
    "tpu_v4": Hardware(
        "tpu_v4", flops=275e12, memory_bandwidth=1.2e12, link_bandwidth=45e9 * 2, link_latency=1e-5,
        platform="tpu", gather_by_sum_from=64, memory_bytes=32 * 2**30,
        levels=(LinkLevel("ici", 4096, 90e9, 1e-5), LinkLevel("dcn", 0, 6.25e9, 5e-5)),
        source="Google Cloud TPU v4 documentation: 275 TFLOP/s bf16, 32 GiB HBM at 1,200 GB/s; "
               "ICI links of ~45 GB/s each way, two per mesh axis (torus), across a pod of up "
               "to 4,096 chips; between slices the data-centre network, taken as 200 Gb/s per "
               "4-chip host (6.25 GB/s per chip: an assumption, measure with your cluster)."),
    "tpu_v5p": Hardware(
        "tpu_v5p", flops=459e12, memory_bandwidth=2.765e12, link_bandwidth=90e9 * 2,
        link_latency=1e-5, platform="tpu", gather_by_sum_from=64, scatter_by_sum_from=8,
        scatter_by_sum_lanes=128, scatter_by_sum_inner=True, scatters_only=TPU_SCATTERED,
        memory_bytes=95 * 10**9,
        levels=(LinkLevel("ici", 8960, 180e9, 1e-5), LinkLevel("dcn", 0, 6.25e9, 5e-5)),
        source="Google Cloud TPU v5p documentation: 459 TFLOP/s bf16, 95 GB HBM2e at 2,765 "
               "GB/s, ICI 4,800 Gb/s per chip (twice v4's), pods of up to 8,960 chips; between "
               "slices taken as v4's data-centre network (an assumption)."),
    "tpu_v5e": Hardware(
        "tpu_v5e", flops=197e12, memory_bandwidth=819e9, link_bandwidth=50e9 * 2,
        link_latency=1e-5, platform="tpu", gather_by_sum_from=64, scatter_by_sum_from=16,
        scatter_by_sum_lanes=128, scatter_by_sum_inner=True, scatters_only=TPU_SCATTERED,
        memory_bytes=16 * 10**9,
        levels=(LinkLevel("ici", 256, 100e9, 1e-5), LinkLevel("dcn", 0, 3.125e9, 5e-5)),
        source="Google Cloud TPU v5e documentation: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, "
               "400 GB/s of bidirectional ICI per chip over 4 ports of a 2D torus (50 GB/s each "
               "way a port, two per mesh axis), pods of 256 chips; between slices 2 x 100 Gb/s "
               "NICs per 8-chip host (3.125 GB/s per chip)."),
    "tpu_v6e": Hardware(
        "tpu_v6e", flops=918e12, memory_bandwidth=1638e9, link_bandwidth=100e9 * 2,
        link_latency=1e-5, platform="tpu", gather_by_sum_from=64, scatter_by_sum_from=16,
        scatter_by_sum_lanes=128, scatter_by_sum_inner=True, scatters_only=TPU_SCATTERED,
        memory_bytes=32 * 10**9,
        levels=(LinkLevel("ici", 256, 200e9, 1e-5), LinkLevel("dcn", 0, 3.125e9, 5e-5)),
        source="Google Cloud TPU v6e (Trillium) documentation: 918 TFLOP/s bf16, 32 GB HBM at "
               "1,638 GB/s, 800 GB/s of bidirectional ICI per chip over 4 ports of a 2D torus "
               "(100 GB/s each way a port, two per mesh axis), pods of 256 chips; between "
               "slices taken as v5e's data-centre network (an assumption)."),
}

# jax's device_kind of each TPU generation -> its profile. TPU v4's compile-only topologies
# list each chip's two TensorCores as devices; the profile is a chip's.
TPU_KINDS = {"tpu v4": "tpu_v4", "tpu v5 lite": "tpu_v5e", "tpu v5e": "tpu_v5e",
             "tpu v5": "tpu_v5p", "tpu v5p": "tpu_v5p", "tpu v6 lite": "tpu_v6e",
             "tpu v6e": "tpu_v6e"}


def get_profile(hardware: "str | os.PathLike | Hardware | None", device: Any = None
                ) -> Hardware:
    """A profile by name, from a JSON file (a path to an existing file, or one ending in
    '.json'), the given one, or (None) the one matching `device` (by default jax's first)."""
    if isinstance(hardware, Hardware):
        return hardware
    if hardware is None:
        hardware = default_profile_name(device)
    if isinstance(hardware, str) and hardware in PROFILES:
        return PROFILES[hardware]
    if isinstance(hardware, os.PathLike) or (isinstance(hardware, str) and (
            hardware.endswith(".json") or os.path.isfile(hardware))):
        return load_hardware(hardware)
    raise AutoparError(
        f"unknown hardware profile {hardware!r}. Fix: use one of {sorted(PROFILES)}, the path "
        "of a JSON profile (autopar.calibrate(mesh, path=...)), or pass an autopar.Hardware(...) "
        "with your device's numbers.")


def default_profile_name(device: Any = None) -> str:
    """The profile of `device` (a jax Device; by default jax's first) by its platform and
    kind. A TPU of a kind not listed in TPU_KINDS gets 'tpu_v4', a GPU other than an H100 or
    H200 'a100'."""
    import jax

    device = jax.devices()[0] if device is None else device
    kind = getattr(device, "device_kind", "").lower()
    if device.platform == "tpu":
        return TPU_KINDS.get(kind, "tpu_v4")
    if device.platform == "gpu":
        return "h100" if "h100" in kind or "h200" in kind else "a100"
    return "cpu"


def measure_host(size: int = 1024, repeats: int = 5) -> Hardware:
    """A profile measured on jax's first device: a float32 matmul and a large copy.

    Link figures stay those of the 'cpu' profile: simulated devices share memory, so there is
    no link to measure.
    """
    import jax
    import jax.numpy as jnp

    a = jnp.ones((size, size), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    copy = jax.jit(lambda x: x * 2.0)
    big = jnp.ones((64 * 2**20 // 4,), jnp.float32)
    matmul(a).block_until_ready()
    copy(big).block_until_ready()
    best_mm = best_cp = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        matmul(a).block_until_ready()
        best_mm = min(best_mm, time.perf_counter() - t)
        t = time.perf_counter()
        copy(big).block_until_ready()
        best_cp = min(best_cp, time.perf_counter() - t)
    base = PROFILES["cpu"]
    return Hardware("measured", flops=2 * size**3 / best_mm,
                    memory_bandwidth=2 * big.nbytes / best_cp,
                    link_bandwidth=base.link_bandwidth, link_latency=base.link_latency,
                    memory_bytes=base.memory_bytes, platform=jax.devices()[0].platform,
                    source=f"measured on {jax.devices()[0].device_kind} by measure_host()")
