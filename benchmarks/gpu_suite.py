"""The `gpu` suite: our plans against MaxText-style experts on one node of 8 GPUs, compiled by
XLA's GPU compiler and judged by `benchmarks/judge.py` (which shares no code with the planner).

One real GPU is enough: JAX's mock GPU topology (`jax_mock_gpu_topology`, here `1x8x1`: one
slice of 8 hosts of one GPU each, the real GPU standing for every one of them) gives 8 devices
that programs are planned, lowered and compiled for, with NCCL's collectives, as on a real
node; nothing runs on them. The cases, the experts' sweep and our meshes are the `tpu` suite's
(`tpu_suite.run`); the judge prices compute on the chip's datasheet figures and collectives
over NVSwitch (busbw 450 GB/s for any group of the node's GPUs).

Run where a GPU is at hand, the mock set before JAX starts its GPU backend:

    JAX_MOCK_GPU_TOPOLOGY=1x8x1 XLA_FLAGS=--xla_gpu_autotune_level=0 \
        python -m benchmarks --suites gpu [--experts-from benchmarks/results/gpu.json]

with XLA's GEMM autotuning switched off (`XLA_FLAGS=--xla_gpu_autotune_level=0`): with it on,
ours for Llama-2-7B did not compile in 400 s, every GEMM's kernels timed on the one real GPU.
Autotuning picks kernels, not shardings or collectives, but a dot it gives cuBLAS rather than
a Triton fusion has its producers written, so peaks may differ from a default compile's
(docs/decisions.md, "One node of 8 GPUs, compiled by XLA GPU").
"""
from __future__ import annotations

import os
from typing import Any, Callable

import jax

from benchmarks import tpu_suite

MOCK = "1x8x1"
# name -> (workload name, batch, seq, Config overrides, mock topology): realistic widths.
CASES: dict[str, tuple[str, int, int, dict[str, Any], str]] = {
    "llama2-7b-h200x8": ("llama2-7b", 16, 2048, {}, MOCK),
    "mixtral-2l-h200x8": ("mixtral-8x7b", 16, 2048, {"layers": 2}, MOCK),
    "llama3-8b-h200x8": ("llama3-8b", 8, 4096, {}, MOCK),
    "vit-large-h200x8": ("vit-large", 256, 0, {}, MOCK),  # added after the H200 run: not measured
}


def node_devices(topology: str) -> list:
    """The mocked node's GPUs: as many as the topology names (slices x hosts x GPUs each)."""
    want = 1
    for part in topology.lower().split("x"):
        want *= int(part)
    devices = jax.devices()
    if devices[0].platform != "gpu" or len(devices) != want:
        raise SystemExit(
            f"the gpu suite needs {want} GPU devices of the mock topology {topology!r}; jax has "
            f"{len(devices)} x {devices[0].platform} ({devices[0].device_kind}). Fix: start it "
            f"with JAX_MOCK_GPU_TOPOLOGY={topology} JAX_CUDA_VISIBLE_DEVICES=0 on a machine with "
            "a GPU (set before JAX starts its backend).")
    return devices


def run(cases: dict[str, tuple], memory_matched: bool = True,
        log: Callable[[str], None] = print,
        devices_for: Callable[[str], list] = node_devices,
        experts_from: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `tpu` suite's rows for these cases, on the node's GPUs; with `experts_from` (an
    earlier result, e.g. benchmarks/results/gpu.json) its expert rows are kept and only ours
    is planned and compiled: a minute of a lent GPU rather than four."""
    result = tpu_suite.run(cases, memory_matched, log=log, devices_for=devices_for,
                           experts_from=experts_from)
    result["mock_topology"] = os.environ.get("JAX_MOCK_GPU_TOPOLOGY", "")
    result["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    return result

