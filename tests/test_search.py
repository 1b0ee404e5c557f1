"""Tests for the pure search library (folder `search/`, installed as `autopar_search`): no jax."""

from __future__ import annotations

import ast
import itertools
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import autopar_search as search
from autopar_search import (
    ALGORITHMS,
    CostGraph,
    CostGraphBuilder,
    InfeasibleError,
    SearchTooLargeError,
    solve,
)

ROOT = Path(__file__).resolve().parents[1]
SEARCH_DIR = ROOT / "search"


# ---------------------------------------------------------------- generators


def _random_matrix(rng: np.random.Generator, rows: int, cols: int, p_inf: float) -> np.ndarray:
    mat = rng.uniform(0.0, 10.0, size=(rows, cols))
    if p_inf:
        mat[rng.random((rows, cols)) < p_inf] = math.inf
    return mat


def _random_small_graph(seed: int, kind: str) -> CostGraph:
    """A graph of up to 7 nodes of the given shape, with awkward features mixed in."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 8))
    ks = [int(k) for k in rng.integers(1, 6, size=n)]
    if n > 1 and rng.random() < 0.3:
        ks[int(rng.integers(n))] = 1  # a node with a single strategy
    p_inf = 0.0 if rng.random() < 0.4 else 0.15
    pairs: list[tuple[int, int]] = []
    if kind == "chain":
        pairs = [(i, i + 1) for i in range(n - 1)]
    elif kind == "cycle":
        pairs = [(i, (i + 1) % n) for i in range(n)] if n > 2 else [(0, n - 1)] * (n - 1)
    elif kind == "tree":
        pairs = [(int(rng.integers(i)), i) for i in range(1, n)]
    elif kind == "dense":
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n) if rng.random() < 0.7]
    else:
        raise AssertionError(kind)
    # Parallel edges, some given in the opposite direction.
    extra = [pairs[int(i)] for i in rng.integers(len(pairs), size=len(pairs) // 2)] if pairs else []
    b = CostGraphBuilder()
    for i, k in enumerate(ks):
        vec = rng.uniform(0.0, 10.0, size=k)
        if p_inf and k > 1 and rng.random() < 0.3:
            vec[int(rng.integers(k))] = math.inf
        b.add_node(vec, f"n{i}")
    for u, v in pairs + extra:
        if rng.random() < 0.5:
            u, v = v, u
        b.add_edge(u, v, _random_matrix(rng, ks[u], ks[v], p_inf))
    if rng.random() < 0.1:
        u = int(rng.integers(n))
        b.add_edge(u, u, _random_matrix(rng, ks[u], ks[u], 0.0))  # self-edge
    if rng.random() < 0.2 and n > 1:
        # Duplicate a strategy so that exact pruning has something to find.
        u = int(rng.integers(n))
        b = _with_duplicated_strategy(b, u)
    return b.build()


def _with_duplicated_strategy(b: CostGraphBuilder, u: int) -> CostGraphBuilder:
    g = b.build()
    costs = list(g.node_costs)
    costs[u] = np.append(costs[u], costs[u][0])
    edges = []
    for a, c, m in g.edges:
        if a == u:
            m = np.vstack([m, m[:1]])
        if c == u:
            m = np.hstack([m, m[:, :1]])
        edges.append((a, c, m))
    out = CostGraphBuilder()
    for i, vec in enumerate(costs):
        out.add_node(vec, g.name(i))
    for a, c, m in edges:
        out.add_edge(a, c, m)
    return out


def _outcome(graph: CostGraph, algorithm: str, **options: object) -> float | None:
    """Optimal cost, or None when infeasible; checks the reported choice."""
    try:
        sol = solve(graph, algorithm, **options)
    except InfeasibleError:
        return None
    assert sol.choice.shape == (graph.num_nodes(),)
    assert sol.cost == graph.total_cost(sol.choice)
    return sol.cost


# --------------------------------------------------------- exactness checks


@pytest.mark.parametrize("kind", ["chain", "cycle", "tree", "dense"])
def test_dp_matches_brute_force_on_random_graphs(kind: str) -> None:
    feasible = 0
    for seed in range(60):  # 4 kinds x 60 = 240 graphs
        graph = _random_small_graph(1000 * len(kind) + seed, kind)
        want = _outcome(graph, "brute_force")
        for prune in (True, False):
            got = _outcome(graph, "dynamic_programming", prune=prune)
            if want is None:
                assert got is None, f"seed {seed}: DP found {got} on an infeasible graph"
            else:
                assert got is not None, f"seed {seed}: DP says infeasible, optimum {want}"
                assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9), (seed, got, want)
        feasible += want is not None
    assert feasible >= 30  # the generator must not make almost everything infeasible


def test_pruning_removes_duplicates_and_keeps_optimum() -> None:
    rng = np.random.default_rng(7)
    b = CostGraphBuilder()
    base = rng.uniform(0, 5, size=4)
    for i in range(6):
        b.add_node(np.concatenate([base, base]))  # strategies 4..7 copy 0..3
    for i in range(5):
        m = rng.uniform(0, 5, size=(4, 4))
        b.add_edge(i, i + 1, np.block([[m, m], [m, m]]))
    graph = b.build()
    sol = solve(graph)
    assert sol.stats["strategies_after_pruning"] <= 6 * 4
    assert math.isclose(sol.cost, solve(graph, "brute_force").cost, rel_tol=1e-12)
    assert (sol.choice < 4).all()  # the lowest index of equal strategies survives


def test_dominated_rows_by_definition(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways `dominated` compares rows (all pairs at once for small blocks, screened by
    row sums for large ones) drop exactly the rows another row is <= everywhere, strictly
    or equal and earlier. The first block is the node's own cost, one column."""
    from autopar_search import reduction

    rng = np.random.default_rng(3)
    for trial in range(300):
        k = int(rng.integers(2, 9))
        widths = [1, *rng.integers(1, 5, size=int(rng.integers(0, 3)))]
        blocks = [rng.integers(0, 3, size=(k, int(w))).astype(float) for w in widths]
        blocks[0][rng.random(blocks[0].shape) < 0.1] = math.inf
        feats = np.hstack(blocks)
        want = np.array([any((feats[b] <= feats[a]).all()
                             and (not (feats[a] <= feats[b]).all() or b < a)
                             for b in range(k) if b != a) for a in range(k)])
        direct = reduction.dominated(blocks)
        with monkeypatch.context() as m:
            m.setattr(reduction, "_ALL_AT_ONCE", 0)
            screened = reduction.dominated(blocks)
        assert (direct == want).all() and (screened == want).all(), trial


def test_trivial_graphs() -> None:
    single = CostGraph((np.array([3.0, 1.0, 2.0]),), ())
    sol = solve(single)
    assert sol.choice.tolist() == [1] and sol.cost == 1.0
    empty = solve(CostGraph((), ()))
    assert empty.choice.shape == (0,) and empty.cost == 0.0
    ones = CostGraph((np.array([2.0]), np.array([5.0])), ((0, 1, np.array([[1.0]])),))
    assert solve(ones).cost == 8.0
    # Two components, one of them a lone node.
    b = CostGraphBuilder()
    for k in (2, 3, 2):
        b.add_node(np.arange(k, dtype=float)[::-1])
    b.add_edge(0, 1, [[0, 9, 9], [9, 9, 0]])
    assert solve(b.build()).cost == solve(b.build(), "brute_force").cost


# ------------------------------------------------------------ large graphs


def _viterbi(costs: list[np.ndarray], mats: list[np.ndarray]) -> float:
    """Textbook min-sum dynamic programme along a chain."""
    acc = costs[0]
    for vec, m in zip(costs[1:], mats):
        acc = (acc[:, None] + m).min(axis=0) + vec
    return float(acc.min())


def test_long_chain_matches_viterbi() -> None:
    rng = np.random.default_rng(3)
    ks = rng.integers(10, 41, size=3000)
    costs = [rng.uniform(0, 10, size=int(k)) for k in ks]
    mats = [rng.uniform(0, 10, size=(int(a), int(b))) for a, b in zip(ks[:-1], ks[1:])]
    graph = CostGraph(tuple(costs), tuple((i, i + 1, m) for i, m in enumerate(mats)))
    start = time.perf_counter()
    sol = solve(graph)
    assert time.perf_counter() - start < 10.0
    assert math.isclose(sol.cost, _viterbi(costs, mats), rel_tol=1e-9)


def _residual_training_graph(n_layers: int, seed: int) -> CostGraph:
    """Forward chain with skip connections, a mirrored backward chain, and
    links from forward ops to the backward ops that reuse their activations."""
    rng = np.random.default_rng(seed)
    ks = [int(k) for k in rng.integers(10, 41, size=n_layers)]
    b = CostGraphBuilder()
    fwd = [b.add_node(rng.uniform(0, 10, size=k), f"fwd{i}") for i, k in enumerate(ks)]
    bwd = [b.add_node(rng.uniform(0, 10, size=k), f"bwd{i}") for i, k in enumerate(ks)]

    def link(u: int, v: int, i: int, j: int) -> None:
        b.add_edge(u, v, rng.uniform(0, 10, size=(ks[i], ks[j])))

    for i in range(n_layers - 1):
        link(fwd[i], fwd[i + 1], i, i + 1)
        link(bwd[i + 1], bwd[i], i + 1, i)
        if i % 5 == 0:
            link(fwd[i + 1], fwd[i], i + 1, i)  # a parallel edge, reversed
    for i in range(0, n_layers - 3, 3):
        link(fwd[i], fwd[i + 3], i, i + 3)  # residual connection
        link(bwd[i + 3], bwd[i], i + 3, i)  # its gradient path
    for i in range(0, n_layers, 6):
        link(fwd[i], bwd[i], i, i)
    return b.build()


def _assert_locally_optimal(graph: CostGraph, choice: np.ndarray) -> None:
    """No single node can switch strategy and lower the total cost."""
    n = graph.num_nodes()
    local = [c.copy() for c in graph.node_costs]
    for u, v, m in graph.edges:
        if u != v:
            local[u] += m[:, choice[v]]
            local[v] += m[choice[u], :]
    for i in range(n):
        assert local[i][choice[i]] <= local[i].min() + 1e-9, graph.name(i)


def test_residual_training_graph_3000_nodes() -> None:
    graph = _residual_training_graph(1500, seed=11)
    assert graph.num_nodes() == 3000
    start = time.perf_counter()
    sol = solve(graph)
    elapsed = time.perf_counter() - start
    assert elapsed < 15.0, elapsed
    assert math.isclose(sol.cost, graph.total_cost(sol.choice))
    assert math.isclose(sol.cost, sol.stats["objective"], rel_tol=1e-9)
    _assert_locally_optimal(graph, sol.choice)
    # An optimum is at most the cost of any assignment, e.g. cheapest-per-node.
    greedy = np.array([int(np.argmin(c)) for c in graph.node_costs])
    assert sol.cost <= graph.total_cost(greedy)


def test_residual_graph_small_matches_brute_force() -> None:
    # Same construction, tiny strategy counts, so exhaustive search is possible.
    graph = _residual_training_graph(7, seed=5)
    small = CostGraph(
        tuple(c[:2] for c in graph.node_costs),
        tuple((u, v, m[:2, :2]) for u, v, m in graph.edges),
    )
    assert math.isclose(solve(small).cost, solve(small, "brute_force").cost, rel_tol=1e-9)


# ------------------------------------------------------------------- errors


def test_infeasible_graph_raises() -> None:
    inf = math.inf
    graph = CostGraph(
        (np.array([0.0, 1.0]), np.array([0.0, 1.0])),
        ((0, 1, np.array([[inf, 0.0], [inf, inf]])), (1, 0, np.array([[inf, inf], [inf, inf]]))),
    )
    for algorithm in ("dynamic_programming", "brute_force"):
        with pytest.raises(InfeasibleError, match="infinite"):
            solve(graph, algorithm)
    with pytest.raises(InfeasibleError):
        solve(CostGraph((np.array([inf, inf]),), ()))
    with pytest.raises(InfeasibleError):
        solve(graph, prune=False)


def test_unknown_backend_lists_known_ones() -> None:
    graph = CostGraph((np.zeros(2),), ())
    with pytest.raises(ValueError, match="dynamic_programming") as info:
        solve(graph, "simulated_annealing")
    assert "brute_force" in str(info.value)
    assert {"dynamic_programming", "brute_force"} <= set(ALGORITHMS)


def test_malformed_graphs_rejected() -> None:
    with pytest.raises(ValueError, match="edge 0"):
        CostGraph((np.zeros(2), np.zeros(3)), ((0, 1, np.zeros((3, 2))),))
    with pytest.raises(ValueError, match="out of range"):
        CostGraph((np.zeros(2),), ((0, 1, np.zeros((2, 2))),))
    with pytest.raises(ValueError, match="NaN"):
        CostGraph((np.array([0.0, math.nan]),), ())
    with pytest.raises(ValueError, match="no strategies"):
        CostGraph((np.zeros(0),), ())
    with pytest.raises(ValueError, match="node_names"):
        CostGraph((np.zeros(1),), (), ("a", "b"))
    b = CostGraphBuilder()
    b.add_node([1.0, 2.0], "matmul")
    b.add_node([1.0], "relu")
    b.add_edge(0, 1, [[0.0, 1.0]])
    with pytest.raises(ValueError, match="matmul"):
        b.build()
    graph = CostGraph((np.zeros(2),), ())
    with pytest.raises(ValueError):
        graph.total_cost([0, 0])
    with pytest.raises(ValueError):
        graph.total_cost([2])


def test_with_node_costs_keeps_edges_and_checks_costs() -> None:
    graph = CostGraph((np.array([1.0, 2.0]), np.array([3.0])), ((0, 1, np.array([[0.0], [5.0]])),),
                      ("a", "b"))
    priced = graph.with_node_costs([np.array([4.0, 0.0]), np.array([1.0])])
    assert priced.edges is graph.edges and priced.node_names == ("a", "b")
    assert solve(priced).cost == solve(CostGraph(priced.node_costs, graph.edges)).cost == 5.0
    assert solve(graph).cost == 4.0  # the original is unchanged
    with pytest.raises(ValueError, match="shapes"):
        graph.with_node_costs([np.zeros(3), np.zeros(1)])
    with pytest.raises(ValueError, match="NaN"):
        graph.with_node_costs([np.array([0.0, math.nan]), np.zeros(1)])


def test_restricted_keeps_the_selected_strategies() -> None:
    graph = _random_small_graph(7, "dense")
    rng = np.random.default_rng(1)
    keep = []
    for c in graph.node_costs:
        mask = rng.random(c.shape[0]) < 0.6
        mask[int(rng.integers(c.shape[0]))] = True
        keep.append(mask)
    small = graph.restricted(keep)
    idx = [np.flatnonzero(k) for k in keep]
    for choice in itertools.product(*(range(len(i)) for i in idx)):
        assert small.total_cost(choice) == graph.total_cost([i[c] for i, c in zip(idx, choice)])
    with pytest.raises(ValueError, match="non-empty"):
        graph.restricted([np.zeros_like(k) for k in keep])


def test_too_large_suggests_recursive_programming() -> None:
    rng = np.random.default_rng(0)
    n, k = 10, 8
    graph = CostGraph(
        tuple(rng.uniform(0, 1, size=k) for _ in range(n)),
        tuple((i, j, rng.uniform(0, 1, size=(k, k))) for i in range(n) for j in range(i + 1, n)),
    )
    with pytest.raises(SearchTooLargeError, match="recursive_programming"):
        solve(graph, max_factor_size=1e5)
    with pytest.raises(ValueError, match="max_assignments"):
        solve(graph, "brute_force")


def test_input_arrays_are_not_modified() -> None:
    vec = np.array([1.0, 2.0])
    mat = np.array([[0.0, 1.0], [1.0, 0.0]])
    graph = CostGraph((vec, vec.copy()), ((0, 1, mat), (1, 0, mat)))
    solve(graph)
    assert vec.tolist() == [1.0, 2.0] and mat.tolist() == [[0.0, 1.0], [1.0, 0.0]]


# ------------------------------------------------------------ independence


def test_search_never_imports_jax() -> None:
    code = (
        "import sys, autopar_search; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'autopar')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_search_sources_import_only_allowed_modules() -> None:
    allowed = set(sys.stdlib_module_names) | {"numpy", "networkx", "__future__"}
    sources = sorted(SEARCH_DIR.glob("*.py"))
    assert sources
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative import inside the package
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in allowed, f"{path.name} imports {name}"
                assert top not in ("jax", "flax", "autopar"), f"{path.name} imports {name}"


def test_package_exports() -> None:
    for name in ("CostGraph", "CostGraphBuilder", "Solution", "InfeasibleError",
                 "SearchTooLargeError", "solve", "ALGORITHMS", "register_algorithm"):
        assert hasattr(search, name)


def test_every_package_folder_is_installed() -> None:
    """pyproject lists packages by hand (the search folder installs under another name), so a
    new folder must be added there; this catches one that was not."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "autopar").rglob("__init__.py")}
    assert set(config["packages"]) == folders | {"autopar_search"}
    assert config["package-dir"] == {"autopar_search": "search"}


@pytest.mark.parametrize("shape", [(3,), (4, 5), (8, 8, 8, 8, 8, 3), (3, 8, 8, 8, 8, 8, 8),
                                   (5, 7, 300)])
def test_minimising_over_a_variable_is_the_first_minimum_of_the_summed_table(shape):
    """Elimination's kernel (one strategy at a time, slab by slab, above a table size) gives
    the minimum over the first axis of the summed terms and the first strategy reaching it,
    as argmin of the whole table does: costs drawn from a few integers tie often."""
    from autopar_search.dynamic_programming import _min_first
    rng = np.random.default_rng(len(shape))
    # terms as elimination passes them: broadcastable, each over some of the axes
    masks = [(1,) * len(shape)] + [tuple(rng.integers(0, 2, len(shape))) for _ in range(4)]
    terms = [rng.integers(0, 4, [d if m or i == 0 else 1 for i, (d, m) in
                                 enumerate(zip(shape, mask))]).astype(float)
             for mask in masks]
    terms[1][(0,) * len(shape)] = np.inf
    joint = sum(np.broadcast_to(t, shape) for t in terms)
    best, arg = _min_first(terms, shape, np.uint8)
    np.testing.assert_array_equal(best, joint.min(axis=0))
    np.testing.assert_array_equal(arg, joint.argmin(axis=0))
