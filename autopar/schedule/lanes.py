"""A Python loop's layers stored stacked on their stages between steps
(`auto_parallel(..., pipeline=S, keep_placement=True)` on a loop of blocks).

A loop of blocks (blocks.py) keeps each layer's weights as the user's own leaves, and the
pipeline reads them stacked [L, ...]: every step the leaves are stacked (each moves to the
stage that runs it) and the stack's gradient is split back into one leaf per layer, which the
optimizer then updates leaf by leaf. An array lives on the whole mesh, so a leaf of one layer
cannot stay on its stage; only a stack split over 'stage' can. Storing the layers stacked
means rewriting the step: the L per-layer chains of the optimizer (layer i's parameter, its
moments and its gradient, through the same equations) become one chain over the stacks.

The rewrite works on the step's jaxpr, as a vectoriser does. A *family* is L inputs of the
step that are one layer each: those the loss stacks (a `stack` of L inputs), and the other
inputs at the same paths with the layer's key changed (optax's moments of those weights).
A family's inputs are *lanes* of one stack, as are the outputs of an `unstack` (the stack's
gradient, split). An equation reading lanes of index i only (and values shared by every
layer) is one of a *group*: the equations with the same primitive, parameters, lane stacks
and shared operands. A group with one member per layer runs once, vmapped over the stacks;
its results are lanes of new stacks. Anything else reads a lane as the stack's row, which
costs that row's move (a global norm's per-layer sums, say: a scalar each). Groups found
incomplete are broken and the search runs again until nothing changes; a family one of whose
lanes is read as a row, or whose next value is not one stack's lanes in order, is not stored
and the search runs again: what is left is stored, and the rest is the step as written.

The stored state is the user's tree with a family's leaves as rows of their stack
(`LayerRow`), wrapped in `Placed` (stored.py): passed back as it came, each family is its
stack again, with no copy; `autopar.unpack` gives the user's leaves.
"""
from __future__ import annotations

import dataclasses
import types
import warnings
from collections import defaultdict
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from autopar.planning.problem import AutoparWarning
from autopar.schedule.separable import bind_equation
from autopar.schedule.stored import placement_order, wrapped_state
from autopar.trace.tracer import argument_names, leaf_paths, state_pairs, trace


# stacked input or output -> the layer each row holds (the circular schedule's placement)
Placement = dict[int, np.ndarray] | None


@dataclasses.dataclass(frozen=True, eq=False)  # compared and hashed as the object it is
class LayerRow:
    """Layer `index` of a stored stack: a leaf of a state the step returned with its Python
    loop's layers stacked (read it through `autopar.unpack`)."""
    stack: Any
    index: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self) -> Any:
        return self.stack.dtype

    @property
    def weak_type(self) -> bool:
        return bool(getattr(jax.typeof(self.stack), "weak_type", False))

    def value(self) -> Any:
        return self.stack[self.index]


@dataclasses.dataclass(frozen=True)
class Lanes:
    """Which of a step's flat inputs and outputs are stored stacked: the stacked step's input
    j is the stack of the user's flat inputs `inputs[j]` (one index: that input as it is), and
    its output j gives the user's outputs `outputs[j]`; `paths`: the stacked inputs' paths."""
    inputs: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]
    paths: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    @property
    def families(self) -> int:
        return sum(len(o) > 1 for o in self.inputs)

    @property
    def layers(self) -> int:
        return max((len(o) for o in self.inputs), default=1)

    def stacked_inputs(self, leaves: Sequence[Any], placement: Placement = None
                       ) -> list[Any]:
        """The user's flat inputs (LayerRows where a Placed state came back) as the stacked
        step takes them: a family whose rows are its stack's, in the order the step keeps
        them (`placement`: stacked input -> the layer of each row, the circular schedule's;
        layer order elsewhere), is that stack."""
        placement = placement or {}
        return [as_leaf(leaves[o[0]]) if len(o) == 1 else
                _stack_of([leaves[k] for k in o], placement.get(j))
                for j, o in enumerate(self.inputs)]

    def user_outputs(self, outs: Sequence[Any], placement: Placement = None) -> list[Any]:
        """The stacked step's flat outputs as the user's, a family's leaves as LayerRows
        (`placement`: stacked output -> the layer of each row)."""
        placement = placement or {}
        flat: list[Any] = [None] * sum(len(o) for o in self.outputs)
        for j, (value, origin) in enumerate(zip(outs, self.outputs)):
            if len(origin) == 1:
                flat[origin[0]] = value
                continue
            row_of = _rows_of(placement.get(j), len(origin))
            for i, k in enumerate(origin):
                flat[k] = LayerRow(value, int(row_of[i]))
        return flat

    def user_specs(self, specs: Sequence[Any]) -> list[Any]:
        """The stacked inputs' specs (`Spec`s) as the user's leaves': a family's leaves get
        their stack's without its first (the layers') dimension."""
        out: list[Any] = [None] * sum(len(o) for o in self.inputs)
        for spec, origin in zip(specs, self.inputs):
            for k in origin:
                out[k] = spec if len(origin) == 1 else tuple(spec[1:])
        return out

    def stacked_abstract(self, shapes: Sequence[jax.ShapeDtypeStruct]
                         ) -> list[jax.ShapeDtypeStruct]:
        """The user's flat inputs' shapes as the stacked step's."""
        return [shapes[o[0]] if len(o) == 1 else
                jax.ShapeDtypeStruct((len(o), *shapes[o[0]].shape), shapes[o[0]].dtype)
                for o in self.inputs]

    def stacked_call(self, call: Any) -> Any:
        """What `calling.place` reads of a call (its function, leaves' paths and donation),
        for the stacked leaves."""
        return types.SimpleNamespace(fn=call.fn, paths=list(self.paths),
                                     donated=self.stacked_donated(call.donated))

    def placed_outputs(self, out_tree: Any, outs: Sequence[Any], placement: Placement = None
                       ) -> Any:
        """The stacked step's outputs as the user's tree, its new state as Placed."""
        stored = [k for o in self.outputs if len(o) > 1 for k in o]
        return wrapped_state(out_tree, self.user_outputs(outs, placement), stored,
                             lambda _: self)

    def unpacked(self, tree: Any) -> Any:
        """A stored state's tree with each LayerRow as the user's leaf."""
        return jax.tree_util.tree_map(as_leaf, tree)

    def placements(self, stored: Any) -> tuple[Placement, Placement]:
        """The circular placement's rows of the stacked inputs and outputs a Storage (in the
        stacked step's leaves) keeps in it: (inputs, outputs)."""
        if stored is None:
            return None, None
        order = placement_order(stored.length, stored.stages, stored.repeats)
        return ({j: order for j in stored.inputs}, {j: order for j in stored.outputs})

    def stacked_donated(self, donated: frozenset[int]) -> frozenset[int]:
        return frozenset(j for j, o in enumerate(self.inputs) if all(k in donated for k in o))

    def stacked_pairs(self, pairs: dict[int, int]) -> dict[int, int]:
        """The user's state pairs (output -> input, flat) between the stacked step's leaves."""
        where_in = {o[0]: j for j, o in enumerate(self.inputs)}
        out: dict[int, int] = {}
        for j, origin in enumerate(self.outputs):
            i = pairs.get(origin[0])
            if i in where_in and len(self.inputs[where_in[i]]) == len(origin):
                out[j] = where_in[i]
        return out


def as_leaf(x: Any) -> Any:
    """A leaf of the user's tree: a LayerRow's row, anything else as it is."""
    return x.value() if isinstance(x, LayerRow) else x


def _rows_of(order: np.ndarray | None, length: int) -> np.ndarray:
    """The row holding each layer, where row r holds layer `order[r]`."""
    return np.arange(length) if order is None else np.argsort(order)


def _stack_of(leaves: list[Any], order: np.ndarray | None = None) -> Any:
    """One family's leaves as the stack whose row r holds layer `order[r]` (layer order
    where None): the stack they are rows of, where they are, else a new one."""
    first, row_of = leaves[0], _rows_of(order, len(leaves))
    if (isinstance(first, LayerRow) and first.stack.shape[0] == len(leaves)
            and all(isinstance(x, LayerRow) and x.stack is first.stack and x.index == row_of[i]
                    for i, x in enumerate(leaves))):
        return first.stack
    layers = range(len(leaves)) if order is None else order
    return jnp.stack([as_leaf(leaves[i]) for i in layers])


# -- finding the families and the groups -----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Lane:
    stack: Any  # hashable: ("in", family), ("group", key, k) or ("unstack", equation)
    index: int


class _Search:
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
               ) -> tuple[dict[int, list[int]], _Search | None, dict[int, str]]:
    """The families that can be stored, the search that stores them (None where none can),
    and why each other family cannot, by its first leaf: `paths`, the inputs' key paths;
    `pairs`: output -> input, the state's next values."""
    jaxpr = closed.jaxpr
    families = dict(enumerate(_families(jaxpr, paths)))
    broken: set = set()
    refused: dict[int, str] = {}
    while families:
        search = _Search(jaxpr, families, broken)
        missing = search.incomplete()
        if missing - broken:
            broken |= missing
            continue
        for f, members in families.items():
            reader = search.rows.get(("in", f))
            if reader is not None:
                refused[members[0]] = (f"a layer is read on its own by {reader.primitive.name} "
                                       f"at {source_info_util.summarize(reader.source_info)}")
            elif not _returned_whole(search, members, pairs):
                refused[members[0]] = "its next value is not computed over the stacks alone"
        if not any(families[f][0] in refused for f in families):
            return families, search, refused
        families = {f: m for f, m in families.items() if m[0] not in refused}
    return {}, None, refused


def _returned_whole(search: _Search, members: list[int], pairs: dict[int, int]) -> bool:
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


# -- the stacked step --------------------------------------------------------------------
def stacked(closed: Any, families: dict[int, list[int]], search: _Search,
            pairs: dict[int, int], in_paths: Sequence[str], n_outputs: int
            ) -> tuple[Callable, Lanes]:
    """The step over stacked inputs (a function of the stacked flat inputs giving the stacked
    flat outputs), and how its leaves relate to the user's."""
    first = {m[0]: f for f, m in families.items()}
    member = {k for m in families.values() for k in m}
    inputs = tuple(tuple(families[first[k]]) if k in first else (k,)
                   for k in range(len(closed.jaxpr.invars)) if k not in member or k in first)
    back = {i: o for o, i in pairs.items()}
    out_family = {back[m[0]]: [back[k] for k in m] for m in families.values()
                  if back.get(m[0]) is not None}
    out_member = {o for m in out_family.values() for o in m}
    outputs = tuple(tuple(out_family[o]) if o in out_family else (o,)
                    for o in range(n_outputs) if o not in out_member or o in out_family)
    paths = tuple(_stack_path([in_paths[k] for k in o]) for o in inputs)
    lanes = Lanes(inputs, outputs, paths)

    def run(*args: Any) -> list[Any]:
        return _Run(closed, search, lanes).outputs(args)

    return run, lanes


def _stack_path(paths: list[str]) -> str:
    if len(paths) == 1:
        return paths[0]
    parts = [p.split("/") for p in paths]
    differ = [d for d in range(len(parts[0])) if len({p[d] for p in parts}) > 1]
    if len({len(p) for p in parts}) == 1 and len(differ) == 1:
        d = differ[0]
        return "/".join(parts[0][:d] + [f"{parts[0][d]}..{parts[-1][d]}"] + parts[0][d + 1:])
    return f"{paths[0]} (+{len(paths) - 1} layers)"


class _Run:
    """The step's equations evaluated over the stacks, as the search decided."""

    def __init__(self, closed: Any, search: _Search, lanes: Lanes) -> None:
        self.closed, self.search, self.lanes = closed, search, lanes
        self.env: dict[Any, Any] = {}
        self.groups: dict[Any, list[Any]] = {}

    def read(self, v: Any) -> Any:
        return v.val if isinstance(v, Literal) else self.env[v]

    def row(self, v: Any) -> Any:
        x = self.read(v)
        return x[0][x[1]] if isinstance(x, tuple) else x

    def outputs(self, args: Sequence[Any]) -> list[Any]:
        jaxpr = self.closed.jaxpr
        self.env.update(zip(jaxpr.constvars, self.closed.consts))
        for value, origin in zip(args, self.lanes.inputs):
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
                else self.read(jaxpr.outvars[o[0]])[0] for o in self.lanes.outputs]

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


def traced_lanes(fn: Callable, args: Sequence[Any], donated: frozenset[int], platform: str
                 ) -> tuple[Any, Lanes, Any, Any, Any] | None:
    """The step traced over its Python loop's layers stacked (an OpGraph whose inputs and
    outputs are the stacked leaves, with their paths and state pairs), the Lanes, the user's
    output tree, and the stacked step's argument and output trees (an argument or output
    element holding a family: a list of its stacked leaves); None where no family can be
    stored."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    names = argument_names(fn, len(args))
    keypaths = [tuple(kp) for a in args for kp, _ in jax.tree_util.tree_flatten_with_path(a)[0]]
    in_paths = [p for name, a in zip(names, args) for p in leaf_paths(a, name)]
    pairs = state_pairs(args, out_shape, len(keypaths))
    families, search, refused = find_lanes(closed, keypaths, pairs)
    if refused:
        named = [f"{in_paths[k]} ({why})" for k, why in sorted(refused.items())]
        warnings.warn(AutoparWarning(
            f"keep_placement: {len(refused)} famil{'y' if len(refused) == 1 else 'ies'} of the "
            f"Python loop's per-layer leaves stay your leaves, stacked every step, since "
            f"{'; '.join(named[:3])}{' ...' if len(named) > 3 else ''}."), stacklevel=4)
    if search is None:
        return None
    out_paths = leaf_paths(out_shape, "out")
    run, lanes = stacked(closed, families, search, pairs, in_paths, len(out_paths))
    flat = jax.tree_util.tree_leaves(args)
    stacked_args = [flat[o[0]] if len(o) == 1 else
                    jax.ShapeDtypeStruct((len(o), *flat[o[0]].shape), flat[o[0]].dtype)
                    for o in lanes.inputs]
    graph = trace(run, stacked_args, lanes.stacked_donated(donated), compiler=platform)[0]
    paths = {**dict(zip(graph.inputs, lanes.paths)),
             **{t: _stack_path([out_paths[k] for k in o])
                for t, o in zip(graph.outputs, lanes.outputs)}}
    tensors = tuple(dataclasses.replace(t, path=paths[t.id]) if t.id in paths else t
                    for t in graph.tensors)
    parts = list(out_shape) if isinstance(out_shape, (tuple, list)) else [out_shape]
    return (dataclasses.replace(graph, tensors=tensors, state_pairs=lanes.stacked_pairs(pairs)),
            lanes, jax.tree_util.tree_structure(out_shape), _regrouped(args, lanes.inputs),
            _regrouped(parts, lanes.outputs))


def _regrouped(parts: Sequence[Any], origins: tuple[tuple[int, ...], ...]) -> Any:
    """The tree of the stacked leaves `origins` (the user's flat leaves of each) over `parts`
    (the user's arguments, or output elements): a part holding no family keeps its tree, one
    that holds some becomes the list of its stacked leaves."""
    trees, start = [], 0
    for part in parts:
        end = start + len(jax.tree_util.tree_leaves(part))
        mine = [o for o in origins if start <= o[0] < end]
        trees.append(part if all(len(o) == 1 for o in mine) else [0] * len(mine))
        start = end
    return jax.tree_util.tree_structure(tuple(trees))
