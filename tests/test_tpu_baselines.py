"""The benchmark transformers (tpu_models) run for real on CPU, and the programs the experts
write for them (tpu_experts) compile for a TPU topology with the shardings their rules say.
"""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from benchmarks import tpu_experts, tpu_models
from benchmarks.tpu_moe import capacity, route

BATCH, SEQ = 8, 16


def tokens(seed: int = 0) -> dict[str, jax.Array]:
    data = jax.random.randint(jax.random.key(seed), (BATCH, SEQ + 1), 0, 256, jnp.int32)
    return {"inputs": data[:, :-1], "targets": data[:, 1:]}


def cpu_step(w: tpu_models.Workload, state, batch):
    """w.step compiled for CPU, at XLA's lowest backend optimization level (half the
    compile time; the tiny steps run in milliseconds anyway)."""
    return jax.jit(w.step).lower(state, batch).compile({"xla_backend_optimization_level": 0})


@pytest.fixture(scope="module")
def llama():
    # The learning rate is high enough for three steps to show progress.
    return tpu_models.llama("llama-tiny", BATCH, SEQ, learning_rate=1e-2)


@pytest.fixture(scope="module")
def mixtral():
    return tpu_models.mixtral("mixtral-tiny", BATCH, SEQ)


@pytest.fixture(scope="module")
def tpu():
    pytest.importorskip("libtpu")
    return tpu_experts.tpu_devices("v5e:2x4")


@pytest.mark.parametrize("name", ["llama-tiny", "mixtral-tiny", "vit-tiny"])
def test_constraints_vanish_without_rules(name):
    w = tpu_models.setup(name, BATCH, SEQ)
    assert "sharding_constraint" not in str(jax.make_jaxpr(w.step)(w.state, w.batch))
    # ... and are there under rules and a mesh: the check above is not vacuous.
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
    with jax.set_mesh(mesh), nn.logical_axis_rules(tpu_experts.mesh_rules(mesh.axis_names)):
        assert "sharding_constraint" in str(jax.make_jaxpr(w.step)(w.state, w.batch))


def test_logical_names_cover_every_leaf(mixtral):
    state_names, batch_names = mixtral.logical
    for names, tree in ((state_names, mixtral.state), (batch_names, mixtral.batch)):
        flat = jax.tree.leaves(names, is_leaf=tpu_models.is_names)
        leaves = jax.tree.leaves(tree)
        assert [len(n) for n in flat] == [leaf.ndim for leaf in leaves]
    params, (_, (adam, *_)) = state_names
    assert params["layers"]["moe"]["wi_0"] == ("layers", "exp", "embed", "mlp")
    assert adam.mu == params and adam.count == ()
    assert jax.tree.leaves(mixtral.state)[0].dtype == jnp.float32


@pytest.fixture(scope="module")
def llama_cpu(llama):
    """(compiled step, initial state) of the tiny llama on CPU."""
    state = llama.init(jax.random.key(1))
    return cpu_step(llama, state, tokens()), state


@pytest.mark.slow
def test_llama_trains_on_cpu(llama_cpu):
    step, state = llama_cpu
    batch = tokens()
    losses = []
    for _ in range(3):
        state, loss = step(state, batch)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[0] > losses[1] > losses[2], losses


def unstack(params: dict, layers: int) -> dict:
    """Scanned params ('layers' stacked on axis 0) as the Python loop's layers_0, ..."""
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(layers):
        out[f"layers_{i}"] = jax.tree.map(lambda a: a[i], params["layers"])
    return out


@pytest.mark.slow
def test_scan_and_loop_agree(llama, llama_cpu):
    loop = tpu_models.llama("llama-tiny", BATCH, SEQ, scan_layers=False, remat="full")
    scan_step, (params, opt_state) = llama_cpu
    looped = unstack(params, llama.config.layers)
    loop_state = (looped, tpu_models.optimizer(1e-2).init(looped))
    _, scan_loss = scan_step((params, opt_state), tokens())
    _, loop_loss = cpu_step(loop, loop_state, tokens())(loop_state, tokens())
    # The same bfloat16 arithmetic, fused differently: equal to bfloat16 precision.
    np.testing.assert_allclose(scan_loss, loop_loss, rtol=1e-2)


@pytest.mark.slow
def test_mixtral_step_on_cpu(mixtral):
    state = mixtral.init(jax.random.key(3))
    _, loss = cpu_step(mixtral, state, tokens())(state, tokens())
    assert np.isfinite(float(loss))


@pytest.mark.slow
def test_routing_respects_capacity():
    cap = capacity(16, 8, 2, 1.25)
    assert cap == 5
    logits = jax.random.normal(jax.random.key(4), (3, 16, 8))
    # Half of the groups send every first choice to expert 0: most must be dropped.
    logits = logits.at[:2, :, 0].add(10.0)
    dispatch, combine, aux = jax.jit(route, static_argnums=(1, 2))(logits, 2, cap)
    assert dispatch.shape == (3, 16, 8, cap)
    assert float(jnp.max(jnp.sum(dispatch, axis=1))) <= 1.0  # one token per slot
    assert float(jnp.max(jnp.sum(dispatch, axis=(2, 3)))) <= 2.0  # top-2 slots per token
    np.testing.assert_array_equal(jnp.sum(dispatch[:2, :, 0]), 2 * cap)  # expert 0 full
    assert float(jnp.max(jnp.sum(combine, axis=(2, 3)))) <= 1.0 + 1e-6
    assert float(aux) > 1.5  # imbalanced routing costs more than the balanced 1


def leaf(tree, path: list):
    """tree[path[0]][path[1]]..."""
    for key in path:
        tree = tree[key]
    return tree


def param_sharding(compiled, path: list):
    """The compiled program's input sharding of the parameter at `path`."""
    return leaf(compiled.input_shardings[0][0][0], path)


@pytest.mark.slow
@pytest.mark.parametrize("kind,axes,shard", [
    ("data_parallel", {"data": 8}, (2, 64, 4, 16)),
    ("fsdp", {"fsdp": 8}, (2, 8, 4, 16)),
    ("fsdp_tp", {"fsdp": 4, "tensor": 2}, (2, 16, 2, 16)),
])
def test_expert_kinds_compile(tpu, llama, kind, axes, shard):
    low = tpu_experts.expert_program(*llama[:4], kind, axes, tpu)
    compiled = low.compile()
    query = param_sharding(compiled, ["layers", "attention", "query", "kernel"])
    assert query.shard_shape((2, 64, 4, 16)) == shard
    inputs = compiled.input_shardings[0][1]["inputs"]
    batch_ways = axes.get("data", axes.get("fsdp"))  # activation_batch: data, fsdp
    assert inputs.shard_shape((BATCH, SEQ)) == (BATCH // batch_ways, SEQ)
    if kind == "fsdp_tp":
        assert_tensor_collective(low, compiled)


@pytest.mark.slow
def test_zero1_splits_only_the_moments(tpu, llama):
    compiled = tpu_experts.expert_program(*llama[:4], "zero1", {"data": 8}, tpu).compile()
    path = ["layers", "mlp", "wi_0", "kernel"]
    assert param_sharding(compiled, path).is_fully_replicated
    adam = compiled.input_shardings[0][0][1][1][0]  # (clip, (adam, decay, lr))
    for moment in (adam.mu, adam.nu):
        assert leaf(moment, path).shard_shape((2, 64, 128)) == (2, 8, 128)  # 'embed' / data


def groups_of(hlo: str) -> set[tuple[tuple[int, ...], ...]]:
    """Replica groups of the collectives of an HLO text, in the explicit {{..}} and the iota
    [G,S]<=[dims]T(perm) forms (other forms skipped)."""
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    found = set()
    for text in re.findall(r"replica_groups=\{(\{[\d,{}]*\})\}", hlo):
        found.add(tuple(tuple(ints(g)) for g in re.findall(r"\{([\d,]+)\}", text)))
    iota = r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"
    for groups, size, dims, perm in re.findall(iota, hlo):
        ids = np.arange(int(np.prod(ints(dims)))).reshape(ints(dims))
        ids = ids.transpose(ints(perm)) if perm else ids
        found.add(tuple(map(tuple, ids.reshape(int(groups), int(size)).tolist())))
    return found


def assert_tensor_collective(lowered, compiled) -> None:
    """The activation constraints reached the program: sharding constraints naming 'tensor'
    in the lowering, and a collective over the tensor axis (partition ids i*2, i*2+1 of the
    (4, 2) mesh) in the compiled HLO."""
    constraints = [l for l in lowered.as_text().splitlines() if "sharding_constraint" in l]
    assert any('"tensor"' in l for l in constraints)
    assert ((0, 1), (2, 3), (4, 5), (6, 7)) in groups_of(compiled.as_text())


@pytest.mark.slow
def test_expert_parallel_compiles(tpu, mixtral):
    axes = {"fsdp": 2, "expert": 4}
    compiled = tpu_experts.expert_program(*mixtral[:4], "expert_parallel", axes, tpu).compile()
    wi = param_sharding(compiled, ["layers", "moe", "wi_0"])
    assert wi.shard_shape((2, 8, 64, 128)) == (2, 2, 32, 128)  # experts over 'expert'
    assert compiled.input_shardings[0][1]["inputs"].shard_shape((BATCH, SEQ))[0] == 1
    assert "all-to-all" in compiled.as_text()


def test_sweep_lists_the_usual_meshes():
    runs = tpu_experts.sweep("llama3-8b", 64)
    kinds = [kind for kind, _ in runs]
    assert kinds[:3] == ["data_parallel", "zero1", "fsdp"]
    tensor = [axes["tensor"] for kind, axes in runs if kind == "fsdp_tp"]
    assert tensor == [2, 4, 8]  # 16 does not divide the 8 kv heads
    moe = {kind for kind, _ in tpu_experts.sweep("mixtral-8x7b", 64)}
    assert {"expert_parallel", "expert_tp"} <= moe
    with pytest.raises(ValueError):
        tpu_experts.expert_program(None, None, None, None, "fsdp", {"data": 8}, [])
