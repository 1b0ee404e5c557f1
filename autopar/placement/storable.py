"""Which of a traced step's leaves can be stored in the circular placement (stored.py).

A leaf [L, ...] may be kept with its layers permuted only if the step does not care about
their order: every operation that touches it, or anything computed from it along its layers,
must treat the layer dimension as a set of independent rows, and whatever else it meets there
must be permuted the same way. So the values that share a layer dimension with a stack's
per-layer input are grouped (a union-find over the operators that carry dimension 0 to
dimension 0: elementwise arithmetic, reductions over other dimensions, reshapes and
transposes that keep it in front, broadcasts along it), through the state pairs (an input and
the output that is its next value) and the stack's reads and their gradients' marks. A group
is stored where nothing in it reads the layers in order: an iota or random bits along them, a
slice, a product over them, a constant, an output that is not the next value of an input.
Values broadcast along the layers (a scalar learning rate, zeros) are the same in any order
and join no group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autopar.rules.kinds import ELEMENTWISE, REDUCTIONS, STACK_READ
from autopar.trace.ir import Op, OpGraph

# Elementwise, and the same in any order of rows: a loop carry is not (its rows are its
# iterations' values).
_ROWWISE = ELEMENTWISE - {"scan_carry", "scan_carry_out", STACK_READ}


@dataclass(frozen=True)
class Storage:
    """What can be stored in placement: the stack's per-layer inputs read from stored leaves,
    the flat input and output indices of those leaves, their layer count, the schedule's
    stages and rounds (set by the planning), and for every stack input read from the step's
    inputs that cannot be stored, why (keyed by the input's index, with the leaves' paths)."""
    reads: tuple[int, ...] = ()
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    length: int = 0
    stages: int = 1
    repeats: int = 1
    refused: dict[int, str] = field(default_factory=dict, compare=False, hash=False)


class _Groups:
    """Union-find over tensor ids, with what each group holds."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}
        self.reads: dict[int, set[int]] = {}  # root -> the stack inputs read from the group
        self.read_by: dict[int, int] = {}  # a stack input -> a tensor of its group
        self.ordered: dict[int, str] = {}  # root -> why the group's layer order matters

    def find(self, t: int) -> int:
        self.parent.setdefault(t, t)
        while self.parent[t] != t:
            self.parent[t] = self.parent[self.parent[t]]
            t = self.parent[t]
        return t

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        self.parent[rb] = ra
        self.reads.setdefault(ra, set()).update(self.reads.pop(rb, set()))
        if rb in self.ordered:
            self.ordered.setdefault(ra, self.ordered.pop(rb))

    def read(self, t: int, index: int) -> None:
        """`t` is the stack's per-layer input `index` (or its gradient): one group."""
        if index in self.read_by:
            self.union(self.read_by[index], t)
        else:
            self.read_by[index] = t
            self.reads.setdefault(self.find(t), set()).add(index)

    def order_matters(self, t: int, why: str) -> None:
        self.ordered.setdefault(self.find(t), why)


def storage(graph: OpGraph, stages: int = 1, repeats: int = 1) -> Storage:
    """The leaves of `graph` that can be stored in the placement of `stages` x `repeats`,
    and why the others cannot (the same whether the stack reads them in layer order or
    stored: the analysis looks only outside the stack)."""
    marks = [op for op in graph.ops if op.primitive == STACK_READ]
    if not marks:
        return Storage()
    length = graph.tensors[marks[0].inputs[0]].shape[0]
    groups = _Groups()
    along = {t.id for t in graph.tensors if t.shape and t.shape[0] == length}
    uniform: set[int] = set()  # the same in every row of the layer dimension

    for op in graph.ops:
        _visit(graph, op, groups, along, uniform)
    made = {t: step for step in graph.program for t in step.outputs if step.eqn is not None}
    for t in along:
        if graph.tensors[t].const and t not in uniform and not _same_rows(graph, made, t):
            groups.order_matters(t, "a constant whose rows differ")
    inputs = {t: k for k, t in enumerate(graph.inputs)}
    for o, t in enumerate(graph.outputs):
        if t not in along:
            continue
        if o in graph.state_pairs:
            groups.union(graph.inputs[graph.state_pairs[o]], t)
        else:
            groups.order_matters(t, f"returned as {graph.tensors[t].path!r}, which is not "
                                    "the next value of an input")

    reads: list[int] = []
    stored: set[int] = set()
    refused: dict[int, str] = {}
    for index in sorted({i for r in groups.reads.values() for i in r}):
        root = next(r for r, rs in groups.reads.items() if index in rs)
        members = {t for t in along if groups.find(t) == root}
        if root in groups.ordered:
            leaves = sorted(graph.tensors[t].path for t in members if t in inputs)
            if leaves:  # an input computed in the step (per-layer random keys) has no leaf
                refused[index] = f"{', '.join(leaves[:3])}: {groups.ordered[root]}"
            continue
        reads.append(index)
        stored |= members
    return Storage(tuple(reads), tuple(sorted(inputs[t] for t in stored if t in inputs)),
                   tuple(o for o, t in enumerate(graph.outputs) if t in stored), length,
                   stages, repeats, refused)


def _same_rows(graph: OpGraph, made: dict, t: int) -> bool:
    """Whether constant `t` is the same in every layer's row: its value where the trace kept
    it, else from the step computing it (a broadcast along the layers, elementwise
    arithmetic of such)."""
    if t in graph.const_values:
        value = np.asarray(graph.const_values[t])
        return bool(value.ndim == 0 or np.all(value == value[:1]))
    step = made.get(t)
    if step is None:
        return False
    name, params = step.eqn.primitive.name, step.eqn.params
    length = graph.tensors[t].shape[0]
    rows = [i for i in step.inputs if graph.tensors[i].shape[:1] == (length,)]
    if name == "broadcast_in_dim":
        dims = params["broadcast_dimensions"]
        if 0 not in dims or graph.tensors[step.inputs[0]].shape[dims.index(0)] == 1:
            return True
        return dims[0] == 0 and _same_rows(graph, made, step.inputs[0])
    return name in _ROWWISE and all(_same_rows(graph, made, i) for i in rows)


def _visit(graph: OpGraph, op: Op, groups: _Groups, along: set[int], uniform: set[int]
           ) -> None:
    """Group `op`'s operands and results that share the layer dimension, or mark where it
    reads or makes one in order."""
    shape = lambda t: graph.tensors[t].shape  # noqa: E731
    ins = [t for t in op.inputs if t in along]
    outs = [t for t in op.outputs if t in along]
    name = op.primitive
    where = f"{name} at {op.source}" if op.source else name
    kept: list[int] = []  # operands whose dimension 0 becomes the results' dimension 0
    if name == STACK_READ:  # the read's operand, or the gradient's mark's result
        groups.read(op.outputs[0] if op.params["grad"] else op.inputs[0], op.params["index"])
        return
    if name in _ROWWISE:
        varying = [t for t in ins if t not in uniform and shape(t) == shape(op.outputs[0])]
        if not varying and outs:
            uniform.update(outs)
            return
        kept = varying
    elif name in REDUCTIONS and ins:  # commutative: over the layers, the same in any order
        if 0 in op.params.get("axes", ()):
            return
        kept = ins[:1]
    elif name == "broadcast_in_dim":
        dims = op.params["broadcast_dimensions"]
        if ins and dims and dims[0] == 0:  # the operand's layers stay first
            if ins[0] in uniform:
                uniform.update(outs)
                return
            kept = ins[:1]
        elif not ins and (0 not in dims or shape(op.inputs[0])[dims.index(0)] == 1):
            uniform.update(outs)  # the same along the layers
            return
    elif name == "reshape" and ins and outs:
        kept = ins[:1]
    elif name == "transpose" and ins and op.params["permutation"][0] == 0:
        kept = ins[:1]
    elif name == "iota" and op.params.get("dimension") != 0:
        uniform.update(outs)
        return
    if kept and outs:
        for t in kept + outs:
            groups.union(kept[0], t)
        for t in ins:
            if t not in kept and t not in uniform:
                groups.order_matters(t, f"read with its layers in order by {where}")
        return
    for t in ins + outs:
        if t not in uniform:
            groups.order_matters(t, f"its layers in order, by {where}")
