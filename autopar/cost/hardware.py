"""Hardware profiles: data with their sources, or measured on the machine at hand."""
from __future__ import annotations

import time
from dataclasses import dataclass

from autopar.errors import AutoparError


@dataclass(frozen=True)
class Hardware:
    """What the cost model needs to know about one device and the links between devices."""

    name: str
    flops: float  # peak floating-point operations per second of one device (training dtype)
    memory_bandwidth: float  # bytes per second between a device and its memory
    link_bandwidth: float  # bytes per second one device sends in a collective
    link_latency: float  # seconds of fixed cost per collective step (alpha)
    memory_bytes: int  # memory of one device
    source: str = ""


PROFILES: dict[str, Hardware] = {
    "cpu": Hardware(
        "cpu", flops=5e10, memory_bandwidth=1e10, link_bandwidth=5e9, link_latency=2e-5,
        memory_bytes=4 * 2**30,
        source="Simulated host devices sharing one CPU: order-of-magnitude figures for a laptop "
               "or CI core; use measure_host() for this machine's own numbers."),
    "a100": Hardware(
        "a100", flops=312e12, memory_bandwidth=2.039e12, link_bandwidth=300e9, link_latency=5e-6,
        memory_bytes=80 * 2**30,
        source="NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s dense bf16, 2,039 GB/s HBM2e, "
               "NVLink 600 GB/s bidirectional (300 GB/s each way)."),
    "h100": Hardware(
        "h100", flops=989e12, memory_bandwidth=3.35e12, link_bandwidth=450e9, link_latency=5e-6,
        memory_bytes=80 * 2**30,
        source="NVIDIA H100 SXM datasheet: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, NVLink 900 "
               "GB/s bidirectional (450 GB/s each way)."),
    "tpu_v4": Hardware(
        "tpu_v4", flops=275e12, memory_bandwidth=1.2e12, link_bandwidth=45e9 * 2, link_latency=1e-5,
        memory_bytes=32 * 2**30,
        source="Google Cloud TPU v4 documentation: 275 TFLOP/s bf16, 32 GiB HBM at 1,200 GB/s; "
               "ICI links of ~45 GB/s each way, two per mesh axis (torus)."),
}


def get_profile(hardware: "str | Hardware | None") -> Hardware:
    """A profile by name, the given one, or (None) the one matching jax's first device."""
    if isinstance(hardware, Hardware):
        return hardware
    if hardware is None:
        hardware = default_profile_name()
    if hardware not in PROFILES:
        raise AutoparError(
            f"unknown hardware profile {hardware!r}. Fix: use one of {sorted(PROFILES)} or pass "
            "an autopar.Hardware(...) with your device's numbers.")
    return PROFILES[hardware]


def default_profile_name() -> str:
    import jax

    device = jax.devices()[0]
    kind = getattr(device, "device_kind", "").lower()
    if device.platform == "tpu":
        return "tpu_v4"
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
                    memory_bytes=base.memory_bytes,
                    source=f"measured on {jax.devices()[0].device_kind} by measure_host()")
