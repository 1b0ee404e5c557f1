"""What a problem's nodes and edges cost: each operator's seconds per strategy, and the
resharding of each operand between its producer's strategies and its reader's, priced once
per graph and mesh (the tables are shared by every build, see problem.build_problem)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.cost.facts import summed_pairs, value_facts
from autopar.cost.hardware import Hardware
from autopar.cost.model import op_time, partial_sum
from autopar.cost.resharding import reshard_terms
from autopar.cost.xla import reassociates_sums
from autopar.mesh import MeshShape
from autopar.rules import Rule, Spec, Strategy
from autopar.trace.ir import Op, OpGraph, Tensor


@dataclass(frozen=True)
class Unit:
    """One input tensor or op, as the problem sees it."""

    name: str
    rule: Rule
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    op: Op | None  # None for an input of the step
    cost_key: tuple = ()  # cost.model.op_signature of the op
    tie: int | None = None  # the unit whose strategies it takes (layers.repeated_ties)
    main: int | None = None  # the operand it follows (main_operand); None: it decides
    # Per operand, the unit that makes it (None: a constant, or made by no unit)
    makers: tuple[int | None, ...] = ()
    # Units of one `alike` cost the same and reshard their operands alike wherever they take
    # the same strategies and their operands' makers do (problem.alike_units)
    alike: int = -1


def resharding_edges(graph: OpGraph, units: list[Unit],
                     producer: dict[int, tuple[int, int]], node_of: list[int],
                     choices: list[list[Strategy]], reshard: Resharding,
                     node_costs: list[np.ndarray], times: list[int]
                     ) -> list[tuple[int, int, np.ndarray]]:
    """The edges that charge each operand's resharding from its producer's spec to what its
    user needs, for each user `times` over (problem.repeats); a resharding inside one node is
    added to `node_costs` instead."""
    edges: list[tuple[int, int, np.ndarray]] = []

    def connect(t: int, src: tuple[int, str, int], dst: tuple[int, str, int], scale: float):
        """Charge resharding `t` from its producer's spec (unit, side, index) to what the
        user (unit, side, index) needs."""
        a, b = node_of[src[0]], node_of[dst[0]]
        srcs = reshard.specs(choices[src[0]], *src[1:])
        dsts = reshard.specs(choices[dst[0]], *dst[1:])
        if a == b and srcs is dsts:  # the operand arrives as produced: nothing to move
            return
        seconds = reshard.cost(graph.tensors[t], srcs, dsts, paired=a == b)
        if a == b:  # both lists are indexed by the same node's strategies
            node_costs[a] += scale * seconds
        elif seconds.any():  # a new array: scaled in place, and taken without a copy
            matrix = seconds if scale == 1 else np.multiply(seconds, scale, out=seconds)
            matrix.flags.writeable = False
            edges.append((a, b, matrix))

    for u, unit in enumerate(units):
        if not times[u]:
            continue
        for i, t in enumerate(unit.inputs):
            if graph.tensors[t].const or t not in producer:
                continue
            p, k = producer[t]
            connect(t, (p, "out", k), (u, "in", i), times[u] * unit.op.operand_repeat(i))
    # The state a step returns is the next step's input: its sharding should not change.
    for out_index, in_index in graph.state_pairs.items():
        t_out, t_in = graph.outputs[out_index], graph.inputs[in_index]
        if t_out in producer and t_in in producer:
            p, k = producer[t_out]
            connect(t_out, (p, "out", k), (producer[t_in][0], "out", 0), 1.0)
    return edges


def summed_edges(graph: OpGraph, units: list[Unit], producer: dict[int, tuple[int, int]],
                 node_of: list[int], choices: list[list[Strategy]], mesh: MeshShape,
                 hw: Hardware, memo: dict[tuple, Any], node_costs: list[np.ndarray]
                 ) -> list[tuple[int, int, np.ndarray]]:
    """Where the compiler reassociates sums (cost.xla.reassociates_sums), the edges that
    charge the second term of each summed pair (cost.facts.summed_pairs) its collective only
    where the first is not summed alike: the two are added first and reduced once. Its
    node's cost leaves that collective out; the edge (or, within one node, the node's cost)
    puts it back."""
    if not reassociates_sums(graph.compiler):
        return []
    facts = _facts(graph, memo)

    def summing(t: int) -> tuple[np.ndarray, np.ndarray]:
        """Per strategy of the unit making `t`: a number for how it sums `t` (-1: it does
        not) and the seconds that takes."""
        u, k = producer[t]
        unit, strategies = units[u], choices[u]
        key = ("summing", unit.cost_key, id(strategies), k)
        if key not in memo:
            found = [partial_sum(unit.op, s, k, graph.tensors, mesh, hw, facts)
                     if unit.op is not None else None for s in strategies]
            kinds = memo.setdefault(("summing kinds",), {})
            memo[key] = (strategies,
                         np.array([kinds.setdefault(f[0], len(kinds)) if f else -1
                                   for f in found]),
                         np.array([f[1] if f else 0.0 for f in found]))
        return memo[key][1:]

    edges = []
    for a, b in summed_pairs(graph):
        if a not in producer or b not in producer:
            continue
        kind_a, _ = summing(a)
        kind_b, seconds_b = summing(b)
        if not np.intersect1d(kind_a[kind_a >= 0], kind_b[kind_b >= 0]).size:
            continue  # never summed alike: b's node keeps its collective, and no edge
        na, nb = node_of[producer[a][0]], node_of[producer[b][0]]
        node_costs[nb] -= seconds_b
        if na == nb:  # one node: strategy i of both units is the node's strategy i
            node_costs[nb] += np.where((kind_a == kind_b) & (kind_b >= 0), 0.0, seconds_b)
            continue
        matrix = np.where((kind_a[:, None] == kind_b[None, :]) & (kind_b[None, :] >= 0),
                          0.0, seconds_b[None, :])
        matrix.flags.writeable = False
        edges.append((na, nb, matrix))
    return edges


def _distinct(specs: list[Spec]) -> tuple[np.ndarray, list[Spec]]:
    index: dict[Spec, int] = {}
    idx = np.array([index.setdefault(s, len(index)) for s in specs], dtype=np.int64)
    return idx, list(index)


class Resharding:
    """Resharding cost tables, kept per pair of spec lists: the cost is linear in the tensor's
    bytes, so one pair of term tables serves every tensor of those specs. Units of a repeated
    layer share strategy lists, so most lookups are by identity."""

    def __init__(self, mesh: MeshShape, hw: Hardware) -> None:
        self.mesh, self.hw = mesh, hw
        self._specs: dict[tuple, tuple[list[Strategy], tuple[Spec, ...]]] = {}
        self._lists: dict[tuple[Spec, ...], tuple[Spec, ...]] = {}
        self._terms: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        # reshard_terms by the specs' numbers: the mesh and profile are this object's, and a
        # spec (nested tuples) hashes slowly; three-axis meshes look up millions of pairs.
        self._number: dict[Spec, int] = {}
        self._specs_by_number: list[Spec] = []
        self._known = np.zeros((0, 0), bool)  # [src, dst]: priced yet
        self._terms_of = np.zeros((0, 0, 2))  # [src, dst]: (latency, seconds per byte)

    def specs(self, strategies: list[Strategy], side: str, index: int) -> tuple[Spec, ...]:
        """The spec of operand (side 'in') or result ('out') `index` under each strategy, as
        one shared tuple per distinct content."""
        key = (id(strategies), side, index)
        if key not in self._specs:  # the entry keeps `strategies` alive: its id stays unique
            specs = tuple(s.in_specs[index] if side == "in" else s.out_specs[index]
                          for s in strategies)
            self._specs[key] = (strategies, self._lists.setdefault(specs, specs))
        return self._specs[key][1]

    def cost(self, tensor: Tensor, srcs: tuple[Spec, ...], dsts: tuple[Spec, ...],
             paired: bool) -> np.ndarray:
        """Seconds per (src, dst): elementwise when `paired`, else a matrix."""
        key = (id(srcs), id(dsts), paired)
        if key not in self._terms:
            src_idx, src_list = _distinct(srcs)
            dst_idx, dst_list = _distinct(dsts)
            table = self._table(src_list, dst_list)
            table = (table[src_idx, dst_idx] if paired
                     else table.take(src_idx, axis=0).take(dst_idx, axis=1))
            self._terms[key] = (table[..., 0], table[..., 1])  # ids of tuples _lists keeps
        latency, per_byte = self._terms[key]
        seconds = per_byte * tensor.nbytes
        seconds += latency  # in place: an edge of a wide mesh's table has millions of entries
        return seconds

    def _numbered(self, spec: Spec) -> int:
        n = self._number.get(spec)
        if n is None:
            n = self._number[spec] = len(self._specs_by_number)
            self._specs_by_number.append(spec)
        return n

    def _table(self, srcs: list[Spec], dsts: list[Spec]) -> np.ndarray:
        """reshard_terms of every (src, dst), as an array [src, dst, 2]."""
        a = np.array([self._numbered(x) for x in srcs], dtype=np.int64)
        b = np.array([self._numbered(x) for x in dsts], dtype=np.int64)
        if len(self._number) > len(self._known):  # grow the tables, doubling
            size = max(2 * len(self._known), len(self._number), 64)
            known, terms = np.zeros((size, size), bool), np.zeros((size, size, 2))
            n = len(self._known)
            known[:n, :n], terms[:n, :n] = self._known, self._terms_of
            self._known, self._terms_of = known, terms
        block = np.ix_(a, b)
        missing = ~self._known[block]
        spec = self._specs_by_number
        for i, j in zip(*np.nonzero(missing)):
            self._terms_of[a[i], b[j]] = reshard_terms(spec[a[i]], spec[b[j]], self.mesh,
                                                       self.hw)
        self._known[block] = True
        return self._terms_of[block]


def unit_costs(unit: Unit, strategies: list[Strategy], graph: OpGraph,
                mesh: MeshShape, hw: Hardware, memo: dict[tuple, Any]) -> np.ndarray:
    """Compute plus communication seconds of the unit's op under each strategy.

    `memo` is shared by all units (and by every build of one graph on one mesh): units of one
    `cost_key` cost the same under the same strategy, and units of a repeated layer share
    their strategy list.
    """
    op = unit.op
    facts = _facts(graph, memo)
    key = (unit.cost_key, id(strategies))
    if key not in memo:
        known = memo.setdefault((unit.cost_key,), {})  # strategy id -> seconds
        for s in strategies:  # strategies are shared objects, alive for the whole build
            if id(s) not in known:
                compute, comm = op_time(op, s, graph.tensors, mesh, hw, facts)
                known[id(s)] = compute + comm
        # The entry keeps the list alive, so that its id stays unique.
        memo[key] = (strategies, np.array([known[id(s)] for s in strategies]))
    return memo[key][1]


def _facts(graph: OpGraph, memo: dict[tuple, Any]) -> Any:
    """cost.facts.value_facts of `graph`, kept in `memo` once per graph (an equal graph from
    another trace hashes alike but compares op by op in value_facts' own cache)."""
    if "facts" not in memo:
        memo["facts"] = value_facts(graph)
    return memo["facts"]
