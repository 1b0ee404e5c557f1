"""The judge (autopar.evaluate) on small hand-checked programs, and per-axis links."""
import dataclasses
import gzip
from pathlib import Path

import jax
import jax.numpy as jnp
import models
import pytest
from jax import shard_map
from jax.sharding import NamedSharding, PartitionSpec as P

import autopar
from autopar.cost.hardware import Hardware, LinkLevel, axis_links, group_link
from autopar.cost.hlo import collectives, compiled_memory_bytes, device_groups
from autopar.cost.xla.gpu import library_work
from autopar.mesh import MeshShape

# Two levels: the 4 devices of a "node" on fast links, the network between nodes 100x slower.
HW = Hardware("two-level", flops=1e12, memory_bandwidth=1e11, link_bandwidth=1e10,
              link_latency=1e-6, memory_bytes=2**30,
              levels=(LinkLevel("node", 4, 1e10, 1e-6), LinkLevel("network", 0, 1e8, 1e-5)))
MESH = {"data": 2, "model": 4}
DATA = Path(__file__).resolve().parent / "data"


def _compile(fn, *shapes_specs, mesh):
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, spec))
            for s, spec in shapes_specs]
    return jax.jit(fn).lower(*args).compile()


def test_links_sit_innermost_axes_on_the_fastest_level():
    h100 = autopar.PROFILES["h100"]
    nvlink, network = (lv for lv in h100.levels)
    assert [k.bandwidth for k in axis_links(h100, MeshShape(("data", "model"), (4, 2)))] == \
        [nvlink.bandwidth] * 2
    assert [k.bandwidth for k in axis_links(h100, MeshShape(("node", "gpu"), (16, 8)))] == \
        [network.bandwidth, nvlink.bandwidth]
    # an axis spanning more devices than a node holds crosses nodes
    assert axis_links(h100, MeshShape(("gpu",), (16,)))[0].bandwidth == network.bandwidth
    placed = dataclasses.replace(h100, axis_levels=(("data", "network"),))
    assert axis_links(placed, MeshShape(("data", "model"), (4, 2)))[0].bandwidth == \
        network.bandwidth
    # a group spanning both runs at the slower link
    shape = MeshShape(("node", "gpu"), (16, 8))
    assert group_link(h100, shape, ("node", "gpu")).bandwidth == network.bandwidth
    with pytest.raises(autopar.AutoparError, match="level"):
        axis_links(dataclasses.replace(h100, axis_levels=(("data", "ib"),)),
                   MeshShape(("data",), (2,)))


def test_device_groups_read_xlas_three_spellings():
    assert device_groups("replica_groups={{0,1},{2,3}}, x") == ((0, 1), (2, 3))
    assert device_groups("replica_groups=[4,2]<=[2,4]T(1,0), x") == ((0, 4), (1, 5), (2, 6),
                                                                     (3, 7))
    assert device_groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, x") == \
        ((0, 1, 2, 3), (4, 5, 6, 7))
    assert device_groups("to_apply=%add") is None


def test_all_reduce_over_one_axis_of_a_2d_mesh():
    mesh = autopar.make_mesh(MESH)
    f = shard_map(lambda x: jax.lax.psum(x, "model"), mesh=mesh, in_specs=P("data", "model"),
                  out_specs=P("data"))
    judged = autopar.evaluate(_compile(f, ((16, 64), P("data", "model")), mesh=mesh), mesh, HW)
    (ar,) = [c for c in judged.collectives if c.kind == "all-reduce"]
    assert (ar.axes, ar.devices, ar.result_bytes) == (("model",), 4, 8 * 16 * 4)
    # 'model' (4 devices, innermost) fits a node: the fast link
    assert ar.seconds == pytest.approx(1e-6 + 2 * 3 / 4 * 512 / 1e10)
    assert judged.communication_s == pytest.approx(sum(c.seconds for c in judged.collectives))
    assert judged.step_s == pytest.approx(judged.compute_s + judged.communication_s)

    g = shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data", "model"),
                  out_specs=P(None, "model"))
    (ar,) = autopar.evaluate(_compile(g, ((16, 64), P("data", "model")), mesh=mesh), mesh,
                             HW).collectives
    # 'data' spans all 8 devices with 'model' inside it: across nodes, the network
    assert ar.axes == ("data",) and ar.seconds == pytest.approx(1e-5 + 2 * 1 / 2 * 512 / 1e8)


def test_reduce_scatter_and_all_to_all():
    mesh = autopar.make_mesh(MESH)
    rs = shard_map(lambda x: jax.lax.psum_scatter(x, "model", scatter_dimension=0, tiled=True),
                   mesh=mesh, in_specs=P("data"), out_specs=P(("data", "model")))
    judged = autopar.evaluate(_compile(rs, ((64, 32), P("data")), mesh=mesh), mesh, HW)
    (c,) = [c for c in judged.collectives if c.kind == "reduce-scatter"]
    result = 64 // 8 * 32 * 4  # each device keeps an eighth
    assert (c.axes, c.result_bytes) == (("model",), result)
    assert c.seconds == pytest.approx(1e-6 + 3 * result / 1e10)  # input 4x the result

    a2a = lambda x: jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P(None, "model")))
    judged = autopar.evaluate(_compile(a2a, ((64, 64), P("model")), mesh=mesh), mesh, HW)
    (c,) = judged.collectives
    assert c.kind == "all-to-all" and c.axes == ("model",)
    assert c.result_bytes == 64 * 64 * 4 // 4
    # nccl-tests' all-to-all: S x (n-1)/n at the bus bandwidth, S the buffer
    assert c.seconds == pytest.approx(1e-6 + 3 / 4 * c.result_bytes / 1e10)


def test_roofline_and_memory_come_from_the_compiled_program():
    mesh = autopar.make_mesh(MESH)
    mm = lambda a, b: a @ b
    compiled = _compile(mm, ((256, 128), P("data")), ((128, 512), P(None, "model")), mesh=mesh)
    judged = autopar.evaluate(compiled, mesh, HW)
    assert judged.flops == pytest.approx(2 * 128 * 128 * 128)  # (128, 128) x (128, 128) here
    assert judged.compute_s == pytest.approx(max(judged.flops / 1e12,
                                                 judged.bytes_accessed / 1e11))
    assert judged.memory_bytes > 128 * 128 * 4 and not judged.collectives


def test_loop_bodies_count_per_iteration():
    mesh = autopar.make_mesh(MESH)

    def f(x, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=3)[0].sum()
    compiled = _compile(jax.grad(f, argnums=1), ((16, 64), P("data", "model")),
                        ((64, 64), P("model")), mesh=mesh)
    assert {c.executions for c in collectives(compiled.as_text())} == {3}


@pytest.mark.slow
def test_per_axis_links_change_the_plan_and_the_judge_agrees():
    """A GPT on 2 nodes of 4 devices. With one link for all, the plan moves bytes over both
    axes. When 'data' crosses a network 100x slower, a byte there costs more than the whole
    step's compute saved by splitting over it (hand calculation: the flat plan's data-axis
    traffic, judged at network speed, is over 20x its compute), so the link-aware plan moves
    nothing over 'data', and the judge, reading both compiled programs under the two-level
    profile, finds it faster."""
    step, state, batch = models.gpt_setup(batch=16, seq=32, vocab=256, d_model=128, heads=4,
                                          layers=2)
    mesh = autopar.make_mesh(MESH)
    flat = dataclasses.replace(HW, levels=())
    plans, judged = {}, {}
    for name, hw in (("flat", flat), ("levels", HW)):
        sharded = autopar.auto_parallel(step, mesh=mesh, hardware=hw)
        plans[name] = sharded.plan(state, batch)
        judged[name] = autopar.evaluate(sharded.lower(state, batch).compile(), mesh, HW)
    on_data = {name: sum(c.seconds for c in j.collectives if "data" in c.axes)
               for name, j in judged.items()}
    assert on_data["flat"] > 20 * judged["flat"].compute_s  # the hand calculation's premise
    assert on_data["levels"] == 0.0
    assert judged["levels"].step_s < judged["flat"].step_s


@pytest.mark.slow
def test_gradient_all_reduces_pay_one_latency_as_xla_combines_them():
    """XLA's all-reduce combiner merges a data-parallel step's gradient all-reduces into one
    collective: the judge sees one all-reduce, and the cost model charges the gradients one
    latency between them. Charged one latency each, the 35 gradients of this GPT cost more than
    replicating the whole step, and the search replicated it (judged twice as slow as plain
    data parallel on h100)."""
    from autopar.cost.facts import value_facts
    from autopar.trace.tracer import trace

    step, state, batch = models.gpt_setup(batch=16, seq=32, vocab=256, d_model=64, heads=4,
                                          layers=2)
    graph = trace(step, (state, batch))[0]
    facts = value_facts(graph)
    params = len(jax.tree_util.tree_leaves(state[0]))
    # one per parameter, two for the embedding, which the output layer shares, and the loss
    assert len(facts.combined) == params + 2
    mesh = autopar.make_mesh({"data": 8})
    sharded = autopar.auto_parallel(step, mesh=mesh, hardware="h100")
    plan = sharded.plan(state, batch)
    assert all(spec[0] == "data" for spec in jax.tree_util.tree_leaves(
        plan.input_specs[1], is_leaf=lambda x: isinstance(x, P)))  # the batch is split
    ours = autopar.evaluate(sharded.lower(state, batch).compile(), mesh, "h100")
    reductions = [c for c in ours.collectives if c.kind == "all-reduce"]
    assert len(reductions) == 1 and reductions[0].executions == 1
    h100 = autopar.PROFILES["h100"]
    # the plan's estimate carries about one latency, not one per gradient
    assert plan.cost["communication_s"] < 3 * h100.link_latency
    replicated = jax.jit(step).lower(state, batch).compile()  # one device's program
    assert ours.step_s < autopar.evaluate(replicated, autopar.make_mesh({"data": 1}),
                                          "h100").step_s


@pytest.mark.slow
def test_at_a_data_parallel_experts_memory_autopar_is_no_slower(monkeypatch):
    """memory_limit set to what plain data-parallel jax.jit compiles to: autopar's estimate of
    its own unconstrained plan (the same program) reads a few percent over that, and the
    budget used to pick a leaner plan, 2.6x slower. XLA's own figure now decides near the
    limit: the plan compiles within it and is judged no slower than the expert. The budget's
    answer, not kept, is not proven (its proofs took 20 of this test's 26 s)."""
    from jax.sharding import PartitionSpec as P
    from autopar.planning import budget
    proofs = []
    real = budget._proven
    monkeypatch.setattr(budget, "_proven", lambda *a: proofs.append(1) or real(*a))

    step, state, batch = models.gpt_setup(batch=16, seq=32, vocab=256, d_model=64, heads=4,
                                          layers=2)
    mesh = autopar.make_mesh({"data": 8})
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    expert = jax.jit(step, in_shardings=(replicated, split), out_shardings=(replicated, None),
                     donate_argnums=0).lower(state, batch).compile()
    limit = compiled_memory_bytes(expert)
    sharded = autopar.auto_parallel(step, mesh=mesh, hardware="h100", memory_limit=limit,
                                    donate_argnums=0)
    plan = sharded.plan(state, batch)
    ours = sharded.lower(state, batch).compile()
    assert compiled_memory_bytes(ours) <= limit
    judged = autopar.evaluate(ours, mesh, "h100").step_s
    assert judged <= autopar.evaluate(expert, mesh, "h100").step_s * (1 + 1e-3)
    assert plan.memory["compiled_bytes"] <= limit
    assert "memory_price_s_per_byte" not in plan.search_stats and not proofs


@pytest.mark.slow
def test_a_conv_net_at_a_data_parallel_experts_memory_is_that_program():
    """The small ResNet at what plain data-parallel jax.jit compiles to. autopar's unlimited
    plan is that program, instruction for instruction; pinned by sharding constraints, XLA
    scheduled it into 0.39% more temporaries (jax 0.10.2, XLA CPU), and the budget chose a
    leaner plan judged 2x slower. Lowered with its inputs' and outputs' shardings alone, it
    fits, is judged no slower, trains as on one device, and a saved plan lowers the same way.
    Before, the search also left the image batch whole on every device, where splitting it
    cost the same time (the kept-bytes tie-break)."""
    from helpers import check_against_single_device

    import architectures
    step, state, batch = architectures.resnet_setup(batch=16, size=16, channels=(32, 64))
    mesh = autopar.make_mesh({"data": 8})
    free = autopar.plan(step, state, batch, donate_argnums=0, mesh=mesh, hardware="h100")
    assert free.input_specs[1]["inputs"] == P("data")  # the tie goes to the leaner layout
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    expert = jax.jit(step, in_shardings=(replicated, split), out_shardings=(replicated, None),
                     donate_argnums=0).lower(state, batch).compile()
    limit = compiled_memory_bytes(expert)
    plan = check_against_single_device(step, state, batch, mesh, donate_argnums=0,
                                       hardware="h100", memory_limit=limit)
    ours = autopar.auto_parallel(step, mesh=mesh, plan=plan, donate_argnums=0).lower(
        state, batch).compile()
    assert compiled_memory_bytes(ours) <= limit and plan.memory["compiled_bytes"] <= limit
    assert (autopar.evaluate(ours, mesh, "h100").step_s
            <= autopar.evaluate(expert, mesh, "h100").step_s * (1 + 1e-3))
    saved = autopar.Plan.from_json(plan.to_json())
    again = autopar.auto_parallel(step, mesh=mesh, plan=saved, donate_argnums=0)
    assert compiled_memory_bytes(again.lower(state, batch).compile()) <= limit


# Lines of XLA GPU's optimised HLO (jax 0.11.2, H200): a cuBLAS matmul and a cuDNN
# backward-filter convolution, with the definitions of their operands.
GPU_CALLS = """
  %fusion.1401 = f32[2048,1024]{1,0} fusion(%p.1), kind=kLoop, calls=%fused_computation.1
  %wrapped_concatenate = f32[1024,3072]{1,0} fusion(%p.2, %p.3, %p.4), kind=kLoop, calls=%c.2
  %custom-call.38 = (f32[2048,3072]{1,0}, s8[33554432]{0}) custom-call(%fusion.1401, %wrapped_concatenate), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]},"epilogue":"DEFAULT"}}
  %loop_maximum_fusion.8 = f32[4,7,7,512]{3,2,1,0} fusion(%p.5, %p.6), kind=kLoop, calls=%c.3
  %get-tuple-element.597 = f32[4,7,7,2048]{3,2,1,0} get-tuple-element(%input_add_reduce_fusion.4), index=0
  %cudnn-conv-bw-filter.31 = (f32[2048,1,1,512]{3,2,1,0}, u8[0]{0}) custom-call(%loop_maximum_fusion.8, %get-tuple-element.597), window={size=1x1}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convBackwardFilter", backend_config={}
"""


def test_the_flops_xla_gpu_hands_to_cublas_and_cudnn_are_counted():
    """2 x M x N x K for the matmul; for the 1x1 convolution's filter gradient, its forward
    output (4x7x7x2048) times the 512 input features, twice."""
    matmul = 2 * 2048 * 3072 * 1024
    convolution = 2 * (4 * 7 * 7 * 2048) * 512
    # operands read and result written, not the calls' scratch space (s8 and u8 results)
    moved = 4 * (2048 * 1024 + 1024 * 3072 + 2048 * 3072) + 4 * (
        4 * 7 * 7 * 512 + 4 * 7 * 7 * 2048 + 2048 * 512)
    assert library_work(GPU_CALLS) == (matmul + convolution, moved)
    assert library_work(GPU_CALLS.replace("__cu", "__cpu_")) == (0.0, 0.0)  # other calls


def test_a_gpu_programs_flops_equal_the_same_step_compiled_for_the_cpu():
    """The MoE of the quality suite at one device's batch share, compiled by XLA GPU (jax
    0.11.2, H200; benchmarks/results/device.md): its cost_analysis counted 17.4 GFLOP, the same
    step compiled for the CPU 150.0. With the cuBLAS calls read from the HLO, the two agree."""
    text = gzip.decompress((DATA / "moe_share_xla_gpu.hlo.gz").read_bytes()).decode()
    cost_analysis_flops, cpu_program_flops = 17437790208.0, 150023798784.0
    assert (cost_analysis_flops + library_work(text)[0]) / cpu_program_flops == pytest.approx(
        1.0, abs=1e-3)


def test_a_loops_later_trips_are_judged_as_its_first():
    """cost_analysis counts a while loop's body once; the judge adds the other trips, read from
    the HLO, so four layers scanned cost what four layers unrolled cost (the flops exactly,
    forward; the backward's loop does a little more elementwise work than the unrolled)."""
    def scanned(w, x):
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0].sum()

    def unrolled(w, x):
        for i in range(4):
            x = jnp.tanh(x @ w[i])
        return x.sum()

    args = (jax.ShapeDtypeStruct((4, 256, 256), jnp.float32),
            jax.ShapeDtypeStruct((64, 256), jnp.float32))
    one = {"data": 1}
    forward = None
    for transform, tolerance in ((lambda f: f, 1e-6), (jax.grad, 0.1)):
        loop, flat = (jax.jit(transform(f)).lower(*args).compile() for f in (scanned, unrolled))
        judged, judged_flat = (autopar.evaluate(p, one, "h100") for p in (loop, flat))
        forward = forward or (judged, judged_flat)
        assert judged.flops == pytest.approx(judged_flat.flops, rel=tolerance)
        assert judged.flops > 3.5 * loop.cost_analysis()["flops"]  # the body counted 4 times
        assert judged.bytes_accessed > loop.cost_analysis()["bytes accessed"]
    # A trip reads its layer's slice of the stacked weights, not the whole stack: counting
    # whole operands would read 2.1x the unrolled program's bytes (forward; 1.37x counted so).
    judged, judged_flat = forward
    assert judged_flat.bytes_accessed <= judged.bytes_accessed < 1.6 * judged_flat.bytes_accessed
