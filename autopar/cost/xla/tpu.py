"""What the TPU compiler (libtpu, compiling for TPU topologies) does to a step's buffers.

`TPU` (a `TpuBuffers`) is the memory estimate's BufferModel "xla-tpu", not calibrated. It is
XLA's CPU model (cpu.py) but for these rules:
- `value_buffers(graph)`: a fused chain whose readers all fuse it (dots and convolutions
  included) gets no buffer: an expensive one (a softmax's exp) is recomputed in each of them;
- `fused_values(graph)`: the values an ideal fuser keeps out of memory that the TPU compiler
  does too;
- `body_buffers(graph, specs, mesh)`: in loop bodies, grouped-query attention's scores are
  written in float32, and their exp, where two of their batch dimensions and three others
  are longer than 1 on the device (see grouped_scores); other scores' softmax and its
  gradient are not written where only dots read them (fused_into_dots);
- no operand is transposed into a copy;
- loop bodies reuse buffers (a fused value's operands live until its last reader:
  loop_bodies.body_peak), run the weight gradients' dots last, and convert a stacked input
  once, whole, at the start of the step.
Nothing here raises.

Design and rationale: docs/internals-steps.md, "autopar/cost/xla/tpu.py".
"""
from __future__ import annotations

from typing import NamedTuple

from autopar.cost.model import fused_values as fusible_values, fused_when_read_by, group_size
from autopar.cost.xla.buffers import ValueBuffers
from autopar.cost.xla.cpu import CpuBuffers, buffered_values
from autopar.mesh import MeshShape
from autopar.rules.factors import Spec
from autopar.rules.kinds import CHEAP, FUSED, FUSING_READERS, REDUCTIONS
from autopar.trace.analysis import per_graph
from autopar.trace.ir import OpGraph

# Readers that take a fused chain into their own fusion on TPU.
TPU_FUSING_READERS = FUSING_READERS | {"dot_general", "conv_general_dilated"}


@per_graph
def value_buffers(graph: OpGraph) -> ValueBuffers:
    """The values the TPU compiler writes to buffers of their own (docs/internals-steps.md)."""
    def written(name: str, kind: str | None, reader_names: list[str]) -> bool:
        return name not in FUSED or not all(r in TPU_FUSING_READERS for r in reader_names)
    return buffered_values(graph, written)


@per_graph
def fused_values(graph: OpGraph) -> frozenset[int]:
    """The values an ideal fuser keeps out of memory that the TPU compiler does too."""
    materialised = value_buffers(graph).materialised
    return frozenset(t for t in fusible_values(graph) if t not in materialised)


class GroupedScores(NamedTuple):
    """A loop body's dot whose result a softmax normalises, through cheap operators."""

    dot: int  # the dot's result
    batch: int  # how many of the result's leading dimensions are the dot's batch dimensions
    normalised: tuple[int, ...]  # the chain's end, and the expensive values normalised after it


@per_graph
def grouped_scores(graph: OpGraph) -> tuple[GroupedScores, ...]:
    """The loop bodies' dots whose result reaches a normalisation (a value read by a
    reduction and by an elementwise reader of that reduction's result: a softmax's scores)
    through cheap operators, each the sole reader of the value before it.

    Where the scores have two batch dimensions and three others longer than 1 on the device
    (grouped-query attention: batch and key-value heads, the queries' group, queries and
    keys), the TPU compiler fuses the chain into the dot's output, writes its end (float32
    after a conversion) and not the dot's result, and writes the softmax's exp too. Measured
    with libtpu 0.0.42.1, a scanned attention layer under remat on one v5p chip: batches of 2
    or 4 with 2 to 8 key-value heads in groups of 2 to 8 write float32 scores; 4 or 16 heads
    with no group, one head with groups of 4 or 16, and a batch of 1 write bfloat16 scores
    alone (tests/test_tpu.py; docs/decisions.md, "Grouped-query attention's scores on TPU")."""
    ops = graph.ops
    made_by: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    for ids in graph.loop_ops.values():
        for k in ids:
            made_by.update((t, k) for t in ops[k].outputs)
            for t in set(ops[k].inputs):
                readers.setdefault(t, []).append(k)

    def reads(k: int, target: int, depth: int = 8) -> bool:
        """Whether op k reads `target`, directly or through fused operators."""
        return target in ops[k].inputs or depth > 0 and any(
            reads(made_by[t], target, depth - 1) for t in ops[k].inputs
            if t in made_by and ops[made_by[t]].primitive in FUSED)

    def normalised(t: int) -> bool:
        rs = readers.get(t, [])
        sums = [u for r in rs if ops[r].primitive in REDUCTIONS for u in ops[r].outputs]
        return any(reads(r, u) for r in rs if ops[r].primitive in FUSED for u in sums)

    out = []
    for k in sorted({k for ids in graph.loop_ops.values() for k in ids}):
        if ops[k].primitive != "dot_general":
            continue
        end = ops[k].outputs[0]
        while len(readers.get(end, ())) == 1 and ops[readers[end][0]].primitive in CHEAP:
            end = ops[readers[end][0]].outputs[0]
        if not normalised(end):
            continue
        found, todo = [end], [end]
        while todo:  # the expensive values fused from it that are normalised too: the exp
            for r in readers.get(todo.pop(), []):
                if ops[r].primitive in FUSED and ops[r].primitive not in REDUCTIONS:
                    found += [u for u in ops[r].outputs
                              if ops[r].primitive not in CHEAP and normalised(u)]
                    todo += ops[r].outputs
        (_, _), (batch, _) = ops[k].params["dimension_numbers"]
        out.append(GroupedScores(ops[k].outputs[0], len(batch), tuple(dict.fromkeys(found))))
    return tuple(out)


@per_graph
def fused_into_dots(graph: OpGraph) -> frozenset[int]:
    """Fused values whose readers all fuse them, dots and convolutions among them: those
    value_buffers gives no buffer outside loops. Inside a loop body, body_buffers takes the
    ones made from attention scores as recomputed in each reader: a softmax's probabilities
    in bfloat16, read by the two dots of attention's forward and backward, get no buffer
    (Llama-2-7B's scanned backward body on 64 v5p chips holds two of its [4, 16, 2048, 2048]
    score-sized buffers at once, not three)."""
    return fused_when_read_by(graph, TPU_FUSING_READERS)


def body_buffers(graph: OpGraph, specs: dict[int, Spec], mesh: MeshShape
                 ) -> tuple[frozenset[int], frozenset[int]]:
    """(loop-body values written that an ideal fuser would not, values the ideal fuser writes
    that are not) with tensors sharded as `specs`: grouped_scores where two of the scores'
    batch dimensions and three others are longer than 1 on the device are written, and not
    their dot; of the other scores, what only dots read of their softmax and its gradient
    (fused_into_dots) is not written (their probabilities in bfloat16). Measured on attention
    alone: Llama-3-8B's grouped scores on 64 v5p chips have their probabilities written too,
    and the Mixtral step's expert dispatch, read by dots alone, read 0.85 of its compiled
    peak within the expert's memory where every such value was taken as recomputed."""
    written, unwritten, recomputed = set(), set(), set()
    for scores in grouped_scores(graph):
        shape, spec = graph.tensors[scores.dot].shape, specs.get(scores.dot)
        local = [n // (group_size(mesh, spec[i]) if spec else 1) for i, n in enumerate(shape)]
        if (sum(n > 1 for n in local[:scores.batch]) >= 2
                and sum(n > 1 for n in local[scores.batch:]) >= 3):
            written.update(scores.normalised)
            unwritten.add(scores.dot)
        else:
            recomputed |= _made_from_scores(graph)[scores.dot]
    return (frozenset(written),
            frozenset(unwritten | (fused_into_dots(graph) & recomputed)))


@per_graph  # body_buffers asks it at every memory estimate
def _made_from_scores(graph: OpGraph) -> dict[int, frozenset[int]]:
    """Each grouped_scores dot's result -> the values made from it through fused operators
    alone, at any depth (its softmax and the softmax's gradient)."""
    readers: dict[int, list] = {}
    for op in graph.ops:
        for u in set(op.inputs):
            readers.setdefault(u, []).append(op)
    out = {}
    for scores in grouped_scores(graph):
        found, todo = set(), [scores.dot]
        while todo:
            for op in readers.get(todo.pop(), ()):
                if op.primitive in FUSED:
                    todo += [u for u in op.outputs if u not in found]
                    found.update(op.outputs)
        out[scores.dot] = frozenset(found)
    return out


class TpuBuffers(CpuBuffers):
    """The TPU compiler as the memory estimate asks for it (autopar.cost.xla.buffers)."""

    name = "xla-tpu"
    calibrated = False
    reuses_in_loops = True
    defers_weight_gradients = True
    hoists_slice_converts = True
    values = staticmethod(value_buffers)
    fused_values = staticmethod(fused_values)
    body_buffers = staticmethod(body_buffers)

    @staticmethod
    def transposed_operands(graph: OpGraph) -> tuple[tuple[int, int, int], ...]:
        return ()


TPU = TpuBuffers()
