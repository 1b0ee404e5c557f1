"""The cost model: estimated seconds per step for computation and collectives.

Collectives use the alpha-beta model over the devices of the mesh axes involved, with B the
bytes each device holds of the buffer: all-reduce a + 2b(n-1)/n B, all-gather and
reduce-scatter a + b(n-1)/n B (B the gathered size), all-to-all a + b(n-1)/(2n) B. Alpha and
beta are those of the link the axes sit on (`hardware.group_link`): a collective over an axis
that crosses nodes pays the network's.
"""
from __future__ import annotations

import functools
import math
from types import MappingProxyType
from typing import Mapping, NamedTuple, Sequence

from autopar.cost.hardware import Hardware, Link, group_link
from autopar.mesh import MeshShape
from autopar.rules.factors import Spec, Strategy
from autopar.rules.kinds import FUSED, FUSING_READERS, SCATTER_ADD, SHIFTING
from autopar.rules.layout import shifts
from autopar.rules.work import flops_for
from autopar.trace.analysis import per_graph
from autopar.trace.ir import Op, OpGraph, Tensor


def group_size(mesh: MeshShape, axes: Sequence[str]) -> int:
    return math.prod(map(mesh.axis_size, axes))


def all_reduce(nbytes: float, n: int, link: Link) -> float:
    return 0.0 if n <= 1 else link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def all_gather(nbytes: float, n: int, link: Link) -> float:
    """nbytes: the gathered size on each device."""
    return 0.0 if n <= 1 else link.latency + (n - 1) / n * nbytes / link.bandwidth


def reduce_scatter(nbytes: float, n: int, link: Link) -> float:
    """nbytes: the partial buffer each device holds before the reduction."""
    return all_gather(nbytes, n, link)


def all_to_all(nbytes: float, n: int, link: Link) -> float:
    return 0.0 if n <= 1 else link.latency + (n - 1) / (2 * n) * nbytes / link.bandwidth


# The byte fraction each kind moves per byte of its result on one device, over n devices.
MOVED = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
         "reduce-scatter": lambda n: (n - 1), "all-to-all": lambda n: (n - 1) / (2 * n),
         "collective-permute": lambda n: 1.0}


def collective_time(kind: str, result_bytes: float, n: int, link: Link) -> float:
    """Seconds of one collective of `kind` over `n` devices on `link`, from the bytes of its
    result on one device (the unit a compiled program's collectives are read in): the
    functions above, with a reduce-scatter's input n times its result."""
    if n <= 1:
        return 0.0
    return link.latency + MOVED[kind](n) * result_bytes / link.bandwidth


def shard_bytes(tensor: Tensor, spec: Spec, mesh: MeshShape) -> float:
    """Bytes one device holds of `tensor` sharded as `spec`."""
    return tensor.nbytes / _ways(spec, mesh)


@functools.lru_cache(maxsize=1 << 16)
def _ways(spec: Spec, mesh: MeshShape) -> int:
    """Into how many shards `spec` cuts a tensor (asked for every strategy of every tensor)."""
    return group_size(mesh, [a for axes in spec for a in axes])


def op_flops(op: Op, tensors: Sequence[Tensor]) -> float:
    """Floating-point operations of one execution of the op, unsharded (rules.work.FLOPS)."""
    return flops_for(op.primitive, [tensors[t].shape for t in op.inputs],
                     [tensors[t].shape for t in op.outputs], op.params)


@per_graph  # asked by every memory estimate of the graph
def fused_values(graph: OpGraph) -> frozenset[int]:
    """Values an ideal fusing compiler never writes to memory: made by an operator it fuses
    into its readers, and read only by operators that take fused producers in (loop fusions,
    reductions), and not a result of the step. A platform's compiler fuses no more
    (BufferModel.fused_values; XLA CPU writes a value several fusions read, cost/xla/cpu.py).
    An elementwise chain reads its inputs and writes its result once, not once per operator;
    charged per operator, a softmax over a vocabulary cost twice what XLA's program reads."""
    return fused_when_read_by(graph, FUSING_READERS)


def fused_when_read_by(graph: OpGraph, fusing: frozenset[str]) -> frozenset[int]:
    """The values made by an operator fused into its readers, read only by `fusing`
    primitives, that are not results of the step."""
    readers: dict[int, list[str]] = {}
    for op in graph.ops:
        for t in set(op.inputs):
            readers.setdefault(t, []).append(op.primitive)
    outputs = set(graph.outputs)
    return frozenset(t for op in graph.ops if op.primitive in FUSED for t in op.outputs
                     if t not in outputs and readers.get(t)
                     and all(r in fusing for r in readers[t]))


class ValueFacts(NamedTuple):
    """What XLA does with some values of a graph, as the cost model prices it."""

    fused: frozenset[int] = frozenset()  # never written to memory: fused_values
    # all-reduced in one collective with others (see value_facts): value -> how many share it
    combined: Mapping[int, int] = MappingProxyType({})


def op_signature(op: Op, tensors: Sequence[Tensor], facts: ValueFacts = ValueFacts()
                 ) -> tuple:
    """Equal for operators that cost the same under the same strategy (the same operator of
    every block): op_time and op_collectives read nothing else of the op."""
    return (op.primitive, op.repeat, str(op.params.get("dimension_numbers")),
            str(op.params.get("padding_config")), op.params.get("shift"),
            tuple((tensors[t].shape, tensors[t].dtype, t in facts.fused, facts.combined.get(t))
                  for t in (*op.inputs, *op.outputs)))


def op_time(op: Op, strategy: Strategy, tensors: Sequence[Tensor], mesh: MeshShape,
            hw: Hardware, facts: ValueFacts = ValueFacts()) -> tuple[float, float]:
    """(compute seconds, communication seconds) of the op under `strategy`, per step: a
    roofline over its flops and the bytes it moves to and from memory (none for fused
    values), and its partial sums' collectives (a combined all-reduce pays its share of one
    latency). See value_facts."""
    fused = facts.fused
    flops = op_flops(op, tensors) / strategy.parallel
    moved = sum(shard_bytes(tensors[t], s, mesh)
                for t, s in zip(op.inputs, strategy.in_specs) if t not in fused)
    moved += sum(shard_bytes(tensors[t], s, mesh)
                 for t, s in zip(op.outputs, strategy.out_specs) if t not in fused)
    compute = max(flops / hw.flops, moved / hw.memory_bandwidth)
    comm = sum(_partial_time(op, strategy, k, tensors, mesh, hw, facts)
               for k in range(len(op.outputs)))
    for axes, nbytes in _shifted(op, strategy, tensors, mesh):
        comm += collective_time("collective-permute", nbytes, 2, group_link(hw, mesh, axes))
    return compute * op.repeat, comm * op.repeat


def _partial_time(op: Op, strategy: Strategy, k: int, tensors: Sequence[Tensor],
                  mesh: MeshShape, hw: Hardware, facts: ValueFacts) -> float:
    """Seconds of the collectives resolving the partial sums of the op's result `k`, once."""
    t, s = op.outputs[k], strategy.out_specs[k]
    comm = 0.0
    for kind, axes, held in partial_collectives(op, strategy, tensors[t], s, mesh):
        n, link = group_size(mesh, axes), group_link(hw, mesh, tuple(axes))
        if kind == "reduce-scatter" and scattered_by_sum(hw, n, mesh, tensors[t], s, axes,
                                                         result_order(op, k, tensors)):
            comm += all_reduce(held * n, n, link)
        elif kind == "reduce-scatter":
            comm += reduce_scatter(held * n, n, link)
        else:
            comm += all_reduce(held, n, link)
            if n > 1 and t in facts.combined:
                comm -= link.latency * (1 - 1 / facts.combined[t])
    return comm


def partial_sum(op: Op, strategy: Strategy, k: int, tensors: Sequence[Tensor],
                mesh: MeshShape, hw: Hardware, facts: ValueFacts = ValueFacts()
                ) -> tuple[tuple, float, dict[str, float]] | None:
    """How the op's result `k` is summed across devices under `strategy`, per step: (its spec
    and the collectives' kinds and axes, their seconds, their bytes by kind), or None where
    it holds no partial sums. Two results of equal first entries are summed alike: a
    compiler that reassociates sums (cost.xla.reassociates_sums) adds them before one
    collective."""
    t, s = op.outputs[k], strategy.out_specs[k]
    found = [(kind, tuple(axes), held) for kind, axes, held in
             partial_collectives(op, strategy, tensors[t], s, mesh)
             if group_size(mesh, axes) > 1]
    if not found:
        return None
    nbytes: dict[str, float] = {}
    for kind, axes, held in found:
        n = group_size(mesh, axes)
        if kind == "reduce-scatter" and scattered_by_sum(hw, n, mesh, tensors[t], s, axes,
                                                         result_order(op, k, tensors)):
            kind, held = "all-reduce", held * n
        nbytes[kind] = nbytes.get(kind, 0.0) + op.repeat * held
    seconds = op.repeat * _partial_time(op, strategy, k, tensors, mesh, hw, facts)
    return (s, tuple((kind, axes) for kind, axes, _ in found)), seconds, nbytes


def _shifted(op: Op, strategy: Strategy, tensors: Sequence[Tensor], mesh: MeshShape
             ) -> list[tuple[tuple[str, ...], float]]:
    """(axes, bytes each device sends) of the collective-permutes a pad that shifts a split
    dimension needs (rules.layout.shifts), or a rotation's: the rows that cross into the next
    device's block."""
    if op.primitive not in SHIFTING:
        return []
    out = []
    spec = strategy.out_specs[0]
    tensor = tensors[op.outputs[0]]
    for d, rows in shifts(op.params).items():
        n = group_size(mesh, spec[d])
        if n > 1:
            block = tensor.shape[d] // n
            out.append((spec[d], shard_bytes(tensor, spec, mesh) * min(rows, block) / block))
    return out


def partial_split(strategy: Strategy, spec: Spec) -> tuple[list[str], list[str]]:
    """The partial-sum axes a result is reduce-scattered over (they shard it) and those it is
    all-reduced over."""
    placed = {a for axes in spec for a in axes}
    return ([a for a in strategy.partial_axes if a in placed],
            [a for a in strategy.partial_axes if a not in placed])


def partial_collectives(op: Op, strategy: Strategy, tensor: Tensor, spec: Spec,
                        mesh: MeshShape) -> list[tuple[str, list[str], float]]:
    """(kind, axes, result bytes per device) of the collectives that resolve the partial sums
    of `op`'s result `tensor` under `strategy`, held as `spec`: a reduce-scatter over the
    partial axes that split the result and an all-reduce over the rest. A scatter-add
    differs (XLA's SPMD partitioner, measured on XLA CPU, jax 0.10.2): its partial results
    are all-reduced whole, one all-reduce per dimension of its updates that the partial axes
    split (updates split P('data', 'model') compile to an all-reduce over 'model' and another
    over 'data', each of the whole result; P(('data', 'model')) to one), then sliced where the
    result is split; never a reduce-scatter."""
    scatter, reduce = partial_split(strategy, spec)
    if op.primitive not in SCATTER_ADD or len(strategy.in_specs) < 3:
        held = shard_bytes(tensor, spec, mesh)
        return [(kind, axes, held) for kind, axes in (("reduce-scatter", scatter),
                                                      ("all-reduce", reduce)) if axes]
    axes = scatter + reduce
    whole = shard_bytes(tensor, tuple(tuple(a for a in d if a not in axes) for d in spec), mesh)
    groups = [[a for a in dim if a in axes] for dim in strategy.in_specs[2]]
    groups = [g for g in groups if g]
    rest = [a for a in axes if not any(a in g for g in groups)]
    return [("all-reduce", g, whole) for g in groups + ([rest] if rest else [])]


def scattered_by_sum(hw: Hardware, n: int, mesh: MeshShape, tensor: Tensor | None = None,
                     spec: Spec = (), axes: Sequence[str] = (),
                     order: Sequence[int] | None = None) -> bool:
    """Whether `hw`'s compiler makes a reduce-scatter over `axes` (`n` devices of `mesh`) of
    `tensor`, held as `spec`, an all-reduce of the whole result: over every device of a large
    enough program (Hardware.scatter_by_sum_from), of elements it does not reduce-scatter
    (Hardware.scatters_only), where it scatters the last dimension of bfloat16 leaving each
    device as many elements as Hardware.scatter_by_sum_lanes, or a dimension inside the
    result's layout (Hardware.scatter_by_sum_inner; `order`: the result's dimensions, most
    major first, as `result_order` gives them; None: as numbered)."""
    if 0 < hw.scatter_by_sum_from <= n == mesh.size:
        return True
    if tensor is None:
        return False
    if hw.scatters_only and tensor.dtype not in hw.scatters_only:
        return True
    if not spec:
        return False
    scattered = [d for d, held in enumerate(spec) if set(axes) & set(held)]
    rank = len(tensor.shape)
    if hw.scatter_by_sum_inner and rank > 3:
        place = {d: p for p, d in enumerate(order or range(rank))}
        if any(1 <= place[d] < rank - 2 for d in scattered):
            return True
    return (bool(hw.scatter_by_sum_lanes) and tensor.dtype == "bfloat16"
            and rank - 1 in scattered
            and tensor.shape[-1] == hw.scatter_by_sum_lanes * group_size(mesh, spec[-1]))


def result_order(op: Op, k: int, tensors: Sequence[Tensor]) -> tuple[int, ...] | None:
    """The dimensions of the op's result `k` as its layout holds them, most major first, where
    that is not their numbering: a dot's result [batch, lhs free, rhs free] is laid out batch
    first, then each operand's free dimensions but its last, then the two last (seen in the
    TPU compiler's programs, libtpu 0.0.42.1: [b, s, heads, head_dim] is held b, heads, s,
    head_dim). None: as numbered."""
    if op.primitive != "dot_general" or k:
        return None
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    lhs = len(tensors[op.inputs[0]].shape) - len(lc) - len(lb)
    rhs = len(tensors[op.inputs[1]].shape) - len(rc) - len(rb)
    if not lhs or not rhs:
        return None
    batch = list(range(len(lb)))
    lhs_free = [len(lb) + i for i in range(lhs)]
    rhs_free = [len(lb) + lhs + i for i in range(rhs)]
    return tuple(batch + lhs_free[:-1] + rhs_free[:-1] + [lhs_free[-1], rhs_free[-1]])


def op_collectives(op: Op, strategy: Strategy, tensors: Sequence[Tensor], mesh: MeshShape,
                   hw: Hardware) -> dict[str, float]:
    """The all-reduce and reduce-scatter bytes (results on one device, per step) the op's
    partial sums need on `hw`'s platform, and the collective-permute bytes of a shift."""
    out: dict[str, float] = {}
    for k in range(len(op.outputs)):
        summed = partial_sum(op, strategy, k, tensors, mesh, hw)
        for kind, nbytes in summed[2].items() if summed else ():
            out[kind] = out.get(kind, 0.0) + nbytes
    for _, nbytes in _shifted(op, strategy, tensors, mesh):
        out["collective-permute"] = out.get("collective-permute", 0.0) + op.repeat * nbytes
    return out
