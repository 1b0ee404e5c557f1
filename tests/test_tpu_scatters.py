"""Which collectives the TPU compiler makes of gathers and reduce-scatters, on compile-only
devices from libtpu, and the cost model pricing each as the collective it becomes (the
profiles' `gather_by_sum_from`, `scatter_by_sum_from`, `scatter_by_sum_lanes`,
`scatter_by_sum_inner` and `scatters_only`)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("libtpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from autopar.cost.hardware import get_profile, group_link  # noqa: E402
from autopar.cost.model import MOVED, result_order, scattered_by_sum  # noqa: E402
from autopar.cost.resharding import (  # noqa: E402
    gathered_by_sum, reshard_sequence, reshard_time)
from autopar.mesh import mesh_shape  # noqa: E402
from autopar.trace.ir import Op, Tensor  # noqa: E402


def _kinds(compiled) -> set[str]:
    text = compiled.as_text()
    return {k for k in ("all-gather", "all-reduce", "reduce-scatter")
            if f" {k}(" in text or f" {k}-start(" in text}


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5p:2x4x4", "v5p:4x4x4"])
def test_the_cost_model_prices_a_gather_as_the_tpu_compiler_emits_it(topology):
    """From 64 chips on, the TPU compiler gathers over every device with an all-reduce (of
    zeros but the device's shard): the profile says so, and the cost model prices it so."""
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    mesh = Mesh(np.array(devices), ("data",))
    compiled = jax.jit(lambda x: x * 2, in_shardings=NamedSharding(mesh, P("data")),
                       out_shardings=NamedSharding(mesh, P())).lower(
        jax.ShapeDtypeStruct((len(devices) * 128, 1024), jnp.float32)).compile()
    kinds = {k for k in ("all-gather", "all-reduce") if f" {k}(" in compiled.as_text()
             or f" {k}-start(" in compiled.as_text()}
    hw, shape = get_profile("tpu_v5p"), mesh_shape(mesh)
    by_sum = gathered_by_sum(hw, len(devices), shape)
    assert kinds == ({"all-reduce"} if by_sum else {"all-gather"})
    assert by_sum == (len(devices) >= 64)
    n, tensor = len(devices), Tensor(0, (len(devices) * 128, 1024), "float32")
    link = group_link(hw, shape, ("data",))
    moved = MOVED["all-reduce" if by_sum else "all-gather"](n) * tensor.nbytes
    assert reshard_time(tensor, (("data",), ()), ((), ()), shape, hw) == pytest.approx(
        link.latency + moved / link.bandwidth)


@pytest.mark.slow
@pytest.mark.parametrize("topology, profile", [("v5p:2x2x1", "tpu_v5p"), ("v5p:2x2x2", "tpu_v5p"),
                                               ("v5e:2x4", "tpu_v5e"), ("v5e:4x4", "tpu_v5e")])
def test_a_reduce_scatter_over_every_chip_is_priced_as_the_tpu_compiler_emits_it(topology,
                                                                                 profile):
    """From 8 v5p chips (16 v5e) on, the TPU compiler makes a reduce-scatter over every device
    an all-reduce of the whole result: the profile says so (the cost model's side is in
    tests/test_rules_cost.py). Results of 256 to 8192 squared all did; below the threshold,
    a few sizes did too (512 squared on 4 v5p chips), which the profile leaves out."""
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    n = len(devices)
    mesh = Mesh(np.array(devices).reshape(n // 2, 2), ("data", "model"))
    both = ("data", "model")
    scatter = jax.shard_map(
        lambda x, w: jax.lax.psum_scatter(x.T @ w, both, scatter_dimension=1, tiled=True),
        mesh=mesh, in_specs=(P(both), P(both)), out_specs=P(None, both), check_vma=False)
    compiled = jax.jit(scatter).lower(*[jax.ShapeDtypeStruct((8 * n, 2048), jnp.bfloat16)] * 2
                                      ).compile()
    by_sum = scattered_by_sum(get_profile(profile), n, mesh_shape(mesh))
    assert _kinds(compiled) == ({"all-reduce"} if by_sum else {"reduce-scatter"})
    assert by_sum == (n >= (8 if profile == "tpu_v5p" else 16))


@pytest.mark.parametrize("topology, profile", [("v5p:2x2x2", "tpu_v5p"), ("v5e:2x4", "tpu_v5e"),
                                               ("v6e:2x4", "tpu_v6e")])
@pytest.mark.parametrize("dtype, left, dim", [(jnp.bfloat16, 128, 1), (jnp.bfloat16, 64, 1),
                                              (jnp.bfloat16, 256, 1), (jnp.float32, 128, 1),
                                              (jnp.bfloat16, 128, 0), (jnp.float16, 256, 0),
                                              (jnp.int32, 64, 1)])
def test_a_reduce_scatter_leaving_one_lane_row_is_priced_as_the_tpu_compiler_emits_it(
        topology, profile, dtype, left, dim):
    """The TPU compiler makes a reduce-scatter of bf16 along the result's last dimension that
    leaves each device 128 elements of it (its lanes) an all-reduce of the whole result and a
    slice, over a group of fewer than all chips too; 64 or 256 left, float32, or the first
    dimension reduce-scatter. Of other element types (float16, integers) it makes an
    all-reduce whatever is left. The profile's `scatter_by_sum_lanes` and `scatters_only` say
    so, and the cost model prices each as the collective it becomes. Seen on Llama-2-7B's
    weight gradients ([32, 128, 4096] split 32 ways on its last dimension, docs/decisions.md)."""
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    n = len(devices)
    mesh = Mesh(np.array(devices).reshape(n // 2, 2), ("data", "model"))
    parts = n // 2
    out = [None, None]
    out[dim] = "data"
    scatter = jax.shard_map(
        lambda x, w: jax.lax.psum_scatter(x.T @ w if dim else w.T @ x, "data",
                                          scatter_dimension=dim, tiled=True),
        mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P(*out), check_vma=False)
    shapes = [(8 * n, 256), (8 * n, parts * left)]
    compiled = jax.jit(scatter).lower(*[jax.ShapeDtypeStruct(s, dtype) for s in shapes]).compile()
    result = (256, parts * left) if dim else (parts * left, 256)
    tensor = Tensor(0, result, jnp.dtype(dtype).name)
    spec = tuple(("data",) if d == dim else () for d in range(2))
    by_sum = scattered_by_sum(get_profile(profile), parts, mesh_shape(mesh), tensor, spec,
                              ("data",))
    assert _kinds(compiled) == ({"all-reduce"} if by_sum else {"reduce-scatter"})
    assert by_sum == (dtype not in (jnp.float32, jnp.bfloat16)
                      or (dtype == jnp.bfloat16 and left == 128 and dim == 1))


@pytest.mark.slow
def test_gathers_over_two_axes_of_64_chips_are_priced_as_the_one_all_reduce_they_become():
    """On a (32, 2) mesh of 64 v5p chips, a tensor split over both axes gathered whole is one
    all-reduce over every chip; XLA CPU gathers it an axis at a time."""
    devices = topologies.get_topology_desc(topology_name="v5p:4x4x4", platform="tpu").devices
    mesh = Mesh(np.array(devices).reshape(32, 2), ("data", "model"))
    compiled = jax.jit(lambda x: x * 2, in_shardings=NamedSharding(mesh, P("data", "model")),
                       out_shardings=NamedSharding(mesh, P())).lower(
        jax.ShapeDtypeStruct((1024, 512), jnp.float32)).compile()
    assert _kinds(compiled) == {"all-reduce"}
    shape, src = mesh_shape(mesh), (("data",), ("model",))
    tpu = get_profile("tpu_v5p").gather_by_sum_from
    assert [k for k, *_ in reshard_sequence(src, ((), ()), shape, tpu)] == ["all-reduce"]
    assert [k for k, *_ in reshard_sequence(src, ((), ()), shape)] == ["all-gather"] * 2


# A dot's result [batch, lhs free, rhs free] and the dimension scattered, with what the TPU
# compiler makes of it: the dimensions inside its layout (batch, lhs free but the last, rhs
# free but the last, then the two last) are all-reduced.
INNER = [
    ("projection", (4, 256, 512), (512, 16, 128), (((2,), (0,)), ((), ())),
     ["reduce-scatter", "reduce-scatter", "all-reduce", "reduce-scatter"]),
    ("grouped projection", (4, 256, 512), (512, 4, 4, 128), (((2,), (0,)), ((), ())),
     ["reduce-scatter", "reduce-scatter", "all-reduce", "all-reduce", "reduce-scatter"]),
    ("scores", (4, 8, 512, 256), (4, 8, 512, 256), (((3,), (3,)), ((0, 1), (0, 1))),
     ["reduce-scatter", "all-reduce", "reduce-scatter", "reduce-scatter"]),
    ("rank 3", (4, 256, 512), (512, 1024), (((2,), (0,)), ((), ())),
     ["reduce-scatter"] * 3),
]


@pytest.mark.parametrize("topology, profile", [
    ("v5p:2x2x2", "tpu_v5p"), pytest.param("v5e:2x4", "tpu_v5e", marks=pytest.mark.slow),
    pytest.param("v6e:2x4", "tpu_v6e", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name, lhs, rhs, numbers, kinds", INNER, ids=[c[0] for c in INNER])
def test_a_reduce_scatter_inside_a_dots_layout_is_priced_as_the_all_reduce_it_becomes(
        topology, profile, name, lhs, rhs, numbers, kinds):
    """The contracted dimension split over 'model', the partial result reduce-scattered along
    each dimension in turn: the profile's `scatter_by_sum_inner` with `result_order` says which
    the TPU compiler makes an all-reduce of the whole result and a slice. Seen on Llama-2-7B's
    q, k and v projections scattered over their heads (docs/decisions.md)."""
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    mesh = Mesh(np.array(devices).reshape(len(devices) // 2, 2), ("data", "model"))
    (lc, rc), _ = numbers
    in_specs = tuple(P(*("model" if d in c else None for d in range(len(s))))
                     for s, c in ((lhs, lc), (rhs, rc)))
    tensors = [Tensor(0, lhs, "bfloat16"), Tensor(1, rhs, "bfloat16")]
    dot = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, numbers),
                         *[jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in (lhs, rhs)])
    tensors.append(Tensor(2, dot.shape, "bfloat16"))
    op = Op(0, "dot_general", (0, 1), (2,), {"dimension_numbers": numbers})
    for dim, kind in enumerate(kinds):
        out = [None] * len(dot.shape)
        out[dim] = "model"
        scatter = jax.shard_map(
            lambda a, b: jax.lax.psum_scatter(jax.lax.dot_general(a, b, numbers), "model",
                                              scatter_dimension=dim, tiled=True),
            mesh=mesh, in_specs=in_specs, out_specs=P(*out), check_vma=False)
        compiled = jax.jit(scatter).lower(*[jax.ShapeDtypeStruct(s, jnp.bfloat16)
                                            for s in (lhs, rhs)]).compile()
        assert _kinds(compiled) == {kind}, (name, dim)
        spec = tuple(("model",) if d == dim else () for d in range(len(dot.shape)))
        by_sum = scattered_by_sum(get_profile(profile), 2, mesh_shape(mesh), tensors[2], spec,
                                  ("model",), result_order(op, 0, tensors))
        assert by_sum == (kind == "all-reduce"), (name, dim)
