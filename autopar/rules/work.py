"""The primitives' floating-point work, keyed by primitive name beside their rules (table.py):
the cost model's flops of one execution of an operator."""
from __future__ import annotations

import math
from typing import Callable

Shape = tuple[int, ...]


def dot_flops(ins: list[Shape], outs: list[Shape], params: dict) -> float:
    """2 x result elements x contraction length."""
    (lc, _), _ = params["dimension_numbers"]
    return 2.0 * sum(math.prod(s) for s in outs) * math.prod(ins[0][d] for d in lc)


def conv_flops(ins: list[Shape], outs: list[Shape], params: dict) -> float:
    """2 x result elements x input features per group x window taps."""
    rhs, dn = ins[1], params["dimension_numbers"]
    window = math.prod(rhs[d] for d in dn.rhs_spec[2:])
    return 2.0 * sum(math.prod(s) for s in outs) * rhs[dn.rhs_spec[1]] * window


# Floating-point operations of one execution, unsharded, where they are not one per element of
# the largest of the results (together) and each operand (`flops_for`).
FLOPS: dict[str, Callable[[list[Shape], list[Shape], dict], float]] = {
    "dot_general": dot_flops, "conv_general_dilated": conv_flops}


def flops_for(primitive: str, ins: list[Shape], outs: list[Shape], params: dict) -> float:
    """Floating-point operations of one execution of the operator, unsharded."""
    fn = FLOPS.get(primitive)
    if fn is not None:
        return fn(ins, outs, params)
    return float(max([sum(math.prod(s) for s in outs)] + [math.prod(s) for s in ins]))
