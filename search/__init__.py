"""Combinatorial search for per-operator parallelisation strategies.

Pure optimisation over a :class:`CostGraph` (numpy only): pick one strategy
per node minimising node plus pairwise edge costs.  Backends register
themselves in :data:`ALGORITHMS`; :func:`solve` dispatches by name.
"""

from .costgraph import (
    ALGORITHMS,
    CostGraph,
    CostGraphBuilder,
    InfeasibleError,
    SearchTooLargeError,
    Solution,
    register_algorithm,
    solve,
)

# Imported for their side effect of registering an algorithm.
from . import brute_force as brute_force  # noqa: E402
from . import dynamic_programming as dynamic_programming  # noqa: E402
from . import recursive_programming as recursive_programming  # noqa: E402
from . import sharding_propagation as sharding_propagation  # noqa: E402
from .bounded import pair_tables, solve_bounded
from .dual import REACHED, Reparametrisation, dual_bound, shortlisted
from .constrained import solve_constrained
from .brute_force import solve_brute_force
from .width import largest_table
from .dynamic_programming import solve_dynamic_programming
from .recursive_programming import solve_recursive_programming
from .sharding_propagation import solve_sharding_propagation

__all__ = [
    "ALGORITHMS",
    "CostGraph",
    "CostGraphBuilder",
    "dual_bound",
    "pair_tables",
    "Reparametrisation",
    "shortlisted",
    "REACHED",
    "InfeasibleError",
    "largest_table",
    "SearchTooLargeError",
    "Solution",
    "register_algorithm",
    "solve",
    "solve_bounded",
    "solve_constrained",
    "solve_brute_force",
    "solve_dynamic_programming",
    "solve_recursive_programming",
    "solve_sharding_propagation",
]
