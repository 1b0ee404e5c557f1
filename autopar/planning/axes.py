"""The device half of the double recursion: one mesh axis at a time.

- `solve_recursive(graph, mesh, hw, pinned, ...)`: plans `graph` one axis per round, largest
  first (`axis_order`), keeping what earlier rounds chose. It returns a Recursion: the last
  round's problem and solution, `exact` only for one round solved exactly. The rounds
  together are not the optimum of the whole mesh.
- `solve_round(graph)`: the exact answer where tables stay within ROUND_TABLE_LIMIT, else
  the greedy one, and which it is.
- `rounds_within`, `merged_within`, `paired_within`: inside a whole-mesh problem, one axis at
  a time, all axes as one, or two neighbouring axes as one; indexed like its strategies.
Any mesh shape works. Nothing here raises an error of its own.

Design and rationale: docs/internals-planning.md, "autopar/planning/axes.py".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import autopar_search as search
from autopar.cost.hardware import Hardware
from autopar.mesh import MeshShape
from autopar.planning.pricing import Unit
from autopar.planning.problem import (Extension, Problem, build_problem, kept_problem,
                                      make_units)
from autopar.rules import Spec, Strategy
from autopar.trace.ir import OpGraph


def axis_order(mesh: MeshShape) -> list[str]:
    """Largest axis first: it splits the most, so it decides first (ties: mesh order)."""
    return sorted((n for n, s in zip(mesh.names, mesh.sizes) if s > 1),
                  key=lambda n: (-mesh.axis_size(n), mesh.names.index(n)))


ROUND_TABLE_LIMIT = 1e6  # a round is solved exactly when its tables stay this small


def solve_round(graph: search.CostGraph) -> tuple[search.Solution, bool]:
    """The exact answer where that is cheap, else the greedy one; and whether it was exact.
    Without pruning dominated strategies: a round's nodes have a handful of strategies, and
    pruning them takes longer than eliminating them (docs/decisions.md, "Planning overhead").
    The width is estimated before eliminating, and the elimination can still meet a wider
    table (a circular pipeline's tick on 2x4: 1.8e6 entries): the greedy answer then too."""
    if search.largest_table(graph, ROUND_TABLE_LIMIT) <= ROUND_TABLE_LIMIT:
        try:
            return search.solve(graph, "dynamic_programming", max_factor_size=ROUND_TABLE_LIMIT,
                                prune=False), True
        except search.SearchTooLargeError:
            pass
    return search.solve(graph, "recursive_programming"), False


def rounds_within(problem: Problem, mesh: MeshShape) -> search.Solution:
    """The device recursion inside a whole-mesh problem, with no problem built per round:
    round by round (largest axis first), each node keeps only its strategies that place the
    axes of earlier rounds as those rounds chose and use no later axis, and the round is
    solved on that restriction. Returns the answer, indexed like `problem`'s strategies. A node
    left with no such strategy (a pinned one: its single strategy uses every axis) keeps all of
    its strategies."""
    graph = problem.graph
    placed = _placed(problem)
    decided = [frozenset()] * len(placed)
    done: set[str] = set()
    choice = [0] * len(placed)
    for axis in axis_order(mesh) or list(mesh.names[:1]):
        done.add(axis)
        # Nodes share strategy lists (a repeated layer's, every memory price's problem): a
        # list's mask for what the rounds before decided is worked out once.
        masks = problem.derived.setdefault(("round", axis, frozenset(done)), {})
        keep = []
        for options, before in zip(placed, decided):
            key = (id(options), before)
            if key not in masks:
                mask = np.array([all(a in done for _, a in p) and
                                 frozenset(x for x in p if x[1] != axis) == before
                                 for p in options])
                masks[key] = mask if mask.any() else np.ones(len(options), dtype=bool)
            keep.append(masks[key])
        answer, _ = solve_round(graph.restricted(keep))
        choice = [int(np.flatnonzero(k)[c]) for k, c in zip(keep, answer.choice)]
        decided = [frozenset(x for x in options[c] if x[1] in done)
                   for options, c in zip(placed, choice)]
    choice_array = np.array(choice, dtype=np.int64)
    stats = {"nodes": graph.num_nodes(), "edges": graph.num_edges()}
    return search.Solution(choice_array, graph.total_cost(choice_array), stats)


def _per_list(problem: Problem, key: Any, make: Callable[[list[Strategy]], Any]) -> list:
    """Per node, `make` of its strategy list: worked out once per list (nodes share theirs: a
    repeated layer's, every memory price's problem) and kept in the problem under `key`."""
    if key not in problem.derived:
        lists: dict[int, Any] = {}
        for r in problem.roots:
            options = problem.choices[r]
            if id(options) not in lists:
                lists[id(options)] = make(options)
        problem.derived[key] = [lists[id(problem.choices[r])] for r in problem.roots]
    return problem.derived[key]


def _placed(problem: Problem) -> list[list[frozenset]]:
    """Per node, per strategy, the (factor, axis) pairs it places."""
    pairs: dict[tuple, frozenset] = {}  # assignment -> its pairs: few assignments are distinct

    def placed(options: list[Strategy]) -> list[frozenset]:
        for s in options:
            if s.assignment not in pairs:
                pairs[s.assignment] = frozenset((f, a) for f, axes in s.assignment for a in axes)
        return [pairs[s.assignment] for s in options]
    return _per_list(problem, "placed", placed)


def _masks(problem: Problem, key: tuple, selects: Callable[[Strategy], bool]
           ) -> list[np.ndarray]:
    """Per node, the mask of its strategies that `selects`, or all where it selects none."""
    def mask(options: list[Strategy]) -> np.ndarray:
        chosen = np.array([selects(s) for s in options])
        return chosen if chosen.any() else np.ones(len(chosen), dtype=bool)
    return _per_list(problem, key, mask)


def merged_within(problem: Problem, mesh: MeshShape) -> search.Solution:
    """The mesh's axes taken as one, inside a whole-mesh problem: each node keeps the
    strategies that place every axis (of more than one device) on one factor, or none; a node
    left with none keeps all. Where the axis recursion's first round, over one small axis,
    finds a split worth less than the latencies it adds, it replicates, and later rounds keep
    that: a small GPT on 2x2x2 stayed replicated, twice as slow as data parallel over all
    eight devices, which this restriction finds."""
    axes = sorted(n for n, size in zip(mesh.names, mesh.sizes) if size > 1)
    keep = _masks(problem, ("merged", tuple(axes)), lambda s: not s.assignment or (
        sum(1 for _, a in s.assignment if a) == 1
        and sorted(a for _, used in s.assignment for a in used) == axes))
    return _solved_within(problem, keep, lambda graph: solve_round(graph)[0])


def adjacent_pairs(mesh: MeshShape) -> list[tuple[str, str]]:
    """Neighbouring axes of a mesh of three or more (of more than one device), in mesh order:
    each pair, taken as one axis, makes the mesh of one axis fewer whose devices it spans."""
    names = [n for n, size in zip(mesh.names, mesh.sizes) if size > 1]
    return list(zip(names, names[1:])) if len(names) >= 3 else []


def paired_within(problem: Problem, pair: tuple[str, str], max_factor_size: float
                  ) -> search.Solution:
    """Bounded elimination inside a whole-mesh problem restricted to the strategies that put
    both axes of `pair` on one factor, next to each other in that order, or neither: the
    problem of the mesh with the two taken as one axis. With an axis of every size as a
    choice, each node's strategies multiply with the axes, and bounded elimination of the
    whole space loses plans the two-axis mesh finds; with the pair as one axis it finds them
    again (docs/decisions.md, "Two neighbouring axes as one"). A node left with no such
    strategy keeps all."""
    first, second = pair

    def selects(s: Strategy) -> bool:
        factor_of = {a: f for f, axes in s.assignment for a in axes}
        if first not in factor_of and second not in factor_of:
            return True
        axes = dict(s.assignment).get(factor_of.get(first), ())
        at = axes.index(first) if first in axes else -1
        return at >= 0 and axes[at:at + 2] == pair

    keep = _masks(problem, ("paired", pair), selects)
    return _solved_within(problem, keep, lambda graph: search.solve_bounded(
        graph, max_factor_size=max_factor_size))


def _solved_within(problem: Problem, keep: list[np.ndarray],
                   solve: Callable[[search.CostGraph], search.Solution]) -> search.Solution:
    """`solve`'s answer on `problem` restricted to the strategies `keep` selects, indexed like
    `problem`'s strategies and costed on its whole graph."""
    answer = solve(problem.graph.restricted(keep))
    choice = np.array([int(np.flatnonzero(k)[c]) for k, c in zip(keep, answer.choice)],
                      dtype=np.int64)
    stats = {"nodes": problem.graph.num_nodes(), "edges": problem.graph.num_edges()}
    return search.Solution(choice, problem.graph.total_cost(choice), stats)


@dataclass(frozen=True)
class Recursion:
    """What planning axis by axis found: the last round's problem and its solution, the
    space that gave it, whether it is the optimum (one round, solved exactly: a mesh of one
    axis), and the rounds' figures for the plan's statistics."""

    problem: Problem
    solution: search.Solution
    space: str
    exact: bool
    details: dict[str, Any]


def solve_recursive(graph: OpGraph, mesh: MeshShape, hw: Hardware,
                    pinned: dict[int, Spec] | None, units: list[Unit] | None = None,
                    memory_weight: float = 0.0, problems: dict | None = None,
                    narrow: bool = False) -> Recursion:
    """Plan `graph` axis by axis: the last round's problem and solution (a Recursion).

    `problems` keeps each round's unpriced problem, by the rounds before it and their answers,
    for the next search of this graph, mesh and pins (at another memory price). `narrow`: in
    the space where only weight gradients are reduce-scattered (build_problem)."""
    units = make_units(graph) if units is None else units
    order = axis_order(mesh)
    if not order:  # a mesh of one device: one round decides everything (all replicated)
        order = list(mesh.names[:1])
    done: list[str] = []
    problem = solution = None
    exact_rounds = 0
    key: tuple = ("narrow",) if narrow else ()
    for axis in order:
        names = tuple(n for n in mesh.names if n in done or n == axis)
        sub = MeshShape(names, tuple(mesh.axis_size(n) for n in names))
        key = (axis, key)

        def build() -> Problem:  # called at once: the loop's variables are this round's
            sub_pins = None if pinned is None else {
                t: tuple(None if axes is None else tuple(a for a in axes if a in names)
                         for axes in spec) for t, spec in pinned.items()}
            extension = None
            if problem is not None:  # keep what the earlier rounds decided
                strategies = problem.decode(solution.choice)
                extension = Extension(frozenset(done),
                                      lambda u, chosen=strategies: dict(chosen[u].assignment))
            return build_problem(graph, sub, hw, sub_pins, extend=extension, units=units,
                                 narrow=narrow, memo=problems)

        problem = kept_problem(problems, key, build).priced(graph, sub, memory_weight)
        solution, exact = solve_round(problem.graph)
        exact_rounds += exact
        if not done:
            first_split = any(axes for s in problem.decode(solution.choice)
                              for _, axes in s.assignment)
        done.append(axis)
        key += (solution.choice.tobytes(),)  # the next round extends this answer
    details, space = {"rounds": len(order), "exact_rounds": exact_rounds}, "one axis at a time"
    merged = None if first_split else _merged_rounds(graph, mesh, hw, pinned, units,
                                                     memory_weight, problems, order, narrow)
    if merged is not None:
        details.update(one_axis_at_a_time_s=solution.cost, all_axes_as_one_s=merged[1].cost)
        if merged[1].cost < solution.cost:
            problem, solution = merged
            space = "all axes as one, then the last axis"
    return Recursion(problem, solution, space, exact_rounds == len(order) == 1, details)


def _merged_rounds(graph: OpGraph, mesh: MeshShape, hw: Hardware,
                   pinned: dict[int, Spec] | None, units: list[Unit], memory_weight: float,
                   problems: dict | None, order: list[str], narrow: bool = False
                   ) -> tuple[Problem, search.Solution] | None:
    """The recursion's second answer, where its first round split nothing: every axis taken
    as one (a one-axis mesh of all the devices), then a round on the whole mesh that keeps
    that answer's placement of all axes but the last and places the last. A first round over
    a small axis finds no split worth the latencies it adds, and later rounds keep its
    replication (see `merged_within`; a small ResNet on 2x2x2: docs/decisions.md,
    "recursive_programming: all axes as one where the first round splits nothing"). None on a
    mesh of one axis, or where a pin splits a dimension over some of the axes only (it has no
    one-axis form)."""
    if len(order) < 2:
        return None
    name = "*".join(order)
    if pinned is not None and any(axes is not None and set(axes) not in (set(), set(order))
                                  for spec in pinned.values() for axes in spec):
        return None
    one = MeshShape((name,), (int(np.prod([mesh.axis_size(a) for a in order])),))
    pins = None if pinned is None else {
        t: tuple(None if axes is None else (name,) if axes else () for axes in spec)
        for t, spec in pinned.items()}
    first = kept_problem(problems, ("all axes as one", narrow), lambda: build_problem(
        graph, one, hw, pins, units=units, narrow=narrow, memo=problems)
    ).priced(graph, one, memory_weight)
    answer, _ = solve_round(first.graph)
    rest = [a for a in mesh.names if a in order[:-1]]
    merged = first.decode(answer.choice)
    extension = Extension(frozenset(rest), lambda u: {
        f: tuple(rest) for f, axes in merged[u].assignment if axes})
    whole = kept_problem(problems, ("all axes as one", narrow, answer.choice.tobytes()),
                         lambda: build_problem(graph, mesh, hw, pinned, extend=extension,
                                               units=units, narrow=narrow, memo=problems)
                         ).priced(graph, mesh, memory_weight)
    return whole, solve_round(whole.graph)[0]
