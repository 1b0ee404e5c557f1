"""Rules of the operators that move data without computing on it: broadcasts, transposes,
reshapes, and those that cut, pad, join, stack, tile, reverse or split dimensions. The
dimensions they act on stay whole; the others split freely. `Factors` hands out the factor
names every rule of the table uses."""
from __future__ import annotations

import itertools
from typing import Sequence

from autopar.rules.factors import Dims, Rule

Shape = tuple[int, ...]


class Factors:
    """Hands out fresh factor names and records their sizes."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        self._names = (f"f{i}" for i in itertools.count())

    def new(self, size: int) -> str | None:
        if size <= 1:
            return None  # a dimension of size 1 cannot be split
        name = next(self._names)
        self.sizes[name] = size
        return name

    def dims(self, shape: Shape) -> Dims:
        return tuple(self.new(d) for d in shape)

    def rule(self, operands: list[Dims], results: list[Dims], combine: str = "sum",
             shifted: frozenset[str] = frozenset()) -> Rule:
        return Rule(tuple(operands), tuple(results), self.sizes, combine, shifted)


def broadcast_in_dim(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    fs = Factors()
    result = list(fs.dims(outs[0]))
    operand = tuple(result[o] if d == outs[0][o] else None
                    for d, o in zip(ins[0], params["broadcast_dimensions"]))
    return fs.rule([operand, *[() for _ in ins[1:]]], [tuple(result)])


def transpose(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    fs = Factors()
    operand = fs.dims(ins[0])
    return fs.rule([operand], [tuple(operand[p] for p in params["permutation"])])


def reshape(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    """Split and merge of dimensions: the major dimensions of each group share a factor.

    Splitting (b*t) into (b, t) keeps a split of b*t into contiguous blocks as a split of b, when
    the axis size divides b: the factor takes the smaller major size.
    """
    src, dst = ins[0], outs[0]
    fs = Factors()
    operand: list[str | None] = [None] * len(src)
    result: list[str | None] = [None] * len(dst)
    i = j = 0
    while i < len(src) and j < len(dst):
        if src[i] == 1:
            i += 1
            continue
        if dst[j] == 1:
            j += 1
            continue
        i0, j0, a, b = i, j, src[i], dst[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b and i < len(src):
                a, i = a * src[i], i + 1
            elif b < a and j < len(dst):
                b, j = b * dst[j], j + 1
            else:
                break
        f = fs.new(min(src[i0], dst[j0]))
        if f is not None and max(src[i0], dst[j0]) % min(src[i0], dst[j0]) == 0:
            operand[i0], result[j0] = f, f
    return fs.rule([tuple(operand), *[() for _ in ins[1:]]], [tuple(result)])


def squeeze(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    fs = Factors()
    dropped = {d % len(ins[0]) for d in params["dimensions"]}
    operand = fs.dims(ins[0])
    return fs.rule([operand], [tuple(f for k, f in enumerate(operand) if k not in dropped)])


def expand_dims(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    return reshape(ins, outs, params)


def concatenate(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    fs = Factors()
    axis = params["dimension"]
    dims = tuple(None if k == axis else f for k, f in enumerate(fs.dims(outs[0])))
    return fs.rule([dims] * len(ins), [dims])


def whole_dims_shared(ins: list[Shape], outs: list[Shape], keep: list[bool],
                       extra_operands: int, shifted: Sequence[int] = ()) -> Rule:
    """Dims marked keep share a factor between operand 0 and the result; the rest stay whole.
    Rows move along the dims `shifted`."""
    fs = Factors()
    dims = tuple(fs.new(d) if k else None for d, k in zip(outs[0], keep))
    return fs.rule([dims] + [() for _ in range(extra_operands)], [dims],
                   shifted=frozenset(dims[d] for d in shifted) - {None})


def slice_rule(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    strides = params.get("strides") or (1,) * len(ins[0])
    keep = [s == 0 and e == d and st == 1 for s, e, st, d in
            zip(params["start_indices"], params["limit_indices"], strides, ins[0])]
    return whole_dims_shared(ins, outs, keep, len(ins) - 1)


def pad(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    """Unpadded dimensions split freely, and so does a shifted one (padded by k low and cut
    by k high, a pipeline's shift between stages): each device sends its last k rows to the
    next, one collective-permute (`shifts`, priced by the cost model)."""
    moved = shifts(params)
    keep = [cfg == (0, 0, 0) or d in moved for d, cfg in
            enumerate(map(tuple, params["padding_config"]))]
    return whole_dims_shared(ins, outs, keep, len(ins) - 1, tuple(moved))


def shifts(params: dict) -> dict[int, int]:
    """{dimension: rows moved} for a pad's dimensions that shift (low k, high -k, no
    interior padding), or a rotation's (autopar.primitives.rotate)."""
    if "shift" in params:
        return {params["axis"]: abs(params["shift"])}
    return {d: abs(lo) for d, (lo, hi, interior) in enumerate(params["padding_config"])
            if lo and lo == -hi and not interior}


def dynamic_slice(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    keep = [s == d for s, d in zip(params["slice_sizes"], ins[0])]
    return whole_dims_shared(ins, outs, keep, len(ins) - 1)


def dynamic_update_slice(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    fs = Factors()
    dims = tuple(fs.new(d) if u == d else None for u, d in zip(ins[1], ins[0]))
    return fs.rule([dims, dims] + [() for _ in ins[2:]], [dims])


def rev(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    """Reversed dimensions stay whole; the others split freely."""
    keep = [k not in params["dimensions"] for k in range(len(ins[0]))]
    return whole_dims_shared(ins, outs, keep, 0)


def split(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    """`jnp.split`: the pieces take the operand's factors except along the split axis, which
    stays whole (a block of the operand is not a block of each piece)."""
    fs = Factors()
    axis = params["axis"] % len(ins[0])
    dims = tuple(None if k == axis else f for k, f in enumerate(fs.dims(ins[0])))
    return fs.rule([dims], [dims] * len(outs))


def stack(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    """`jnp.stack`: the operands share the result's factors but the new axis, which is whole
    (each operand is one index of it)."""
    fs = Factors()
    axis = params["axis"] % len(outs[0])
    result = tuple(None if k == axis else f for k, f in enumerate(fs.dims(outs[0])))
    operand = result[:axis] + result[axis + 1:]
    return fs.rule([operand] * len(ins), [result])


def unstack(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    """The transpose of stack (its gradient): the pieces take the operand's other factors."""
    stacked = stack(outs, ins, params)
    return Rule(stacked.results, stacked.operands, stacked.sizes)


def tile(ins: list[Shape], outs: list[Shape], params: dict) -> Rule:
    """`jnp.tile`: untiled dimensions split freely; a tiled one stays whole (a block of the
    result is not a block of the operand)."""
    return whole_dims_shared(ins, outs, [r == 1 for r in params["reps"]], len(ins) - 1)
