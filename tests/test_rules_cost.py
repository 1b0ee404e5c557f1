"""Sharding rules in factor notation, and the cost model's formulas."""
import math

import pytest
from jax.sharding import PartitionSpec as P

from autopar.cost import PROFILES
from autopar.cost.hardware import Link, group_link
from autopar.cost.model import all_gather, all_reduce, all_to_all, op_collectives, op_time
from autopar.cost.resharding import reshard_time
from autopar.mesh import MeshShape
from autopar.rules import enumerate_strategies, follow, rule_for, to_partition_spec
from autopar.trace.ir import Op, Tensor

MESH = MeshShape(("data", "model"), (2, 4))
HW = PROFILES["a100"]


def test_dot_general_factors_and_partial_sums():
    rule = rule_for("dot_general", [(8, 16), (16, 32)], [(8, 32)],
                    {"dimension_numbers": (((1,), (0,)), ((), ()))})
    b, i = rule.operands[0]
    assert rule.operands[1] == (i, rule.results[0][1])
    assert rule.results[0][0] == b
    assert rule.reduction_factors == {i}
    strategies = enumerate_strategies(rule, MESH)
    # 3 factors, 2 axes: each axis on one of them or none, all sizes divisible
    assert len(strategies) == 16
    # and for each of the 7 with partial sums, the variants that reduce-scatter them along
    # each result dimension they divide (both, in each of the 7)
    assert len(enumerate_strategies(rule, MESH, scatter=True)) == 16 + 7 * 2
    megatron_row = [s for s in strategies if dict(s.assignment) == {i: ("model",), b: ("data",)}]
    assert megatron_row and megatron_row[0].partial_axes == ("model",)
    assert to_partition_spec(megatron_row[0].in_specs[1]) == P("model")


def test_reduce_scatter_variant_moves_half_the_bytes():
    rule = rule_for("dot_general", [(8, 16), (16, 32)], [(8, 32)],
                    {"dimension_numbers": (((1,), (0,)), ((), ()))})
    b, i = rule.operands[0]
    tensors = [Tensor(0, (8, 16), "float32"), Tensor(1, (16, 32), "float32"),
               Tensor(2, (8, 32), "float32")]
    op = Op(0, "dot_general", (0, 1), (2,), {"dimension_numbers": (((1,), (0,)), ((), ()))})
    reduce, scatter, along_second = [s for s in enumerate_strategies(rule, MESH, scatter=True)
                                     if dict(s.assignment) == {i: ("data",)}]
    assert reduce.out_specs[0] == ((), ()) and scatter.out_specs[0] == (("data",), ())
    assert along_second.out_specs[0] == ((), ("data",))
    hw = PROFILES["cpu"]
    ar = op_time(op, reduce, tensors, MESH, hw)[1] - hw.link_latency
    rs = op_time(op, scatter, tensors, MESH, hw)[1] - hw.link_latency
    assert math.isclose(rs, ar / 2)
    assert op_collectives(op, scatter, tensors, MESH, hw) == {"reduce-scatter": 8 * 32 * 4 / 2}
    assert "reduce-scatter over ('data',)" in scatter.describe()


def test_a_reduce_scatter_over_every_tpu_chip_is_priced_as_the_all_reduce_it_compiles_to():
    """v5p compiles a reduce-scatter over all of 8 chips or more as an all-reduce of the whole
    result (tests/test_tpu.py compiles it); over a part of the mesh, or on the CPU, it stays
    a reduce-scatter."""
    rule = rule_for("dot_general", [(8, 16), (16, 32)], [(8, 32)],
                    {"dimension_numbers": (((1,), (0,)), ((), ()))})
    tensors = [Tensor(0, (8, 16), "float32"), Tensor(1, (16, 32), "float32"),
               Tensor(2, (8, 32), "float32")]
    op = Op(0, "dot_general", (0, 1), (2,), {"dimension_numbers": (((1,), (0,)), ((), ()))})
    whole = 8 * 32 * 4
    for mesh, n in ((MeshShape(("data",), (8,)), 8), (MESH, 2)):
        i = rule.operands[0][1]
        reduce, scatter = [s for s in enumerate_strategies(rule, mesh, scatter=True)
                           if dict(s.assignment) == {i: ("data",)}][:2]
        assert scatter.out_specs[0] == (("data",), ()) and scatter.partial_axes == ("data",)
        for hw in (PROFILES["tpu_v5p"], PROFILES["cpu"]):
            summed = hw.scatter_by_sum_from > 0 and n == mesh.size
            got = op_collectives(op, scatter, tensors, mesh, hw)
            assert got == ({"all-reduce": whole} if summed else {"reduce-scatter": whole / n})
            assert math.isclose(op_time(op, scatter, tensors, mesh, hw)[1],
                                op_time(op, reduce, tensors, mesh, hw)[1] if summed else
                                op_time(op, reduce, tensors, mesh, hw)[1] / 2 +
                                hw.link_latency / 2)


def test_a_bf16_reduce_scatter_leaving_one_lane_row_is_priced_on_tpu_as_its_all_reduce():
    """A TPU compiler makes a bf16 reduce-scatter along the result's last dimension that
    leaves each device 128 elements of it an all-reduce of the whole result (tests/test_tpu.py
    compiles it), over part of the mesh too, and every float16 one; with 64 left, in float32,
    or on the CPU it stays a reduce-scatter."""
    mesh = MeshShape(("data", "model"), (4, 2))
    for dtype, cols, summed_on_tpu in (("bfloat16", 512, True), ("bfloat16", 256, False),
                                       ("float32", 512, False), ("float16", 256, True)):
        dims = {"dimension_numbers": (((0,), (0,)), ((), ()))}
        rule = rule_for("dot_general", [(64, 8), (64, cols)], [(8, cols)], dims)
        tensors = [Tensor(0, (64, 8), dtype), Tensor(1, (64, cols), dtype),
                   Tensor(2, (8, cols), dtype)]
        op = Op(0, "dot_general", (0, 1), (2,), dims)
        k = rule.operands[0][0]  # the contracted dimension
        scatter = [s for s in enumerate_strategies(rule, mesh, scatter=True)
                   if dict(s.assignment) == {k: ("data",)} and s.out_specs[0] == ((), ("data",))]
        assert len(scatter) == 1 and scatter[0].partial_axes == ("data",)
        whole = tensors[2].nbytes
        for hw in (PROFILES["tpu_v5p"], PROFILES["tpu_v5e"], PROFILES["cpu"]):
            summed = summed_on_tpu and hw.platform == "tpu"
            assert op_collectives(op, scatter[0], tensors, mesh, hw) == (
                {"all-reduce": whole} if summed else {"reduce-scatter": whole / 4})


def test_indivisible_dimension_never_split():
    rule = rule_for("dot_general", [(6, 16), (16, 32)], [(6, 32)],
                    {"dimension_numbers": (((1,), (0,)), ((), ()))})
    for s in enumerate_strategies(rule, MESH):
        assert "model" not in s.in_specs[0][0], "6 rows cannot be split 4 ways"


def test_reshape_split_and_merge_share_major_factor():
    rule = rule_for("reshape", [(8, 16, 32)], [(128, 32)], {"new_sizes": (128, 32), "dimensions": None})
    assert rule.operands[0][0] == rule.results[0][0] is not None
    assert rule.operands[0][1] is None
    assert rule.operands[0][2] == rule.results[0][1]


def test_follow_keeps_incoming_sharding():
    rule = rule_for("reduce_sum", [(8, 32)], [(8,)], {"axes": (1,)})
    s = follow(rule, MESH, 0, (("data",), ("model",)))
    assert s.in_specs[0] == (("data",), ("model",))
    assert s.out_specs[0] == (("data",),)
    assert s.partial_axes == ("model",)


def test_gather_embedding_lookup():
    from jax import lax
    dn = lax.GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(0,),
                                    start_index_map=(0,))
    rule = rule_for("gather", [(64, 32), (8, 16, 1)], [(8, 16, 32)],
                    {"dimension_numbers": dn, "slice_sizes": (1, 32)})
    table, idx = rule.operands
    assert table[0] in rule.reduction_factors and table[1] == rule.results[0][2]
    assert idx[:2] == rule.results[0][:2]


def test_unknown_primitive_has_no_rule():
    assert rule_for("my_custom_op", [(4,)], [(4,)], {}) is None


def test_collective_formulas():
    b = 1e9
    link = Link(HW.link_latency, HW.link_bandwidth)
    assert all_reduce(b, 4, link) == pytest.approx(HW.link_latency + 2 * 3 / 4 * b / HW.link_bandwidth)
    assert all_gather(b, 4, link) == pytest.approx(HW.link_latency + 3 / 4 * b / HW.link_bandwidth)
    assert all_to_all(b, 4, link) == pytest.approx(HW.link_latency + 3 / 8 * b / HW.link_bandwidth)
    assert all_reduce(b, 1, link) == 0.0


def test_reshard_costs():
    t = Tensor(0, (64, 64), "float32")
    rep = ((), ())
    row = (("data",), ())
    col = ((), ("data",))
    assert reshard_time(t, rep, row, MESH, HW) == 0.0  # slicing is free
    link = group_link(HW, MESH, ("data",))
    assert reshard_time(t, row, rep, MESH, HW) == pytest.approx(all_gather(t.nbytes, 2, link))
    assert reshard_time(t, row, col, MESH, HW) == pytest.approx(all_to_all(t.nbytes / 2, 2, link))
    # gathering the second dimension is done in a layout that makes it major, then copied
    # back: the gathered bytes read and written once more
    assert reshard_time(t, col, rep, MESH, HW) == pytest.approx(
        all_gather(t.nbytes, 2, link) + 2 * t.nbytes / HW.memory_bandwidth)



def test_fused_values_are_the_elementwise_chains_xla_never_writes():
    """A softmax feeding a product: its exp, sum and division stay inside fusions; the
    product's operands, the reduction's result read by a non-fusing reader and the step's
    result are written."""
    import jax.numpy as jnp

    from autopar.cost.model import fused_values
    from autopar.trace.tracer import trace

    def f(x, w):
        e = jnp.exp(x - 1.0)
        p = e / jnp.sum(e, axis=-1, keepdims=True)
        return p @ w
    graph = trace(f, (jnp.ones((8, 16)), jnp.ones((16, 4))))[0]
    fused = fused_values(graph)
    by_op = {op.primitive: op for op in graph.ops}
    assert by_op["exp"].outputs[0] in fused and by_op["sub"].outputs[0] in fused
    assert by_op["div"].outputs[0] not in fused  # a dot reads it
    assert by_op["dot_general"].outputs[0] not in fused  # the result
    assert not set(graph.inputs) & fused


def test_the_compilers_fusion_decides_which_values_cost_memory_traffic():
    """A value two fusions read: an ideal fuser recomputes it in both (no bytes), XLA CPU
    writes it once and reads it twice. The traced graph's compiler picks the rule."""
    import jax.numpy as jnp

    from autopar.cost.facts import value_facts
    from autopar.trace.tracer import trace

    def f(x, w):
        y = jnp.tanh(x)
        return (jnp.exp(y) @ w).sum() + (jnp.sin(y) @ w).sum()
    args = (jnp.ones((8, 16)), jnp.ones((16, 4)))
    for compiler, written in (("cpu", True), ("gpu", False), ("", False)):
        graph = trace(f, args, compiler=compiler)[0]
        (tanh,) = [op for op in graph.ops if op.primitive == "tanh"]
        assert (tanh.outputs[0] not in value_facts(graph).fused) == written, compiler


def test_primitive_kinds_are_one_catalogue():
    """Every set of primitives is derived from the catalogue's disjoint kinds, and every kind
    that has a sharding rule gets it from the table."""
    from autopar.rules import kinds
    from autopar.rules.table import RULES
    from autopar.trace.shard import SHARD_PRIMITIVE
    parts = [kinds.CHEAP_ELEMENTWISE, kinds.OTHER_ELEMENTWISE, kinds.MARKS,
             kinds.RANDOM_ELEMENTWISE, kinds.LAYOUT, kinds.COMPOSITE_LAYOUT]
    assert sum(map(len, parts)) == len(frozenset().union(*parts))  # disjoint
    assert kinds.CHEAP <= kinds.FUSED <= kinds.FUSING_READERS
    assert kinds.SHARD_MARK == SHARD_PRIMITIVE
    unruled = (kinds.ELEMENTWISE | kinds.RANDOM_ELEMENTWISE | kinds.REDUCTIONS
               | kinds.CUMULATIVE | kinds.CONTRACTING) - RULES.keys()
    assert not unruled, sorted(unruled)
    assert kinds.decides("dot_general", [(4, 4), (4, 4)], [(4, 4)])
    assert not kinds.decides("add", [(4, 4), (4, 4)], [(4, 4)])
    assert kinds.decides("broadcast_in_dim", [(4,)], [(8, 4)])
