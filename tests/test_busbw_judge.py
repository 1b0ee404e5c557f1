"""The independent judge (benchmarks/judge.py) on programs the TPU compiler really emits.

Every program is compiled for 8 compile-only v5e devices (a 2x4 mesh); the expected bytes,
axes, trip counts and seconds are worked out by hand here from nccl-tests' bus-bandwidth
formulas, and the group parser is checked on literal HLO spellings.
"""
from __future__ import annotations

import json
import os
import re
from functools import partial

import numpy as np
import pytest

pytest.importorskip("libtpu")
# Compile-only use of libtpu: other processes on the machine may hold its lock file.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from benchmarks import judge as J  # noqa: E402

F32 = jnp.float32
V5E = J.CHIPS["v5e"]


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    devices = topologies.get_topology_desc(topology_name="v5e:2x4", platform="tpu").devices
    return Mesh(np.array(devices).reshape(2, 4), ("data", "model"))


def _compile(fn, mesh, in_specs, out_specs, *shapes):
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    return jax.jit(fn, in_shardings=tuple(map(shard, in_specs)),
                   out_shardings=jax.tree.map(shard, out_specs)).lower(
        *(jax.ShapeDtypeStruct(s, F32) for s in shapes)).compile()


def _nccl(kind: str, size: int, n: int, axes: int, chip: J.Chip = V5E) -> float:
    """nccl-tests time of one collective: S * factor / busbw plus alpha per ring step."""
    factor, steps = {"all-reduce": (2 * (n - 1) / n, 2 * (n - 1)),
                     "collective-permute": (1.0, 1)}.get(kind, ((n - 1) / n, n - 1))
    return size * factor / (axes * chip.ici_axis_bandwidth) + steps * chip.latency


def _only(judged: J.Judged, kind: str) -> list[J.Collective]:
    return [c for c in judged.collectives if c.kind == kind]


def _loss(w, x):
    return jnp.mean(jnp.tanh(x @ w))


def _mlp_loss(w1, w2, x):
    return jnp.mean((jnp.tanh(x @ w1) @ w2) ** 2)


@pytest.fixture(scope="module")
def data_parallel(mesh):
    return _compile(jax.grad(_loss), mesh, (P(), P(("data", "model"))), P(),
                    (256, 256), (64, 256))


@pytest.fixture(scope="module")
def fsdp(mesh):
    split = P(("data", "model"))
    return _compile(jax.grad(_mlp_loss, argnums=(0, 1)), mesh, (split,) * 3, (split, split),
                    (512, 1024), (1024, 512), (256, 512))


@pytest.fixture(scope="module")
def scanned(mesh):
    def step(w, x):
        def body(c, _):
            c = jnp.tanh(c @ w)   # columns split over "model": gathered back every trip
            return jax.lax.with_sharding_constraint(c, NamedSharding(mesh, P("data"))), None
        return jax.lax.scan(body, x, None, length=5)[0]
    return _compile(step, mesh, (P(None, "model"), P("data")), P("data"), (256, 256), (64, 256))


def test_a_data_parallel_gradient_all_reduce_is_priced_by_the_nccl_formula(mesh, data_parallel):
    judged = J.judge(data_parallel, mesh)
    [ar] = _only(judged, "all-reduce")
    assert (ar.bytes, ar.axes, ar.devices) == (256 * 256 * 4, ("data", "model"), 8)
    assert ar.executions == 1
    # 2(n-1)/n of the buffer over the two axes' rings, plus 2(n-1) latency steps
    assert ar.seconds == pytest.approx(256 * 256 * 4 * (2 * 7 / 8) / (2 * 100e9) + 14 * 1e-6)
    assert judged.collectives_s == pytest.approx(ar.seconds)


def test_a_batch_split_over_one_axis_reduces_over_that_axis_only(mesh):
    judged = J.judge(_compile(jax.grad(_loss), mesh, (P(), P("data")), P(),
                              (256, 256), (64, 256)), mesh)
    [ar] = _only(judged, "all-reduce")
    assert (ar.axes, ar.devices) == (("data",), 2)
    assert ar.seconds == pytest.approx(_nccl("all-reduce", 256 * 256 * 4, 2, 1))


def test_fsdp_gathers_weights_and_scatters_gradients(mesh, fsdp):
    judged = J.judge(fsdp, mesh)
    gathers = _only(judged, "all-gather")
    # the async collective fusions repeat each gather three times under one channel id
    assert gathers and all(c.executions == 1 for c in gathers)
    weights = [c for c in gathers if c.bytes == 1024 * 512 * 2]   # w1, w2 whole, in bf16
    assert len(weights) == 2
    assert all(c.axes == ("data", "model") and c.devices == 8 for c in weights)
    assert weights[0].seconds == pytest.approx(_nccl("all-gather", 1024 * 512 * 2, 8, 2))
    [rs] = _only(judged, "reduce-scatter")             # all-reduce + dynamic-slice fusion
    assert (rs.bytes, rs.devices, rs.axes) == (1024 * 512 * 4, 8, ("data", "model"))
    assert rs.seconds == pytest.approx(_nccl("reduce-scatter", 1024 * 512 * 4, 8, 2))


def test_a_collective_in_a_scan_body_counts_once_per_trip(mesh, scanned):
    judged = J.judge(scanned, mesh)
    [ag] = _only(judged, "all-gather")
    assert (ag.executions, ag.axes, ag.devices) == (5, ("model",), 4)
    assert ag.bytes == 64 // 2 * 256 * 4                  # a [32, 256] f32 block gathered
    assert ag.seconds == pytest.approx(5 * _nccl("all-gather", ag.bytes, 4, 1))
    # the cost analysis counts the body's matmul once; the judge counts all 5 trips
    per_trip = 2 * 32 * 256 * 64
    assert scanned.cost_analysis()["flops"] < 2 * per_trip
    assert judged.flops == pytest.approx(5 * per_trip, rel=0.05)


def test_a_fori_loop_of_matmuls_counts_every_trip(mesh):
    def power(x):
        return jax.lax.fori_loop(0, 6, lambda i, c: jnp.tanh(c @ c), x)
    judged = J.judge(_compile(power, mesh, (P(),), P(), (128, 128)), mesh)
    assert judged.flops == pytest.approx(6 * 2 * 128 ** 3, rel=0.05)
    assert judged.collectives == ()


def test_a_scan_over_stacked_layers_reads_one_layer_per_trip(mesh):
    """The body's fusions take the whole [L, D, D] stack as an operand but read one layer
    (dynamic-slice) and write one gradient row in place (dynamic-update-slice): the bytes
    grow linearly with L, not as L trips of the whole stack (L squared)."""
    def step(w, x):
        def loss(w):
            return jnp.sum(jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0] ** 2)
        return w - 0.1 * jax.grad(loss)(w)

    def judged_bytes(layers):
        program = _compile(step, mesh, (P(), P("data")), P(), (layers, 256, 256), (64, 256))
        return J.judge(program, mesh).bytes_accessed

    four, sixteen = judged_bytes(4), judged_bytes(16)
    assert sixteen / four == pytest.approx(4, rel=0.15)


def test_an_all_to_all_is_priced_with_n_minus_one_over_n(mesh):
    @partial(jax.shard_map, mesh=mesh, in_specs=P(None, "model"), out_specs=P("model", None))
    def swap(x):
        return jax.lax.all_to_all(x, "model", 0, 1, tiled=True)
    judged = J.judge(jax.jit(swap).lower(jax.ShapeDtypeStruct((128, 256), F32)).compile(), mesh)
    [a2a] = _only(judged, "all-to-all")
    assert (a2a.bytes, a2a.axes, a2a.devices) == (128 * 64 * 4, ("model",), 4)
    assert a2a.seconds == pytest.approx(128 * 64 * 4 * 3 / 4 / 100e9 + 3 * 1e-6)


def test_a_permute_start_done_pair_counts_once(mesh):
    @partial(jax.shard_map, mesh=mesh, in_specs=P("data", "model"), out_specs=P("data", "model"))
    def shift(x):
        return jax.lax.ppermute(x, "model", [(i, (i + 1) % 4) for i in range(4)])
    judged = J.judge(jax.jit(shift).lower(jax.ShapeDtypeStruct((64, 256), F32)).compile(), mesh)
    [cp] = judged.collectives
    assert (cp.kind, cp.bytes, cp.axes) == ("collective-permute", 32 * 64 * 4, ("model",))
    assert cp.seconds == pytest.approx(_nccl("collective-permute", 32 * 64 * 4, 4, 1))


@pytest.mark.parametrize("spellings, axes", [
    (["replica_groups={{0,1,2,3},{4,5,6,7}}", "replica_groups=[2,4]<=[8]",
      "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}"], ("model",)),
    (["replica_groups={{0,4},{1,5},{2,6},{3,7}}", "replica_groups=[4,2]<=[2,4]T(1,0)",
      "replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}"], ("data",)),
    (["replica_groups={{0,1,2,3,4,5,6,7}}", "replica_groups={}", "replica_groups=[1,8]<=[8]",
      "replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}"], ("data", "model")),
])
def test_every_group_spelling_parses_to_the_same_groups_and_axes(mesh, spellings, axes):
    parsed = [sorted(sorted(g) for g in J._groups(s, 8)) for s in spellings]
    assert all(p == parsed[0] for p in parsed)
    assert {J._axes(J._groups(s, 8), mesh) for s in spellings} == {axes}


def test_sub_axes_device_ids_and_pairs_parse(mesh):
    halves = J._groups("replica_groups=mesh['a'=2,'b'=4] {'b':(1)2}", 8)
    assert sorted(map(sorted, halves)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    strided = J._groups("replica_groups=mesh['a'=2,'b'=4], device_ids=([2,4]<=[4,2]T(1,0)) "
                        "{'b'}", 8)
    assert sorted(map(sorted, strided)) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    ring = J._groups("source_target_pairs={{0,1},{1,2},{2,3},{3,0}}", 8)
    assert J._axes(ring, mesh) == ("model",)
    with pytest.raises(ValueError, match="does not fit"):
        J._axes(J._groups("replica_groups={{0,9}}", 8), mesh)


_LOOP_HLO = """HloModule loop, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%scatter (input: f32[64,8]) -> f32[16,8] {
  %input = f32[64,8]{1,0} parameter(0)
  %ar = f32[64,8]{1,0} all-reduce(%input), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add
  %i = s32[] constant(0)
  ROOT %ds = f32[16,8]{1,0} dynamic-slice(%ar, %i, %i), dynamic_slice_sizes={16,8}
}

%body (p: (s32[], f32[64,8])) -> (s32[], f32[64,8]) {
  %p = (s32[], f32[64,8]{1,0}) parameter(0)
  %n = s32[] get-tuple-element(%p), index=0
  %one = s32[] constant(2)
  %next = s32[] add(%n, %one)
  %v = f32[64,8]{1,0} get-tuple-element(%p), index=1
  %cps = (f32[64,8]{1,0}, f32[64,8]{1,0}, u32[], u32[]) collective-permute-start(%v), channel_id=3, source_target_pairs={{0,4},{4,0}}
  %cpd = f32[64,8]{1,0} collective-permute-done(%cps)
  ROOT %t = (s32[], f32[64,8]{1,0}) tuple(%next, %cpd)
}

%cond (q: (s32[], f32[64,8])) -> pred[] {
  %q = (s32[], f32[64,8]{1,0}) parameter(0)
  %c = s32[] get-tuple-element(%q), index=0
  %lim = s32[] constant(10)
  ROOT %lt = pred[] compare(%c, %lim), direction=LT
}

ENTRY %main (a: f32[64,8]) -> f32[16,8] {
  %a = f32[64,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = s32[] copy(%zero)
  %tup = (s32[], f32[64,8]{1,0}) tuple(%init, %a)
  %w = (s32[], f32[64,8]{1,0}) while(%tup), condition=%cond, body=%body
  %out = f32[64,8]{1,0} get-tuple-element(%w), index=1
  ROOT %f = f32[16,8]{1,0} fusion(%out), kind=kCustom, calls=%scatter
}
"""


class _Literal:
    """A stand-in for a Compiled that serves literal HLO text."""
    def as_text(self) -> str:
        return _LOOP_HLO

    def cost_analysis(self) -> dict:
        return {"flops": 0.0}

    def memory_analysis(self):
        return type("Memory", (), {"peak_memory_in_bytes": 123})()


def test_literal_hlo_loop_trips_scatter_and_async_pair(mesh):
    judged = J.judge(_Literal(), mesh)
    by_kind = {c.kind: c for c in judged.collectives}
    assert set(by_kind) == {"collective-permute", "reduce-scatter"}
    cp, rs = by_kind["collective-permute"], by_kind["reduce-scatter"]
    assert (cp.executions, cp.bytes, cp.axes) == (5, 64 * 8 * 4, ("data",))   # 0,2,..,8 < 10
    assert (rs.executions, rs.bytes, rs.devices, rs.axes) == (1, 64 * 8 * 4, 4, ("model",))
    assert judged.peak_memory_bytes == 123
    with pytest.raises(ValueError, match="partitions"):
        J.judge(_Literal(), Mesh(np.array(mesh.devices).reshape(-1)[:4], ("x",)))


def test_bounds_peak_memory_and_report(mesh, data_parallel, fsdp, scanned):
    for compiled in (data_parallel, fsdp, scanned):
        judged = J.judge(compiled, mesh)
        assert judged.no_overlap_s >= judged.overlapped_s
        assert judged.overlapped_s >= max(judged.compute_s, judged.collectives_s)
        assert judged.no_overlap_s == pytest.approx(judged.compute_s + judged.collectives_s)
        assert judged.peak_memory_bytes == compiled.memory_analysis().peak_memory_in_bytes
        report = json.loads(json.dumps(judged.to_dict()))
        assert report["chip"] == "v5e"
        assert sum(report["collective_counts_by_kind"].values()) == sum(
            c.executions for c in judged.collectives)
        assert "collectives" in judged.summary()
    faster = J.judge(data_parallel, mesh, chip="v6e")   # twice v5e's ICI per axis
    assert faster.chip.name == "v6e"
    assert faster.collectives[0].seconds < J.judge(data_parallel, mesh).collectives[0].seconds


def test_fsdp_mlp_flops_match_a_hand_count(mesh):
    width, tokens = 1024, 512
    split = P(("data", "model"))
    compiled = _compile(jax.grad(_mlp_loss, argnums=(0, 1)), mesh, (split,) * 3,
                        (split, split), (width, width), (width, width), (tokens, width))
    # forward 2 flops per weight per token for both layers; backward 2 (weight grads) for
    # both and 2 (input grads) for the second layer only: x needs no gradient
    params = width * width
    hand = tokens * params * (2 * 2 + 2 * 2 + 2) / 8
    assert J.judge(compiled, mesh).flops == pytest.approx(hand, rel=0.10)


def test_dot_flops_of_a_loop_free_program_match_the_compilers(mesh):
    """Per-head projections with their gradient, which the TPU compiler writes as
    convolutions whose window runs over padding: the judge's count of real multiply-adds
    equals cost_analysis's, where a count of every tap read 32x it."""
    def loss(w, x):
        q = jnp.einsum("bsd,dhk->bshk", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
        return jnp.mean(jnp.square(q.astype(F32)))

    compiled = _compile(jax.grad(loss), mesh, (P(None, "model"), P("data")), P(None, "model"),
                        (256, 32, 128), (4, 512, 256))
    comps, entry = J._parse_module(compiled.as_text())
    once, _ = J._multiplicities(comps, entry, False)
    ours = sum(J._dot_flops(c) * once.get(name, 0) for name, c in comps.items())
    assert ours == pytest.approx(compiled.cost_analysis()["flops"], rel=0.05)


def test_collectives_sharing_a_channel_id_are_each_counted(mesh):
    """The TPU compiler gives a shard_map's collectives one channel id (1): two
    psum_scatters and a psum are three collectives, not one."""
    def step(a, b, c):
        def inner(a, b, c):
            x = jax.lax.psum_scatter(a @ a.T, "data", scatter_dimension=1, tiled=True)
            y = jax.lax.psum_scatter(b @ b.T, "data", scatter_dimension=1, tiled=True)
            return x, y, jax.lax.psum(jnp.sum(c * c), "data")
        return jax.shard_map(inner, mesh=mesh, in_specs=(P("data"),) * 3,
                             out_specs=(P(None, "data"), P(None, "data"), P()))(a, b, c)
    shape = jax.ShapeDtypeStruct((256, 512), F32)
    compiled = jax.jit(step).lower(shape, shape, shape).compile()
    assert len(set(re.findall(r"channel_id=(\d+)", compiled.as_text()))) == 1
    judged = J.judge(compiled, mesh)
    assert sorted(c.kind for c in judged.collectives) == [
        "all-reduce", "reduce-scatter", "reduce-scatter"]
    scatter = _nccl("reduce-scatter", 128 * 128 * 4, 2, 1)  # a [128, 128] product a device
    assert judged.collectives_s == pytest.approx(2 * scatter + _nccl("all-reduce", 0, 2, 1))
