"""From an OpGraph to a CostGraph, and from the search's choice back to per-op strategies.

Only operators that change what sharding costs get a choice of their own (dot_general, conv,
reductions, gather/scatter, the step's inputs). Elementwise and layout operators follow the
producer of their main operand: they form one node with it, so the graph the search sees has a
node per decision, not per equation (MindSpore's elementwise_op_strategy_follow, Alpa's follow
ties). Resharding between nodes becomes an edge's cost matrix (pricing.py prices both).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

import autopar_search as search
from autopar.collector import paused
from autopar.cost.facts import op_signatures, weight_gradients
from autopar.cost.hardware import Hardware
from autopar.cost.model import shard_bytes
from autopar.errors import AutoparWarning
from autopar.mesh import MeshShape
from autopar.planning.pricing import (Resharding, Unit, resharding_edges, summed_edges,
                                     unit_costs)
from autopar.rules import (Rule, Spec, Strategy, enumerate_strategies, follow, replicated_rule,
                           rule_for)
from autopar.rules.factors import canonical, strategy
from autopar.rules.kinds import DECIDERS, GROWTH
from autopar.trace.analysis import roles
from autopar.trace.ir import Op, OpGraph, Tensor
from autopar.trace.layers import repeated_ties

# Seconds each kept byte costs in a search without a memory limit: a tie-break, far below
# what the cost model resolves (100 GB per device cost 0.1 us), far above float64 rounding of
# step times up to a second (1e-16 s). Without it, a step time that does not depend on where
# an input lives left a ResNet's image batch whole on every device (49 KB more than data
# parallelism, and 2x slower at the data-parallel program's memory, where the budget had to
# choose a leaner plan).
TIE_PRICE = 1e-18
Made = tuple[int, int]  # where a tensor is made: (the unit that makes it, its output index)


@dataclass(frozen=True)
class Extension:
    """Decisions of earlier rounds: for a unit `u`, `before(u)` maps each factor to the axes
    of `axes` it went to. Asked only of the units that decide (a build reads a few hundred of
    tens of thousands)."""

    axes: frozenset[str]
    before: Callable[[int], dict[str, tuple[str, ...]]] = field(hash=False, compare=False)

    def filter(self, options: list[Strategy], u: int) -> list[Strategy]:
        """The strategies of unit `u` among `options` that place `axes` as before."""
        def placed(assignment) -> set[tuple[str, str]]:
            return {(f, a) for f, axes in assignment for a in axes if a in self.axes}
        want = placed(self.before(u).items())
        return [s for s in options if placed(s.assignment) == want]


@dataclass
class Problem:
    """The search problem and how to read its answer back."""

    graph: search.CostGraph
    units: list[Unit]
    node_of: list[int]  # unit -> node
    choices: list[list[Strategy]]  # unit -> its strategy for each strategy of its node
    producer: dict[int, tuple[int, int]]  # tensor -> (unit, output index)
    roots: list[int]  # node -> the unit that defines it
    times: list[int]  # unit -> how many units it is priced for (`repeats`)

    memory: list[np.ndarray] | None = None  # node -> bytes it keeps per device, per strategy
    # What the searches within the problem derive from its strategies alone (axes.py: the axes
    # each strategy places, the masks that restrict it), shared by the problem at every price.
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def priced(self, graph: OpGraph, mesh: MeshShape, weight: float) -> Problem:
        """This problem with each byte per device it keeps of the step's inputs, activations
        and gradients charged `weight` seconds, so that the search trades time for memory, and
        at least TIE_PRICE, so that of plans equally fast the leaner wins. The unpriced problem
        stays as it is: a search at another price reuses it."""
        weight = max(weight, TIE_PRICE)
        costs = tuple(c + weight * m for c, m in zip(self.graph.node_costs,
                                                     self.kept(graph, mesh)))
        return dataclasses.replace(self, graph=self.graph.with_node_costs(costs))

    def kept(self, graph: OpGraph, mesh: MeshShape) -> list[np.ndarray]:
        """Per node and strategy, the bytes per device its units keep of the step's inputs,
        activations and gradients (memory.kept_bytes of a whole plan is their sum)."""
        if self.memory is None:
            self.memory = _memory_bytes(graph, self.units, self.choices, self.node_of,
                                        canonical(mesh), self.roots, self.times)
        return self.memory

    def decode(self, choice: np.ndarray) -> list[Strategy]:
        """The strategy of every unit under the search's choice per node."""
        picks = np.asarray(choice).tolist()  # Python ints: indexing an array per unit is slower
        return [options[picks[node]] for options, node in zip(self.choices, self.node_of)]


def kept_problem(problems: dict | None, key: Any, build: Callable[[], Problem]) -> Problem:
    """The unpriced problem kept under `key` in `problems`, built (and kept) if it is not
    there; built afresh when nothing is kept (`problems` None)."""
    if problems is None:
        return build()
    if key not in problems:
        problems[key] = build()
    return problems[key]


def make_units(graph: OpGraph, priced: bool = True) -> list[Unit]:
    """One unit per non-constant input, then one per op; warns about ops without a rule.

    Units depend on the graph alone: one list serves every search of the graph (each mesh,
    round and memory price). `priced` False leaves out what only a search prices with (cost
    keys, ties, alike units): enough to apply a saved plan (planning/saved.py)."""
    units = []
    for t in graph.inputs:
        tensor = graph.tensors[t]
        if not tensor.const:
            units.append(Unit(tensor.path or f"input {t}", _input_rule(tensor), (), (t,), None))
    missing: dict[str, list[str]] = defaultdict(list)
    signatures = op_signatures(graph) if priced else [()] * len(graph.ops)
    for op in graph.ops:
        ins = [graph.tensors[t].shape for t in op.inputs]
        outs = [graph.tensors[t].shape for t in op.outputs]
        rule = rule_for(op.primitive, ins, outs, op.params)
        if rule is None:
            missing[op.primitive].append(op.source)
            rule = replicated_rule(ins, outs)
        rule = canonical(rule)
        units.append(Unit(f"{op.primitive} #{op.id}", rule, op.inputs, op.outputs, op,
                          signatures[op.id],
                          main=main_operand(rule, op, graph)))
    for primitive, sources in missing.items() if jax.process_index() == 0 else ():
        named = sorted({s for s in sources if s}) or ["inside a jax function"]
        where = "; ".join(named[:3]) + (" ..." if len(named) > 3 else "")
        warnings.warn(f"autopar has no sharding rule for primitive '{primitive}' "
                      f"({len(sources)} use(s), at {where}); it runs replicated.",
                      AutoparWarning, stacklevel=4)
    return alike_units(graph, units, repeated_ties(graph, units)) if priced else units


def alike_units(graph: OpGraph, units: list[Unit], ties: dict[int, int]) -> list[Unit]:
    """`units` with their `ties` (layers.repeated_ties), their operands' makers, and a
    number shared by the units alike in all a build prices of them but their strategies and
    their operands' makers: cost signature, results' shapes, dtypes and roles, and each
    operand's shape, dtype, output index and reads. (The same operator of two instances of a
    layer is alike; so are most of an optimizer's updates of equal parameters.) A build
    prices one unit of those that are alike and take the same strategies from makers that
    do, once for all of them (`repeats`)."""
    producer = {t: (u, k) for u, unit in enumerate(units) for k, t in enumerate(unit.outputs)}
    kept = roles(graph)
    kinds: dict[tuple, int] = {}
    done = []
    for u, unit in enumerate(units):
        makers, operands = [], []
        for i, t in enumerate(unit.inputs):
            tensor = graph.tensors[t]
            made = None if tensor.const else producer.get(t)
            makers.append(None if made is None else made[0])
            operands.append(None if made is None else (
                made[1], tensor.shape, tensor.dtype, unit.op.operand_repeat(i)))
        results = tuple((graph.tensors[t].shape, graph.tensors[t].dtype,
                         t in kept and not graph.tensors[t].const) for t in unit.outputs)
        kind = (unit.cost_key, results, tuple(operands))
        # Unit(...) rather than dataclasses.replace: one per op, and replace is several
        # times slower
        done.append(Unit(name=unit.name, rule=unit.rule, inputs=unit.inputs,
                         outputs=unit.outputs, op=unit.op, cost_key=unit.cost_key,
                         tie=ties.get(u), main=unit.main, makers=tuple(makers),
                         alike=kinds.setdefault(kind, len(kinds))))
    return done


def repeats(units: list[Unit], node_of: list[int], choices: list[list[Strategy]]
            ) -> list[int]:
    """Per unit, how many units a build prices it for: the first of the units alike
    (`alike_units`) that take the same node and strategy list, whose operands' makers do too,
    stands for all of them, and the others for none. Such units cost the same and reshard
    their operands alike, so a stack of equal layers is priced a few layers' worth."""
    first: dict[tuple, int] = {}
    times = [0] * len(units)
    for u, unit in enumerate(units):
        key = (unit.alike, node_of[u], id(choices[u]),
               *[None if m is None else (node_of[m], id(choices[m])) for m in unit.makers])
        times[first.setdefault(key, u)] += 1
    return times


def _input_rule(tensor: Tensor) -> Rule:
    names = tuple(f"d{k}" if d > 1 else None for k, d in enumerate(tensor.shape))
    return Rule((), (names,), {f"d{k}": d for k, d in enumerate(tensor.shape) if d > 1})


def main_operand(rule: Rule, op: Op, graph: OpGraph) -> int | None:
    """The operand of `op` (under `rule`) a follower takes its sharding from: the first
    non-constant one of the result's shape, else the first non-constant one. None where the
    op decides: a decider, and an operator whose result is at least GROWTH times its main
    operand (a broadcast, a one-hot): following, it could not split the dimensions it
    creates, and everything after it would follow it replicated (a MoE's (tokens, experts,
    capacity) routing tensors stayed whole on every device, where XLA's propagation splits
    them over the experts of the product that reads them)."""
    live = [i for i, t in enumerate(op.inputs) if not graph.tensors[t].const]
    if not live or op.primitive in DECIDERS or not rule.sizes:
        return None
    result = graph.tensors[op.outputs[0]]
    same = [i for i in live if graph.tensors[op.inputs[i]].shape == result.shape]
    main = (same or live)[0]
    if math.prod(result.shape) >= GROWTH * math.prod(graph.tensors[op.inputs[main]].shape):
        return None
    return main


@paused()  # its tables and strategy lists outlive it: a collection would free little
def build_problem(graph: OpGraph, mesh: MeshShape, hw: Hardware,
                  pinned: dict[int, Spec] | None = None, extend: Extension | None = None,
                  tie_layers: bool = True, units: list[Unit] | None = None,
                  narrow: bool = False, memo: dict | None = None,
                  edges: bool = True) -> Problem:
    """The CostGraph of `graph` on `mesh` under the cost model of `hw`.

    `pinned` fixes the sharding of tensors by id (inputs, and results of `autopar.shard`): the
    unit producing one becomes a node of its own with that one strategy.
    `extend` keeps only the strategies that agree with earlier decisions on the axes they were
    made for: a round of the device recursion adds one axis to the rounds before.
    `tie_layers` gives instances of a repeated layer two apart the same strategies
    (layers.repeated_ties); without it every unit decides on its own.
    `units` (from make_units) saves computing the rules again when one graph is planned twice.
    `narrow` offers reduce-scatters to weight gradients alone, along their first dimension:
    a smaller space, where the searches that are not exact (bounded elimination, one axis at
    a time) sometimes find a better plan than in the whole one (solve._best_within_bound).
    `memo` (a dict kept for one graph, as solve's `problems` is) keeps the operators' costs
    and the resharding tables for the next build of the graph on the same mesh: the narrow
    space, the tied and untied problems and every round of the recursion share most of them.
    `edges` False leaves out the edges (the resharding between nodes, the collective of a
    second summand its first is not summed alike with) and resharding inside a node: a
    relaxation, each plan's cost in it at most its cost in the whole problem, and quick to
    build where pricing the edges' spec pairs is not (its node minima bound the optimum).
    The problem is unpriced: `Problem.priced` charges the memory it keeps.
    """
    units = make_units(graph) if units is None else units
    mesh = canonical(mesh)
    producer, sources = _producers(units, memo)
    same_layer = {u: unit.tie for u, unit in enumerate(units)
                  if tie_layers and unit.tie is not None}
    node_of, choices, roots = _group(graph, units, sources, mesh, same_layer, extend,
                                     pinned or {}, narrow)
    op_costs, reshard = ({}, Resharding(mesh, hw)) if memo is None else memo.setdefault(
        ("pricing", mesh, hw), ({}, Resharding(mesh, hw)))

    times = repeats(units, node_of, choices)
    node_costs = [np.zeros(len(choices[r])) for r in roots]
    for u, unit in enumerate(units):
        if unit.op is not None and times[u]:
            seconds = unit_costs(unit, choices[u], graph, mesh, hw, op_costs)
            node_costs[node_of[u]] += seconds if times[u] == 1 else times[u] * seconds

    found = (resharding_edges(graph, units, producer, node_of, choices, reshard, node_costs,
                              times) if edges else [])
    # summed edges take their collective out of the node's cost: that part is kept alone
    found += summed_edges(graph, units, producer, node_of, choices, mesh, hw, op_costs,
                          node_costs)
    names = tuple(units[r].name for r in roots)
    cost_graph = search.CostGraph(tuple(node_costs), tuple(found) if edges else (), names)
    return Problem(cost_graph, units, node_of, choices, producer, roots, times)


def _producers(units: list[Unit], memo: dict | None
               ) -> tuple[dict[int, Made], list[Made | None]]:
    """Tensor -> where it is made, and per unit where its main operand is (None: the unit
    decides); kept in `memo` for its units: every build of the graph reads them."""
    kept = memo.get("producers") if memo is not None else None
    if kept is None or kept[0] is not units:
        producer = {t: (u, k) for u, unit in enumerate(units) for k, t in enumerate(unit.outputs)}
        sources = [None if unit.main is None else producer.get(unit.inputs[unit.main])
                   for unit in units]
        kept = (units, producer, sources)
        if memo is not None:
            memo["producers"] = kept
    return kept[1], kept[2]


def _group(graph: OpGraph, units: list[Unit], sources: list[Made | None], mesh: MeshShape,
           same_layer: dict[int, int], extend: Extension | None, pinned: dict[int, Spec],
           narrow: bool = False) -> tuple[list[int], list[list[Strategy]], list[int]]:
    """Nodes of the search: which node each unit belongs to, each unit's strategy for every
    strategy of its node, and the unit that defines each node.

    A unit that follows takes its producer's node and derives its strategy from the producer's
    output spec; an instance of a repeated layer takes the first instance's node; any other unit
    defines a node of its own with all its strategies (those extending `extend`, if given).
    A unit whose result is pinned neither follows nor ties: it is a node of its own with the
    one strategy that produces the pinned spec, or where the pin leaves dimensions free (None),
    every strategy that gives the others their pinned axes.
    """
    node_of: list[int] = []
    choices: list[list[Strategy]] = []
    roots: list[int] = []
    derived: dict[tuple, list[Strategy]] = {}
    lists: dict[tuple[Strategy, ...], list[Strategy]] = {}
    for u, (unit, source) in enumerate(zip(units, sources)):
        main = unit.main
        fixed = pinned.get(unit.outputs[0]) if pinned and unit.outputs else None
        if fixed is not None:
            node_of.append(len(roots))
            roots.append(u)
            options = pinned_strategies(unit.rule, mesh, fixed)
            if len(options) > 1 and extend is not None:
                options = extend.filter(options, u) or options
            choices.append(options)
        elif source is not None and source[0] < u:
            src_unit, k = source
            node_of.append(node_of[src_unit])
            key = (unit.rule, main, id(choices[src_unit]), k)
            if key not in derived:  # a repeated layer's followers share their producers' list
                made = [follow(unit.rule, mesh, main, s.out_specs[k]) for s in choices[src_unit]]
                # one list of each content: a residual stream's adds, each following the
                # one before, then share theirs, and so do the layers that read them
                derived[key] = lists.setdefault(tuple(made), made)
            choices.append(derived[key])
        elif u in same_layer and not set(units[same_layer[u]].outputs[:1]) & pinned.keys():
            node_of.append(node_of[same_layer[u]])
            choices.append(choices[same_layer[u]])
        else:
            node_of.append(len(roots))
            roots.append(u)
            # Every product with partial sums is offered their reduce-scatters: weight
            # gradients into a sharded optimizer state, activation gradients into the split
            # of the layer below. `narrow`: weight gradients alone, along their first
            # dimension (see build_problem).
            scatter = (("first" if set(unit.outputs) & weight_gradients(graph) else False)
                       if narrow else True)
            options = enumerate_strategies(unit.rule, mesh, scatter=scatter)
            if extend is not None:
                options = extend.filter(options, u) or options[:1]
            choices.append(options)
    return node_of, choices, roots


def untied_node_count(graph: OpGraph, units: list[Unit], pinned: dict[int, Spec]) -> int:
    """Nodes of the problem built without ties, counted without building it: as in _group,
    a unit is a node of its own where its result is pinned or it has no earlier producer."""
    producer = {t: u for u, unit in enumerate(units) for t in unit.outputs}
    count = 0
    for u, unit in enumerate(units):
        main = unit.main
        source = producer.get(unit.inputs[main]) if main is not None else None
        pinned_here = bool(unit.outputs) and unit.outputs[0] in pinned
        count += pinned_here or source is None or source >= u
    return count


def pinned_strategies(rule: Rule, mesh: MeshShape, spec: Spec) -> list[Strategy]:
    """The strategies of a one-result rule whose result has `spec` (checked by pins.resolve):
    one, or where `spec` leaves dimensions free (None), each that gives the other dimensions
    their axes."""
    if None not in spec:
        dims = rule.results[0]
        return [strategy(rule, mesh, {f: axes for f, axes in zip(dims, spec) if f and axes})]
    return [s for s in enumerate_strategies(rule, mesh)
            if all(want is None or got == want for got, want in zip(s.out_specs[0], spec))]


def _memory_bytes(graph: OpGraph, units: list[Unit], choices: list[list[Strategy]],
                  node_of: list[int], mesh: MeshShape, roots: list[int], times: list[int]
                  ) -> list[np.ndarray]:
    """Per node and strategy, the bytes per device of the tensors that make up most of a
    training step's peak (inputs, activations, gradients: `memory.roles`) its units produce,
    each unit `times` over."""
    kept = roles(graph)
    total = [np.zeros(len(choices[r])) for r in roots]
    for u, unit in enumerate(units):
        if not times[u]:
            continue
        for k, t in enumerate(unit.outputs):
            if t in kept and not graph.tensors[t].const:
                held = [shard_bytes(graph.tensors[t], s.out_specs[k], mesh) for s in choices[u]]
                total[node_of[u]] += held if times[u] == 1 else times[u] * np.array(held)
    return total
