"""Per-device memory of a plan: a liveness walk over the program as XLA will buffer it.

What the walk assumes of XLA (each rule checked against `memory_analysis()` of compiled plans,
docs/decisions.md):
- Chains of elementwise and layout operators fuse into their reader, so their results get no
  buffer of their own, unless a reader cannot fuse them (a dot, a convolution, a loop), the
  backward pass keeps them, or several operators read them.
- Arguments stay live for the whole step. The state is donated: a returned state that keeps its
  input's sharding reuses the input's buffer. Other results are counted whole.
- An intermediate lives from its producer to its last reader; a fused reader reads at the end of
  its own fused chain.
- A resharded operand costs, at the operator that needs it, the result of every collective of
  the resharding (cost.model.reshard_sequence), plus the result: where the partitioner has no
  pattern for it, that is the whole tensor, gathered and then sliced.
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

from autopar.cost.model import reshard_sequence, shard_bytes
from autopar.errors import AutoparError
from autopar.ir import OpGraph, Tensor
from autopar.mesh import MeshShape
from autopar.rules.factors import Spec, replicated
from autopar.rules.table import ELEMENTWISE

# Operators XLA fuses into their reader.
FUSED = ELEMENTWISE | {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
                       "slice", "pad", "concatenate", "iota", "rev", "dynamic_slice", "copy_p"}
# Readers that take fused producers in: loop fusions and reductions' input fusions.
FUSING_READERS = FUSED | {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
                          "argmin", "reduce_and", "reduce_or"}
# Fused operators XLA deems cheap (InstructionFusion::IsExpensive is false): read once, by the
# backward pass, such a result is recomputed inside its reader's fusion from the chain's inputs
# (which live instead); an expensive one (exp, tanh, div, ...) read by the backward pass is kept.
CHEAP = {
    "abs", "add", "add_any", "and", "ceil", "clamp", "convert_element_type", "copy", "copy_p",
    "eq", "floor", "ge", "gt", "imag", "integer_pow", "is_finite", "le", "lt", "max", "min",
    "mul", "ne", "neg", "not", "or", "population_count", "real", "reduce_precision", "round",
    "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "square",
    "stop_gradient", "sub", "xor", "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
    "transpose", "slice", "pad", "concatenate", "iota", "rev", "dynamic_slice"}

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


@functools.lru_cache(maxsize=4)
def roles(graph: OpGraph) -> dict[int, str]:
    """The kind of every input, and of the intermediates that are activations or gradients.

    State inputs read before the backward pass begins are parameters; other state inputs (read
    only by the update) are optimizer state. Results of the forward pass that the backward pass
    reads are activations; results of the backward pass read after it are gradients.
    """
    backward = [op.id for op in graph.ops if op.backward]
    first_bwd = backward[0] if backward else len(graph.ops)
    last_bwd = backward[-1] if backward else -1
    state = set(graph.state_pairs.values())
    read_forward: set[int] = set()
    read_backward: set[int] = set()
    read_after: set[int] = set()
    for op in graph.ops:
        if op.backward:
            read_backward.update(op.inputs)
        elif op.id < first_bwd:
            read_forward.update(op.inputs)
        elif op.id > last_bwd:
            read_after.update(op.inputs)
    out: dict[int, str] = {}
    for k, t in enumerate(graph.inputs):
        out[t] = ("other_inputs" if k not in state else
                  "parameters" if t in read_forward else "optimizer_state")
    for op in graph.ops:
        for t in op.outputs:
            if op.backward and t in read_after:
                out[t] = "gradients"
            elif not op.backward and op.id < first_bwd and t in read_backward:
                out[t] = "activations"
    return out


@functools.lru_cache(maxsize=4)
def backward_steps(graph: OpGraph) -> frozenset[int]:
    """Program steps that belong to the backward pass."""
    producer = graph.producers()
    out = set()
    for i, step in enumerate(graph.program):
        ops = [graph.ops[producer[t][0]] for t in step.outputs if t in producer]
        if ops and ops[0].backward:
            out.add(i)
    return frozenset(out)


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
                    operand_reshards(graph, decisions), decisions.recompute)


def estimate(graph: OpGraph, specs: dict[int, Spec], mesh: MeshShape,
             reshards: dict[tuple[int, int], Spec] | None = None,
             recompute: Iterable[int] = ()) -> MemoryEstimate:
    """The per-device memory of running `graph` with tensors sharded as `specs` (as produced),
    operands resharded as `reshards` says (see operand_reshards), and the forward steps in
    `recompute` recomputed for the backward pass."""
    tensors = graph.tensors
    program = graph.program
    recompute = set(recompute)

    def size(t: int) -> int:
        tensor = tensors[t]
        if tensor.const:
            return 0
        return int(shard_bytes(tensor, specs.get(t, replicated(len(tensor.shape))), mesh))

    producer_step, readers, kind, materialised, last = _liveness(graph)
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

    # A layer is recomputed when the backward pass first reads one of its results; it reads
    # its inputs from other layers then, so those live until that step.
    backward = backward_steps(graph) if recompute else frozenset()
    layer_at = recomputed_layer_of(graph, recompute)
    needed: dict[str, int] = {}
    for i in sorted(backward):
        for t in program[i].inputs:
            layer = layer_at.get(producer_step.get(t, -1))
            if layer is not None:
                needed.setdefault(layer, i)

    # Buffers as (first step, last step, kind, bytes, what).
    buffers = []
    for t in materialised - outputs:
        start, rs = producer_step[t], readers.get(t, ())
        label: Any = t  # named only if among the largest at the peak (naming is slow)
        own = layer_at.get(start)
        read_again = max([needed.get(layer_at[r], 0) for r in rs
                          if r in layer_at and layer_at[r] != own], default=0)
        used = uses(t) if own is not None else set()
        if any(r in backward for r in used):
            fwd = [r for r in used if r not in backward]
            bwd = [r for r in used if r in backward]
            buffers.append((start, max(fwd + [start, read_again]),
                            kind.get(t, "temporaries"), size(t), label))
            again = min(needed.get(own, min(bwd)), min(bwd))
            buffers.append((again, max(bwd), "temporaries", size(t), (t,)))
        else:
            buffers.append((start, max(last[t], read_again), kind.get(t, "temporaries"),
                            size(t), label))
    # XLA merges equal resharding of one tensor (the lowering's constraints are equal): one
    # result, live from the first step that reads it to the last (a weight gathered for the
    # forward pass is kept for the backward pass); the gathered tensor it is sliced from, at
    # the first.
    merged: dict[tuple[int, Spec], list[int]] = {}
    for (i, k), spec in (reshards or {}).items():
        merged.setdefault((program[i].inputs[k], spec), []).append(i)
    for (t, spec), steps in merged.items():
        first = min(steps)
        gathered, result = _reshard_buffers(tensors[t], specs.get(t), spec, mesh)
        end = _last_read(program, materialised, last, steps, first)
        buffers.append((first, end, "temporaries", result, (t, first)))
        if gathered:
            buffers.append((first, first, "temporaries", gathered, (t, first)))
    # Convolutions whose dimension numbers are not XLA's canonical ones (the backward pass's)
    # get transposed copies of those operands and of their result, live at the convolution.
    for i, k, t in _transposed_for_convolution(graph):
        spec = (reshards or {}).get((i, k)) if k >= 0 else None
        nbytes = size(t) if spec is None else int(shard_bytes(tensors[t], spec, mesh))
        buffers.append((i, i, "temporaries", nbytes, (t, i, "transposed")))
    aliased = {graph.outputs[o] for o, i in graph.state_pairs.items()
               if specs.get(graph.outputs[o]) == specs.get(graph.inputs[i])}
    base: dict[str, int] = dict.fromkeys(KINDS, 0)
    for t in graph.inputs:
        base[kind[t]] += size(t)
    base["temporaries"] += sum(size(t) for t in outputs if t not in aliased)

    delta = [0] * (len(program) + 1)
    for start, end, _, nbytes, _ in buffers:
        delta[start] += nbytes
        delta[end + 1] -= nbytes
    peak, peak_step, live = sum(base.values()), -1, sum(base.values())
    for i in range(len(program)):
        live += delta[i]
        if live > peak:
            peak, peak_step = live, i
    at_peak = dict(base)
    held = [(size(t), tensors[t].path or f"input {t}") for t in graph.inputs]
    for start, end, k, nbytes, label in buffers:
        if start <= peak_step <= end:
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
        t, i, *transposed = label
        what = "transposing" if transposed else "resharding"
        return f"{what} {tensors[t].path or f'tensor {t}'} for {_name(program[i], i)}"

    where = _name(program[peak_step], peak_step) if peak_step >= 0 else "the start of the step"
    return MemoryEstimate(int(peak), at_peak, where,
                          tuple((describe(w), b) for b, w in held[:5]))


@functools.lru_cache(maxsize=4)  # a memory budget estimates one graph under many plans
def _liveness(graph: OpGraph) -> tuple[dict[int, int], dict[int, list[int]], dict[int, str],
                                       frozenset[int], dict[int, int]]:
    """What the estimate needs of the program alone: each value's producing step, its
    readers, its kind (`roles`), which values get a buffer of their own, and the step at which
    each value is last needed (a fused value is read where its fused reader's result is)."""
    program = graph.program

    def primitive(i: int) -> str:
        eqn = program[i].eqn
        return "copy_p" if eqn is None else eqn.primitive.name

    producer_step = {t: i for i, step in enumerate(program) for t in step.outputs}
    readers: dict[int, list[int]] = {}
    for i, step in enumerate(program):
        for t in set(step.inputs):
            readers.setdefault(t, []).append(i)
    kind = roles(graph)
    outputs = set(graph.outputs)
    materialised = set()
    for t, i in producer_step.items():
        rs = readers.get(t, ())
        if (t in outputs or primitive(i) not in FUSED or len(rs) > 1
                or (kind.get(t) == "activations" and primitive(i) not in CHEAP)
                or any(primitive(r) not in FUSING_READERS for r in rs)):
            materialised.add(t)
    last: dict[int, int] = {}
    for i in range(len(program) - 1, -1, -1):  # backwards: readers are settled first
        for t in program[i].outputs:
            last[t] = _last_read(program, materialised, last, readers.get(t, ()), i)
    return producer_step, readers, kind, frozenset(materialised), last


def _last_read(program: Any, materialised: Any, last: dict[int, int], steps: Iterable[int],
               default: int) -> int:
    """The last step that needs a value read at `steps`, fused readers followed."""
    end = default
    for r in steps:
        end = max(end, r, *(last.get(o, r) for o in program[r].outputs if o not in materialised))
    return end


def _reshard_buffers(tensor: Tensor, src: Spec | None, dst: Spec, mesh: MeshShape
                     ) -> tuple[int, int]:
    """(the buffers the resharding's collectives make beside the result, the result). Each
    collective's result is a buffer of its own (an all-gather's, the tensor gathered so far),
    but the last one's is the result where nothing is sliced from it afterwards; an
    all-to-all's is copied into the result's layout, so it counts too. Where the partitioner
    has no pattern it gathers the whole tensor and slices (see cost.model.reshard_sequence)."""
    src = src or replicated(len(tensor.shape))
    result = int(shard_bytes(tensor, dst, mesh))
    steps = reshard_sequence(src, dst, mesh)
    made = [int(tensor.nbytes * share) for _, _, share in steps]
    if steps and steps[-1][0] != "all-to-all" and made[-1] == result:
        made.pop()
    return sum(made), result


@functools.lru_cache(maxsize=4)  # program-only, like _liveness
def _transposed_for_convolution(graph: OpGraph) -> tuple[tuple[int, int, int], ...]:
    """(step, operand or -1 for the result, tensor) of every convolution operand and result
    XLA transposes. Its convolution canonicalisation wants the input as (batch, spatial...,
    feature), the kernel as (spatial..., in feature, out feature) and the result as the input;
    otherwise it transposes into a buffer of its own (the forward pass's convolutions are
    canonical, the weight gradient's are not: its input is read with batch and feature
    exchanged, and its output gradient as the kernel)."""
    out = []
    for i, step in enumerate(graph.program):
        eqn = step.eqn
        if eqn is None or eqn.primitive.name != "conv_general_dilated":
            continue
        dn = eqn.params["dimension_numbers"]
        rank = len(dn.lhs_spec)
        canonical_data = (0, rank - 1, *range(1, rank - 1))
        canonical_kernel = (rank - 1, rank - 2, *range(rank - 2))
        for k, (spec, canonical) in enumerate(((dn.lhs_spec, canonical_data),
                                               (dn.rhs_spec, canonical_kernel))):
            if tuple(spec) != canonical:
                out.append((i, k, step.inputs[k]))
        if tuple(dn.out_spec) != canonical_data:
            out.append((i, -1, step.outputs[0]))
    return tuple(out)


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


# -- recompute: the unit is a layer, the scope up to its first numbered name -------------------
def layer_of(scope: str) -> str | None:
    """'GPT/block_3' for 'GPT/block_3/mlp_in'; None for a scope with no numbered name."""
    parts = scope.split("/")
    for k, part in enumerate(parts):
        if re.search(r"\d", part):
            return "/".join(parts[:k + 1])
    return None


@functools.lru_cache(maxsize=4)
def layer_steps(graph: OpGraph) -> dict[str, tuple[int, ...]]:
    """The forward program steps of every layer that can be recomputed: plain equations (not
    loops) before the backward pass, in a numbered scope."""
    producer = graph.producers()
    backward = backward_steps(graph)
    first_bwd = min(backward, default=len(graph.program))
    out: dict[str, list[int]] = {}
    for i, step in enumerate(graph.program[:first_bwd]):
        if step.eqn is None or step.eqn.primitive.name in ("scan", "while", "cond"):
            continue
        ops = [graph.ops[producer[t][0]] for t in step.outputs if t in producer]
        layer = layer_of(ops[0].scope) if ops else None
        if layer is not None:
            out.setdefault(layer, []).append(i)
    return {name: tuple(steps) for name, steps in out.items()}


def recomputed_layer_of(graph: OpGraph, steps: Iterable[int]) -> dict[int, str]:
    """The layer of each recomputed program step (nothing to walk when none is)."""
    steps = set(steps)
    if not steps:
        return {}
    return {i: name for name, ids in layer_steps(graph).items() for i in ids if i in steps}


def recomputed_ops(graph: OpGraph, steps: Iterable[int]) -> set[int]:
    """The planning ops of the recomputed program steps."""
    steps = set(steps)
    if not steps:
        return set()
    producer = graph.producers()
    return {producer[t][0] for i in steps for t in graph.program[i].outputs if t in producer}


def recomputed_layers(graph: OpGraph, steps: Iterable[int]) -> tuple[str, ...]:
    """The recomputed layers, in program order."""
    return tuple(dict.fromkeys(recomputed_layer_of(graph, steps).values()))
