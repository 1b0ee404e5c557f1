"""`rotate(x, shift)`: x rolled by `shift` along its first dimension, as one primitive.

The circular pipeline (gpipe.py) sends every stage's value to the next and the last stage's to
the first. Split over the 'stage' axis, that is one collective-permute in a cycle, which XLA
compiles `jnp.roll` to (XLA CPU, jax 0.10.2). Traced as `jnp.roll` it would reach the planner
as two slices and a concatenation, which it prices as gathers; as two shifts (pads), the
planner may gather once where XLA still sends twice. One primitive lets the planner price the
one collective-permute XLA compiles: its rule splits every dimension, and the cost model
charges each device's rows that cross into another's block (cost.model._shifted). Its rule
is registered here, beside its definition.

Outside autopar it is `jnp.roll`; it is linear, its transpose the opposite roll.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from autopar.rules.factors import Rule
from autopar.rules.kinds import ROTATE
from autopar.rules.layout import Shape, shifts, whole_dims_shared
from autopar.rules.table import register

rotate_p = Primitive(ROTATE)
rotate_p.def_impl(lambda x, *, shift, axis: jnp.roll(x, shift, axis))
rotate_p.def_abstract_eval(lambda x, *, shift, axis: x)
mlir.register_lowering(rotate_p, mlir.lower_fun(
    lambda x, *, shift, axis: jnp.roll(x, shift, axis), multiple_results=False))
ad.deflinear2(rotate_p, lambda ct, x, *, shift, axis: [rotate_p.bind(ct, shift=-shift,
                                                                      axis=axis)])


def _batch_rule(args: Any, dims: Any, *, shift: int, axis: int) -> tuple[Any, Any]:
    (x,), (d,) = args, dims
    if d is None:
        return rotate_p.bind(x, shift=shift, axis=axis), d
    return rotate_p.bind(x, shift=shift, axis=axis + (d <= axis)), d


batching.primitive_batchers[rotate_p] = _batch_rule


def rotate(x: Any, shift: int = 1) -> Any:
    """`jnp.roll(x, shift, axis=0)`, which the planner sees as one operator."""
    return rotate_p.bind(x, shift=shift, axis=0)


def rule(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    """Every dimension splits, the rotated one shifted: each device sends the rows that cross
    into another's block, one collective-permute (rules.layout.shifts)."""
    return whole_dims_shared(ins, outs, [True] * len(ins[0]), 0, tuple(shifts(params)))


register(ROTATE, rule)
