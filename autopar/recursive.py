"""The device half of the double recursion: one mesh axis at a time.

Each round adds one axis (largest first) to the mesh planned so far and lets every deciding
operator choose only which factor that axis splits, keeping what earlier rounds chose. A round's
problem therefore has a handful of strategies per node whatever the device count, and the graph
half (`search.recursive_programming`: heaviest operator first, then coordinate descent) solves
it in time linear in the graph. Any mesh shape works: axes of any size, indivisible dimensions
are never offered to an axis that does not divide them.
"""
from __future__ import annotations

import search
from autopar.cost.hardware import Hardware
from autopar.ir import OpGraph
from autopar.mesh import MeshShape
from autopar.problem import Extension, Problem, build_problem
from autopar.rules.factors import Spec


def axis_order(mesh: MeshShape) -> list[str]:
    """Largest axis first: it splits the most, so it decides first (ties: mesh order)."""
    return sorted((n for n, s in zip(mesh.names, mesh.sizes) if s > 1),
                  key=lambda n: (-mesh.axis_size(n), mesh.names.index(n)))


def solve_recursive(graph: OpGraph, mesh: MeshShape, hw: Hardware,
                    pinned: dict[str, Spec] | None) -> tuple[Problem, search.Solution, int]:
    """Plan `graph` axis by axis; returns the last round's problem and solution, and the rounds."""
    order = axis_order(mesh)
    if not order:  # a mesh of one device: one round decides everything (all replicated)
        order = list(mesh.names[:1])
    done: list[str] = []
    extension: Extension | None = None
    problem = solution = None
    for axis in order:
        done.append(axis)
        names = tuple(n for n in mesh.names if n in done)
        sub = MeshShape(names, tuple(mesh.axis_size(n) for n in names))
        sub_pins = None if pinned is None else {
            path: tuple(tuple(a for a in axes if a in names) for axes in spec)
            for path, spec in pinned.items()}
        problem = build_problem(graph, sub, hw, sub_pins, extend=extension)
        solution = search.solve(problem.graph, "recursive_programming")
        strategies = problem.decode(solution.choice)
        extension = Extension(frozenset(done), {
            u: dict(strategies[u].assignment) for u in range(len(problem.units))})
    return problem, solution, len(order)
