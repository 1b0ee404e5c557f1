"""A conservative buffer model for platforms without a calibrated one (autopar.cost.xla).

It assumes none of the savings a compiler may make and keeps what the step writes: every value
has a buffer from its step to its last reader (no fusion), all-reduces run one by one, steps
run in program order, each collective of a resharding keeps its result beside the final one,
a donated input that anything but its update reads is copied first, and nothing is placed in
the allocations donated inputs free. Operands are transposed where XLA's CPU compiler
transposes them (a GPU or TPU compiler transposes no more than a canonical layout needs).
"""
from __future__ import annotations

from autopar.cost.model import fused_values, shard_bytes
from autopar.cost.resharding import reshard_sequence
from autopar.cost.xla.buffers import ValueBuffers
from autopar.cost.xla.cpu import transposed_operands
from autopar.mesh import MeshShape
from autopar.rules.factors import Spec, replicated
from autopar.trace.analysis import edges, per_graph, roles
from autopar.trace.ir import OpGraph, Tensor


@per_graph
def _value_buffers(graph: OpGraph) -> ValueBuffers:
    producer_step = edges(graph)[0]
    return ValueBuffers(frozenset(producer_step), frozenset(), dict(roles(graph)))


class ConservativeBuffers:
    """The buffers a step needs where nothing is known of its compiler."""

    name = "conservative"
    calibrated = False
    reuses_in_loops = False
    defers_weight_gradients = False
    hoists_slice_converts = False
    values = staticmethod(_value_buffers)
    # Times are estimated with an ideal fuser's fusion: GPU and TPU compilers are taken to
    # fuse at least as much as XLA CPU (not measured here), and charging every value's bytes
    # put the MoE's compute estimate at 2.3x what XLA CPU compiled.
    fused_values = staticmethod(fused_values)
    transposed_operands = staticmethod(transposed_operands)

    @staticmethod
    def body_buffers(graph: OpGraph, specs: dict[int, Spec], mesh: MeshShape
                     ) -> tuple[frozenset[int], frozenset[int]]:
        return frozenset(), frozenset()

    @staticmethod
    def fuses(primitive: str) -> bool:
        return False

    @staticmethod
    def combined_all_reduces(graph: OpGraph, all_reduces: dict[int, tuple[str, ...]]
                             ) -> list[list[int]]:
        return [[step] for step in sorted(all_reduces)]

    @staticmethod
    def copied_before_update(graph: OpGraph, aliased: set[int], groups: list[list[int]]
                             ) -> list[int]:
        producer_step, readers = edges(graph)
        out = []
        for o, i in graph.donated_pairs.items():
            t, new = graph.inputs[i], graph.outputs[o]
            update = producer_step.get(new)
            if (new in aliased and update is not None and t != new
                    and any(r != update for r in readers.get(t, ()))):
                out.append(t)
        return out

    @staticmethod
    def early_steps(graph: OpGraph, tail: int) -> frozenset[int]:
        return frozenset()

    @staticmethod
    def schedule(graph: OpGraph, groups: list[list[int]], tail: int) -> list[int] | None:
        return None

    @staticmethod
    def reshard_buffers(tensor: Tensor, src: Spec | None, dst: Spec, mesh: MeshShape,
                        into_fusion: bool = False) -> tuple[int, int]:
        src = src or replicated(len(tensor.shape))
        made = [int(tensor.nbytes * share) for _, _, share, _, _ in reshard_sequence(src, dst, mesh)]
        return sum(made), int(shard_bytes(tensor, dst, mesh))

    @staticmethod
    def placed_in_donated(buffers: list[tuple[int, int, int]],
                          slots: list[tuple[int, int, int]]) -> set[int]:
        return set()


CONSERVATIVE = ConservativeBuffers()
