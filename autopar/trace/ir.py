"""The operator graph: plain frozen dataclasses, with JAX objects kept at the edges.

Two views of one traced step live here. `ops` is the planning view: every operator whose
sharding the search decides, with the bodies of loops inlined once (their costs scaled by the
trip count). `program` is the execution view: the equations the lowering re-runs, where a loop is
one equation again.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Tensor:
    """A value in the step: its shape, dtype and, for inputs and outputs, its pytree path."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    path: str | None = None
    const: bool = False  # a literal or closed-over constant, or computed from those alone
    # Bytes per element where numpy does not know the dtype: a PRNG key (`key<fry>`) holds its
    # key data, 2 x uint32 for threefry. None: numpy's itemsize of `dtype`.
    itemsize: int | None = None

    @functools.cached_property
    def nbytes(self) -> int:  # read for every strategy of every operator: computed once
        if self.dtype == "token":
            return 0
        size = self.itemsize if self.itemsize is not None else np.dtype(self.dtype).itemsize
        return math.prod(self.shape) * size


@dataclass(frozen=True)
class Op:
    """One operator of the planning view."""

    id: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: dict[str, Any] = field(hash=False, compare=False)
    source: str = ""
    repeat: int = 1  # how often it runs per step (trip count of enclosing loops)
    scope: str = ""  # the module path of its name stack, transformations left out
    backward: bool = False  # made by transposition: part of the backward pass

    def operand_repeat(self, i: int) -> int:
        """How often operand i is read per step: a loop carry's next value (operand 1 of
        scan_carry) and a stacked result (scan_stack's operand), both from the body, once per
        iteration; anything else as often as the op runs."""
        if (self.primitive == "scan_carry" and i == 1) or self.primitive == "scan_stack":
            return self.repeat * self.params.get("length", 1)
        return self.repeat


@dataclass(frozen=True)
class Equation:
    """One equation of the execution view.

    `requires[i]` names the planning op and operand index whose strategy fixes the sharding
    operand i must have (None: no requirement, e.g. a constant); results take the sharding of
    the planning op that produces them. `eqn` None copies its one input through.

    `remat` numbers the recomputations the step belongs to, outermost first: the body of a
    differentiated `remat2` (jax.checkpoint, nn.remat) recomputes forward values for the
    backward pass, and the lowering reads what each such body takes from outside it through
    one optimization barrier, as JAX lowers it, so XLA cannot merge it into the forward pass.
    """

    eqn: Any = field(hash=False, compare=False)
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    requires: tuple[tuple[int, int] | None, ...]
    remat: tuple[int, ...] = ()


@dataclass(frozen=True)
class OpGraph:
    """A traced step: tensors, planning ops, execution steps, and the flat inputs and outputs."""

    tensors: tuple[Tensor, ...]
    ops: tuple[Op, ...]
    program: tuple[Equation, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    const_values: dict[int, Any] = field(hash=False, compare=False)
    # output index -> input index when the output is the next step's value of that input (state)
    state_pairs: dict[int, int] = field(hash=False, compare=False, default_factory=dict)
    # input indices the caller donates (jax.jit's donate_argnums): XLA may write outputs there
    donated: frozenset[int] = frozenset()
    # program step of a loop (scan) -> the planning ops of its body, which run inside that step
    loop_ops: dict[int, tuple[int, ...]] = field(hash=False, compare=False, default_factory=dict)
    # the platform whose XLA compiles the step ('cpu', 'gpu', ...; '' where not known): its
    # compiler's fusion decides which values cost memory traffic (autopar.cost.facts)
    compiler: str = ""
    # a loop's first result -> (its body's steps, the ids its body reads its operands as, the
    # ids of its body's results): the lowering runs a body step by step, as planned
    loop_bodies: dict[int, tuple] = field(hash=False, compare=False, default_factory=dict)

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:  # every per-graph analysis is cached on the graph: hashed once
        return hash((self.tensors, self.ops, self.program, self.inputs, self.outputs,
                     self.donated, self.compiler))

    @property
    def donated_pairs(self) -> dict[int, int]:
        """The state pairs whose input is donated: the new state written into the old one's
        buffer (without donation XLA holds both)."""
        return {o: i for o, i in self.state_pairs.items() if i in self.donated}

    def producers(self) -> dict[int, tuple[int, int]]:
        """tensor id -> (op id, output index) for every tensor a planning op produces."""
        return {t: (op.id, k) for op in self.ops for k, t in enumerate(op.outputs)}
