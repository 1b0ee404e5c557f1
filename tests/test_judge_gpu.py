"""The independent judge (benchmarks/judge.py) on GPU programs: the cuBLAS GEMMs that XLA GPU's
cost analysis counts as free, read from a program XLA GPU compiled (jax 0.11.2, an H200), and
collectives priced over NVSwitch, where a group's bus bandwidth does not grow with the mesh axes
it spans."""
from __future__ import annotations

import gzip
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from autopar.cost.xla.gpu import library_work as planners_reading
from benchmarks import judge as J, judge_hlo as H

GPU_PROGRAM = os.path.join(os.path.dirname(__file__), "data", "moe_share_xla_gpu.hlo.gz")


def test_a_cublas_gemm_counts_its_shapes_work_and_not_its_workspace():
    text = gzip.open(GPU_PROGRAM, "rt").read()
    comps, entry = H._parse_module(text)
    main = comps[entry]
    call = main.insts["custom-call.10"]  # f32[8,160,1024] x f32[8,1024,4096], batch 8
    alone = H._Comp("alone", {n: main.insts[n] for n in [*call.operands, call.name]}, call.name)
    flops, nbytes = H.library_work(alone)
    assert flops == 2 * 8 * 160 * 4096 * 1024
    # operands read, output written; the s8[33554432] workspace of its result tuple is not
    assert nbytes == 4 * (8 * 160 * 1024 + 8 * 1024 * 4096 + 8 * 160 * 4096)
    # the whole program's 30 calls, counted once each as the program runs no loop
    mult, _ = H._multiplicities(comps, entry, True)
    whole = [sum(mult[n] * H.library_work(c)[k] for n, c in comps.items() if mult.get(n))
             for k in (0, 1)]
    assert whole == list(planners_reading(text))  # two readings written apart agree


def test_a_collective_over_nvswitch_gets_one_gpus_bandwidth_whatever_axes_it_spans():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))

    @partial(jax.shard_map, mesh=mesh, in_specs=P(("data", "model")), out_specs=P())
    def total(x):
        return jax.lax.psum(x, ("data", "model"))

    x = jax.ShapeDtypeStruct((8 * 1024, 1024), jnp.float32,
                             sharding=NamedSharding(mesh, P(("data", "model"))))
    compiled = jax.jit(total).lower(x).compile()
    size = 1024 * 1024 * 4  # each device's block, all-reduced
    gpu, tpu = J.judge(compiled, mesh, chip="h100"), J.judge(compiled, mesh, chip="v5e")
    [c] = [c for c in gpu.collectives if c.kind == "all-reduce"]
    assert (c.axes, c.devices, c.bytes) == (("data", "model"), 8, size)
    assert np.isclose(c.seconds, size * 2 * 7 / 8 / 450e9 + 2 * 7 * 1e-6)
    # a TPU torus drives both axes' rings at once: twice one axis's bandwidth
    [t] = [t for t in tpu.collectives if t.kind == "all-reduce"]
    assert np.isclose(t.seconds, size * 2 * 7 / 8 / (2 * 100e9) + 2 * 7 * 1e-6)


def test_the_gpus_are_known_by_their_device_kind():
    class Device:
        device_kind = "NVIDIA H200"

    class FakeMesh:
        devices = np.array([Device()])

    assert J._chip(None, FakeMesh()).name == "h200"
    assert J.CHIPS["h100"].switched and not J.CHIPS["v5p"].switched


def test_the_gpu_suite_says_how_to_start_it_where_there_is_no_gpu_node():
    """On this machine's CPU devices the gpu suite stops at once, saying what it needs."""
    import pytest

    from benchmarks.gpu_suite import node_devices
    with pytest.raises(SystemExit, match="JAX_MOCK_GPU_TOPOLOGY=1x8x1"):
        node_devices("1x8x1")


CUDNN = """HloModule convs

ENTRY %main (x: f32[8,16,16,4], w: f32[3,3,4,32], dy: f32[8,16,16,32]) -> f32[] {
  %x = f32[8,16,16,4]{3,2,1,0} parameter(0)
  %w = f32[3,3,4,32]{3,2,1,0} parameter(1)
  %dy = f32[8,16,16,32]{3,2,1,0} parameter(2)
  %fwd = (f32[8,16,16,32]{3,2,1,0}, u8[1024]{0}) custom-call(%x, %w), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convForward"
  %din = (f32[8,16,16,4]{3,2,1,0}, u8[1024]{0}) custom-call(%dy, %w), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convBackwardInput"
  %dw = (f32[3,3,4,32]{3,2,1,0}, u8[1024]{0}) custom-call(%x, %dy), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convBackwardFilter"
  ROOT %r = f32[] constant(0)
}
"""


def test_cudnn_convolutions_count_the_forward_convolutions_work_each():
    """A 3x3 convolution of 4 into 32 features over an 8 x 16 x 16 batch, forward and both
    backward calls: each 2 x the forward output's elements x 36 filter taps per feature,
    as the planner's own reading (written apart) finds too."""
    comps, entry = H._parse_module(CUDNN)
    flops, nbytes = H.library_work(comps[entry])
    each = 2 * (8 * 16 * 16 * 32) * (3 * 3 * 4)
    assert flops == 3 * each
    x, w, dy = 8 * 16 * 16 * 4 * 4, 3 * 3 * 4 * 32 * 4, 8 * 16 * 16 * 32 * 4
    assert nbytes == (x + w + dy) + (dy + w + x) + (x + dy + w)  # workspaces not counted
    assert flops == planners_reading(CUDNN)[0]
