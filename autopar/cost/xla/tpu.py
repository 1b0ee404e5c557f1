"""What the TPU compiler (libtpu, compiling for TPU topologies) does to a step's buffers.

Its copies, schedule and combined all-reduces are taken as XLA's CPU compiler's (cpu.py).
What differs, suggested by the TPU compiler's buffer dumps and checked against
`peak_memory_in_bytes` of a few programs compiled for compile-only TPU devices (not
calibrated: docs/decisions.md, "TPU buffer model"):
- its fusion takes more in: a dot or convolution reads elementwise and layout chains inside
  its own fusion, and a cheap chain read by several fusions is recomputed in each, so such a
  value gets no buffer; an expensive one (exp, div) read by several is written once, unless
  the backward pass reads it: then it is recomputed there, where every reader fuses it
  (the loss's exp, from the logits the backward pass keeps anyway: libtpu 0.0.42.1 writes no
  exp buffer for a decoder on v5e 2x4 nor for Llama-3-8B on v5p 4x4x4, docs/decisions.md);
- its layout assignment picks the layouts dots want, so no operand is transposed into a copy;
- a loop's body runs with its own buffer reuse: its values are held from their producer to
  their last reader inside the body, not all together (a scanned decoder layer's backward
  body recomputes the forward pass, and the two passes' attention matrices are not all live
  at once);
- inside a body, the collectives' buffers count as outside one (a layer's weights gathered,
  a weight gradient's partial sums before their reduce-scatter), and the weight gradients'
  dots run last, so what they read lives to the end of the body;
- a body's conversion of its slice of a stacked input (bf16 compute on f32 weights) is one
  conversion of the whole stack, made at the start of the step and kept until the last loop
  that reads it.
"""
from __future__ import annotations

from autopar.cost.model import fused_values as fusible_values
from autopar.cost.xla.buffers import ValueBuffers
from autopar.cost.xla.cpu import CpuBuffers, buffered_values
from autopar.rules.kinds import CHEAP, FUSED, FUSING_READERS
from autopar.trace.analysis import per_graph
from autopar.trace.ir import OpGraph

# Readers that take a fused chain into their own fusion on TPU.
TPU_FUSING_READERS = FUSING_READERS | {"dot_general", "conv_general_dilated"}


@per_graph
def value_buffers(graph: OpGraph) -> ValueBuffers:
    """The values the TPU compiler writes to buffers of their own (see the module)."""
    def written(name: str, kind: str | None, reader_names: list[str]) -> bool:
        fusing = all(r in TPU_FUSING_READERS for r in reader_names)
        if name in FUSED and kind == "activations" and fusing:
            return False  # recomputed in the backward pass's fusions, from what they keep
        return (name not in FUSED or not fusing
                or (name not in CHEAP and len(reader_names) > 1))
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
