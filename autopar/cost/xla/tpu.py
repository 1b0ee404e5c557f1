"""What the TPU compiler (libtpu, compiling for TPU topologies) does to a step's buffers.

`TPU` (a `TpuBuffers`) is the memory estimate's BufferModel "xla-tpu", not calibrated. It is
XLA's CPU model (cpu.py) but for these rules:
- `value_buffers(graph)`: a fused chain whose readers all fuse it (dots and convolutions
  included) gets no buffer: an expensive one (a softmax's exp) is recomputed in each of them;
- `fused_values(graph)`: the values an ideal fuser keeps out of memory that the TPU compiler
  does too;
- no operand is transposed into a copy;
- loop bodies reuse buffers, run the weight gradients' dots last, and convert a stacked input
  once, whole, at the start of the step.
Nothing here raises.

Design and rationale: docs/internals-steps.md, "autopar/cost/xla/tpu.py".
"""
from __future__ import annotations

from autopar.cost.model import fused_values as fusible_values
from autopar.cost.xla.buffers import ValueBuffers
from autopar.cost.xla.cpu import CpuBuffers, buffered_values
from autopar.rules.kinds import FUSED, FUSING_READERS
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


class TpuBuffers(CpuBuffers):
    """The TPU compiler as the memory estimate asks for it (autopar.cost.xla.buffers)."""

    name = "xla-tpu"
    calibrated = False
    reuses_in_loops = True
    defers_weight_gradients = True
    hoists_slice_converts = True
    values = staticmethod(value_buffers)
    fused_values = staticmethod(fused_values)

    @staticmethod
    def transposed_operands(graph: OpGraph) -> tuple[tuple[int, int, int], ...]:
        return ()


TPU = TpuBuffers()
