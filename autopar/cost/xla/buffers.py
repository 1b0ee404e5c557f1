"""What a platform's XLA compiler does to a step's buffers that the step's equations do not
show, behind one seam (`BufferModel`) that the memory estimate (autopar.cost.memory) walks.

- `cpu`: XLA's CPU compiler, rule by rule as read from its dumps and checked against compiled
  steps (tests/test_memory.py; docs/decisions.md has the measurements).
- `xla-tpu` and `xla-gpu`: the TPU compiler, and XLA's GPU compiler, from rules read in
  their dumps and checked against their compiled peaks (tpu.py, gpu.py); not calibrated.
- `conservative`: for platforms without a model of their own. Nothing fuses, nothing is placed
  in freed allocations, steps run in program order, every collective's result is a buffer and
  every donated input with another reader is copied: an estimate above what a fusing compiler
  needs.
A plan whose memory limit rests on a model not calibrated is compiled to check wherever a
compiler is at hand (autopar.api).
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

from autopar.mesh import MeshShape
from autopar.rules.factors import Spec
from autopar.trace.ir import OpGraph, Tensor


class ValueBuffers(NamedTuple):
    """Which of a program's values a compiler gives buffers of their own."""

    materialised: frozenset[int]  # values written to memory (not fused into their readers)
    into_sum: frozenset[int]  # scatters into zeros written into a sum's operand instead
    kind: dict[int, str]  # analysis.roles, with the kind a value folded into another passes on


class BufferModel(Protocol):
    """A platform's buffer behaviour, as the memory estimate asks for it."""

    name: str
    calibrated: bool  # checked against this platform's compiled programs
    reuses_in_loops: bool  # a loop body's values freed after their last reader in the body
    defers_weight_gradients: bool  # a loop body's weight-gradient dots run at its end
    hoists_slice_converts: bool  # a body's conversion of a stacked input's slice made whole

    def values(self, graph: OpGraph) -> ValueBuffers: ...

    def fused_values(self, graph: OpGraph) -> frozenset[int]:
        """The values never written to memory, fused into their readers: the compute estimate
        charges no bytes for them (autopar.cost.facts)."""

    def body_buffers(self, graph: OpGraph, specs: dict[int, Spec], mesh: MeshShape
                     ) -> tuple[frozenset[int], frozenset[int]]:
        """With tensors sharded as `specs`: the loop bodies' values written that fused_values
        holds fused, and those fused_values holds written that are not (a dot's result the
        compiler writes only as its output fusion's)."""

    def fuses(self, primitive: str) -> bool:
        """Whether a loop fusion can read a value computed by `primitive`'s step."""

    def combined_all_reduces(self, graph: OpGraph, all_reduces: dict[int, tuple[str, ...]]
                             ) -> list[list[int]]:
        """The steps whose all-reduces run as one collective."""

    def copied_before_update(self, graph: OpGraph, aliased: set[int],
                             groups: list[list[int]]) -> list[int]:
        """The donated inputs copied before they are updated in place."""

    def early_steps(self, graph: OpGraph, tail: int) -> frozenset[int]:
        """The steps before `tail` run first, at the start of the step."""

    def schedule(self, graph: OpGraph, groups: list[list[int]], tail: int) -> list[int] | None:
        """Each step's place in the order the compiler runs them; None: program order."""

    def reshard_buffers(self, tensor: Tensor, src: Spec | None, dst: Spec, mesh: MeshShape,
                        into_fusion: bool = False) -> tuple[int, int]:
        """(bytes the resharding makes beside its result, the result's bytes)."""

    def transposed_operands(self, graph: OpGraph) -> tuple[tuple[int, int, int], ...]:
        """(step, operand or -1 for the result, tensor) copied into a transposed buffer."""

    def placed_in_donated(self, buffers: list[tuple[int, int, int]],
                          slots: list[tuple[int, int, int]]) -> set[int]:
        """The buffers placed in donated inputs' allocations while those hold nothing."""
