"""What a loop's body holds while its step runs, for the memory estimate (cost/liveness.py):
every value at once (an upper bound), or the most live at once where the platform's compiler
reuses buffers inside a body (autopar.cost.xla's `reuses_in_loops`)."""
from __future__ import annotations

from typing import Callable, Sequence

Held = tuple[int, int, int]  # (first, last) place in the body's ops, bytes

from autopar.rules.factors import Spec
from autopar.trace.analysis import per_graph
from autopar.trace.ir import OpGraph

# The tracer's markers of a loop's carries and slices: views of buffers counted elsewhere. A
# loop's stacked results and final carries (scan_stack, scan_carry_out) are not among them:
# inside another loop's body they are that body's values.
LOOP_VIEWS = frozenset({"scan_carry", "scan_slice"})
LAYOUT_AND_DTYPE = frozenset({"convert_element_type", "transpose", "reshape"})


def _values(graph: OpGraph, ids: tuple[int, ...], fused: frozenset[int]
            ) -> list[tuple[int, list[int]]]:
    """Per op of the body, by its place in `ids`: its results that take memory."""
    ops = graph.ops
    return [(n, [t for t in ops[k].outputs if t not in fused])
            for n, k in enumerate(ids) if ops[k].primitive not in LOOP_VIEWS]


def body_sum(graph: OpGraph, ids: tuple[int, ...], fused: frozenset[int],
             size: Callable[[int], int]) -> int:
    """Every value of the body at once."""
    return sum(size(t) for _, ts in _values(graph, ids, fused) for t in ts)


def body_peak(graph: OpGraph, ids: tuple[int, ...], fused: frozenset[int],
              size: Callable[[int], int], extra: Sequence[Held] = (),
              deferred: bool = False) -> int:
    """The most the body holds at once, each value live from its op to its last reader in the
    body, with the `extra` buffers that the body's collectives make. `deferred`: the
    weight gradients' dots run at the end of the body (see weight_gradients). A `fused`
    value is computed again inside each of its readers, so what it is made from lives until
    its last reader runs (as the program's walk follows fused readers, last_reads.last_read):
    a softmax's backward fused into the two dots that read it holds the probabilities and
    their gradient until the second dot."""
    at = list(range(len(ids)))  # when each op runs
    for n in weight_gradients(graph, ids) if deferred else ():
        at[n] = len(ids) - 1
    last: dict[int, int] = {}
    for n in range(len(ids) - 1, -1, -1):  # readers before the ops whose results they read
        op = graph.ops[ids[n]]
        end = max([at[n]] + [last[o] for o in op.outputs if o in fused and o in last])
        for t in op.inputs:
            last[t] = max(last.get(t, 0), end)
    delta = [0] * (len(ids) + 1)
    for n, ts in _values(graph, ids, fused):
        for t in ts:
            delta[at[n]] += size(t)
            delta[max(last.get(t, at[n]), at[n]) + 1] -= size(t)
    for first, end, nbytes in extra:  # places in `ids`: where those ops run
        delta[at[first]] += nbytes
        delta[max(at[first], at[end]) + 1] -= nbytes
    live = peak = 0
    for d in delta:
        live += d
        peak = max(peak, live)
    return peak


def weight_gradients(graph: OpGraph, ids: tuple[int, ...]) -> list[int]:
    """The places in `ids` of the dots whose results leave the body as stacked results (one
    per trip, not carried to the next), through layout and dtype changes alone: a layer's
    weight gradients, which nothing else in the body waits for. The TPU compiler's scheduler
    runs them last (measured on a scanned Llama layer's backward body: its MLP's gradients
    and activations stayed live through the attention's backward, for the weight gradients'
    dots after it)."""
    ops, stacked = graph.ops, _stacked(graph)
    readers: dict[int, list[int]] = {}
    for k in ids:
        for t in ops[k].inputs:
            readers.setdefault(t, []).append(k)

    def leaves(t: int) -> bool:
        rs = readers.get(t, ())
        return (t in stacked or bool(rs)) and all(
            ops[r].primitive in LAYOUT_AND_DTYPE and all(map(leaves, ops[r].outputs))
            for r in rs)
    return [n for n, k in enumerate(ids)
            if ops[k].primitive == "dot_general" and all(map(leaves, ops[k].outputs))]


def body_collectives(graph: OpGraph, ids: tuple[int, ...],
                     reshards: dict[tuple[int, int], Spec], scattered: dict[int, int],
                     size: Callable[[int], int],
                     resharded: Callable[[int, Spec], tuple[int, int]]) -> list[Held]:
    """What the body's collectives hold (memory.loop_body_collectives says which): an operand
    resharded, from its first reader to its last (equal reshardings of one value merged, as
    outside loops), the collectives' own results (`resharded`: gathered, result bytes) at the
    first; a result reduce-scattered, its partial sums whole at its op."""
    readers: dict[tuple[int, Spec], list[int]] = {}
    out = []
    for n, k in enumerate(ids):
        op = graph.ops[k]
        for j, t in enumerate(op.inputs):
            if (k, j) in reshards:
                readers.setdefault((t, reshards[(k, j)]), []).append(n)
        out += [(n, n, size(t) * scattered[t]) for t in op.outputs if t in scattered]
    for (t, spec), at in readers.items():
        gathered, result = resharded(t, spec)
        out += [(min(at), max(at), result), (min(at), min(at), gathered)]
    return out


def converted_stacks(graph: OpGraph, size: Callable[[int], int],
                     from_inputs: Callable[[int], bool]
                     ) -> tuple[list[tuple[int, int, list[int]]], frozenset[int]]:
    """Where the compiler converts a stacked input once for all its loops' trips (the TPU
    compiler: a loop body's dtype conversion of its slice of a stacked weight, or of a stack
    made from inputs alone (`from_inputs`), becomes one conversion of the whole stack, kept
    until the last loop that reads it): (stack, bytes converted, the loop steps reading it)
    per stack and dtype, and the body values they replace (slices of them, read in place)."""
    sliced_from = _sliced_from(graph)
    stacks: dict[tuple[int, str], tuple[int, list[int]]] = {}
    replaced = set()
    for i, ids in graph.loop_ops.items():
        for k in ids:
            op = graph.ops[k]
            x = sliced_from.get(op.inputs[0]) if op.inputs else None
            if op.primitive != "convert_element_type" or x is None or not from_inputs(x):
                continue
            piece, whole = graph.tensors[op.inputs[0]], graph.tensors[op.outputs[0]]
            nbytes = size(x) * whole.nbytes // max(piece.nbytes, 1)
            stacks.setdefault((x, whole.dtype), (nbytes, []))[1].append(i)
            replaced.add(op.outputs[0])
    return ([(x, nbytes, loops) for (x, _), (nbytes, loops) in stacks.items()],
            frozenset(replaced))


@per_graph
def _sliced_from(graph: OpGraph) -> dict[int, int]:
    """A scanned input's slice -> the stack it is sliced from."""
    return {op.outputs[0]: op.inputs[0] for op in graph.ops if op.primitive == "scan_slice"}


@per_graph
def _stacked(graph: OpGraph) -> frozenset[int]:
    return frozenset(op.inputs[0] for op in graph.ops if op.primitive == "scan_stack")
