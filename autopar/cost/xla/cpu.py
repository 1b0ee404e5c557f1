"""What XLA's CPU compiler does to a step's buffers that the step's equations do not show:
which operators it fuses, the copies and transposes it makes, the collectives it combines, the
steps it runs first and the optimizer's as soon as it can, and the donated inputs' allocations
it fills while they hold nothing. Each rule was read from XLA's dumps
(`--xla_dump_to`: the optimized HLO, its buffer assignment and live ranges) and is checked
against compiled steps in tests/test_memory.py; docs/decisions.md has the measurements.
"""
from __future__ import annotations

import bisect
import functools
from typing import Any, Callable, Sequence

import numpy as np

from autopar.cost.model import fused_values as fusible_values
from autopar.cost.model import group_size, shard_bytes
from autopar.cost.resharding import reshard_sequence
from autopar.cost.xla.buffers import ValueBuffers
from autopar.mesh import MeshShape
from autopar.rules.factors import Spec, replicated
from autopar.rules.kinds import CHEAP, FUSED, FUSING_READERS
from autopar.trace.analysis import ancestors, edges, per_graph, roles
from autopar.trace.ir import OpGraph, Equation, Tensor


def scatter_into_sum(program: Sequence[Equation], producer_step: dict[int, int],
                     primitive: Callable[[int], str], i: int, readers: list[int]) -> bool:
    """Whether step i scatter-adds into zeros for a sum alone (the transpose of a gather, read
    by the gradient's add): XLA's simplifier scatters into the sum's other operand instead, in
    place, so the scatter has no buffer of its own."""
    if primitive(i) != "scatter-add" or len(readers) != 1:
        return False
    into = producer_step.get(program[i].inputs[0])
    return (into is not None and primitive(into) == "broadcast_in_dim"
            and primitive(readers[0]) in ("add", "add_any"))


def copied_before_update(graph: OpGraph, aliased: set[int], groups: list[list[int]]
                         ) -> list[int]:
    """The donated inputs XLA copies before updating them in place: those with a reader that
    the update does not depend on (its copy insertion keeps the copy where the old value's
    readers are not all ordered before the new value's definition by data dependence). XLA
    combines all-reduces that do not depend on each other, over the same devices, into one
    (`groups`, see all_reduce_groups); each then depends on what any of them depends on
    (gradients all-reduced together order every update after the whole backward pass)."""
    producer_step, readers = edges(graph)
    before = ancestors(graph)
    members = [sum(1 << m for m in g) for g in groups]
    reach = [functools.reduce(lambda a, m: a | before[m], g, 0) | members[k]
             for k, g in enumerate(groups)]
    out = []
    for o, i in graph.donated_pairs.items():
        t, new = graph.inputs[i], graph.outputs[o]
        update = producer_step.get(new)
        if new not in aliased or update is None or t == new:
            continue
        after = before[update]
        grown = True
        while grown:
            grown = False
            for k in range(len(groups)):
                if after & members[k] and (after | reach[k]) != after:
                    after |= reach[k]
                    grown = True
        if any(r != update and not after >> r & 1 for r in readers.get(t, ())):
            out.append(t)
    return out


def all_reduce_groups(graph: OpGraph, all_reduces: dict[int, tuple[str, ...]]
                      ) -> list[list[int]]:
    """The steps whose all-reduces XLA combines into one, as its combiner does: in program
    order, over the same axes, each joining the open group unless it depends on a member."""
    before = ancestors(graph)
    groups: list[list[int]] = []
    open_group: dict[tuple[str, ...], int] = {}  # axes -> index of the group still open
    members: list[int] = []  # per group, its steps as a bit set
    for step in sorted(all_reduces):
        k = open_group.get(all_reduces[step])
        if k is None or before[step] & members[k]:
            k = open_group[all_reduces[step]] = len(groups)
            groups.append([])
            members.append(0)
        groups[k].append(step)
        members[k] |= 1 << step
    return groups


def schedule(graph: OpGraph, groups: list[list[int]], tail: int) -> list[int] | None:
    """Each program step's place in the order XLA runs them, or None for program order.

    The steps from `tail` on (the optimizer's, after the backward pass) run as soon as their
    inputs are ready, as XLA's memory-minimising scheduler places them: each weight's update
    follows its gradient, which is then freed, unless the gradient is all-reduced in one of
    `groups` (all_reduce_groups), whose updates wait for the last of them. Steps that read
    nothing computed run just before their first reader."""
    program = graph.program
    if tail >= len(program):
        return None
    producer_step, readers = edges(graph)
    ready = list(range(len(program)))
    for group in groups:
        for m in group:
            ready[m] = group[-1]
    at: list[float] = [float(i) for i in range(len(program))]
    free: set[int] = set()  # steps that read nothing computed, transitively
    for i in range(tail, len(program)):
        deps = [ready[p] if p < tail else at[p] for t in program[i].inputs
                if (p := producer_step.get(t)) is not None and p not in free]
        if deps:
            at[i] = max(deps) + 0.5  # after its last input, before the next program step
        else:
            free.add(i)
    for i in sorted(free, reverse=True):
        at[i] = min([at[r] for t in program[i].outputs for r in readers.get(t, ())],
                    default=at[i]) - 0.25
    order = sorted(range(len(program)), key=lambda i: (at[i], i))
    place = [0] * len(program)
    for k, i in enumerate(order):
        place[i] = k
    return place


def reshard_buffers(tensor: Tensor, src: Spec | None, dst: Spec, mesh: MeshShape,
                     into_fusion: bool = False) -> tuple[int, int]:
    """(the buffers the resharding's collectives make beside the result, the result). Each
    collective's result is a buffer of its own (an all-gather's, the tensor gathered so far),
    but the last one's is the result where nothing is sliced from it afterwards, unless it
    must be copied into the result's layout: XLA gathers a dimension other than the major one
    in a layout that makes it major, and an all-to-all's result comes in pieces. Loop fusions
    (`into_fusion`: the resharded value's readers) read any layout, so they need no copy. An
    all-to-all over n devices also copies the n - 1 pieces it sends into buffers of their
    own; they are freed before a copy of its result is made. Where the partitioner has no
    pattern it gathers the whole tensor and slices (see cost.resharding.reshard_sequence)."""
    src = src or replicated(len(tensor.shape))
    result = int(shard_bytes(tensor, dst, mesh))
    steps = reshard_sequence(src, dst, mesh)
    made = [int(tensor.nbytes * share) for _, _, share, _, _ in steps]
    if steps and made[-1] == result:
        kind, n, _, dim, _ = steps[-1]
        local = [size // group_size(mesh, axes) for size, axes in zip(tensor.shape, dst)]
        if kind == "all-to-all" and into_fusion:
            made[-1] = int(result * (1 - 1 / n))  # the pieces sent, beside the result
        elif into_fusion or (kind == "all-gather" and all(k == 1 for k in local[:dim])):
            made.pop()  # the last collective's result is the result
    return sum(made), result


@per_graph
def transposed_operands(graph: OpGraph) -> tuple[tuple[int, int, int], ...]:
    """(step, operand or -1 for the result, tensor) of every convolution and dot operand and
    result XLA transposes into a buffer of its own before computing."""
    producer_step, readers = edges(graph)
    out = []
    for i, step in enumerate(graph.program):
        name = step.eqn.primitive.name if step.eqn is not None else ""
        if name == "conv_general_dilated":
            out += [(i, k, step.outputs[0] if k < 0 else step.inputs[k])
                    for k in _convolution_transposes(step.eqn.params["dimension_numbers"])]
        elif name == "dot_general":
            shapes = [graph.tensors[t].shape for t in step.inputs[:2]]
            for k in dot_transposes(step.eqn.params["dimension_numbers"], shapes):
                t = step.inputs[k]
                producer = producer_step.get(t)
                # A transpose of a fused chain's result read by this dot alone fuses into the
                # chain, which writes in the transposed order instead.
                if (producer is None or len(readers[t]) > 1
                        or graph.program[producer].eqn is None
                        or graph.program[producer].eqn.primitive.name not in FUSED):
                    out.append((i, k, t))
    return tuple(out)


def _convolution_transposes(dn: Any) -> list[int]:
    """The operands (-1: the result) of a convolution XLA transposes. Its convolution
    canonicalisation wants the input as (batch, spatial..., feature), the kernel as
    (spatial..., in feature, out feature) and the result as the input (the forward pass's
    convolutions are canonical, the weight gradient's are not: its input is read with batch
    and feature exchanged, and its output gradient as the kernel)."""
    rank = len(dn.lhs_spec)
    canonical_data = (0, rank - 1, *range(1, rank - 1))
    canonical_kernel = (rank - 1, rank - 2, *range(rank - 2))
    out = [k for k, (spec, canonical) in enumerate(((dn.lhs_spec, canonical_data),
                                                    (dn.rhs_spec, canonical_kernel)))
           if tuple(spec) != canonical]
    return out + ([-1] if tuple(dn.out_spec) != canonical_data else [])


def dot_transposes(dn: Any, shapes: list[tuple[int, ...]]) -> list[int]:
    """The operands of a dot XLA transposes. Its dot decomposition reshapes an operand with
    more than one contracting or non-contracting dimension, or batch dimensions not leading,
    into a (batch, rows, contracted) or (batch, contracted, columns) matrix; an operand whose
    dimensions that reorders (other than those of size 1) is transposed. An operand that is a
    matrix already is read as it is, transposed or not. The weight gradient of a (batch,
    sequence, features) activation is one: the activation is read features first."""
    contracting, batch = dn  # each (lhs dimensions, rhs dimensions)
    out = []
    for k, (c, b, shape) in enumerate(zip(contracting, batch, shapes)):
        rest = [d for d in range(len(shape)) if d not in c and d not in b]
        if len(c) == 1 and len(rest) <= 1 and tuple(b) == tuple(range(len(b))):
            continue
        order = [*b, *rest, *c] if k == 0 else [*b, *c, *rest]
        kept = [d for d in order if shape[d] != 1]
        if kept != sorted(kept):
            out.append(k)
    return out


# Steps XLA does not run ahead of their place in the program, whatever they read.
IN_PLACE = {"dot_general", "conv_general_dilated", "scan", "while", "cond"}


@per_graph
def input_only_steps(graph: OpGraph, tail: int) -> frozenset[int]:
    """The steps before `tail` that XLA's scheduler runs at the start of the step: those that
    read only the step's inputs and constants, directly or through other such steps, other
    than dots, convolutions and loops (the gathers of embeddings, the loss's scatter of the
    labels for the backward pass, the weights' transposes)."""
    producer_step = edges(graph)[0]
    out: set[int] = set()
    for i, step in enumerate(graph.program[:tail]):
        name = step.eqn.primitive.name if step.eqn is not None else "copy_p"
        if name not in IN_PLACE and all(t not in producer_step or producer_step[t] in out
                                        for t in step.inputs):
            out.add(i)
    return frozenset(out)


def placed_in_donated(buffers: list[tuple[int, int, int]], slots: list[tuple[int, int, int]]
                      ) -> set[int]:
    """The `buffers` ((first time, last time, bytes)) that XLA's buffer assignment places in
    the allocations of donated inputs (`slots`: (bytes, first free time, last free time)), so
    that they take no memory beyond the inputs'.

    A donated input copied before its update (copied_before_update) holds nothing from its
    copy until the update writes into it. XLA assigns buffers largest first, each to the
    smallest allocation it fits in whose other buffers it does not overlap in time; what
    fits nowhere goes to the heap of temporaries."""
    order = sorted(range(len(slots)), key=lambda s: slots[s][0])
    sizes = [slots[s][0] for s in order]
    last = max([b[1] for b in buffers] + [s[2] for s in slots]) + 1
    # Per time, a bit per allocation (in `order`) set where it is not free then: only those
    # free at a buffer's first and last times need their buffers' times compared.
    taken = np.zeros((last + 1, (len(order) + 7) // 8), dtype=np.uint8)

    def take(n: int, first: int, end: int) -> None:
        taken[first:end + 1, n // 8] |= np.uint8(128 >> n % 8)

    for n, s in enumerate(order):
        take(n, 0, slots[s][1] - 1)
        take(n, slots[s][2] + 1, last)
    held: list[list[tuple[int, int]]] = [[] for _ in order]  # per allocation, (first, last)
    placed = set()
    for b in sorted(range(len(buffers)), key=lambda b: (-buffers[b][2], buffers[b][0])):
        start, end, nbytes = buffers[b]
        smallest = bisect.bisect_left(sizes, nbytes)
        if smallest == len(order):
            continue
        free = np.unpackbits(~(taken[start] | taken[end]), count=len(order))
        for n in np.flatnonzero(free[smallest:]) + smallest:
            k = bisect.bisect(held[n], (start, end))
            if ((k == 0 or held[n][k - 1][1] < start)
                    and (k == len(held[n]) or held[n][k][0] > end)):
                held[n].insert(k, (start, end))
                take(n, start, end)
                placed.add(b)
                break
    return placed


@per_graph
def value_buffers(graph: OpGraph) -> ValueBuffers:
    """The values XLA's CPU compiler writes to buffers of their own. Chains of elementwise and
    layout operators fuse into their reader, unless a reader cannot fuse them (a dot, a
    convolution, a loop), several operators read them, or the backward pass keeps an expensive
    one (CHEAP). A transpose of a dot read by it alone is the dot's own buffer; a scatter into
    zeros that a sum alone reads scatters into the sum (scatter_into_sum)."""
    def written(name: str, kind: str | None, reader_names: list[str]) -> bool:
        return (name not in FUSED or len(reader_names) > 1
                or (kind == "activations" and name not in CHEAP)
                or any(r not in FUSING_READERS for r in reader_names))
    return buffered_values(graph, written)


def buffered_values(graph: OpGraph, written: Callable[[str, str | None, list[str]], bool]
                    ) -> ValueBuffers:
    """The values a compiler writes to buffers: the step's outputs, and every value for which
    `written(its primitive, its kind, its readers' primitives)` holds, less the transposes of
    dots and the scatters into sums that XLA's simplifier folds away (see value_buffers)."""
    program = graph.program

    def primitive(i: int) -> str:
        eqn = program[i].eqn
        return "copy_p" if eqn is None else eqn.primitive.name

    producer_step, readers = edges(graph)
    kind = dict(roles(graph))
    outputs = set(graph.outputs)
    materialised = set()
    into_sum = set()
    for t, i in producer_step.items():
        rs = readers.get(t, ())
        if t not in outputs and scatter_into_sum(program, producer_step, primitive, i, rs):
            into_sum.add(t)
            continue
        if (primitive(i) == "transpose" and len(readers.get(program[i].inputs[0], ())) == 1
                and primitive(producer_step.get(program[i].inputs[0], i)) == "dot_general"):
            # XLA's simplifier folds the transpose of a dot read by it alone into the dot
            # (operands exchanged): the dot's buffer holds the transposed result.
            kind.setdefault(program[i].inputs[0], kind.get(t, "temporaries"))
            continue
        if t in outputs or written(primitive(i), kind.get(t), [primitive(r) for r in rs]):
            materialised.add(t)
    return ValueBuffers(frozenset(materialised), frozenset(into_sum), kind)


@per_graph
def fused_values(graph: OpGraph) -> frozenset[int]:
    """The values an ideal fuser keeps out of memory that XLA's CPU compiler does too: not
    those value_buffers materialises (read by several fusions, or an activation the backward
    pass keeps). Charged as fused, a value XLA writes and reads again is under-priced, and the
    search keeps replicated what it should split (a mixture of experts' token path:
    docs/decisions.md, "Measurements moved out of the planning code")."""
    materialised = value_buffers(graph).materialised
    return frozenset(t for t in fusible_values(graph) if t not in materialised)


class CpuBuffers:
    """XLA's CPU compiler as the memory estimate asks for it (autopar.cost.xla.buffers)."""

    name = "xla-cpu"
    calibrated = True
    reuses_in_loops = False
    defers_weight_gradients = False
    hoists_slice_converts = False
    values = staticmethod(value_buffers)
    fused_values = staticmethod(fused_values)
    combined_all_reduces = staticmethod(all_reduce_groups)
    copied_before_update = staticmethod(copied_before_update)
    early_steps = staticmethod(input_only_steps)
    schedule = staticmethod(schedule)
    reshard_buffers = staticmethod(reshard_buffers)
    transposed_operands = staticmethod(transposed_operands)
    placed_in_donated = staticmethod(placed_in_donated)

    @staticmethod
    def body_buffers(graph: OpGraph, specs: dict[int, Spec], mesh: MeshShape
                     ) -> tuple[frozenset[int], frozenset[int]]:
        return frozenset(), frozenset()

    @staticmethod
    def fuses(primitive: str) -> bool:
        return primitive in FUSED


CPU = CpuBuffers()
