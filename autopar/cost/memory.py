"""Per-device memory of a plan: a liveness walk over the program as XLA will buffer it.

What the walk assumes of XLA (each rule checked against `memory_analysis()` of compiled plans;
the rules that the program's equations do not show are in autopar.cost.xla.cpu, and
docs/decisions.md has the measurements):
- Chains of elementwise and layout operators fuse into their reader, so their results get no
  buffer of their own, unless a reader cannot fuse them (a dot, a convolution, a loop), the
  backward pass keeps them, or several operators read them. A transpose of a dot's result is
  the dot's own buffer; a scatter into zeros that a sum alone reads scatters into the sum,
  unless the sum reads it resharded.
- Arguments stay live for the whole step. The state is donated: a returned state that keeps its
  input's sharding reuses the input's buffer, after a copy where a reader of the old value is
  not ordered before the update. The copies are made first, and the input's buffer holds other
  buffers until the update. Other results are counted whole.
- An intermediate lives from its producer to its last reader; a fused reader reads at the end of
  its own fused chain. The steps that read only inputs run first (after the copies), the
  optimizer's as soon as their inputs are ready.
- A resharded operand costs, at the operator that needs it, its collectives' results
  (cost.model.reshard_sequence) and the result; a slice with no collective is made as soon
  as its value is, which is then freed unless read whole, and so is an activation resharded
  and transposed for the weight gradient. A dot or convolution whose dimensions XLA reorders
  costs a transposed copy of the operands it reorders.
- A recomputed layer keeps its forward results only as long as the forward pass reads them; the
  backward pass recomputes them when it first needs them.

The estimate is what the plan records (`plan.memory`): the peak, and what is live at the peak by
kind (parameters, optimizer state, other inputs, activations kept for the backward pass,
gradients, temporaries), with the largest buffers live then.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Iterable

from autopar.cost.model import shard_bytes
from autopar.cost.xla.cpu import (CHEAP, all_reduce_groups, all_reduce_steps, copied_before_update,
                                  input_only_steps, placed_in_donated, reshard_buffers,
                                  scatter_into_sum, schedule, transposed_operands)
from autopar.errors import AutoparError
from autopar.mesh import MeshShape
from autopar.rules.factors import Spec, replicated
from autopar.rules.table import FUSED, FUSING_READERS
from autopar.trace.analysis import backward_steps, edges, recomputed_layer_of, roles
from autopar.trace.ir import OpGraph

KINDS = ("parameters", "optimizer_state", "other_inputs", "activations", "gradients",
         "temporaries")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """Bytes from a number or a string like '2GiB', '512 MB' or '1.5e9'."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise AutoparError(f"memory_limit={value!r} must be positive. Fix: pass bytes or a "
                               "string like '2GiB'.")
        return int(value)
    match = re.fullmatch(r"\s*([0-9.]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    unit = match[2].lower() if match else ""
    if not match or unit not in _UNITS:
        raise AutoparError(f"memory_limit={value!r} is not understood. Fix: pass bytes or a "
                           "string like '2GiB', '512MiB' or '80GB'.")
    return parse_bytes(float(match[1]) * _UNITS[unit])


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.2f} MiB"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device: the peak, what is live then by kind, and the largest buffers then."""

    peak_bytes: int
    at_peak: dict[str, int]
    where: str  # the operator at which the peak occurs
    largest: tuple[tuple[str, int], ...]  # (what, bytes), largest first

    def describe(self) -> str:
        parts = ", ".join(f"{k.replace('_', ' ')} {mib(v)}" for k, v in self.at_peak.items() if v)
        return f"{mib(self.peak_bytes)} per device at {self.where} ({parts})"


def operand_reshards(graph: OpGraph, decisions: Any) -> dict[tuple[int, int], Spec]:
    """(step, operand) -> the sharding the operand is resharded to, where it is."""
    produced = decisions.tensor_specs(graph)
    out = {}
    for i, step in enumerate(graph.program):
        for k, (t, need) in enumerate(zip(step.inputs, step.requires)):
            if need is not None:
                spec = decisions.ops[need[0]].in_specs[need[1]]
                if spec != produced.get(t):
                    out[(i, k)] = spec
    return out


def kept_bytes(graph: OpGraph, decisions: Any, mesh: MeshShape) -> int:
    """The bytes per device `decisions` keep of the step's inputs, activations and gradients:
    the search's model of memory, additive over strategies (problem.Problem.kept prices the
    same tensors strategy by strategy), which a memory budget bounds exactly."""
    specs = decisions.tensor_specs(graph)
    return sum(int(shard_bytes(graph.tensors[t], specs[t], mesh)) for t in roles(graph)
               if not graph.tensors[t].const)


def plan_memory(graph: OpGraph, decisions: Any, mesh: MeshShape) -> MemoryEstimate:
    """The memory estimate of `decisions` (with their recomputed steps)."""
    return estimate(graph, decisions.tensor_specs(graph), mesh,
                    operand_reshards(graph, decisions), decisions.recompute,
                    all_reduce_steps(graph, decisions, mesh))


def updated_in_place(graph: OpGraph, specs: dict[int, Spec]) -> set[int]:
    """The returned state that keeps its input's sharding: written into the donated input."""
    return {graph.outputs[o] for o, i in graph.donated_pairs.items()
            if specs.get(graph.outputs[o]) == specs.get(graph.inputs[i])}


def estimate(graph: OpGraph, specs: dict[int, Spec], mesh: MeshShape,
             reshards: dict[tuple[int, int], Spec] | None = None,
             recompute: Iterable[int] = (),
             all_reduces: dict[int, tuple[str, ...]] | None = None) -> MemoryEstimate:
    """The per-device memory of running `graph` with tensors sharded as `specs` (as produced),
    operands resharded as `reshards` says (see operand_reshards), the forward steps in
    `recompute` recomputed for the backward pass, and the steps in `all_reduces` all-reducing
    their results (see all_reduce_steps)."""
    tensors = graph.tensors
    program = graph.program
    recompute = set(recompute)
    reshards = reshards or {}

    def size(t: int) -> int:
        tensor = tensors[t]
        if tensor.const:
            return 0
        return int(shard_bytes(tensor, specs.get(t, replicated(len(tensor.shape))), mesh))

    producer_step, readers, kind, materialised, last, into_sum = _liveness(graph)
    # A scatter into zeros for a sum alone scatters into the sum's other operand, unless the
    # sum reads it resharded: then it is a buffer of its own (made first where it reads only
    # inputs, as the loss's scatter of the labels does).
    resharded = {program[i].inputs[k] for i, k in reshards}
    materialised |= into_sum & resharded
    outputs = set(graph.outputs)

    def uses(t: int) -> set[int]:
        """The steps that need t: its readers and, through fused readers, theirs."""
        out: set[int] = set()
        stack = [t]
        while stack:
            for r in readers.get(stack.pop(), ()):
                out.add(r)
                stack += [o for o in program[r].outputs if o not in materialised]
        return out

    # Times: program order, but the update of the state follows its inputs at once (see
    # schedule). XLA first copies the donated inputs it must copy (see copied_before_update),
    # one after the other (times 0, 1, ...), then runs the steps that read only inputs (see
    # input_only_steps); `last` is redone in those times.
    in_backward = backward_steps(graph)
    done = max(in_backward, default=len(program))  # the backward pass's last step
    groups = all_reduce_groups(graph, all_reduces or {})
    aliased = updated_in_place(graph, specs)
    copied = [t for t in copied_before_update(graph, aliased, groups)
              if any(r <= done for r in readers[t])]
    begin = len(copied)  # the time of the first step
    layer_at = recomputed_layer_of(graph, recompute)
    # Recomputations (the plan's, and the user's: Step.remat) wait for the backward pass.
    early = (input_only_steps(graph, done + 1) - layer_at.keys()
             - {i for i, step in enumerate(program) if step.remat})
    order = schedule(graph, groups, done + 1) or range(len(program))
    when = [begin if i in early else begin + at for i, at in enumerate(order)]
    # The steps before the optimizer's keep their order: a value they alone need is last
    # needed at the time of its last step.
    last = {t: when[end] for t, end in last.items() if end <= done}
    for i in range(len(program) - 1, -1, -1):
        for t in program[i].outputs:
            if t not in last:
                last[t] = _last_read(program, materialised, last, readers.get(t, ()), when[i],
                                     when)

    # A layer is recomputed when the backward pass first reads one of its results; it reads
    # its inputs from other layers then, so those live until that step.
    backward = in_backward if recompute else frozenset()
    needed: dict[str, int] = {}
    for i in sorted(backward):
        for t in program[i].inputs:
            layer = layer_at.get(producer_step.get(t, -1))
            if layer is not None:
                needed.setdefault(layer, when[i])

    # XLA merges equal resharding of one tensor (the lowering's constraints are equal) into one
    # result. Its scheduler runs a resharding that only slices (no collective, no bigger
    # result) as soon as the value is made, so the whole value is freed then unless other
    # readers still need it whole.
    merged: dict[tuple[int, Spec], list[int]] = {}
    for (i, k), spec in reshards.items():
        merged.setdefault((program[i].inputs[k], spec), []).append(i)

    def loop_fused(i: int) -> bool:
        """Whether step i is a loop fusion, with the fused readers of its result: a loop
        fusion reads an operand in any layout; a reduction (XLA's CPU backend emits a sum of
        products as a library call) reads the default one."""
        chain = {i} | {r for o in program[i].outputs if o not in materialised for r in uses(o)}
        return all(program[r].eqn is not None and program[r].eqn.primitive.name in FUSED
                   for r in chain)

    resharding = {key: reshard_buffers(tensors[key[0]], specs.get(key[0]), key[1], mesh,
                                       all(loop_fused(i) for i in steps))
                  for key, steps in merged.items()}
    slices = {key for key, (gathered, result) in resharding.items()
              if gathered == 0 and result <= size(key[0])}
    sliced: dict[int, set[int]] = {}  # value -> the steps that read it sliced
    for t, spec in slices:
        sliced.setdefault(t, set()).update(merged[(t, spec)])
    whole_until = {}  # sliced value -> the last time it is needed whole
    for t in sliced.keys() & materialised - outputs:
        # Not a recomputed value (see below), nor one made first (XLA slices those where
        # they are read).
        if producer_step[t] in layer_at or producer_step[t] in early:
            continue
        whole = [r for r in readers[t] if r not in sliced[t] or any(
            u == t and (r, k) not in reshards for k, u in enumerate(program[r].inputs))]
        if len(whole) < len(readers[t]):
            whole_until[t] = _last_read(program, materialised, last, whole, when[producer_step[t]],
                                        when)

    # Buffers as (first time, last time, kind, bytes, what).
    buffers = []
    for t in materialised - outputs:
        start, rs = when[producer_step[t]], readers.get(t, ())
        label: Any = t  # named only if among the largest at the peak (naming is slow)
        own = layer_at.get(producer_step[t])
        read_again = max([needed.get(layer_at[r], 0) for r in rs
                          if r in layer_at and layer_at[r] != own], default=0)
        used = uses(t) if own is not None else set()
        if any(r in backward for r in used):
            fwd = [when[r] for r in used if r not in backward]
            bwd = [when[r] for r in used if r in backward]
            buffers.append((start, max(fwd + [start, read_again]),
                            kind.get(t, "temporaries"), size(t), label))
            again = min(needed.get(own, min(bwd)), min(bwd))
            buffers.append((again, max(bwd), "temporaries", size(t), (t,)))
        else:
            end = max(whole_until.get(t, last[t]), read_again)
            buffers.append((start, end, kind.get(t, "temporaries"), size(t), label))
    # A resharding's result lives from the first step that reads it to the last (a weight
    # gathered for the forward pass is kept for the backward pass), a slice from the value's
    # making (see above); the gathered tensor it is sliced from, at the first. A forward value
    # resharded for backward steps that transpose it (a weight gradient's convolution reads
    # its activation so) is resharded and transposed as soon as it is made: the transposed
    # copy lives from then, the resharded value only until it is transposed.
    transposed = {(i, k) for i, k, _ in transposed_operands(graph)}
    transposed_from: dict[tuple[int, int], int] = {}  # (step, operand) -> when it is made

    def operands(t: int, steps: list[int]) -> list[tuple[int, int]]:
        """(step, operand) wherever `steps` read t."""
        return [(i, k) for i in steps for k, u in enumerate(program[i].inputs) if u == t]

    for (t, spec), steps in merged.items():
        gathered, result = resharding[(t, spec)]
        first = min(when[i] for i in steps)
        end = None
        if t in whole_until and (t, spec) in slices:
            first = when[producer_step[t]]
        elif (t in producer_step and producer_step[t] not in in_backward
              and producer_step[t] not in early and all(i in in_backward for i in steps)
              and all(p in transposed for p in operands(t, steps))):
            first = end = when[producer_step[t]] + 1
            transposed_from.update(dict.fromkeys(operands(t, steps), first))
        if end is None:
            end = _last_read(program, materialised, last, steps, first, when)
        buffers.append((first, end, "temporaries", result, (t, min(steps))))
        if gathered:
            buffers.append((first, first, "temporaries", gathered, (t, min(steps))))
    # Convolutions and dots whose dimension numbers are not XLA's canonical ones get
    # transposed copies of those operands (and a convolution's result), live at the step. The
    # copy of an input, or of a value made from inputs alone, read unresharded is made with
    # the steps that read only inputs; that of a resharded activation as above.
    for i, k, t in transposed_operands(graph):
        spec = reshards.get((i, k)) if k >= 0 else None
        nbytes = size(t) if spec is None else int(shard_bytes(tensors[t], spec, mesh))
        made = (begin if spec is None and k >= 0
                and (t not in producer_step or producer_step[t] in early) else
                transposed_from.get((i, k), when[i]))
        buffers.append((made, when[i], "temporaries", nbytes, (t, i, "transposed")))
    # A donated input is updated in place; XLA copies it, first of all, for the readers of the
    # old value not ordered before the update (the optimizer's steps read the original). Its
    # allocation is then free until the update, for other buffers.
    slots = []
    update_of = {graph.inputs[i]: producer_step[graph.outputs[o]]
                 for o, i in graph.donated_pairs.items()}
    for at, t in enumerate(copied):
        rs = [r for r in readers[t] if r <= done]
        buffers.append((at, _last_read(program, materialised, last, rs, at, when),
                        "temporaries", size(t), (t, -1, "copied")))
        slots.append((size(t), at + 1, when[update_of[t]] - 1))
    placed = placed_in_donated([b[:2] + b[3:4] for b in buffers], slots) if slots else set()
    buffers = [b for n, b in enumerate(buffers) if n not in placed]
    base: dict[str, int] = dict.fromkeys(KINDS, 0)
    for t in graph.inputs:
        base[kind[t]] += size(t)
    base["temporaries"] += sum(size(t) for t in outputs if t not in aliased)

    delta = [0] * (len(program) + begin + 1)
    for start, end, _, nbytes, _ in buffers:
        delta[start] += nbytes
        delta[end + 1] -= nbytes
    peak, peak_time, live = sum(base.values()), -1, sum(base.values())
    for i in range(len(delta) - 1):
        live += delta[i]
        if live > peak:
            peak, peak_time = live, i
    at_peak = dict(base)
    held = [(size(t), tensors[t].path or f"input {t}") for t in graph.inputs]
    for start, end, k, nbytes, label in buffers:
        if start <= peak_time <= end:
            at_peak[k] += nbytes
            held.append((nbytes, label))
    held.sort(key=lambda h: -h[0])

    def describe(label: Any) -> str:
        """A buffer's name: tensor t, (t,) its recomputation, (t, i) resharding it for step i,
        (t, i, "transposed") transposing it for the convolution at step i."""
        if isinstance(label, str):
            return label
        if isinstance(label, int):
            return tensors[label].path or _name(program[producer_step[label]],
                                                producer_step[label])
        if len(label) == 1:
            return f"{describe(label[0])} (recomputed)"
        t, i, *how = label
        if how == ["copied"]:
            return f"{tensors[t].path or f'input {t}'} (copied before its update)"
        what = "transposing" if how else "resharding"
        return f"{what} {tensors[t].path or f'tensor {t}'} for {_name(program[i], i)}"

    then = [i for i, t in enumerate(when) if t == peak_time]
    where = (_name(program[then[0]], then[0]) if then else "the copies of donated inputs"
             if peak_time >= 0 else "the start of the step")
    return MemoryEstimate(int(peak), at_peak, where,
                          tuple((describe(w), b) for b, w in held[:5]))


@functools.lru_cache(maxsize=4)  # a memory budget estimates one graph under many plans
def _liveness(graph: OpGraph) -> tuple[dict[int, int], dict[int, list[int]], dict[int, str],
                                       frozenset[int], dict[int, int], frozenset[int]]:
    """What the estimate needs of the program alone: each value's producing step, its
    readers, its kind (`roles`), which values get a buffer of their own, the step at which
    each value is last needed (a fused value is read where its fused reader's result is), and
    the scatters into zeros that scatter into a sum instead (see scatter_into_sum)."""
    program = graph.program

    def primitive(i: int) -> str:
        eqn = program[i].eqn
        return "copy_p" if eqn is None else eqn.primitive.name

    producer_step, readers = edges(graph)
    kind = dict(roles(graph))
    outputs = set(graph.outputs)
    materialised = set()
    into_sum = set()
    for t, i in producer_step.items():
        rs = readers.get(t, ())
        if t not in outputs and scatter_into_sum(program, producer_step, primitive, i, rs):
            into_sum.add(t)
            continue
        if (primitive(i) == "transpose" and len(readers.get(program[i].inputs[0], ())) == 1
                and primitive(producer_step.get(program[i].inputs[0], i)) == "dot_general"):
            # XLA's simplifier folds the transpose of a dot read by it alone into the dot
            # (operands exchanged): the dot's buffer holds the transposed result.
            kind.setdefault(program[i].inputs[0], kind.get(t, "temporaries"))
            continue
        if (t in outputs or primitive(i) not in FUSED or len(rs) > 1
                or (kind.get(t) == "activations" and primitive(i) not in CHEAP)
                or any(primitive(r) not in FUSING_READERS for r in rs)):
            materialised.add(t)
    last: dict[int, int] = {}
    for i in range(len(program) - 1, -1, -1):  # backwards: readers are settled first
        for t in program[i].outputs:
            last[t] = _last_read(program, materialised, last, readers.get(t, ()), i)
    return producer_step, readers, kind, frozenset(materialised), last, frozenset(into_sum)


def _last_read(program: Any, materialised: Any, last: dict[int, int], steps: Iterable[int],
               default: int, when: Any = None) -> int:
    """The last time a value read at `steps` is needed, fused readers followed; times are
    program steps, or `when[step]` where given (see schedule)."""
    end = default
    for r in steps:
        at = r if when is None else when[r]
        end = max(end, at, *(last.get(o, at) for o in program[r].outputs
                             if o not in materialised))
    return end


def _name(step: Any, i: int) -> str:
    eqn = step.eqn
    what = eqn.primitive.name if eqn is not None else "copy"
    source = getattr(getattr(eqn, "source_info", None), "name_stack", None)
    return f"{what} (step {i}{f', {source}' if str(source or '') else ''})"


def memory_json(m: MemoryEstimate, limit: int | None = None) -> dict[str, Any]:
    """The estimate as the plan records it."""
    out: dict[str, Any] = {"peak_bytes": m.peak_bytes, "at_peak": dict(m.at_peak),
                           "where": m.where, "largest": [list(x) for x in m.largest]}
    if limit is not None:
        out["limit_bytes"] = limit
    return out


