"""The pipelined stack's read of a per-layer input, marked in the traced step, and whether that
input arrives stored in the circular schedule's placement (autopar/placement/stored.py)."""
from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable, Sequence

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from autopar.rules.kinds import STACK_READ

# An identity on a stacked input [L, ...] of the pipelined stack (`index`: its position among
# the stack's per-layer inputs), so that the planning finds where the stack reads a leaf and
# where the leaf's gradient comes back (`grad`: the transpose's mark).
stack_read_p = Primitive(STACK_READ)
stack_read_p.def_impl(lambda x, *, index, grad: x)
stack_read_p.def_abstract_eval(lambda x, *, index, grad: x)
mlir.register_lowering(stack_read_p, mlir.lower_fun(lambda x, *, index, grad: x,
                                                    multiple_results=False))
ad.deflinear2(stack_read_p, lambda ct, x, *, index, grad: [
    stack_read_p.bind(ct, index=index, grad=not grad)])
batching.primitive_batchers[stack_read_p] = lambda args, dims, **params: (
    stack_read_p.bind(args[0], **params), dims[0])


def stack_read(x: Any, index: int) -> Any:
    """`x`, marked as the stack's per-layer input number `index`."""
    return stack_read_p.bind(x, index=index, grad=False)


# Per-layer inputs (by index) that arrive in placement order while a step is traced.
_STORED: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "autopar_stored_layers", default=frozenset())


def reading_stored(fn: Callable, indices: Sequence[int]) -> Callable:
    """`fn` with its pipeline reading per-layer inputs `indices` as stored in placement
    order. A new function, with `fn`'s name and signature (the inputs' paths): jax's trace
    cache, keyed by the function, would give `fn`'s first trace back."""
    @functools.wraps(fn)
    def stored_step(*args: Any) -> Any:
        token = _STORED.set(frozenset(indices))
        try:
            return fn(*args)
        finally:
            _STORED.reset(token)
    return stored_step


def is_stored(index: int) -> bool:
    return index in _STORED.get()


