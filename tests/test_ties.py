"""Ties of repeated layers: what they join, what they leave reachable, and what the search
then claims to be exact for."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from helpers import check_against_single_device

import autopar
from autopar.cost.hardware import get_profile
from autopar.cost.hlo import collective_counts
from autopar.mesh import mesh_shape
from autopar.planning import problem as problem_module
from autopar.planning import solve
from autopar.planning.problem import build_problem, make_units
from autopar.trace.layers import TIED_SPACE, instance_classes
from autopar.trace.tracer import trace

COLUMN, ROW = ((), ("model",)), (("model",), ())  # a (in, out) kernel split on out, on in
WIDTH = 1024  # weights large against the batch of 8: splitting them beats splitting the batch


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    return x @ w


def sgd_pair_step(state, batch):
    """Two square layers through one helper inside a numbered scope: the two products look
    alike (primitive, scope up to numbers, source line and column, shapes) but are different
    operators, and the two weights are paths equal up to numbers (state/0, state/1)."""
    def loss(ws):
        with jax.named_scope("mlp_0"):
            h = jnp.tanh(dense(batch["x"], ws[0]))
            return jnp.mean((dense(h, ws[1]) - batch["y"]) ** 2)
    value, grads = jax.value_and_grad(loss)(state)
    return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, state, grads), value


def pair_inputs():
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    state = (jax.random.normal(k1, (WIDTH, WIDTH)) / WIDTH ** 0.5,
             jax.random.normal(k2, (WIDTH, WIDTH)) / WIDTH ** 0.5)
    batch = {"x": jax.random.normal(k3, (8, WIDTH)), "y": jax.random.normal(k4, (8, WIDTH))}
    return state, batch


class Stack(nn.Module):
    """Six equal Dense layers: one source line, one shape, scopes Stack/Dense_0..Dense_5."""

    layers: int = 6

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.layers):
            x = nn.Dense(WIDTH, use_bias=False)(x)
            if i < self.layers - 1:
                x = jnp.tanh(x)
        return x


def stack_setup(layers: int = 6):
    model = Stack(layers)
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
    x, y = jax.random.normal(k1, (8, WIDTH)), jax.random.normal(k2, (8, WIDTH))
    params = model.init(k3, x)
    tx = optax.adam(1e-3)
    return (models.linen_step(model, models.mse, tx), (params, tx.init(params)),
            {"inputs": x, "targets": y})


def plain_stack_step(state, batch):
    """The stack in plain jax: weights in a list, one product line for all of them."""
    def loss(ws):
        x = batch["inputs"]
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean((x - batch["targets"]) ** 2)
    value, grads = jax.value_and_grad(loss)(state)
    return [w - 0.1 * g for w, g in zip(state, grads)], value


def kernels(plan, prefix: str = "state/0/params/") -> list:
    """The specs of the stack's kernels, in layer order."""
    found = {t.path: t.spec for t in plan.inputs if t.path.startswith(prefix)}
    return [found[p] for p in sorted(found, key=lambda p: int(p.split("_")[-1].split("/")[0]))]


def forward_products(units: list) -> list[int]:
    return [u for u, unit in enumerate(units)
            if unit.op is not None and unit.op.primitive == "dot_general"
            and not unit.op.backward]


def test_products_on_one_line_do_not_tie():
    state, batch = pair_inputs()
    graph, _, _ = trace(sgd_pair_step, (state, batch))
    units = make_units(graph)
    first, second = forward_products(units)
    assert units[first].op.source == units[second].op.source
    assert units[first].op.scope == units[second].op.scope == "mlp_0"
    assert units[second].tie is None and units[first].tie is None
    # nor do the two weights (state/0 and state/1: one shape, paths equal up to numbers)
    assert all(unit.tie is None for unit in units if unit.op is None)


def test_ranks_are_numeric_and_per_number():
    blocks = instance_classes({f"GPT/block_{i}" for i in range(11)})
    # numerically block_2 is even and block_10 even; as text block_10 would sort third
    assert blocks["GPT/block_2"] == blocks["GPT/block_10"] == blocks["GPT/block_0"] == (0,)
    assert blocks["GPT/block_9"] == blocks["GPT/block_1"] == (1,)
    nested = instance_classes({f"b_{i}/ln_{j}" for i in range(4) for j in range(2)})
    assert nested["b_0/ln_0"] == nested["b_2/ln_0"] != nested["b_1/ln_0"]
    assert nested["b_0/ln_0"] != nested["b_0/ln_1"]


def test_instances_two_apart_tie_and_parameters_rank_like_their_layer():
    step, state, batch = stack_setup()
    graph, _, _ = trace(step, (state, batch))
    units = make_units(graph)
    by_name = {graph.tensors[unit.outputs[0]].path: u for u, unit in enumerate(units)
               if unit.op is None}
    for copy in ("state/0/params", "state/1/0/mu/params", "state/1/0/nu/params"):
        kernel = [by_name[f"{copy}/Dense_{i}/kernel"] for i in range(6)]
        assert units[kernel[0]].tie is None and units[kernel[1]].tie is None
        assert [units[k].tie for k in kernel[2:]] == [kernel[0], kernel[1]] * 2
    products = forward_products(units)
    assert [units[u].op.scope for u in products] == [f"Stack/Dense_{i}" for i in range(6)]
    assert [units[u].tie for u in products] == [None, None] + [products[0], products[1]] * 2
    # a backward product ties to the same product of a layer an even distance away (the
    # backward pass meets the layers in reverse: the first odd one it sees is Dense_5)
    backward = [u for u, unit in enumerate(units) if unit.op is not None
                and unit.op.primitive == "dot_general" and unit.op.backward]
    for u in backward:
        if units[u].tie is not None:
            here, there = units[u].op.scope, units[units[u].tie].op.scope
            distance = int(here[-1]) - int(there[-1])
            assert distance != 0 and distance % 2 == 0, (here, there)


def test_two_layer_mlp_gets_column_then_row_with_one_all_reduce():
    state, batch = pair_inputs()
    plan = autopar.plan(sgd_pair_step, state, batch, mesh={"model": 8})
    specs = {t.path: t.spec for t in plan.inputs}
    assert specs["state/0"] == COLUMN and specs["state/1"] == ROW, specs
    mesh = autopar.make_mesh({"model": 8})
    check_against_single_device(sgd_pair_step, state, batch, mesh)
    stepper = autopar.auto_parallel(sgd_pair_step, mesh=mesh)
    text = stepper.lower(state, batch).compile().as_text()
    counts = collective_counts(text)
    # the pair's partial sums after the second product: the whole step's one collective
    # (the gradients of column- and row-split weights need none)
    assert counts.get("all-reduce", 0) == 1 and sum(counts.values()) == 1, counts


@pytest.mark.slow
def test_six_layer_stack_alternates_column_and_row():
    step, state, batch = stack_setup()
    plan = check_against_single_device(step, state, batch, autopar.make_mesh({"model": 8}))
    specs = kernels(plan)
    assert specs in ([COLUMN, ROW] * 3, [ROW, COLUMN] * 3), specs
    assert plan.search_stats["exact"] and plan.search_stats["exact_for"] == "all plans"


def test_plain_stack_alternates_column_and_row():
    state = [jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)] * 6
    batch = {k: jax.ShapeDtypeStruct((8, WIDTH), jnp.float32) for k in ("inputs", "targets")}
    plan = autopar.plan(plain_stack_step, state, batch, mesh={"model": 8})
    specs = [t.spec for t in plan.inputs if t.path.startswith("state/")]
    assert specs in ([COLUMN, ROW] * 3, [ROW, COLUMN] * 3), specs


def test_exactness_is_stated_for_the_tied_plans(monkeypatch):
    """Searched with its ties (as a deep model is), the stack still alternates, and the stats
    say the optimum is over plans that repeat layers two apart, not over all plans."""
    monkeypatch.setattr(solve, "UNTIED_NODE_LIMIT", 0)
    step, state, batch = stack_setup()
    plan = autopar.plan(step, state, batch, mesh={"model": 8})
    stats = plan.search_stats
    assert stats["tied_units"] > 0
    assert not stats["exact"] and stats["exact_for"] == TIED_SPACE
    assert kernels(plan) in ([COLUMN, ROW] * 3, [ROW, COLUMN] * 3)
    # untied, the same step is proven over all plans, and the tied answer was that optimum
    monkeypatch.undo()
    untied = autopar.plan(step, state, batch, mesh={"model": 8}).search_stats
    assert untied["exact"] and untied["exact_for"] == "all plans" and untied["tied_units"] == 0
    assert stats["objective_s"] == pytest.approx(untied["objective_s"], rel=1e-9)


@pytest.mark.slow
def test_search_grows_with_distinct_layers_not_depth():
    """A second block is a layer of its own (it may take other strategies than the first);
    from there on the search no longer grows with depth."""
    hw = get_profile("cpu")
    nodes = []
    for layers in (1, 2, 6):
        step, state, batch = models.gpt_abstract(batch=8, seq=16, layers=layers)
        graph, _, _ = trace(step, (state, batch))
        nodes.append(len(build_problem(graph, mesh_shape({"data": 8}), hw).roots))
    assert nodes[0] < nodes[1] == nodes[2], nodes


def _priced(problem, graph, mesh) -> tuple[list, dict, list]:
    """A problem's node costs, its edges summed per pair of nodes, and its kept bytes."""
    edges: dict = {}
    for a, b, matrix in problem.graph.edges:
        edges[(a, b)] = edges.get((a, b), 0) + matrix
    return list(problem.graph.node_costs), edges, problem.kept(graph, mesh)


def test_a_stack_is_priced_a_few_layers_worth_and_as_unit_by_unit(monkeypatch):
    """A build prices once the units that are alike and take the same strategies from makers
    that do: a layer amid others (layer 3 of 6: its forward pass reads a layer like the one
    layer 1 reads, its backward pass one like layer 0's) costs nothing more to price, and the
    problem is the one priced unit by unit."""
    hw, mesh = get_profile("cpu"), mesh_shape({"data": 2, "model": 4})
    step, state, batch = models.gpt_abstract(batch=8, seq=16, layers=6)
    graph, _, _ = trace(step, (state, batch))
    problem = build_problem(graph, mesh, hw)
    middle = [u for u, unit in enumerate(problem.units)
              if unit.op is not None and unit.op.scope.startswith("GPT/block_3/")]
    assert middle and not any(problem.times[u] for u in middle)
    assert sum(1 for n in problem.times if n) < len(problem.units) / 2

    monkeypatch.setattr(problem_module, "repeats", lambda units, *_: [1] * len(units))
    one_by_one = build_problem(graph, mesh, hw)
    assert one_by_one.node_of == problem.node_of and max(one_by_one.times) == 1
    (costs, edges, kept), (costs1, edges1, kept1) = (_priced(p, graph, mesh)
                                                     for p in (problem, one_by_one))
    for mine, theirs in zip(costs + kept, costs1 + kept1):
        np.testing.assert_allclose(mine, theirs, rtol=1e-12)
    assert edges.keys() == edges1.keys()
    for pair, matrix in edges.items():
        np.testing.assert_allclose(matrix, edges1[pair], rtol=1e-12)
