"""What the cost model knows of a traced step's values beyond their operators: which ones the
compiler fuses away (no memory traffic), which sums XLA combines into one all-reduce, the
weight gradients, and the values only the step's results read."""
from __future__ import annotations

from collections import Counter
from types import MappingProxyType

from autopar.cost.model import ValueFacts, op_signature
from autopar.cost.xla import buffer_model
from autopar.rules.kinds import FUSED, SUMMING
from autopar.trace.analysis import per_graph
from autopar.trace.ir import Op, OpGraph


@per_graph  # asked by every build of its problem
def weight_gradients(graph: OpGraph) -> frozenset[int]:
    """Results of backward operators of a state leaf's shape (maybe transposed, maybe with
    unit dimensions a reshape drops, as a norm's scale gets): the weight gradients, products
    and reductions of a parameter's shape."""
    def key(shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted(d for d in shape if d != 1))

    state_shapes = {key(graph.tensors[graph.inputs[i]].shape)
                    for i in graph.state_pairs.values()}
    return frozenset(op.outputs[0] for op in graph.ops
                     if op.backward and len(op.outputs) == 1
                     and key(graph.tensors[op.outputs[0]].shape) in state_shapes)


@per_graph  # asked by every search of it
def value_facts(graph: OpGraph) -> ValueFacts:
    """The values the compiler of the graph's platform fuses away (its BufferModel's
    fused_values: XLA CPU's as measured, an ideal fuser's elsewhere), and the sums XLA's
    all-reduce combiner merges into one collective: the weight gradients, and the sums only
    the step's results read (the loss). Neither kind waits for another's all-reduce, so a step
    pays one collective's latency for all of them (data parallel gpt-1024 on 8 devices
    compiles to one all-reduce for all its gradients and its loss). Each is charged its share
    of one latency; charged one each, a small GPT's sums cost more than its whole step and the
    search replicated it (docs/decisions.md, "Combined all-reduces, and all axes as one").
    The combiner works within one computation: the sums of a loop body (a microbatch's
    gradients, reduced in each microbatch) share one latency per trip, as the compiled loop
    does (one all-reduce of all of them per microbatch), apart from those outside it; ops
    that run as often are taken to share a loop. GPU's XLA splits the combined buffer at a
    threshold of tens of MiB, where the bandwidth term outweighs the latencies: not
    modelled."""
    gradients, terminal = weight_gradients(graph), terminal_values(graph)
    loops: dict[int, list[int]] = {}  # trips per step -> the sums combined there
    for op in graph.ops:
        if op.primitive in SUMMING and (op.outputs[0] in gradients
                                        or op.outputs[0] in terminal):
            loops.setdefault(op.repeat, []).append(op.outputs[0])
    combined = {t: len(sums) for sums in loops.values() for t in sums}
    return ValueFacts(buffer_model(graph.compiler).fused_values(graph),
                      MappingProxyType(combined))


@per_graph  # the units of every search, and the cost of every plan, of the graph
def op_signatures(graph: OpGraph) -> tuple[tuple, ...]:
    """cost.model.op_signature of each of the graph's operators."""
    facts = value_facts(graph)
    return tuple(op_signature(op, graph.tensors, facts) for op in graph.ops)


@per_graph
def signature_ids(graph: OpGraph) -> tuple[int, ...]:
    """Per operator, a number equal where their op_signatures are: a key that hashes at once
    (the tally of every candidate looks each operator up)."""
    ids: dict[tuple, int] = {}
    return tuple(ids.setdefault(s, len(ids)) for s in op_signatures(graph))


def terminal_values(graph: OpGraph) -> frozenset[int]:
    """Values that reach nothing but the step's results, through elementwise and layout
    operators only (a loss, a metric)."""
    readers: dict[int, list[Op]] = {}
    for op in graph.ops:
        for t in set(op.inputs):
            readers.setdefault(t, []).append(op)
    outputs = set(graph.outputs)
    terminal: set[int] = set()
    for op in reversed(graph.ops):  # readers come after their operands
        for t in op.outputs:
            if (t in outputs or t in readers) and all(
                    r.primitive in FUSED and all(u in terminal for u in r.outputs)
                    for r in readers.get(t, ())):
                terminal.add(t)
    return frozenset(terminal)


SUMS = frozenset({"add", "add_any"})


@per_graph  # asked by every build of its problem, and every plan's cost
def summed_pairs(graph: OpGraph) -> tuple[tuple[int, int], ...]:
    """Pairs of values (a, b) added next to each other in a sum: `a` the last term of an
    add's left operand and `b` the first of its right one, where a term is a value summed
    and read nowhere else, at the add's trip count, the result of a one-result operator
    other than an add. Where both are partial sums over the same axes, a compiler that
    reassociates sums (cost.xla.reassociates_sums) reduces them in one collective. A
    backward pass's input gradient is such a sum, over the projections that read the input
    (the attention's query, key and value; the MLP's gate and up)."""
    producer = {t: op for op in graph.ops for t in op.outputs}
    reads = Counter(t for op in graph.ops for t in op.inputs)
    reads.update(graph.outputs)

    def inner(t: int) -> Op | None:  # the add that makes `t`, read once: part of the sum
        op = producer.get(t)
        return op if op is not None and op.primitive in SUMS and len(op.inputs) == 2 \
            and reads[t] == 1 else None

    def term(t: int, side: int, repeat: int) -> int | None:
        while (op := inner(t)) is not None:
            t = op.inputs[side]
        op = producer.get(t)
        if (op is None or op.primitive in SUMS or len(op.outputs) != 1 or reads[t] != 1
                or op.repeat != repeat):
            return None
        return t

    pairs = []
    for op in graph.ops:
        if op.primitive in SUMS and len(op.inputs) == 2 and op.inputs[0] != op.inputs[1]:
            a, b = term(op.inputs[0], 1, op.repeat), term(op.inputs[1], 0, op.repeat)
            if a is not None and b is not None:
                pairs.append((a, b))
    return tuple(pairs)
