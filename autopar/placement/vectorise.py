"""The vectoriser behind keep_placement on a Python loop (lanes.py): which of a step's
per-layer inputs can be kept stacked, and the step evaluated over the stacks.

- `find_lanes(closed, paths, pairs)` takes the step's jaxpr, its inputs' key paths and its
  state pairs (output -> input). It returns the families that can be stored, the `LaneSearch`
  that stores them (None where none can), and why each other family cannot. A family is
  refused where a layer of it is read on its own, or its next value is not one stack's lanes
  in order.
- `StackedRun(closed, search, inputs, outputs).run(args)`: the step's outputs, computed over
  the stacks; a stored family's come back as one stack.
Nothing raises: lanes.py warns of refused families.

Design and rationale: docs/internals-steps.md, "autopar/placement/vectorise.py".
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any, Sequence

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from autopar.trace.jaxpr import bind_equation, eqn_source


@dataclasses.dataclass(frozen=True)
class _Lane:
    stack: Any  # hashable: ("in", family), ("group", key, k) or ("unstack", equation)
    index: int


class LaneSearch:
    """One pass over the step's equations with some families stored and some groups broken:
    what each equation does (`modes`), the groups' members, which families had a lane read
    as a row, and which value each output is."""

    def __init__(self, jaxpr: Any, families: dict[int, list[int]], broken: set) -> None:
        self.lengths: dict[Any, int] = {}
        desc: dict[Any, _Lane] = {}
        for f, members in families.items():
            self.lengths[("in", f)] = len(members)
            for i, k in enumerate(members):
                desc[jaxpr.invars[k]] = _Lane(("in", f), i)
        self.modes: dict[int, Any] = {}
        self.members: dict[Any, list[int]] = defaultdict(list)
        self.group_length: dict[Any, int] = {}
        self.rows: dict[Any, Any] = {}  # stacks a lane of which was read as a row -> by what
        # A value read by every layer is the same operand wherever it comes from the same
        # computation (each layer's own zeros, say): numbered by what computes it.
        self.same: dict[Any, int] = {}
        self.numbers: dict[Any, int] = {}
        for e, eqn in enumerate(jaxpr.eqns):
            ins = [None if isinstance(v, Literal) else desc.get(v) for v in eqn.invars]
            lanes = [d for d in ins if d is not None]
            name = eqn.primitive.name
            if not lanes and not eqn.effects:
                computed = (_signature(eqn), tuple(self._operand(v) for v in eqn.invars))
                for k, v in enumerate(eqn.outvars):
                    self.same[v] = self.numbers.setdefault((computed, k), len(self.numbers))
            if not lanes:
                if (name == "unstack" and eqn.params.get("axis") == 0
                        and len(eqn.outvars) > 1):
                    self.modes[e] = "unstack"
                    self.lengths[("unstack", e)] = len(eqn.outvars)
                    desc.update((v, _Lane(("unstack", e), i)) for i, v in enumerate(eqn.outvars))
                continue
            if (name == "stack" and eqn.params.get("axis") == 0 and len(lanes) == len(ins)
                    and len({d.stack for d in lanes}) == 1
                    and self.lengths[lanes[0].stack] == len(lanes)
                    and [d.index for d in lanes] == list(range(len(lanes)))):
                self.modes[e] = "restack"
                continue
            key = self._group(eqn, ins, lanes)
            if key is not None and key not in broken:
                self.modes[e] = ("group", key)
                self.members[key].append(lanes[0].index)
                self.group_length[key] = self.lengths[lanes[0].stack]
                self.lengths.update((("group", key, k), self.group_length[key])
                                    for k in range(len(eqn.outvars)))
                desc.update((v, _Lane(("group", key, k), lanes[0].index))
                            for k, v in enumerate(eqn.outvars))
                continue
            for d in lanes:
                self.rows.setdefault(d.stack, eqn)
        self.outputs = [None if isinstance(v, Literal) else desc.get(v) for v in jaxpr.outvars]

    def _group(self, eqn: Any, ins: list, lanes: list[_Lane]) -> Any:
        if (len({d.index for d in lanes}) != 1 or eqn.effects
                or len({self.lengths[d.stack] for d in lanes}) != 1):
            return None
        operands = tuple(("lane", d.stack) if d is not None else self._operand(v)
                         for d, v in zip(ins, eqn.invars))
        return (_signature(eqn), operands)

    def _operand(self, v: Any) -> Any:
        if isinstance(v, Literal):
            return ("literal", _literal_key(v))
        return ("computed", self.same[v]) if v in self.same else ("shared", v)

    def incomplete(self) -> set:
        """Groups missing a layer. A layer may have the group's computation more than once
        (its gradient squared for a norm and again for a metric): one result serves all."""
        return {key for key, got in self.members.items()
                if set(got) != set(range(self.group_length[key]))}


def _literal_key(v: Any) -> Any:
    value = np.asarray(v.val)
    return (str(value.dtype), value.shape, value.tobytes())


def _signature(eqn: Any) -> Any:
    """What makes two equations the same computation on the same operands: the primitive,
    the parameters (a sub-program by identity: JAX traces a function once per shapes, so
    each layer's call of it holds the same one) and the operands' types."""
    return (eqn.primitive, tuple((k, _param_key(v)) for k, v in sorted(eqn.params.items())),
            tuple(str(v.aval) for v in eqn.invars))


def _param_key(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return tuple(map(_param_key, value))
    if isinstance(value, (ClosedJaxpr, Jaxpr)) or callable(value):
        return ("object", id(value))
    return repr(value)


def _families(jaxpr: Any, paths: Sequence[tuple]) -> list[list[int]]:
    """Candidate families (flat input indices in layer order): the inputs the loss stacks,
    and every other set of inputs at their paths with the layer's key changed, of one type."""
    position = {v: k for k, v in enumerate(jaxpr.invars)}
    by_path = {tuple(p): k for k, p in enumerate(paths)}
    found: list[list[int]] = []
    layer_keys: list[tuple[int, list]] = []  # (depth, the layers' keys in order)
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "stack" or eqn.params.get("axis") != 0:
            continue
        members = [position.get(v) for v in eqn.invars if not isinstance(v, Literal)]
        if len(members) != len(eqn.invars) or None in members or len(set(members)) < 2:
            continue
        ps = [tuple(paths[k]) for k in members]
        differ = [d for d in range(len(ps[0])) if len({p[d] for p in ps}) > 1]
        if len({len(p) for p in ps}) != 1 or len(differ) != 1:
            continue
        found.append(members)
        layer_keys.append((differ[0], [p[differ[0]] for p in ps]))
    taken = {k for f in found for k in f}
    for keys in {tuple(ks) for _, ks in layer_keys}:
        for k, p in enumerate(paths):
            for d, entry in enumerate(p):
                if k in taken or entry != keys[0]:
                    continue
                members = [by_path.get(tuple(p[:d]) + (key,) + tuple(p[d + 1:])) for key in keys]
                if (None in members or taken.intersection(members)
                        or len({str(jaxpr.invars[m].aval) for m in members}) != 1):
                    continue
                found.append(members)
                taken.update(members)
    return found


def find_lanes(closed: Any, paths: Sequence[tuple], pairs: dict[int, int]
               ) -> tuple[dict[int, list[int]], LaneSearch | None, dict[int, str]]:
    """The families that can be stored, the search that stores them (None where none can),
    and why each other family cannot, by its first leaf: `paths`, the inputs' key paths;
    `pairs`: output -> input, the state's next values."""
    jaxpr = closed.jaxpr
    families = dict(enumerate(_families(jaxpr, paths)))
    broken: set = set()
    refused: dict[int, str] = {}
    while families:
        search = LaneSearch(jaxpr, families, broken)
        missing = search.incomplete()
        if missing - broken:
            broken |= missing
            continue
        for f, members in families.items():
            reader = search.rows.get(("in", f))
            if reader is not None:
                refused[members[0]] = (f"a layer is read on its own by {reader.primitive.name} "
                                       f"at {eqn_source(reader)}")
            elif not _returned_whole(search, members, pairs):
                refused[members[0]] = "its next value is not computed over the stacks alone"
        if not any(families[f][0] in refused for f in families):
            return families, search, refused
        families = {f: m for f, m in families.items() if m[0] not in refused}
    return {}, None, refused


def _returned_whole(search: LaneSearch, members: list[int], pairs: dict[int, int]) -> bool:
    """Whether the family's next values (the outputs paired with its inputs) are the lanes of
    one stack, in order; a family that is only read has none."""
    back = {i: o for o, i in pairs.items()}
    outs = [back.get(k) for k in members]
    if all(o is None for o in outs):
        return True
    if None in outs:
        return False
    lanes = [search.outputs[o] for o in outs]
    return (all(d is not None for d in lanes) and len({d.stack for d in lanes}) == 1
            and [d.index for d in lanes] == list(range(len(lanes))))


class StackedRun:
    """The step's equations evaluated over the stacks, as the search decided."""

    def __init__(self, closed: Any, search: LaneSearch, inputs: tuple[tuple[int, ...], ...],
                 outputs: tuple[tuple[int, ...], ...]) -> None:
        self.closed, self.search = closed, search
        self.inputs, self.outputs = inputs, outputs  # as Lanes.inputs and Lanes.outputs
        self.env: dict[Any, Any] = {}
        self.groups: dict[Any, list[Any]] = {}

    def read(self, v: Any) -> Any:
        return v.val if isinstance(v, Literal) else self.env[v]

    def row(self, v: Any) -> Any:
        x = self.read(v)
        return x[0][x[1]] if isinstance(x, tuple) else x

    def run(self, args: Sequence[Any]) -> list[Any]:
        jaxpr = self.closed.jaxpr
        self.env.update(zip(jaxpr.constvars, self.closed.consts))
        for value, origin in zip(args, self.inputs):
            if len(origin) == 1:
                self.env[jaxpr.invars[origin[0]]] = value
            else:
                self.env.update((jaxpr.invars[k], (value, i)) for i, k in enumerate(origin))
        for e, eqn in enumerate(jaxpr.eqns):
            mode = self.search.modes.get(e)
            if mode == "restack":
                self.env[eqn.outvars[0]] = self.read(eqn.invars[0])[0]
            elif mode == "unstack":
                whole = self.read(eqn.invars[0])
                self.env.update((v, (whole, i)) for i, v in enumerate(eqn.outvars))
            elif mode is not None:
                index = next(x[1] for v in eqn.invars if isinstance(x := self.read(v), tuple))
                outs = self.group(mode[1], eqn)
                self.env.update((v, (o, index)) for v, o in zip(eqn.outvars, outs))
            else:
                results = bind_equation(eqn, [self.row(v) for v in eqn.invars])
                self.env.update(zip(eqn.outvars, results))
        return [self.row(jaxpr.outvars[o[0]]) if len(o) == 1
                else self.read(jaxpr.outvars[o[0]])[0] for o in self.outputs]

    def group(self, key: Any, eqn: Any) -> list[Any]:
        """The group's results over the stacks, computed at its first member."""
        if key not in self.groups:
            values = [self.read(v) for v in eqn.invars]
            at = [k for k, x in enumerate(values) if isinstance(x, tuple)]

            def one(*rows: Any) -> list[Any]:
                args = list(values)
                for k, r in zip(at, rows):
                    args[k] = r
                return bind_equation(eqn, args)
            self.groups[key] = jax.vmap(one)(*[values[k][0] for k in at])
        return self.groups[key]
