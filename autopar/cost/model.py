"""The cost model: estimated seconds per step for computation and collectives.

Collectives use the alpha-beta model over the devices of the mesh axes involved, with B the
bytes each device holds of the buffer: all-reduce a + 2b(n-1)/n B, all-gather and
reduce-scatter a + b(n-1)/n B (B the gathered size), all-to-all a + b(n-1)/(2n) B.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from autopar.cost.hardware import Hardware
from autopar.ir import Op, Tensor
from autopar.mesh import MeshShape
from autopar.rules.factors import Spec, Strategy


def group_size(mesh: MeshShape, axes: Sequence[str]) -> int:
    return math.prod(mesh.axis_size(a) for a in axes)


def all_reduce(nbytes: float, n: int, hw: Hardware) -> float:
    return 0.0 if n <= 1 else hw.link_latency + 2 * (n - 1) / n * nbytes / hw.link_bandwidth


def all_gather(nbytes: float, n: int, hw: Hardware) -> float:
    """nbytes: the gathered size on each device."""
    return 0.0 if n <= 1 else hw.link_latency + (n - 1) / n * nbytes / hw.link_bandwidth


def all_to_all(nbytes: float, n: int, hw: Hardware) -> float:
    return 0.0 if n <= 1 else hw.link_latency + (n - 1) / (2 * n) * nbytes / hw.link_bandwidth


def shard_bytes(tensor: Tensor, spec: Spec, mesh: MeshShape) -> float:
    """Bytes one device holds of `tensor` sharded as `spec`."""
    return tensor.nbytes / group_size(mesh, [a for axes in spec for a in axes])


def op_flops(op: Op, tensors: Sequence[Tensor]) -> float:
    """Floating-point operations of one execution of the op, unsharded."""
    ins = [tensors[t] for t in op.inputs]
    outs = [tensors[t] for t in op.outputs]
    out_elems = sum(math.prod(t.shape) for t in outs)
    if op.primitive == "dot_general":
        (lc, _), _ = op.params["dimension_numbers"]
        return 2.0 * out_elems * math.prod(ins[0].shape[d] for d in lc)
    if op.primitive == "conv_general_dilated":
        rhs = ins[1].shape
        dn = op.params["dimension_numbers"]
        window = math.prod(rhs[d] for d in dn.rhs_spec[2:])
        return 2.0 * out_elems * rhs[dn.rhs_spec[1]] * window
    return float(max([out_elems] + [math.prod(t.shape) for t in ins]))


def op_time(op: Op, strategy: Strategy, tensors: Sequence[Tensor], mesh: MeshShape,
            hw: Hardware) -> tuple[float, float]:
    """(compute seconds, communication seconds) of the op under `strategy`, per step."""
    flops = op_flops(op, tensors) / strategy.parallel
    moved = sum(shard_bytes(tensors[t], s, mesh) for t, s in zip(op.inputs, strategy.in_specs))
    moved += sum(shard_bytes(tensors[t], s, mesh) for t, s in zip(op.outputs, strategy.out_specs))
    compute = max(flops / hw.flops, moved / hw.memory_bandwidth)
    comm = 0.0
    if strategy.partial_axes:
        n = group_size(mesh, strategy.partial_axes)
        comm = sum(all_reduce(shard_bytes(tensors[t], s, mesh), n, hw)
                   for t, s in zip(op.outputs, strategy.out_specs))
    return compute * op.repeat, comm * op.repeat


def reshard_time(tensor: Tensor, src: Spec, dst: Spec, mesh: MeshShape, hw: Hardware) -> float:
    """Seconds to turn `tensor` sharded as `src` into `dst`.

    Axes that move to another dimension cost an all-to-all, axes dropped an all-gather; axes
    added are free (each device keeps its slice).
    """
    if src == dst:
        return 0.0
    where_src = {a: (d, k) for d, axes in enumerate(src) for k, a in enumerate(axes)}
    where_dst = {a: (d, k) for d, axes in enumerate(dst) for k, a in enumerate(axes)}
    size = shard_bytes(tensor, src, mesh)
    moved = [a for a in where_src if a in where_dst and where_src[a] != where_dst[a]]
    dropped = [a for a in where_src if a not in where_dst]
    cost = 0.0
    if moved:
        cost += all_to_all(size, group_size(mesh, moved), hw)
    for a in dropped:
        size *= mesh.axis_size(a)
        cost += all_gather(size, mesh.axis_size(a), hw)
    return cost


def reshard_matrix(tensor: Tensor, srcs: Sequence[Spec], dsts: Sequence[Spec], mesh: MeshShape,
                   hw: Hardware) -> np.ndarray:
    return np.array([[reshard_time(tensor, s, d, mesh, hw) for d in dsts] for s in srcs],
                    dtype=np.float64).reshape(len(srcs), len(dsts))
