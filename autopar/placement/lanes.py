"""A Python loop's layers stored stacked on their stages between steps
(`auto_parallel(..., pipeline=S, keep_placement=True)` on a loop of blocks).

- `traced_lanes(fn, args, donated, platform)`: the step traced over its layers stacked, as a
  `StackedTrace`; None where no family can be stored. A family that cannot be stored stays the
  user's leaves, stacked every step, and an AutoparWarning says why. Nothing raises.
- `stacked(...)`: the step over the stacks, and its `Lanes`: which user leaves each stacked
  input and output holds.
- `LayerRow`: a row of a stored stack. A stored state is the user's tree, a family's leaves
  as `LayerRow`s, wrapped in `Placed` (stored.py): passed back as it came, each family
  is its stack again, with no copy. `autopar.unpack` gives the user's leaves.

Design and rationale: docs/internals-steps.md, "autopar/placement/lanes.py".
"""
from __future__ import annotations

import dataclasses
import types
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopar.errors import AutoparWarning
from autopar.placement.stored import placement_order, wrapped_state
from autopar.placement.vectorise import LaneSearch, StackedRun, find_lanes
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


# -- the stacked step --------------------------------------------------------------------
def stacked(closed: Any, families: dict[int, list[int]], search: LaneSearch,
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
        return StackedRun(closed, search, inputs, outputs).run(args)

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


@dataclasses.dataclass(frozen=True)
class StackedTrace:
    """A step traced over its Python loop's layers stacked: the OpGraph (its inputs and
    outputs the stacked leaves, with their paths and state pairs), the Lanes, the user's
    output tree, and the stacked step's argument and output trees (an argument or output
    element holding a family: a list of its stacked leaves)."""

    graph: Any
    lanes: Lanes
    out_tree: Any
    in_tree: Any
    plan_out_tree: Any


def traced_lanes(fn: Callable, args: Sequence[Any], donated: frozenset[int], platform: str
                 ) -> StackedTrace | None:
    """The step traced over its Python loop's layers stacked (a StackedTrace); None where no
    family can be stored."""
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
    return StackedTrace(
        dataclasses.replace(graph, tensors=tensors, state_pairs=lanes.stacked_pairs(pairs)),
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
