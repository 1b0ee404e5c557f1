"""Which of a traced step's leaves can be stored in the circular placement (stored.py).

`storage(graph, stages, rounds)` returns a `Storage`: the stack's per-layer inputs that can be
read from leaves stored with their layers permuted, those leaves' input and output indices,
and for each that cannot, why (its paths and the operation that reads its layers in order). A
leaf is stored only where every operation on it, or on what is computed from it along its
layers, treats the layer dimension as independent rows, as the operation's sharding rule says
(a pass-through factor that no row moves along), or reduces one value over the layers.

Design and rationale: docs/internals-steps.md, "autopar/placement/storable.py".
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from autopar.rules.factors import COMBINED, PASS_THROUGH, SUMMED
from autopar.rules.kinds import ELEMENTWISE, LOOP_CARRIES, REDUCTIONS, STACK_READ, WITH_BODIES
from autopar.rules.table import rule_for
from autopar.trace.ir import Op, OpGraph

# Elementwise, and the same in any order of rows: a loop carry is not (its rows are its
# iterations' values).
_ROWWISE = ELEMENTWISE - LOOP_CARRIES - {STACK_READ}


@dataclass(frozen=True)
class Storage:
    """What can be stored in placement: the stack's per-layer inputs read from stored leaves,
    the flat input and output indices of those leaves, their layer count, the schedule's
    stages and rounds (set by the planning; the rounds are `repeats`, as the plan's JSON
    names them: a plan shows this record, `plan.stored`), and for every stack input read
    from the step's inputs that cannot be stored, why (keyed by the input's index, with the
    leaves' paths)."""
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


def storage(graph: OpGraph, stages: int = 1, rounds: int = 1) -> Storage:
    """The leaves of `graph` that can be stored in the placement of `stages` x `rounds`,
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
                   stages, rounds, refused)


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
    ins = [t for t in op.inputs if t in along]
    outs = [t for t in op.outputs if t in along]
    name = op.primitive
    where = f"{name} at {op.source}" if op.source else name
    if name == STACK_READ:  # the read's operand, or the gradient's mark's result
        groups.read(op.outputs[0] if op.params["grad"] else op.inputs[0], op.params["index"])
        return
    if outs and _made_uniform(graph, op, ins, uniform):
        uniform.update(outs)
        return
    kept = _rows_kept(graph, op, ins, outs)
    if kept is None:
        return
    varying = [t for t in kept if t not in uniform]
    if kept and outs and not varying:  # rowwise from values the same in every row
        uniform.update(outs)
        return
    if varying and outs:
        for t in varying + outs:
            groups.union(varying[0], t)
        for t in ins:
            if t not in kept and t not in uniform:
                groups.order_matters(t, f"read with its layers in order by {where}")
        return
    for t in ins + outs:
        if t not in uniform:
            groups.order_matters(t, f"its layers in order, by {where}")


def _made_uniform(graph: OpGraph, op: Op, ins: list[int], uniform: set[int]) -> bool:
    """Whether `op` makes values the same in every row of the layer dimension from none that
    vary along it: a broadcast along the layers, an iota along another dimension."""
    name, params = op.primitive, op.params
    if name == "broadcast_in_dim" and not ins:
        dims = params["broadcast_dimensions"]
        return 0 not in dims or graph.tensors[op.inputs[0]].shape[dims.index(0)] == 1
    return name == "iota" and params.get("dimension") != 0


def _rows_kept(graph: OpGraph, op: Op, ins: list[int], outs: list[int]) -> list[int] | None:
    """The operands whose rows along the layers become the results' rows, each row computed
    from its own, as `op`'s sharding rule says: their dimension 0 is one factor that passes
    through to every such result's dimension 0, no other operand holds it elsewhere, and no
    row moves along it. None: a reduction of one value over its layers, the same in any order.
    [] where the layers' order matters (a loop's carry, whose rows are its iterations)."""
    if not ins or op.primitive in LOOP_CARRIES | WITH_BODIES:
        return []
    rule = rule_for(op.primitive, [graph.tensors[t].shape for t in op.inputs],
                    [graph.tensors[t].shape for t in op.outputs], op.params)
    if rule is None or len(rule.operands) != len(op.inputs):
        return []
    f = rule.operands[op.inputs.index(ins[0])][0]
    if f is None:
        return []
    holders = [(t, dims) for t, dims in zip(op.inputs, rule.operands) if f in dims]
    if any(dims[:1] != (f,) for _, dims in holders):
        return []
    kind = rule.kind(f)
    if kind in (SUMMED, COMBINED):
        return None if len(holders) == 1 and op.primitive in REDUCTIONS else []
    if kind != PASS_THROUGH or not all(rule.results[k][:1] == (f,) for k, t in
                                       enumerate(op.outputs) if t in outs):
        return []
    return [t for t, _ in holders]
