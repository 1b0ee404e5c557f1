"""The circular schedule's layers stored in its placement between steps
(`auto_parallel(..., pipeline_repeats=R, keep_placement=True)`).

Row i of a stored leaf [L, ...] holds layer `placement_order(L, S, R)[i]`, so the leaf split
over 'stage' gives each stage its own chunks. The step's state is returned wrapped as
`Placed` and taken back as it came; `unpack` gives the user's own tree (for a checkpoint, for
evaluation elsewhere). Which leaves can be stored is storable.py's.

Design and rationale: docs/internals-steps.md, "autopar/placement/stored.py".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autopar.errors import AutoparError


def placement_order(length: int, stages: int, rounds: int) -> np.ndarray:
    """Row i of a stored leaf holds layer `order[i]`: stage s's chunks (s, s+S, ...) one after
    the other, so that a split over 'stage' of the stored leaf gives each stage its own."""
    return np.arange(length).reshape(rounds, stages, -1).swapaxes(0, 1).reshape(-1)


# -- the state, stored ----------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Which leaves of a tree are stored in placement order, and that order."""
    leaves: tuple[int, ...]  # flat leaf indices within the tree
    length: int
    stages: int
    rounds: int

    def order(self) -> np.ndarray:
        return placement_order(self.length, self.stages, self.rounds)


class PlacedStateError(AutoparError, AttributeError):
    """A Placed state read as the user's tree (an AttributeError too, so hasattr works)."""


@jax.tree_util.register_pytree_node_class
class Placed:
    """A step's state with its stack's layers stored in the circular schedule's placement
    (keep_placement=True). Pass it back to the step as it came; `autopar.unpack(placed)` (or
    `placed.unpack()`) gives the tree in the user's layer order."""

    def __init__(self, tree: Any, layout: Layout) -> None:
        self.tree, self.layout = tree, layout

    def tree_flatten(self) -> tuple[tuple, Layout]:
        return (self.tree,), self.layout

    @classmethod
    def tree_unflatten(cls, layout: Layout, children: tuple) -> Placed:
        return cls(children[0], layout)

    def unpack(self) -> Any:
        return unpack(self)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise PlacedStateError(
            f"this state holds its stack's layers {self._how()}, so it has no {name!r} of "
            "yours to read. Fix: autopar.unpack(state) gives your tree; pass the state itself "
            "back to the step.")

    def _how(self) -> str:
        layout = self.layout
        if isinstance(layout, Layout):
            return (f"in the pipeline's placement ({len(layout.leaves)} leaves of "
                    f"{layout.length} layers stored as {layout.stages} stages x "
                    f"{layout.rounds} rounds), not in your layer order")
        return (f"stacked ({layout.families} families of {layout.layers} layers, one array "
                "each), not as your leaves")

    def __getitem__(self, key: Any) -> Any:
        return self.__getattr__(f"[{key!r}]")

    def __repr__(self) -> str:
        return f"Placed(layers {self._how()}; autopar.unpack gives the tree)"


def reorder(leaves: list, layout: Layout, inverse: bool) -> list:
    """`leaves` (a tree's flat leaves) with those of `layout` put into placement order, or
    (inverse) back into layer order."""
    order = layout.order()
    index = np.argsort(order) if inverse else order
    out = list(leaves)
    for k in layout.leaves:
        out[k] = _take_rows(out[k], index)
    return out


def _take_rows(x: Any, index: np.ndarray) -> Any:
    if isinstance(x, jax.Array):
        return jnp.take(x, jnp.asarray(index), axis=0)
    return np.take(np.asarray(x), index, axis=0)


def unpack(state: Any) -> Any:
    """The user's tree of a state the step returned with keep_placement=True (its stack's
    layers back in layer order); anything else is returned as it is. Placed values inside a
    larger tree are unpacked too."""
    def one(x: Any) -> Any:
        if not isinstance(x, Placed):
            return x
        if not isinstance(x.layout, Layout):  # layers stacked (lanes.Lanes)
            return x.layout.unpacked(x.tree)
        leaves, tree = jax.tree_util.tree_flatten(x.tree)
        return tree.unflatten(reorder(leaves, x.layout, inverse=True))
    return jax.tree_util.tree_map(one, state, is_leaf=lambda x: isinstance(x, Placed))


# -- a call's state in and out --------------------------------------------------------------
def unwrapped(args: tuple, kwargs: dict) -> tuple[tuple, dict, dict[int | str, Layout]]:
    """The call's arguments with each Placed one replaced by the tree it wraps, and where
    those were (position or keyword) with their layouts."""
    placed: dict[int | str, Layout] = {}

    def one(where: int | str, value: Any) -> Any:
        if isinstance(value, Placed):
            placed[where] = value.layout
            return value.tree
        return value
    return (tuple(one(i, a) for i, a in enumerate(args)),
            {k: one(k, v) for k, v in kwargs.items()}, placed)


def stored_inputs(call: Any, stored: Any) -> list:
    """The call's flat leaves as the step takes them (`stored`: the plan's Storage, None where
    it stores nothing): the stored ones of a Placed argument as they came, those of a plain
    tree (the user's first state, a restored checkpoint) put into placement order; a Placed
    argument the plan does not store so (a step planned otherwise, an evaluation step) is
    put back into layer order first."""
    leaves = list(call.leaves)
    start = 0
    for where, tree in zip(call.slots, call.trees):
        end = start + tree.num_leaves
        mine = tuple(k - start for k in (stored.inputs if stored else ()) if start <= k < end)
        layout = Layout(mine, stored.length, stored.stages, stored.repeats) if mine else None
        given = call.placed.get(where)
        if not isinstance(given, Layout):  # layers stacked (lanes.py): taken as they are
            given = None
        if given != layout:
            if given is not None:
                leaves[start:end] = reorder(leaves[start:end], given, inverse=True)
            if layout is not None:
                leaves[start:end] = reorder(leaves[start:end], layout, inverse=False)
        start = end
    return leaves


def placed_outputs(out_tree: Any, outs: list, stored: Any) -> Any:
    """The step's outputs, the element holding the stored leaves (the new state) returned as
    Placed."""
    return wrapped_state(out_tree, outs, stored.outputs, lambda start: Layout(
        tuple(k - start for k in stored.outputs), stored.length, stored.stages,
        stored.repeats))


def wrapped_state(out_tree: Any, outs: list, stored: Sequence[int],
                  layout_at: Callable[[int], Any]) -> Any:
    """The step's outputs, the element holding the flat outputs `stored` (the whole output,
    or one element of a tuple or list) returned as Placed, with the layout `layout_at` gives
    for that element's first flat output."""
    out = jax.tree_util.tree_unflatten(out_tree, outs)
    if isinstance(out, (tuple, list)):
        start = 0
        for i, child in enumerate(out_tree.children()):
            end = start + child.num_leaves
            if all(start <= k < end for k in stored):
                items = list(out)
                items[i] = Placed(items[i], layout_at(start))
                return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
            start = end
    return Placed(out, layout_at(0))
