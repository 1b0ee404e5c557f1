"""An independent judge of compiled TPU programs: step time per device, from the HLO.

Reads any `jax.stages.Compiled` built for a mesh of (compile-only) TPU devices and shares
no code with the planner, so it grades the planner fairly.  Choices and sources:

* Compute: roofline max(flops / peak, bytes / HBM bandwidth) from `cost_analysis()`.  On
  jax 0.10.2 / libtpu 0.0.42.1 it counts a while body ONCE (a scan of 8 matmuls reports
  the flops of 1) and the optimised HLO has no `known_trip_count` (used when present), so
  trips are read from the loop: the condition's `compare(counter, constant)`, the
  counter's initial constant in the `while` operand tuple and the body's `add` step
  (unreadable: 1).  Extra trips add dot/convolution flops from HLO shapes and, for loop
  bodies, operand + result bytes of their top-level ops, where a loop-carried stack counts
  only the slice a dynamic-slice reads and the update a dynamic-update-slice writes in
  place (as `cost_analysis` counts them).  Peaks are bf16 figures.
* Collectives: every all-reduce, all-gather, reduce-scatter, all-to-all and permute of
  `as_text()`, in loop bodies (times trips, nested loops multiplied), fusions and async
  forms.  The TPU compiler wraps async collectives in fusions (AsyncCollectiveStart,
  continuations, AsyncCollectiveDone) repeating the op under one `channel_id`, and emits
  `collective-permute-start`/`-done`: one collective per channel id, size and group, `*-done`
  skipped (the TPU compiler gives id 1 to several different collectives).  Its
  reduce-scatter is an `all-reduce-scatter` fusion, an all-reduce feeding a dynamic-slice
  in the same computation: priced as one (a slice in a later fusion, seen on v5p, leaves
  the all-reduce it is).
  Groups: `{{0,1},{2,3}}`, iota `[2,4]<=[8]` / `[4,2]<=[2,4]T(1,0)`, XLA's mesh form
  `mesh['a'=2,'b'=4] {'b'}` (sub-axes `b:(pre)size`, optional `device_ids=(..)`; XLA
  mesh_and_axis.cc) and `source_target_pairs`.  Ids are positions in the mesh's flat
  device order; a group spans the mesh axes along which its members differ.
* Price (NVIDIA nccl-tests, doc/PERFORMANCE.md): S * factor / busbw + steps * alpha, S:
  all-reduce the buffer, all-gather the gathered output, reduce-scatter the full input,
  all-to-all and permute the buffer; factor 2(n-1)/n, (n-1)/n, (n-1)/n, (n-1)/n, 1; steps
  2(n-1), n-1, n-1, n-1, 1.  alpha = 1 us per step: an assumed order of magnitude (ICI
  neighbours are sub-microsecond apart; synchronisation adds to it).
* busbw of a mesh axis: a torus ring through 2 of the chip's ICI ports, run both ways, so
  one port's bidirectional bandwidth = per-chip bidirectional ICI / ports.  Groups over
  several axes get the SUM, as a multi-dimensional torus collective drives every spanned
  axis's rings at once.  Axes are assumed physical torus axes with wraparound; a line
  without it, or a one-way permute, can take up to 2x the price.
* Chips (Google Cloud TPU docs, per chip): v5e 197 TFLOP/s bf16, 819 GB/s HBM, 400 GB/s
  ICI / 4 ports -> 100 GB/s per axis; v5p 459 TFLOP/s, 2,765 GB/s, 1,200 GB/s / 6 ports
  -> 200 GB/s; v6e 918 TFLOP/s, 1,638 GB/s, 800 GB/s / 4 -> 200 GB/s; v4 275 TFLOP/s,
  1,200 GB/s, 3D torus, 45 GB/s one way per link (jax-ml "How to Scale Your Model") ->
  90 GB/s.  Devices that are TensorCores (v4 lists 2 per chip) get a share of the chip's
  flops and HBM; traffic between two cores of one chip is still priced as ICI.
* Bounds: no_overlap_s = compute_s + collectives_s, overlapped_s = their max.  Peak
  memory: `memory_analysis().peak_memory_in_bytes` (TPU reports temp_size 0).
  Conditionals count every branch (an upper bound).
"""
from __future__ import annotations

import math
import re
from collections import defaultdict, namedtuple
from dataclasses import asdict, dataclass

import jax
import numpy as np


@dataclass(frozen=True)
class Chip:
    """Per-chip peaks: flops (bf16 FLOP/s), hbm_bandwidth (B/s), ici_axis_bandwidth (the
    nccl-tests busbw of one mesh axis, B/s), latency (s per ring step), hbm_bytes (its
    memory), source."""
    name: str
    flops: float
    hbm_bandwidth: float
    ici_axis_bandwidth: float
    latency: float
    source: str
    hbm_bytes: int = 0


_DOCS = "Google Cloud TPU docs, cloud.google.com/tpu/docs/"
CHIPS: dict[str, Chip] = {
    "v5e": Chip("v5e", 197e12, 819e9, 400e9 / 4, 1e-6, _DOCS + "v5e", 16 * 10**9),
    "v5p": Chip("v5p", 459e12, 2765e9, 1200e9 / 6, 1e-6, _DOCS + "v5p-training", 95 * 2**30),
    "v6e": Chip("v6e", 918e12, 1638e9, 800e9 / 4, 1e-6, _DOCS + "v6e", 32 * 10**9),
    "v4": Chip("v4", 275e12, 1200e9, 2 * 45e9, 1e-6,
               _DOCS + "v4; ICI: jax-ml.github.io/scaling-book/tpus", 32 * 2**30),
}
_KINDS = {"TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v5": "v5p", "TPU v5p": "v5p",
          "TPU v6 lite": "v6e", "TPU v6e": "v6e", "TPU v4": "v4"}


@dataclass(frozen=True)
class Collective:
    """One collective: kind, nccl-tests size S in bytes per execution, the mesh axes and
    devices per group it spans, executions per step, and seconds of all executions."""
    kind: str
    bytes: int
    axes: tuple[str, ...]
    devices: int
    executions: int
    seconds: float


@dataclass(frozen=True)
class Judged:
    """A judged program: per-device flops and bytes (loop trips included), the compute
    roofline, priced collectives, both step-time bounds and the compiler's peak memory."""
    chip: Chip
    flops: float
    bytes_accessed: float
    compute_s: float
    collectives_s: float
    no_overlap_s: float
    overlapped_s: float
    peak_memory_bytes: int
    collectives: tuple[Collective, ...]

    def summary(self) -> str:
        """One readable block: the bounds, compute, and collectives by kind and axes."""
        rows: dict = defaultdict(lambda: [0, 0, 0.0])
        for c in self.collectives:
            r = rows[(c.kind, c.axes)]
            r[:] = r[0] + c.executions, r[1] + c.bytes * c.executions, r[2] + c.seconds
        lines = [f"judge [{self.chip.name}]: no-overlap {self.no_overlap_s * 1e6:.2f} us, "
                 f"overlapped {self.overlapped_s * 1e6:.2f} us",
                 f"  compute {self.compute_s * 1e6:.2f} us ({self.flops:.3g} flops, "
                 f"{self.bytes_accessed:.3g} B), peak {self.peak_memory_bytes / 2**20:.2f} MiB",
                 f"  collectives {self.collectives_s * 1e6:.2f} us"]
        lines += [f"    {k} over ({', '.join(a)}): {n}x, {b / 2**20:.3f} MiB, {s * 1e6:.2f} us"
                  for (k, a), (n, b, s) in sorted(rows.items())]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready fields plus collective bytes (S x executions) and counts by kind."""
        d = {k: v for k, v in asdict(self).items() if k not in ("chip", "collectives")}
        d.update(chip=self.chip.name, collective_bytes_by_kind={},
                 collective_counts_by_kind={},
                 collectives=[dict(asdict(c), axes=list(c.axes)) for c in self.collectives])
        b, n = d["collective_bytes_by_kind"], d["collective_counts_by_kind"]
        for c in self.collectives:
            b[c.kind] = b.get(c.kind, 0) + c.bytes * c.executions
            n[c.kind] = n.get(c.kind, 0) + c.executions
        return d


# One HLO instruction (args: raw text inside its operand parentheses) and one computation.
_Inst = namedtuple("_Inst", "name shape op args operands attrs")
_Comp = namedtuple("_Comp", "name insts root")
_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->.*\{\s*$")
_INST = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
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
    """Bytes `inst` writes: a dynamic-update-slice its update (in place), others their result."""
    if inst.op == "dynamic-update-slice" and len(inst.operands) > 1:
        update = comp.insts.get(inst.operands[1])
        return _nbytes(update.shape) if update else 0.0
    return _nbytes(inst.shape)


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


_COLLECTIVES = {op: kind for kind in ("all-reduce", "all-gather", "reduce-scatter",
                                      "all-to-all", "collective-permute")
                for op in (kind, kind + "-start")} | {"ragged-all-to-all": "all-to-all"}
_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "collective-permute": lambda n: 1.0}
_STEPS = {"all-reduce": lambda n: 2 * (n - 1), "collective-permute": lambda n: 1}


def _iota(dims: str, reshape: str, perm: str | None) -> np.ndarray:
    """XLA's iota device list `[dims]<=[reshape]T(perm)` as an array of ids."""
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    ids = np.arange(math.prod(ints(reshape))).reshape(ints(reshape))
    return (ids.transpose(ints(perm)) if perm else ids).reshape(ints(dims))


def _mesh_groups(axes_text: str, device_ids: str | None, grouped: str) -> list[list[int]]:
    """Groups of the `mesh[...] {axes}` spelling: members share every coordinate except
    the grouped (sub-)axes'; sub-axis `x:(pre)size` is the digit of x of that size with
    `pre` more major."""
    names = re.findall(r"'?([^'=,\s]+)'?=\d+", axes_text)
    sizes = [int(s) for s in re.findall(r"=(\d+)", axes_text)]
    ids = np.arange(math.prod(sizes))
    if device_ids and "<=" in device_ids:
        ids = _iota(*re.search(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?",
                               device_ids).groups()).ravel()
    elif device_ids:
        ids = np.array([int(x) for x in re.findall(r"\d+", device_ids)])
    coords = np.indices(sizes).reshape(len(sizes), -1)
    key = coords.copy()
    for name, pre, size in re.findall(r"'?([^':,\s]+)'?(?::\((\d+)\)(\d+))?", grouped):
        i = names.index(name)
        minor = sizes[i] // (int(pre) * int(size)) if size else 1
        key[i] -= (coords[i] // minor % int(size)) * minor if size else coords[i]
    groups: dict = defaultdict(list)
    for pos in range(ids.size):
        groups[tuple(key[:, pos])].append(int(ids[pos]))
    return list(groups.values())


def _groups(attrs: str, num_devices: int) -> list[list[int]]:
    """Device groups of a collective, from any spelling of its attributes."""
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", pairs.group(0))]
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?"
                     r"\s*\{([^}]*)\}", attrs)
    if mesh:
        return _mesh_groups(*mesh.groups())
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if iota:
        ids = _iota(*iota.groups())
        return ids.reshape(-1, ids.shape[-1]).tolist()
    listed = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    groups = [[int(x) for x in g.split(",") if x.strip()]
              for g in re.findall(r"\{([\d,\s]*)\}", listed.group(1) if listed else "")]
    return [g for g in groups if g] or [list(range(num_devices))]


def _axes(groups: list[list[int]], mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    """Mesh axes along which some group's members differ (ids: flat mesh positions)."""
    ids = sorted({d for g in groups for d in g})
    if ids and (ids[0] < 0 or ids[-1] >= mesh.devices.size):
        raise ValueError(f"device id {ids[-1]} of the program does not fit the mesh "
                         f"{dict(mesh.shape)} of {mesh.devices.size} devices")
    spans = set()
    for g in groups:
        coords = np.unravel_index(g, mesh.devices.shape)
        spans |= {i for i, c in enumerate(coords) if len(set(c.tolist())) > 1}
    return tuple(mesh.axis_names[i] for i in sorted(spans))


def _size(inst: _Inst, comp: _Comp) -> float:
    """nccl-tests' S: the larger of the operand and the result buffers."""
    results = [b * math.prod(d) for b, d in _arrays(inst.shape) if d]
    operands = [_nbytes(comp.insts[o].shape) for o in inst.operands if o in comp.insts]
    if inst.op.endswith("-start") and len(results) > len(operands):
        results = results[len(operands):]        # (operands, results, contexts) tuples
    return max(sum(results), sum(operands))


def _collectives(comps: dict[str, _Comp], mult: dict[str, int], mesh: jax.sharding.Mesh,
                 chip: Chip) -> tuple[Collective, ...]:
    """Every collective once, priced with nccl-tests' busbw. The async forms repeat a
    collective under one channel id, in computations of their own; the TPU compiler also
    gives one id (1) to different collectives (a shard_map's psum and psum_scatters), in one
    computation or several. So a collective is its channel id, size and groups, and the
    k-th of those in a computation is the k-th in another."""
    found: dict = {}
    for comp in (c for c in comps.values() if mult.get(c.name)):
        nth: dict = {}
        for inst in (i for i in comp.insts.values() if i.op in _COLLECTIVES):
            kind = _COLLECTIVES[inst.op]
            groups = _groups(inst.attrs, mesh.devices.size)
            n = len({d for g in groups for d in g}) if "permute" in kind else len(groups[0])
            if kind == "all-reduce" and any(u.op == "dynamic-slice" and u.operands[:1] == [
                    inst.name] for u in comp.insts.values()):
                kind = "reduce-scatter"           # the TPU's fused all-reduce + slice
            channel = re.search(r"channel_id=(\d+)", inst.attrs)
            size = int(_size(inst, comp))
            same = ((channel.group(1) if channel else (comp.name, inst.name)), size, str(groups))
            nth[same] = nth.get(same, -1) + 1
            key = (*same, nth[same])
            runs = max(mult[comp.name], found.get(key, (0,))[0])
            found[key] = (runs, kind, size, _axes(groups, mesh), n)
    out = []
    for runs, kind, size, axes, n in found.values():
        once = 0.0
        if n > 1 and axes:
            factor = _FACTOR.get(kind, lambda k: (k - 1) / k)(n)
            steps = _STEPS.get(kind, lambda k: k - 1)(n)
            once = size * factor / (chip.ici_axis_bandwidth * len(axes)) + steps * chip.latency
        out.append(Collective(kind, size, axes, n, runs, once * runs))
    return tuple(out)


def _chip(chip: str | Chip | None, mesh: jax.sharding.Mesh) -> Chip:
    """The Chip given, named, or matching the mesh devices' device_kind."""
    name = _KINDS.get(mesh.devices.flat[0].device_kind) if chip is None else chip
    if isinstance(name, Chip):
        return name
    if name not in CHIPS:
        raise ValueError(f"unknown chip {name or mesh.devices.flat[0].device_kind!r}: "
                         f"pass chip= one of {list(CHIPS)}")
    return CHIPS[name]


def judge(compiled, mesh: jax.sharding.Mesh, chip: str | Chip | None = None) -> Judged:
    """Estimate a compiled SPMD program's step time per device on `mesh`, for `chip`
    (default: from the devices' device_kind).  Raises ValueError when the program's
    partition count or device ids do not fit the mesh."""
    text = compiled.as_text()
    parts = re.search(r"num_partitions=(\d+)", text.split("\n", 1)[0])
    if parts and int(parts.group(1)) != mesh.devices.size:
        raise ValueError(f"the program has {parts.group(1)} partitions but the mesh "
                         f"{dict(mesh.shape)} has {mesh.devices.size} devices")
    spec = _chip(chip, mesh)
    cores = 1 + max(getattr(d, "core_on_chip", 0) or 0 for d in mesh.devices.flat)
    comps, entry = _parse_module(text)
    (mult, top), (once, _) = (_multiplicities(comps, entry, t) for t in (True, False))
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    flops, nbytes = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    for name, comp in comps.items():              # the trips cost_analysis left out
        extra = mult.get(name, 0) - once.get(name, 0)
        flops += extra * _dot_flops(comp) if extra > 0 else 0.0
        nbytes += extra * _body_bytes(comp, comps) if extra > 0 and name in top else 0.0
    compute = max(flops * cores / spec.flops, nbytes * cores / spec.hbm_bandwidth)
    colls = _collectives(comps, mult, mesh, spec)
    comm = sum(c.seconds for c in colls)
    return Judged(spec, flops, nbytes, compute, comm, compute + comm, max(compute, comm),
                  int(compiled.memory_analysis().peak_memory_in_bytes), colls)
