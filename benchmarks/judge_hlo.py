"""Reading an optimised HLO module as text, for the independent judge (benchmarks/judge.py):
its computations and instructions, how often each computation runs in a step (loop trips
read from the loop), the flops of its dots and convolutions, the HBM bytes its scheduled
code moves, and the work of the library calls (cuBLAS GEMMs, cuDNN convolutions) that XLA
GPU's cost analysis leaves out. Shares no code with the planner.
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict, namedtuple

import numpy as np

# One HLO instruction (args: raw text inside its operand parentheses) and one computation.
_Inst = namedtuple("_Inst", "name shape op args operands attrs")
_Comp = namedtuple("_Comp", "name insts root")
_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->.*\{\s*$")
_INST = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COLLECTIVES = {op: kind for kind in ("all-reduce", "all-gather", "reduce-scatter",
                                      "all-to-all", "collective-permute")
                for op in (kind, kind + "-start")} | {"ragged-all-to-all": "all-to-all"}
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": .5}


def _arrays(shape: str) -> list[tuple[float, tuple[int, ...]]]:
    """(bytes per element, dims) of every array in a (tuple) shape."""
    return [(_BYTES.get(t, 1 if t.startswith("f8") else 0),
             tuple(int(d) for d in s.split(",") if d))
            for t, s in re.findall(r"([a-z][a-z0-9]*)\[([0-9,]*)\]", shape)]


def _nbytes(shape: str) -> float:
    """Bytes of the non-scalar arrays of a shape (scalars are counters and contexts)."""
    return sum(b * math.prod(d) for b, d in _arrays(shape) if d)


def _close(text: str, start: int) -> int:
    """Index of the parenthesis closing the one opened at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text)


def _parse_inst(line: str) -> _Inst | None:
    """`[ROOT] %name = shape opcode(operands), attributes`; None for other lines."""
    m = _INST.match(line)
    rest = m.group(3) if m else ""
    end = _close(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
    shape, tail = rest[:end], rest[end:].lstrip()
    op = re.match(r"([\w\-]+)\(", tail)
    if not m or not op:
        return None
    close = _close(tail, op.end() - 1)
    args = tail[op.end():close]
    return _Inst(m.group(2), shape, op.group(1), args, re.findall(r"%([\w.\-]+)", args),
                 tail[close + 1:])


def _parse_module(text: str) -> tuple[dict[str, _Comp], str]:
    """Computations in text order (callees print before callers) and the entry's name."""
    comps, entry, cur = {}, "", None
    for line in text.splitlines():
        head = _HEAD.match(line)
        if head and cur is None:
            cur, entry = [head.group(2), {}, ""], head.group(2) if head.group(1) else entry
        elif cur is not None and line.startswith("}"):
            comps[cur[0]], cur = _Comp(*cur), None
        elif cur is not None and (inst := _parse_inst(line)):
            cur[1][inst.name] = inst
            cur[2] = inst.name if line.lstrip().startswith("ROOT") else cur[2]
    return comps, entry


def _constant(comp: _Comp | None, name: str) -> int | None:
    """The integer a value holds when it is a constant, seen through copies."""
    inst = comp.insts.get(name) if comp else None
    while inst is not None and inst.op in ("copy", "convert", "bitcast") and inst.operands:
        inst = comp.insts.get(inst.operands[0])
    ok = inst is not None and inst.op == "constant" and re.fullmatch(r"-?\d+", inst.args.strip())
    return int(inst.args) if ok else None


def _trip_count(loop: _Inst, caller: _Comp, comps: dict[str, _Comp]) -> int:
    """Trips of a while: known_trip_count, else the counter's init, step and limit."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
    if known:
        return int(known.group(1))
    cond = comps.get((re.search(r"condition=%?([\w.\-]+)", loop.attrs) or [0, ""])[1])
    body = comps.get((re.search(r"body=%?([\w.\-]+)", loop.attrs) or [0, ""])[1])
    root = cond.insts.get(cond.root) if cond else None
    if root is None or body is None or root.op != "compare" or len(root.operands) != 2:
        return 1
    way = (re.search(r"direction=(\w+)", root.attrs) or [0, ""])[1]
    a, b = root.operands
    if _constant(cond, a) is not None:        # constant on the left: mirror the compare
        a, b, way = b, a, {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE"}.get(way, way)
    counter, limit = cond.insts.get(a), _constant(cond, b)
    if counter is None or counter.op != "get-tuple-element" or limit is None:
        return 1
    i = int(re.search(r"index=(\d+)", counter.attrs).group(1))
    init_tuple = caller.insts.get(loop.operands[0]) if loop.operands else None
    init = init_tuple and init_tuple.op == "tuple" and _constant(caller, init_tuple.operands[i])
    init, step = init or 0, 1
    update = body.insts.get(body.root)
    update = body.insts.get(update.operands[i]) if update and update.op == "tuple" else None
    if update is not None and update.op in ("add", "subtract"):
        step = next((c for c in (_constant(body, o) for o in update.operands) if c), 1)
        step = -step if update.op == "subtract" else step
    span = limit - init if step > 0 else init - limit
    inclusive = {"LT": False, "NE": False, "GT": False, "LE": True, "GE": True}.get(way)
    if inclusive is None or (step > 0) != (way in ("LT", "NE", "LE")):
        return 1
    return max(0, span // abs(step) + 1 if inclusive else -(-span // abs(step)))


_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
                    r"=%?([\w.\-]+)|\b(?:branch_computations|called_computations)=\{([^}]*)\}")


def _multiplicities(comps: dict[str, _Comp], entry: str, trips: bool
                    ) -> tuple[dict[str, int], set[str]]:
    """Runs of every computation per step (with loop trips or without), and the ones that
    run as scheduled code (entry, loop bodies, branches, calls) rather than in a fusion."""
    mult, top = defaultdict(int, {entry: 1}), {entry}
    for comp in reversed(list(comps.values())):     # callers print after their callees
        for inst in comp.insts.values():
            if inst.op.endswith(("-done", "-update")):    # async partners repeat calls=
                continue
            names = [n for one, many in _CALLS.findall(inst.attrs)
                     for n in ([one] if one else re.findall(r"%?([\w.\-]+)", many))]
            runs = _trip_count(inst, comp, comps) if trips and inst.op == "while" else 1
            for name in names:
                mult[name] += mult[comp.name] * runs
                if comp.name in top and inst.op in ("while", "conditional", "call"):
                    top.add(name)
    return mult, top


def _dot_flops(comp: _Comp) -> float:
    """2 x output elements x contracted size, summed over dots and convolutions."""
    total = 0.0
    for inst in (i for i in comp.insts.values() if i.op in ("dot", "convolution")):
        lhs, rhs = (_arrays(comp.insts[o].shape)[0][1] if o in comp.insts else ()
                    for o in (inst.operands + ["", ""])[:2])
        if not lhs or not rhs:
            continue
        if inst.op == "dot":
            dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", inst.attrs)
            k = math.prod(lhs[int(d)] for d in dims.group(1).split(",") if d) if dims else 1
            total += 2.0 * math.prod(_arrays(inst.shape)[0][1]) * k
        else:
            total += _conv_flops(inst.attrs, lhs, rhs, _arrays(inst.shape)[0][1])
    return total


def _conv_flops(attrs: str, lhs: tuple[int, ...], rhs: tuple[int, ...],
                out: tuple[int, ...]) -> float:
    """2 x multiply-adds of a convolution that touch real input: per output position and
    kernel tap, only where the tap lands on an input element rather than on padding or a
    hole of lhs dilation. The TPU compiler writes dots as convolutions with a window over
    padding (`size=1x32 pad=0_0x31_31`), where a tap count that ignores padding reads 32x
    the work."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attrs)
    if not labels:
        return 2.0 * math.prod(out) * math.prod(rhs)
    lhs_l, rhs_l, out_l = labels.groups()
    spatial = sorted(c for c in rhs_l if c.isdigit())
    window = _window(attrs, len(spatial))
    valid = 1
    for d, c in enumerate(spatial):
        size, stride, (lo, _), lhs_dil, rhs_dil = (window[key][d] for key in
                                                   ("size", "stride", "pad", "lhs_dilate",
                                                    "rhs_dilate"))
        n, m = lhs[lhs_l.index(c)], out[out_l.index(c)]
        extent = (n - 1) * lhs_dil + 1
        pos = (np.arange(m)[:, None] * stride + np.arange(size)[None, :] * rhs_dil - lo)
        valid *= int(np.count_nonzero((pos >= 0) & (pos < extent) & (pos % lhs_dil == 0)))
    out_rest = math.prod(out[k] for k, c in enumerate(out_l) if not c.isdigit())
    return 2.0 * out_rest * rhs[rhs_l.index("i")] * valid


def _window(attrs: str, rank: int) -> dict[str, list]:
    """A convolution's window attributes per spatial dimension, with XLA's defaults."""
    found = re.search(r"window=\{([^}]*)\}", attrs)
    fields = dict(kv.split("=") for kv in found.group(1).split()) if found else {}

    def ints(key: str, default: int) -> list[int]:
        return [int(v) for v in fields[key].split("x")] if key in fields else [default] * rank

    pads = ([tuple(int(v) for v in p.split("_")) for p in fields["pad"].split("x")]
            if "pad" in fields else [(0, 0)] * rank)
    return {"size": ints("size", 1), "stride": ints("stride", 1), "pad": pads,
            "lhs_dilate": ints("lhs_dilate", 1), "rhs_dilate": ints("rhs_dilate", 1)}


_NO_TRAFFIC = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while",
               "call", "conditional", "after-all", "partition-id", "replica-id"}


def _body_bytes(comp: _Comp, comps: dict[str, _Comp]) -> float:
    """HBM traffic estimate of scheduled code: operands plus results of its ops, where a
    loop-carried stack is touched only in the slice a dynamic-slice reads or a
    dynamic-update-slice writes in place (as XLA's own cost analysis counts them)."""
    total = 0.0
    for inst in comp.insts.values():
        if inst.op in _NO_TRAFFIC or inst.op in _COLLECTIVES or inst.op.endswith("-done"):
            continue
        callee = _fused(inst, comps)
        total += _written(callee, callee.root, comps) if callee else _inst_written(comp, inst)
        for k, o in enumerate(inst.operands):
            if o not in comp.insts:
                continue
            if callee:
                total += _read(callee, _parameter(callee, k), comps)
            else:
                total += _operand_read(comp, inst, k, _nbytes(comp.insts[o].shape))
    return total


def _fused(inst: _Inst, comps: dict[str, _Comp]) -> _Comp | None:
    """The computation a fusion (or another op with `calls=`) runs, if any."""
    return comps.get((re.search(r"calls=%?([\w.\-]+)", inst.attrs) or [0, ""])[1])


def _parameter(comp: _Comp, k: int) -> str:
    return next((i.name for i in comp.insts.values()
                 if i.op == "parameter" and i.args.strip() == str(k)), "")


def _operand_read(comp: _Comp, inst: _Inst, k: int, full: float) -> float:
    """Bytes `inst` reads of its k-th operand: a slice's worth of a sliced stack, none of
    the stack a dynamic-update-slice writes into in place."""
    if k == 0 and inst.op == "dynamic-slice":
        return _nbytes(inst.shape)
    if k == 0 and inst.op == "dynamic-update-slice":
        return 0.0
    return full


def _inst_written(comp: _Comp, inst: _Inst) -> float:
    """Bytes `inst` writes: a dynamic-update-slice its update (in place), a library call its
    result (not its scratch space), others their result."""
    if inst.op == "dynamic-update-slice" and len(inst.operands) > 1:
        update = comp.insts.get(inst.operands[1])
        return _nbytes(update.shape) if update else 0.0
    if _LIBRARY.search(inst.attrs) and inst.shape.startswith("("):
        return _nbytes(inst.shape) - _nbytes(_arrays_text(inst.shape)[-1])
    return _nbytes(inst.shape)


# XLA GPU hands dots to cuBLAS as custom calls; their result is (output, s8[] workspace).
_LIBRARY = re.compile(r'custom_call_target="__(?:cublas|cudnn)\$')
_GEMM = re.compile(r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)"')
_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":(\[[^\]]*\])')


def _arrays_text(shape: str) -> list[str]:
    return re.findall(r"[a-z][a-z0-9]*\[[0-9,]*\]", shape)


# cuDNN's convolution calls: where the forward output and the filter are ("out": the result).
_CUDNN = re.compile(r'custom_call_target="__cudnn\$(\w+)"')
_CONVOLUTIONS = {"convForward": ("out", 1), "convBiasActivationForward": ("out", 1),
                 "convBackwardInput": (0, 1), "convBackwardFilter": (1, "out")}
_FILTER_LABELS = re.compile(r"dim_labels=\w+_(\w+)->")


def library_work(comp: _Comp) -> tuple[float, float]:
    """(flops, bytes) of one run of a computation's cuBLAS GEMM and cuDNN convolution calls,
    which XLA GPU's `cost_analysis()` counts as neither (seen with jax 0.11.2 on an H200):
    a GEMM 2 x output elements x contraction length; a convolution, forward or either
    backward, 2 x the forward output's elements x the filter's elements per output feature
    (every tap, padding included); the operands read and the output written."""
    flops = nbytes = 0.0
    for inst in comp.insts.values():
        if inst.op != "custom-call":
            continue
        shapes = [_arrays(comp.insts[o].shape)[0][1] if o in comp.insts else ()
                  for o in inst.operands]
        out = _arrays(inst.shape)[0][1] if _arrays(inst.shape) else ()
        dims, conv = _CONTRACTING.search(inst.attrs), _CUDNN.search(inst.attrs)
        if _GEMM.search(inst.attrs) and dims and shapes and shapes[0]:
            k = math.prod(shapes[0][int(d)] for d in json.loads(dims.group(1)))
            flops += 2.0 * math.prod(out) * k
        elif conv and conv.group(1) in _CONVOLUTIONS and _FILTER_LABELS.search(inst.attrs):
            at_out, at_filter = _CONVOLUTIONS[conv.group(1)]
            forward = out if at_out == "out" else shapes[at_out]
            kernel = out if at_filter == "out" else shapes[at_filter]
            features = kernel[_FILTER_LABELS.search(inst.attrs).group(1).index("o")]
            flops += 2.0 * math.prod(forward) * math.prod(kernel) / features
        else:
            continue
        nbytes += _inst_written(comp, inst) + sum(
            _nbytes(comp.insts[o].shape) for o in inst.operands if o in comp.insts)
    return flops, nbytes


def _read(comp: _Comp, name: str, comps: dict[str, _Comp]) -> float:
    """Bytes a fused computation reads of its value `name`, through bitcasts and nested
    fusions; the whole value unless only slices of it are read or written."""
    inst = comp.insts.get(name)
    if inst is None:
        return 0.0
    full, total = _nbytes(inst.shape), 0.0
    users = [u for u in comp.insts.values() if name in u.operands]
    for user in users:
        callee = _fused(user, comps)
        for k in (k for k, o in enumerate(user.operands) if o == name):
            if user.op == "bitcast":
                total += _read(comp, user.name, comps)
            elif user.op == "fusion" and callee:
                total += _read(callee, _parameter(callee, k), comps)
            elif user.op in ("dynamic-slice", "dynamic-update-slice") and k == 0:
                total += _operand_read(comp, user, k, full)
            else:
                return full
    return min(total, full) if users else 0.0


def _written(comp: _Comp, name: str, comps: dict[str, _Comp]) -> float:
    """Bytes a fused computation writes for its value `name`: the update of an in-place
    dynamic-update-slice, each element of a tuple, else the whole value."""
    inst = comp.insts.get(name)
    if inst is None:
        return 0.0
    if inst.op == "tuple":
        return sum(_written(comp, o, comps) for o in inst.operands)
    if inst.op == "bitcast" and inst.operands:
        return min(_written(comp, inst.operands[0], comps), _nbytes(inst.shape))
    return _inst_written(comp, inst)
