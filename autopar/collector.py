"""Python's garbage collector during planning.

Planning and tracing allocate hundreds of thousands of short-lived objects (equations, tracers,
strategies, cost tables). Each allocation burst triggers collections, and every full
collection scans the whole heap: JAX's own state, the user's model and arrays, everything
alive before planning began, none of which planning can free: on the example's step about a
quarter of planning and lowering went to the collector (docs/decisions.md, "Planning
overhead"). With the older objects set aside, it scans only what planning made. Cycles among
the objects planning makes are still collected as usual, after a problem is built: during the
build (`paused`) none runs, as its tables and strategy lists outlive it. What a stage leaves
for the stages after it (the traced program and its units, the problems kept for the next
memory price) is set aside as the block's older objects are (`settle`): on a 96-layer GPT,
full collections that freed nothing took about 3.7 of its 15 s of planning
(docs/decisions.md, "Planning a deep model").
"""
from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def young_objects_only() -> Iterator[None]:
    """Within the block, the collector scans only objects made within it.

    Objects alive on entry are moved to the permanent generation (`gc.freeze`) and back on exit
    (`gc.unfreeze`), where the next collections see them again. If something froze objects
    already (a server freezing its heap before forking, or an enclosing block), nothing is
    changed: unfreezing on exit would undo that freeze too.
    """
    global _owned
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    _owned = True
    try:
        yield
    finally:
        _owned = False
        gc.unfreeze()


_owned = False  # within young_objects_only, which froze the heap and unfreezes it on exit


def settle() -> None:
    """Within young_objects_only: the objects alive now (what a stage made for the stages
    after it) are set aside from collections, as those alive on entry are, until the block
    ends. Outside it, nothing: only that block's exit gives them back to the collector.
    Objects set aside are still freed when no longer referenced; only cycles among them wait
    for the block's end."""
    if _owned:  # also where paused: the objects made while it was are set aside unscanned
        gc.freeze()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Within the block (or the function it decorates), no collection runs: for work that
    makes many objects which outlive it (a problem's cost tables, the spec pairs priced for
    them), where each collection would walk all that planning holds and free little. Cycles
    made within are collected by the next collection after it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
