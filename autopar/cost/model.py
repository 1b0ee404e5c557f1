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
from autopar.rules.kinds import FUSED, FUSING_READERS, ROTATE, SCATTER_ADD
from autopar.rules.layout import shifts
from autopar.trace.analysis import per_graph
from autopar.trace.ir import Op, OpGraph, Tensor


def group_size(mesh: MeshShape, axes: Sequence[str]) -> int:
    return math.prod(mesh.axis_size(a) for a in axes)


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


@per_graph  # asked by every memory estimate of the graph
def fused_values(graph: OpGraph) -> frozenset[int]:
    """Values an ideal fusing compiler never writes to memory: made by an operator it fuses
    into its readers, and read only by operators that take fused producers in (loop fusions,
    reductions), and not a result of the step. A platform's compiler fuses no more
    (BufferModel.fused_values; XLA CPU writes a value several fusions read, cost/xla/cpu.py).
    An elementwise chain reads its inputs and writes its result once, not once per operator;
    charged per operator, a softmax over a vocabulary cost twice what XLA's program reads."""
    readers: dict[int, list[str]] = {}
    for op in graph.ops:
        for t in set(op.inputs):
            readers.setdefault(t, []).append(op.primitive)
    outputs = set(graph.outputs)
    return frozenset(t for op in graph.ops if op.primitive in FUSED for t in op.outputs
                     if t not in outputs and readers.get(t)
                     and all(r in FUSING_READERS for r in readers[t]))


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
    comm = 0.0
    for t, s in zip(op.outputs, strategy.out_specs):
        for kind, axes, held in partial_collectives(op, strategy, tensors[t], s, mesh):
            n, link = group_size(mesh, axes), group_link(hw, mesh, tuple(axes))
            if kind == "reduce-scatter" and scattered_by_sum(hw, n, mesh):
                comm += all_reduce(held * n, n, link)
                continue
            if kind == "reduce-scatter":
                comm += reduce_scatter(held * n, n, link)
                continue
            comm += all_reduce(held, n, link)
            if n > 1 and t in facts.combined:
                comm -= link.latency * (1 - 1 / facts.combined[t])
    for axes, nbytes in _shifted(op, strategy, tensors, mesh):
        comm += collective_time("collective-permute", nbytes, 2, group_link(hw, mesh, axes))
    return compute * op.repeat, comm * op.repeat


def _shifted(op: Op, strategy: Strategy, tensors: Sequence[Tensor], mesh: MeshShape
             ) -> list[tuple[tuple[str, ...], float]]:
    """(axes, bytes each device sends) of the collective-permutes a pad that shifts a split
    dimension needs (rules.layout.shifts), or a rotation's: the rows that cross into the next
    device's block."""
    if op.primitive not in ("pad", ROTATE):
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


def gathers(src: Spec, dropped: Sequence[str], mesh: MeshShape) -> list[tuple[int, int]]:
    """The all-gathers that drop `dropped` from `src`, as XLA emits them: one per tensor
    dimension losing axes (all its dropped axes at once), the last dimension first; each as
    (the dimension, the factor by which it grows the buffer)."""
    return [(d, n) for d in reversed(range(len(src)))
            if (n := group_size(mesh, [a for a in src[d] if a in dropped])) > 1]


def _changes(src: Spec, dst: Spec) -> tuple[dict, dict, list, list, bool, set]:
    """What a resharding changes: each axis's (dimension, position) in `src` and in `dst`, the
    axes that move (within or across dimensions), those dropped, whether any is added, and
    the (source, destination) dimension pairs the moving axes cross."""
    where_src = {a: (d, k) for d, axes in enumerate(src) for k, a in enumerate(axes)}
    where_dst = {a: (d, k) for d, axes in enumerate(dst) for k, a in enumerate(axes)}
    moved = [a for a in where_src if a in where_dst and where_src[a] != where_dst[a]]
    dropped = [a for a in where_src if a not in where_dst]
    added = any(a not in where_src for a in where_dst)
    across = {(where_src[a][0], where_dst[a][0]) for a in moved
              if where_src[a][0] != where_dst[a][0]}
    return where_src, where_dst, moved, dropped, added, across


@functools.lru_cache(maxsize=1 << 20)
def reshard_stops(src: Spec, dst: Spec) -> tuple[Spec, ...]:
    """The shardings a resharding from `src` to `dst` is lowered through, in order (none
    where XLA's partitioner, given the two ends, compiles it as `reshard_sequence` prices).

    Given only the two ends of three kinds of resharding, XLA's partitioner (jax 0.10.2) can
    find no pattern: it gathers the whole tensor and slices, logging "Involuntary full
    rematerialization" (on a 2x4 mesh, every one of the last two kinds and 12 of the 18 of
    the first among the reshardings of a 3-D tensor):
    - axes dropped and others added, the rest in place (layers split over 'data' on one
      dimension becoming split over 'stage' on another);
    - an axis moving to another dimension while another axis leaves the dimension it comes
      from, none added (`P(None, None, ('a', 'b'))` becoming `P('a')`);
    - axes moving from one dimension into two, or from two into one (`P(None, None, ('a',
      'b'))` becoming `P('a', 'b')`).
    Through these stops each step has a pattern: the axes dropped (and, in the last two, the
    moving axes but one dimension's) are gathered, that dimension's axes move in one
    all-to-all (before the gathers where they are the minor axes of their dimension), and the
    axes left to add are sliced locally. Measured on XLA CPU, 8 devices (a, b) = (2, 4): the
    second example on a (2, 4, 8) tensor gathered 256 bytes per device at once, and in steps
    gathers 128 and moves 128 in an all-to-all, without the warning."""
    where_src, where_dst, moved, dropped, added, across = _changes(src, dst)
    if not moved:
        return ((tuple(tuple(a for a in axes if a not in dropped) for axes in src),)
                if dropped and added else ())
    if not ((not added and any(p == where_src[b][0] for p, _ in across for b in dropped))
            or any(p != q and (p[0] == q[0] or p[1] == q[1]) for p in across for q in across)):
        return ()
    p, q = min(across)  # the axes moving from dimension p to q move in one all-to-all
    carried = tuple(a for a in src[p] if a in moved and where_dst[a][0] == q)
    left = [k for k, a in enumerate(src[p]) if a not in carried]
    if left and min(left) < where_src[carried[0]][1]:
        # The carried axes are minor in p: moved first, behind q's axes, the rest in place;
        # then what is left (`P(None, ('data', 'model'))` to `P('model')` on 2x4: an
        # all-to-all over 'model', then an all-gather over 'data').
        first = tuple(tuple(a for a in axes if a not in carried) + (carried if d == q else ())
                      for d, axes in enumerate(src))
        return (first, *reshard_stops(first, dst))
    # The carried axes lead in p: the axes that drop or move elsewhere are gathered first.
    kept = (where_src.keys() - set(dropped) - set(moved)) | set(carried)
    gathered = tuple(tuple(a for a in axes if a in kept) for axes in src)
    arrived = tuple(tuple(a for a in axes if a in kept) for axes in dst)
    return tuple(dict.fromkeys(s for s in (gathered, arrived) if s not in (src, dst)))


@functools.lru_cache(maxsize=1 << 20)
def reshard_sequence(src: Spec, dst: Spec, mesh: MeshShape, gather_by_sum_from: int = 0
                     ) -> tuple[tuple[str, int, float, int, tuple[str, ...]], ...]:
    """The collectives that turn `src` sharding into `dst`, in XLA's order, each as (kind,
    devices in its group, its result's share of the tensor on one device, the dimension an
    all-gather concatenates or -1, the mesh axes of its group): those of each step between
    the stops the lowering constrains to (`reshard_stops`). `gather_by_sum_from`: the
    platform's Hardware.gather_by_sum_from (see `_summed_gathers`)."""
    ends = (src, *reshard_stops(src, dst), dst)
    return tuple(c for a, b in zip(ends, ends[1:])
                 for c in _summed_gathers(_direct_sequence(a, b, mesh), mesh, gather_by_sum_from))


def _summed_gathers(steps: tuple, mesh: MeshShape, gather_by_sum_from: int) -> tuple:
    """`steps` of one resharding, where gathers over several dimensions that together span
    every device of a large enough program are one all-reduce of the gathered result: the TPU
    compiler (libtpu 0.0.42.1) merges them into one gather over all devices, made by a sum.
    On v5p 4x4x4 as (32, 2), (16, 4) and (8, 8), `P('data', 'model')` to `P()` compiles to
    one all-reduce of the whole tensor; XLA CPU gathers axis by axis (tests/test_tpu.py)."""
    gathered = [step for step in steps if step[0] == "all-gather"]
    if (len(gathered) < 2 or len(gathered) != len(steps)
            or not 0 < gather_by_sum_from <= mesh.size
            or math.prod(step[1] for step in gathered) != mesh.size):
        return steps
    axes = tuple(a for step in gathered for a in step[4])
    return (("all-reduce", mesh.size, gathered[-1][2], -1, axes),)


def _direct_sequence(src: Spec, dst: Spec, mesh: MeshShape
                     ) -> tuple[tuple[str, int, float, int, tuple[str, ...]], ...]:
    """`reshard_sequence` of a resharding XLA's partitioner has a pattern for.

    Axes that move (within or across dimensions) are one all-to-all, but for axes only
    reordered within their dimensions (a collective-permute); axes dropped are gathered
    (see `gathers`); axes added are free (each device keeps its slice). The all-to-all comes
    after the all-gathers where an axis changes dimension and none is added (the gathered
    shard moves: `P('data', 'model')` to `P(None, 'data')` on 4x2 compiles to an all-gather
    over 'model', then an all-to-all of the (4, 64) shard), and before them otherwise, where
    the partitioner first permutes shards within a dimension. docs/decisions.md has what
    this was measured against."""
    where_src, where_dst, moved, dropped, added, across = _changes(src, dst)
    share = 1.0 / group_size(mesh, list(where_src))
    if moved and not dropped and not across:
        # Axes reordered within their dimensions (`P('model')` to `P(('data', 'model'))`): a
        # device's new block is not inside its old one, and XLA fetches it whole from the
        # device holding it, one collective-permute of the result's shard (measured on 2x4,
        # XLA CPU, jax 0.10.2: 8 MiB for a 64 MiB tensor, where an all-to-all was priced).
        axes = tuple(a for d in {where_dst[a][0] for a in moved} for a in dst[d])
        return (("collective-permute", 2, 1.0 / group_size(mesh, list(where_dst)), -1, axes),)
    gather_first = not added and bool(across) and bool(moved)
    steps: list[tuple[str, int, float, int, tuple[str, ...]]] = []
    if moved and not gather_first:
        steps.append(("all-to-all", group_size(mesh, moved), share, -1, tuple(moved)))
    for d, n in gathers(src, dropped, mesh):
        share *= n
        steps.append(("all-gather", n, share, d, tuple(a for a in src[d] if a in dropped)))
    if moved and gather_first:
        steps.append(("all-to-all", group_size(mesh, moved), share, -1, tuple(moved)))
    return tuple(steps)


@functools.lru_cache(maxsize=1 << 20)
def reshard_terms(src: Spec, dst: Spec, mesh: MeshShape, hw: Hardware) -> tuple[float, float]:
    """(latency seconds, seconds per byte of the tensor) to turn `src` sharding into `dst`
    (see reshard_sequence), each step on its axes' link, with the layout copies it needs. The
    time is linear in the tensor's size, latency + per_byte * bytes, so these terms serve
    every tensor.
    """
    latency = per_byte = 0.0
    for kind, n, share, dim, axes in reshard_sequence(src, dst, mesh, hw.gather_by_sum_from):
        link = group_link(hw, mesh, axes)
        latency += link.latency
        # Gathering step by step moves the bytes one all-gather over all the axes would.
        if kind == "collective-permute":  # every device receives its whole new shard
            per_byte += share / link.bandwidth
        elif kind == "all-reduce" or kind == "all-gather" and gathered_by_sum(hw, n, mesh):
            per_byte += MOVED["all-reduce"](n) * share / link.bandwidth
        else:
            per_byte += (n - 1) / (2 * n if kind == "all-to-all" else n) * share / link.bandwidth
        if kind == "all-gather" and dim > 0:
            # XLA gathers another dimension than the first in a layout that makes it major,
            # then copies the result back (read and written once). Seen on XLA CPU 0.10.2,
            # where a mixture of experts' tokens gathered over the sequence dimension paid 8
            # such copies; taken to hold elsewhere until measured. A gathered tensor whose
            # leading dimensions are 1 on each device needs none: rare, not told apart.
            per_byte += 2 * share / hw.memory_bandwidth
    return latency, per_byte


def gathered_by_sum(hw: Hardware, n: int, mesh: MeshShape) -> bool:
    """Whether `hw`'s compiler makes an all-gather over `n` devices of `mesh` an all-reduce
    (over every device of a large enough program: Hardware.gather_by_sum_from)."""
    return 0 < hw.gather_by_sum_from <= n == mesh.size


def scattered_by_sum(hw: Hardware, n: int, mesh: MeshShape) -> bool:
    """Whether `hw`'s compiler makes a reduce-scatter over `n` devices of `mesh` an all-reduce
    of the whole result (over every device of a large enough program:
    Hardware.scatter_by_sum_from)."""
    return 0 < hw.scatter_by_sum_from <= n == mesh.size


def reshard_collectives(tensor: Tensor, src: Spec, dst: Spec, mesh: MeshShape, hw: Hardware
                        ) -> dict[str, float]:
    """Bytes of each collective's result on one device when `src` becomes `dst`, by kind: the
    steps of reshard_sequence on `hw`'s platform, in the units a compiled program's
    collectives are read in."""
    out: dict[str, float] = {}
    for kind, _, share, _, _ in reshard_sequence(src, dst, mesh, hw.gather_by_sum_from):
        out[kind] = out.get(kind, 0.0) + tensor.nbytes * share
    return out


def op_collectives(op: Op, strategy: Strategy, tensors: Sequence[Tensor], mesh: MeshShape,
                   hw: Hardware) -> dict[str, float]:
    """The all-reduce and reduce-scatter bytes (results on one device, per step) the op's
    partial sums need on `hw`'s platform, and the collective-permute bytes of a shift."""
    out: dict[str, float] = {}
    for t, s in zip(op.outputs, strategy.out_specs):
        for kind, axes, held in partial_collectives(op, strategy, tensors[t], s, mesh):
            n = group_size(mesh, axes)
            if kind == "reduce-scatter" and scattered_by_sum(hw, n, mesh):
                kind, held = "all-reduce", held * n
            if n > 1:
                out[kind] = out.get(kind, 0.0) + op.repeat * held
    for _, nbytes in _shifted(op, strategy, tensors, mesh):
        out["collective-permute"] = out.get("collective-permute", 0.0) + op.repeat * nbytes
    return out


def reshard_time(tensor: Tensor, src: Spec, dst: Spec, mesh: MeshShape, hw: Hardware) -> float:
    """Seconds to turn `tensor` sharded as `src` into `dst` (see reshard_terms)."""
    latency, per_byte = reshard_terms(src, dst, mesh, hw)
    return latency + per_byte * tensor.nbytes
