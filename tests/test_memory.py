"""Memory-aware planning: the estimate against XLA, budgets, sharded optimizer state, recompute.

The estimate-against-compiled checks hold for XLA's CPU compiler as jax 0.10.2 ships it (the
platform compiled here): its calibrated buffer model. The GPU model is checked against a
recorded GPU compile; platforms with no model get the conservative one, checked here only to
stay above the CPU compiler's figures."""
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import models
import numpy as np
import optax
import pytest
from helpers import (check_against_single_device, compile_as_users_do, copy_tree,
                     global_relative_error)
from jax.sharding import NamedSharding, PartitionSpec as P

import autopar
from autopar.cost.hardware import get_profile
from autopar.cost.hlo import compiled_memory_bytes
from autopar.cost.liveness import updated_in_place
from autopar.cost.memory import kept_bytes, parse_bytes
from autopar.mesh import mesh_shape
from autopar.planning.assemble import assemble
from autopar.planning.driver import Planning, plan_step
from autopar.planning.problem import make_units
from autopar.planning.solve import solve
from autopar.trace.analysis import roles
from autopar.trace.tracer import trace


def state_leaves(state) -> frozenset[int]:
    """The flat input indices of the state: what a train step donates (donate_argnums=0)."""
    return frozenset(range(len(jax.tree_util.tree_leaves(state))))


def compiled_bytes(step, state, batch) -> int:
    return compiled_memory_bytes(compile_as_users_do(step.lower(state, batch)))


def estimate_over_compiled(step, state, batch, mesh, search, annotations) -> float:
    """The plan's estimated peak memory over the compiled step's."""
    sharded = autopar.auto_parallel(step, donate_argnums=0, mesh=mesh, search=search,
                                    annotations=annotations)
    plan = sharded.plan(state, batch)
    return plan.cost["peak_memory_bytes"] / compiled_bytes(sharded, state, batch)


# Links slow against compute: unconstrained, the search keeps the state replicated, so a budget
# shows what memory alone makes it shard.
SLOW_LINKS = autopar.Hardware("slow-links", flops=1e12, memory_bandwidth=1e12,
                              link_bandwidth=1e9, link_latency=1e-4, memory_bytes=2**30)


def mlp():
    return models.mlp_setup(batch=64, features=128, hidden=512, out=128)


def gpt_4_layers():
    return models.gpt_setup(batch=32, seq=64, vocab=64, d_model=64, heads=4, layers=4)


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512 MB") == 512 * 10**6
    assert parse_bytes(1.5e9) == 1_500_000_000
    for bad in ("lots", "2 parsecs", -1):
        with pytest.raises(autopar.AutoparError, match="memory_limit"):
            parse_bytes(bad)


@pytest.mark.slow
@pytest.mark.parametrize("axes,donate", [({"data": 2, "model": 4}, 0), ({"data": 8}, 0),
                                         ({"data": 8}, ())])
def test_estimate_matches_compiled_memory(axes, donate):
    """With the state donated (as train steps do) and without: then XLA holds the old state
    and the new one, and so does the estimate."""
    step, state, batch = mlp()
    sharded = autopar.auto_parallel(step, donate_argnums=donate, mesh=autopar.make_mesh(axes))
    plan = sharded.plan(state, batch)
    ratio = plan.cost["peak_memory_bytes"] / compiled_bytes(sharded, state, batch)
    assert 0.85 <= ratio <= 1.15, ratio
    kinds = plan.memory["at_peak"]
    assert kinds["parameters"] > 0 and kinds["optimizer_state"] > 0
    assert sum(kinds.values()) == plan.memory["peak_bytes"] == plan.cost["peak_memory_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("search", ["sharding_propagation", "dynamic_programming"])
def test_estimate_matches_compiled_memory_of_transformers(search):
    """The GPT's estimate, from the propagation of its batch's sharding (1.24 of compiled
    before the scatter of the loss's gradient into its sum was seen) and from the search on a
    2x2x2 mesh (0.84 before the copies of donated weights)."""
    step, state, batch = models.gpt_setup(batch=16, seq=32, vocab=256, d_model=64, heads=4,
                                          layers=2)
    if search == "sharding_propagation":
        mesh, annotations = autopar.make_mesh({"data": 8}), {r"^batch/": P("data")}
    else:
        mesh, annotations = autopar.make_mesh({"data": 2, "model": 2, "inner": 2}), None
    ratio = estimate_over_compiled(step, state, batch, mesh, search, annotations)
    assert 0.85 <= ratio <= 1.15, ratio


@pytest.mark.slow
@pytest.mark.parametrize("search", ["sharding_propagation", "dynamic_programming"])
def test_estimate_follows_slices_and_layouts_of_mixture_of_experts(search):
    """The mixture of experts replicates its dispatch and combine tensors and reads them
    sliced: XLA slices each as soon as it is made and frees the whole (1.43 of compiled under
    propagation before that was seen), and gathers a slice back in the default layout for the
    backward pass's sum of products, a copy beside the gathered tensor (with the slices
    alone, the search's plan read 0.86)."""
    import architectures
    step, state, batch = architectures.moe_setup(batch=8, seq=16, experts=8, d_model=64)
    annotations = {r"^batch/": P("data")} if search == "sharding_propagation" else None
    ratio = estimate_over_compiled(step, state, batch, autopar.make_mesh({"data": 8}), search,
                                   annotations)
    assert 0.85 <= ratio <= 1.15, ratio


@pytest.mark.slow
def test_estimate_reuses_the_allocations_of_copied_weights():
    """The encoder-decoder's search plan on 2x4 copies 21 weights before updating them in
    place. XLA copies them first of all and puts other buffers, the copies of other weights
    among them, in their freed allocations until the updates; it also runs the steps that
    read only inputs first (the weights' transposes for the backward pass). Without both the
    estimate read 1.27 of the compiled memory."""
    import architectures
    step, state, batch = architectures.encdec_setup(batch=8, seq=16, d_model=64)
    ratio = estimate_over_compiled(step, state, batch, autopar.make_mesh({"data": 2, "model": 4}),
                                   "dynamic_programming", None)
    assert 0.85 <= ratio <= 1.15, ratio


@pytest.mark.slow
def test_estimate_of_a_convolution_net_split_by_channels():
    """The ResNet under Megatron-style annotations (kernels split by output channels): the
    weight gradients' convolutions read activations gathered and transposed, which XLA
    gathers and transposes as soon as the forward pass makes them and holds until then.
    Without that the estimate read 0.81 of the compiled memory."""
    import architectures

    step, state, batch = architectures.resnet_setup(batch=16, size=16, channels=(32, 64))
    axes = {"data": 8}
    # every input pinned: a block's first and middle convolutions split by output channels,
    # its last by input channels (and their Adam moments alike), the rest replicated
    annotations = [(r"conv_(in|mid)/kernel$", P(None, None, None, "data")),
                   (r"conv_(in|mid)/bias$", P("data")),
                   (r"conv_out/kernel$", P(None, None, "data", None)), (r".", P())]
    ratio = estimate_over_compiled(step, state, batch, autopar.make_mesh(axes),
                                   "dynamic_programming", annotations)
    assert 0.85 <= ratio <= 1.15, ratio


def test_buffers_go_into_freed_allocations_largest_first_after_the_copy():
    """Two donated inputs of 64 bytes, copied at times 0 and 1 and free from the time after
    their copy to 10: the first copy fits no allocation freed before it; the second goes into
    the first input's; a small buffer then into the second's, the first being taken then."""
    from autopar.cost.xla.cpu import placed_in_donated
    buffers = [(0, 8, 64), (1, 9, 64), (3, 4, 16), (2, 11, 8)]  # the last outlives both
    assert placed_in_donated(buffers, [(64, 1, 10), (64, 2, 10)]) == {1, 2}


@pytest.mark.parametrize("lhs, rhs, contracting, transposed", [
    ((8, 16, 64), (256, 64), ((2,), (1,)), []),  # a dense layer's input gradient
    ((8, 16, 4, 16), (64, 4, 16), ((2, 3), (1, 2)), [1]),  # an attention projection's
    ((8, 16, 64), (8, 16, 256), ((0, 1), (0, 1)), [0]),  # a dense layer's weight gradient
])
def test_dot_operands_are_transposed_where_xla_transposes_them(lhs, rhs, contracting,
                                                               transposed):
    """XLA's dot decomposition copies an operand it must reorder in a loop fusion of its own;
    a matrix it reads transposed needs none (the dense layers' weights were counted twice)."""
    import re

    from jax import lax

    from autopar.cost.xla.cpu import dot_transposes
    dot = jax.jit(lambda x, w: lax.dot_general(x, w, (contracting, ((), ()))))
    text = compile_as_users_do(dot.lower(np.zeros(lhs, np.float32),
                                         np.zeros(rhs, np.float32))).as_text()
    copies = len(re.findall(r"fusion\(.*kind=kLoop", text[text.index("ENTRY"):]))
    assert dot_transposes((contracting, ((), ())), [lhs, rhs]) == transposed
    assert copies == len(transposed), text


def test_donated_state_is_copied_where_its_update_may_run_before_its_readers():
    """XLA updates donated state in place. Where a reader of a weight's old value (the
    backward pass's dot for the input gradient) is not ordered before the update by data
    dependence, it copies the weight first: the estimate names the same weights."""
    import re

    from autopar.cost.hardware import get_profile
    from autopar.cost.memory import all_reduce_steps
    from autopar.cost.xla.cpu import all_reduce_groups, copied_before_update
    step, state, batch = mlp()
    axes = {"data": 8}
    planned = plan_step(step, (state, batch), mesh_shape(axes),
                        get_profile(None), "dynamic_programming",
                        donated=state_leaves(state))
    graph, decisions, plan = planned.planning.graph, planned.decisions, planned.plan
    aliased = updated_in_place(graph, decisions.tensor_specs(graph))
    groups = all_reduce_groups(graph, all_reduce_steps(graph, decisions, mesh_shape(axes)))
    predicted = {graph.inputs.index(t) for t in copied_before_update(graph, aliased, groups)}
    sharded = autopar.auto_parallel(step, donate_argnums=0, mesh=autopar.make_mesh(axes), plan=plan)
    text = compile_as_users_do(sharded.lower(state, batch)).as_text()
    entry = text[text.index("ENTRY"):]
    argument = dict(re.findall(r"(%param[.\d]*) = \S+ parameter\((\d+)\)", entry))
    copied = {int(argument[p]) for p in re.findall(r"= \S+ copy\((%param[.\d]*)\)", entry)}
    assert copied and predicted == copied, (predicted, copied)


def _resnet_estimate_over_compiled() -> float:
    import architectures
    step, state, batch = architectures.resnet_setup(batch=16, size=16, channels=(32, 64))
    sharded = autopar.auto_parallel(step, donate_argnums=0, mesh=autopar.make_mesh({"data": 8}))
    plan = sharded.plan(state, batch)
    return plan.cost["peak_memory_bytes"] / compiled_bytes(sharded, state, batch)


@pytest.mark.slow
def test_estimate_counts_the_transposes_of_weight_gradient_convolutions():
    """XLA transposes the operands of the backward pass's convolutions into buffers of their
    own: without them the ResNet's estimate was 0.78 of the compiled memory."""
    ratio = _resnet_estimate_over_compiled()
    assert 0.85 <= ratio, ratio


@pytest.mark.slow
@pytest.mark.xfail(jax.__version_info__ < (0, 11), strict=True,
                   reason="known gap: jax 0.10's XLA CPU reuses buffers the walk holds apart "
                   "(226 KB here); jax 0.11.2's compiles this ResNet within 15% of the walk")
def test_estimate_of_the_resnets_data_parallel_plan_is_within_15_percent():
    """The same ResNet's plan, since ties go to the leaner plan (the image batch split, as in
    data parallelism), reads 1.1504 of XLA's figure, 226 KB over, as the plan keeping the
    batch whole did (1.146 of a larger figure). The over-read: at XLA's peak, a naive
    liveness of the scheduled HLO's instructions gives 1.17 MB of temporaries and the walk
    1.18 MB, where XLA allocates 0.95 MB: it shares buffers between values of that liveness
    (likely a fusion's result written into an operand that dies there). When the walk models
    that reuse, this passes and the mark goes."""
    assert _resnet_estimate_over_compiled() <= 1.15


@pytest.mark.parametrize("reader", ["dot", "elementwise"])
def test_resharding_buffers_follow_the_collectives(reader):
    """The buffers of a resharding, against XLA's temporaries for a step that reshards a
    tensor for one reader: the collectives' results; a copy into the result's layout where a
    dimension other than the major one is gathered or an all-to-all's pieces arrive, unless
    a loop fusion reads it; an all-to-all's pieces sent."""
    import jax.numpy as jnp

    from autopar.cost.xla.cpu import reshard_buffers
    from autopar.rules.factors import from_partition_spec
    from autopar.trace.ir import Tensor
    axes = {"data": 4, "model": 2}
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), tuple(axes))
    if reader == "dot":  # the contracted dimension stays whole, so the dot needs no more
        cases = [(("data", None), (None, None)), ((None, "data"), (None, None)),
                 (("data", "model"), (None, None)), (("data", "model"), ("data", None)),
                 ((None, ("data", "model")), (None, None)), ((None, "data"), ("data", None))]
    else:  # only where the gather does not run after the elementwise reader instead
        cases = [((None, "data"), (None, None)), (("data", "model"), ("data", None)),
                 ((None, ("data", "model")), (None, "data")), (("data", None), (None, "data")),
                 ((None, "data"), ("data", None))]
    for src, dst in cases:
        to = NamedSharding(mesh, P(*dst))
        if reader == "dot":
            def step(x, w):
                return jax.lax.with_sharding_constraint(x * 2, to) @ w
        else:
            def step(x, w):
                return jnp.exp(jax.lax.with_sharding_constraint(x * 2, to)) + w[0, 0]
        compiled = compile_as_users_do(jax.jit(step, in_shardings=(
            NamedSharding(mesh, P(*src)), NamedSharding(mesh, P()))).lower(
            jax.ShapeDtypeStruct((1024, 1024), "float32"),
            jax.ShapeDtypeStruct((1024, 4), "float32")))
        temp = compiled.memory_analysis().temp_size_in_bytes
        made, result = reshard_buffers(Tensor(0, (1024, 1024), "float32"),
                                        from_partition_spec(P(*src), 2),
                                        from_partition_spec(P(*dst), 2), mesh_shape(axes),
                                        into_fusion=reader == "elementwise")
        assert abs(made + result - temp) <= 0.05 * temp, (src, dst, made, result, temp)


@pytest.mark.slow
def test_a_plan_near_the_limit_is_planned_again_where_xla_needs_more(monkeypatch):
    """The memory benchmark's GPT at half its unconstrained (data-parallel) peak: a plan whose
    estimate is near the limit is compiled, and where XLA needs more than the limit the step
    is planned again for a smaller estimate until it fits once compiled, and trains as on one
    device.
    Allowed no second plan, it says why not. The estimate reads over XLA's figure on this
    model now (under it before: the first plan compiled over the limit), so XLA's figure is
    reported a fifth higher than it is."""
    from autopar import fitting
    monkeypatch.setattr(fitting, "compiled_memory_bytes",
                        lambda c: int(1.2 * compiled_memory_bytes(c)))
    step, state, batch = gpt_4_layers()
    mesh = autopar.make_mesh({"data": 8})
    free = autopar.plan(step, state, batch, donate_argnums=0, mesh=mesh, hardware=SLOW_LINKS,
                        memory_limit="1TiB")
    limit = int(0.5 * free.cost["peak_memory_bytes"])
    plan = check_against_single_device(step, state, batch, mesh, donate_argnums=0,
                                       hardware=SLOW_LINKS, memory_limit=limit)
    assert plan.search_stats["compile_checks"] >= 2
    assert plan.cost["peak_memory_bytes"] <= limit and plan.memory["compiled_bytes"] <= limit
    assert "compiled by XLA" in plan.summary()
    # the compiles that checked it are a stage of its planning, timed with the others
    spent = plan.search_stats.planning_seconds
    assert spent["compile checks"] > 0 and spent["searching"] > 0 and spent["tracing"] > 0
    assert sum(s for stage, s in spent.items() if stage != "total") <= spent["total"]
    monkeypatch.setattr(fitting, "COMPILE_CHECKS", 0)
    with pytest.raises(autopar.AutoparError, match="compiles to .* over memory_limit"):
        autopar.auto_parallel(step, donate_argnums=0, mesh=mesh, hardware=SLOW_LINKS,
                              memory_limit=limit).plan(state, batch)


@pytest.mark.slow
def test_state_four_times_the_budget_fits_and_trains():
    step, state, batch = mlp()
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    limit = state_bytes // 4
    mesh = autopar.make_mesh({"data": 8})
    free = autopar.plan(step, state, batch, donate_argnums=0, mesh=mesh, hardware=SLOW_LINKS,
                        memory_limit=10 * state_bytes)
    assert free.cost["peak_memory_bytes"] > limit, "the test needs a budget that binds"
    plan = check_against_single_device(step, state, batch, mesh, donate_argnums=0, hardware=SLOW_LINKS,
                                       memory_limit=limit)
    assert plan.cost["peak_memory_bytes"] <= limit
    assert plan.memory["limit_bytes"] == limit and plan.search_stats["memory_solves"] > 1
    assert plan.search_stats["memory_search_s"] > plan.search_stats["search_s"]
    # the budget's answer, kept, is proven (stepper.py puts the proof off until it is kept)
    assert plan.search_stats["exact"] and "kept_budget_bytes" in plan.search_stats
    sharded = autopar.auto_parallel(step, donate_argnums=0, mesh=mesh, plan=plan)
    assert compiled_bytes(sharded, state, batch) <= limit
    # the search sharded the optimizer state along the data axis (ZeRO)
    opt = [t for t in plan.inputs if "/mu/" in t.path and "kernel" in t.path]
    assert opt and all(any(t.spec) for t in opt)


def test_budgeted_dp_is_proven_and_no_slower_than_prices_alone():
    """Under a budget, dynamic_programming proves its plan the fastest of those keeping at most
    the kept-bytes cap it reports; prices alone find no faster fitting plan."""
    step, state, batch = mlp()
    state_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
    shape, limit = mesh_shape({"data": 8}), state_bytes // 4
    planned = plan_step(step, (state, batch), shape, SLOW_LINKS,
                        "dynamic_programming", memory_limit=limit,
                        donated=state_leaves(state))
    graph, decisions, plan = planned.planning.graph, planned.decisions, planned.plan
    stats = plan.search_stats
    assert stats["exact"] and stats["gap"] == 0 and plan.cost["peak_memory_bytes"] <= limit
    assert stats["parts"] > 1, "the budget should need branching beyond the prices' hull"
    # the search's additive model is the plan's kept bytes, and the cap holds
    assert stats["kept_bytes"] == kept_bytes(graph, decisions, shape) <= stats["kept_budget_bytes"]
    planning = Planning.traced(step, (state, batch), SLOW_LINKS, "dynamic_programming",
                               donated=state_leaves(state))
    planning.prove = False
    priced = planning.plan(shape, limit).plan
    assert not priced.search_stats["exact"]
    assert plan.cost["total_s"] <= priced.cost["total_s"] * (1 + 1e-12)


def test_generous_budget_gives_the_unconstrained_optimum():
    step, state, batch = mlp()
    mesh = {"data": 2, "model": 4}
    free = autopar.plan(step, state, batch, donate_argnums=0, mesh=mesh, memory_limit="1TiB")
    assert "memory_price_s_per_byte" not in free.search_stats
    default = autopar.plan(step, state, batch, donate_argnums=0, mesh=mesh)  # the profile's 4 GiB: fits too
    assert free.specs == default.specs and free.cost["total_s"] == default.cost["total_s"]


def test_impossible_budget_names_the_least_memory_and_its_consumers():
    step, state, batch = mlp()
    with pytest.raises(autopar.AutoparError) as err:
        autopar.plan(step, state, batch, donate_argnums=0, mesh={"data": 8}, memory_limit="64KiB")
    text = str(err.value)
    assert "no plan fits memory_limit=0.06 MiB" in text and "{'data': 8}" in text
    assert "needs" in text and "Largest buffers" in text and "state/" in text
    assert "Fix: allow at least" in text


def gpt():
    return models.gpt_setup(batch=32, seq=32, vocab=64, d_model=32, heads=4, layers=2)


@pytest.mark.slow
def test_recompute_when_sharding_is_not_enough():
    step, state, batch = gpt()
    mesh = autopar.make_mesh({"data": 8})
    shape = autopar.mesh.mesh_shape(mesh)
    graph = trace(step, (state, batch))[0]
    # the plan with memory priced far above time; the budget search's own bisection finds
    # sharding-only plans down to about 0.7 of its peak (vocabulary-split lookups and loss),
    # so 0.6 of it is below what sharding alone reaches
    solved = solve(graph, shape, SLOW_LINKS, "dynamic_programming", None, 1.0)
    leanest = assemble(graph, solved.decisions, shape, SLOW_LINKS, "dp", solved.stats)
    limit = int(0.6 * leanest.cost["peak_memory_bytes"])
    plan = check_against_single_device(step, state, batch, mesh, steps=2, donate_argnums=0,
                                       hardware=SLOW_LINKS,
                                       memory_limit=limit)
    assert plan.recompute and plan.cost["recompute_s"] > 0
    assert all(layer.startswith("GPT/") for layer in plan.recompute)
    assert plan.cost["peak_memory_bytes"] <= limit
    assert plan.memory.get("compiled_bytes", 0) <= limit
    # the estimate against XLA for the plan made for this limit, before any compiled check
    first = autopar.plan(step, state, batch, donate_argnums=0, mesh=mesh, hardware=SLOW_LINKS, memory_limit=limit)
    assert first.recompute
    compiled = compiled_bytes(autopar.auto_parallel(step, donate_argnums=0, mesh=mesh, plan=first), state, batch)
    assert compiled < leanest.cost["peak_memory_bytes"]
    assert 0.85 <= first.cost["peak_memory_bytes"] / compiled <= 1.15


@pytest.mark.slow
def test_recomputed_layers_lower_compiled_memory_and_keep_numerics():
    step, state, batch = gpt()
    mesh = autopar.make_mesh({"data": 8})
    full = autopar.plan(step, state, batch, donate_argnums=0, mesh=mesh, hardware=SLOW_LINKS,
                        memory_limit="1TiB")
    layers = ("GPT/block_0", "GPT/block_1")
    saved = json.loads(full.to_json())
    saved["recompute"] = list(layers)
    again = autopar.Plan.from_json(json.dumps(saved))
    plain = autopar.auto_parallel(step, donate_argnums=0, mesh=mesh, plan=full)
    remat = autopar.auto_parallel(step, donate_argnums=0, mesh=mesh, plan=again)
    assert remat.plan(state, batch).recompute == layers
    assert remat.plan(state, batch).cost["recompute_s"] > 0
    before, after = compiled_bytes(plain, state, batch), compiled_bytes(remat, state, batch)
    assert after < 0.8 * before, (before, after)
    predicted = remat.plan(state, batch).cost["peak_memory_bytes"]
    assert predicted < full.cost["peak_memory_bytes"]
    ref_state, ref_loss = jax.jit(step)(copy_tree(state), batch)
    new_state, loss = remat(copy_tree(state), batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    # as in every single-device comparison: the key bias has a zero gradient in exact
    # arithmetic, so adam turns rounding noise into updates there; compare the whole state
    assert global_relative_error(ref_state, new_state) < 1e-4


def test_plan_json_keeps_memory_and_recompute():
    step, state, batch = mlp()
    plan = autopar.plan(step, state, batch, donate_argnums=0, mesh={"data": 8}, memory_limit="1GiB")
    again = autopar.Plan.from_json(plan.to_json())
    assert again.memory == plan.memory and again.memory["limit_bytes"] == 2**30
    assert "memory at its peak of 1024.0 MiB allowed" in plan.summary()


@pytest.mark.slow
@pytest.mark.parametrize("search", ["dynamic_programming", "recursive_programming"])
def test_problems_kept_across_prices_search_as_fresh_ones(search):
    """The budget searches one graph at many prices and keeps the problems it built, unpriced;
    each search must find what a search of freshly built problems finds."""
    step, state, batch = gpt()
    graph = trace(step, (state, batch))[0]
    shape = autopar.mesh.mesh_shape({"data": 2, "model": 4})
    units, kept = make_units(graph), {}
    for price in (0.0, 1e-9, 1e-7, 1e-9):
        reused = solve(graph, shape, SLOW_LINKS, search, None, price, units, kept).decisions
        fresh = solve(graph, shape, SLOW_LINKS, search, None, price).decisions
        assert reused.ops == fresh.ops and reused.inputs == fresh.inputs
    assert kept  # the problems were kept, not built again


@pytest.mark.parametrize("anchor", [np.inf, -np.inf, np.nan, 3.0])
def test_recompute_ordering_adds_an_exact_zero_whatever_the_anchor(anchor):
    """The recomputation waits for a backward value through arithmetic that is zero for every
    float: an infinite (or NaN) anchor leaves the value unchanged, compiled as XLA runs it."""
    from autopar.lower import after_anchor

    value = jnp.arange(4.0)
    got = jax.jit(after_anchor)(value, jnp.array([anchor, 1.0], jnp.float32))
    np.testing.assert_array_equal(np.asarray(got), np.arange(4.0))


@pytest.mark.slow
@pytest.mark.parametrize("setup", ["mlp", "gpt"])
def test_conservative_buffer_model_is_above_xla_cpu(setup):
    """The buffer model of platforms without a calibrated one assumes no fusion and no reuse:
    on the one platform compiled here (XLA CPU) it estimates no less than the compiled step
    needs, and no less than the calibrated CPU model."""
    from autopar.cost.memory import plan_memory
    from autopar.cost.xla import CONSERVATIVE, CPU
    step, state, batch = mlp() if setup == "mlp" else gpt_4_layers()
    axes = {"data": 2, "model": 4}
    planned = plan_step(step, (state, batch), mesh_shape(axes),
                        get_profile(None), "dynamic_programming",
                        donated=state_leaves(state))
    graph, decisions, plan = planned.planning.graph, planned.decisions, planned.plan
    sharded = autopar.auto_parallel(step, donate_argnums=0, mesh=autopar.make_mesh(axes),
                                    plan=plan)
    compiled = compiled_bytes(sharded, state, batch)
    conservative = plan_memory(graph, decisions, mesh_shape(axes), CONSERVATIVE).peak_bytes
    calibrated = plan_memory(graph, decisions, mesh_shape(axes), CPU).peak_bytes
    assert conservative >= compiled and conservative >= calibrated, (conservative, compiled)


def test_buffer_model_follows_the_compiler_platform():
    """A plan for devices at hand estimates memory as their compiler buffers it; a plan on an
    abstract mesh, as the hardware profile's platform does."""
    step, state, batch = mlp()
    on_devices = autopar.plan(step, state, batch, mesh=autopar.make_mesh({"data": 8}),
                              hardware="h100")
    assert on_devices.memory["buffer_model"] == "xla-cpu"
    for hardware, model in (("h100", "xla-gpu"), ("tpu_v5p", "xla-tpu")):
        abstract = autopar.plan(step, state, batch, mesh={"data": 8}, hardware=hardware)
        assert abstract.memory["buffer_model"] == model
        assert autopar.Plan.from_json(abstract.to_json()).memory == abstract.memory


def test_a_saved_plan_is_estimated_with_its_compilers_buffer_model(monkeypatch):
    """A saved plan applied to a step is estimated as the compiler that builds it buffers
    (here made to look like one autopar has no model of): its decisions are kept."""
    from autopar import stepper
    step, state, batch = mlp()
    mesh = autopar.make_mesh({"data": 8})
    saved = autopar.plan(step, state, batch, mesh=mesh)
    assert saved.memory["buffer_model"] == "xla-cpu"
    monkeypatch.setattr(stepper, "compiler_platform", lambda mesh, hw: "rocm")
    applied = autopar.auto_parallel(step, mesh=mesh, plan=saved).plan(state, batch)
    assert applied.memory["buffer_model"] == "conservative"
    assert applied.specs == saved.specs
    assert applied.cost["peak_memory_bytes"] >= saved.cost["peak_memory_bytes"]


@pytest.mark.slow
def test_uncalibrated_platform_compiles_to_check_a_binding_budget(monkeypatch):
    """Where the platform's buffer model is the conservative one, a budget that binds is
    checked by compiling: the plan made without it is kept where XLA fits it in the limit,
    whatever the conservative estimate says, and the step trains as on one device."""
    from autopar import stepper
    monkeypatch.setattr(stepper, "compiler_platform", lambda mesh, hw: "rocm")
    step, state, batch = mlp()
    mesh = autopar.make_mesh({"data": 8})
    free = autopar.auto_parallel(step, donate_argnums=0, mesh=mesh, hardware=SLOW_LINKS,
                                 memory_limit="1TiB")
    free_plan = free.plan(state, batch)
    assert free_plan.memory["buffer_model"] == "conservative"
    needed = compiled_bytes(free, state, batch)
    assert free_plan.cost["peak_memory_bytes"] > needed, "the estimate should be above XLA's"
    limit = (needed + free_plan.cost["peak_memory_bytes"]) // 2  # binds, yet the plan fits
    plan = check_against_single_device(step, state, batch, mesh, donate_argnums=0,
                                       hardware=SLOW_LINKS, memory_limit=limit)
    assert plan.search_stats["compile_checks"] == 1
    assert plan.memory["compiled_bytes"] <= limit < plan.cost["peak_memory_bytes"]
    assert plan.inputs == free_plan.inputs


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(x.shape[-1])(jnp.tanh(nn.Dense(x.shape[-1])(x))), None


class _ScannedStack(nn.Module):
    """nn.scan over nn.remat blocks: the forward loop stacks each block's input for the
    backward loop, which recomputes the block from it."""

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(nn.remat(_Block), variable_axes={"params": 0},
                        split_rngs={"params": True}, length=4)
        return nn.Dense(8)(stack(name="layers")(x, None)[0])


def scanned_stack(batch: int = 64, width: int = 32):
    model, tx = _ScannedStack(), optax.sgd(1e-2)
    x = jax.random.normal(jax.random.PRNGKey(0), (batch, width))
    y = jax.random.normal(jax.random.PRNGKey(1), (batch, 8))
    params = model.init(jax.random.PRNGKey(2), x)
    return models.linen_step(model, models.mse, tx), (params, tx.init(params)), {
        "inputs": x, "targets": y}


def test_a_loops_stacked_residuals_and_weight_gradients_are_kept_bytes():
    """The backward loop reads the forward loop's stacked residuals (its slices), and stacks
    the layers' weight gradients: both are what the step keeps, and the memory price charges
    them. The loop's own ops were once outside either pass, and a memory-limited Llama-2-7B
    on 32 x 2 TPU v5p chips kept its 2 GiB of residuals whole on the model axis."""
    step, state, batch = scanned_stack()
    graph = trace(step, (state, batch))[0]
    kind = roles(graph)
    stacks = [op for op in graph.ops if op.primitive == "scan_stack"]
    residuals = [op.outputs[0] for op in stacks if not op.backward]
    gradients = [op.outputs[0] for op in stacks if op.backward]
    assert [graph.tensors[t].shape for t in residuals] == [(4, 64, 32)]
    assert [kind.get(t) for t in residuals] == ["activations"]
    assert sorted(graph.tensors[t].shape for t in gradients if kind.get(t) == "gradients") == [
        (4, 32), (4, 32), (4, 32, 32), (4, 32, 32)]
    # priced far above time, the plan splits the residuals over all 8 devices
    shape = mesh_shape({"data": 2, "model": 4})
    decisions = solve(graph, shape, SLOW_LINKS, "dynamic_programming", None, 1.0).decisions
    spec = decisions.tensor_specs(graph)[residuals[0]]
    assert sorted(a for axes in spec for a in axes) == ["data", "model"], spec


@pytest.mark.slow
def test_a_loops_residuals_split_to_fit_train_equal_to_one_device():
    """A scanned stack planned within half of what its plan made without a limit compiles to
    trains as on one device, and compiles within the limit."""
    step, state, batch = scanned_stack(batch=1024, width=64)
    mesh = autopar.make_mesh({"data": 2, "model": 4})
    free = autopar.auto_parallel(step, donate_argnums=0, mesh=mesh, hardware=SLOW_LINKS)
    limit = compiled_bytes(free, state, batch) // 2
    plan = check_against_single_device(step, state, batch, mesh, steps=2, donate_argnums=0,
                                       hardware=SLOW_LINKS, memory_limit=limit)
    assert plan.cost["peak_memory_bytes"] <= limit
    lean = autopar.auto_parallel(step, donate_argnums=0, mesh=mesh, plan=plan)
    assert compiled_bytes(lean, state, batch) <= limit


@pytest.mark.slow
def test_the_gpu_model_against_a_recorded_gpu_compile():
    """XLA GPU's compiled peak of the scanned d_model-1024 GPT's step on an eighth of its batch
    (jax 0.11.2 on an H200, recorded in benchmarks/results/device.json) against the GPU
    buffer model's estimate of the same step on one GPU: within 10% (the conservative model
    read 1.10x of it, the TPU compiler's fusion rules 0.955x)."""
    import os

    from benchmarks.device import share
    from benchmarks.zoo import REALISTIC
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "device.json")
    with open(path) as f:
        row = next(r for r in json.load(f)["device"]
                   if r["model"] == "gpt-1024-scan" and r["batch_share"] == "1/8")
    step, state, batch = REALISTIC["gpt-1024-scan"].setup()
    plan = autopar.plan(step, state, share(batch, 8), mesh={"data": 1}, hardware="h100",
                        donate_argnums=0)
    assert plan.memory["buffer_model"] == "xla-gpu"
    assert 0.9 <= plan.cost["peak_memory_bytes"] / row["chip_memory_bytes"] <= 1.1
