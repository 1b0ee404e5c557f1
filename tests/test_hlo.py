"""Reading collectives from compiled HLO, and the cost model's prediction of them."""
import jax
import models
import pytest

import autopar
from autopar.cost.hlo import collective_bytes, collective_counts

HLO = """
ENTRY %main {
  %p = f32[16,64]{1,0} parameter(0)
  %all-reduce.1 = f32[16,64]{1,0} all-reduce(f32[16,64]{1,0} %p), replica_groups={{0,1}}, to_apply=%add
  %ar2 = (f32[8]{0}, bf16[4,4]{1,0}) all-reduce(f32[8]{0} %a, bf16[4,4]{1,0} %b), to_apply=%add
  %ag = f32[32,64]{1,0} all-gather(f32[16,64]{1,0} %p), dimensions={0}
  %ags = (f32[16,64]{1,0}, f32[32,64]{1,0}) all-gather-start(f32[16,64]{1,0} %p), dimensions={0}
  %agd = f32[32,64]{1,0} all-gather-done(%ags)
  ROOT %a2a = s32[16,64]{1,0} all-to-all(s32[16,64]{1,0} %q), dimensions={1}
}
"""


def test_parser_reads_every_element_of_tuples_and_async_pairs_once():
    got = collective_bytes(HLO)
    assert got["all-reduce"] == 16 * 64 * 4 + 8 * 4 + 16 * 2
    assert got["all-gather"] == 2 * 32 * 64 * 4
    assert got["all-to-all"] == 16 * 64 * 4
    assert collective_counts(HLO) == {"all-reduce": 2, "all-gather": 2, "all-to-all": 1}


@pytest.mark.parametrize("mesh", [{"data": 8}, {"data": 2, "model": 4}])
def test_predicted_collectives_match_the_compiled_step(mesh):
    """Data parallel MLP: the gradients' all-reduces are all there is, and both agree."""
    step, state, batch = models.mlp_setup()
    annotations = {r"^batch/": jax.sharding.PartitionSpec(tuple(mesh)), r".": None}
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(mesh), annotations=annotations)
    plan = sharded.plan(state, batch)
    compiled = collective_bytes(sharded.lower(state, batch).compile().as_text())
    predicted = {k[:-len("_bytes")]: v for k, v in plan.cost.items()
                 if k.endswith("_bytes") and k != "peak_memory_bytes"}
    assert predicted and sum(predicted.values()) == pytest.approx(sum(compiled.values()), rel=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [{"data": 2, "model": 4}, {"data": 2, "model": 2, "inner": 2}])
def test_planned_reduce_scatters_and_multi_axis_reductions_compile_as_predicted(mesh):
    """The encoder-decoder's plans reduce-scatter weight gradients (2x4) and contract heads and
    head_dim on different axes (2x2x2): XLA, given shardings only, all-reduces the full
    gradient, and all-reduces once per contracted dimension; the lowering writes them out."""
    import architectures
    step, state, batch = architectures.encdec_setup()
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(mesh))
    plan = sharded.plan(state, batch)
    compiled = collective_bytes(sharded.lower(state, batch).compile().as_text())
    predicted = {k[:-len("_bytes")]: v for k, v in plan.cost.items()
                 if k.endswith("_bytes") and k != "peak_memory_bytes" and v}
    assert sum(predicted.values()) == pytest.approx(sum(compiled.values()), rel=0.1)
    for kind, nbytes in predicted.items():
        assert compiled.get(kind, 0.0) == pytest.approx(nbytes, rel=0.1), (kind, compiled)


@pytest.mark.parametrize("src", [("data", "model"), ("model", "data"), (None, ("data", "model"))])
@pytest.mark.parametrize("sizes", [(4, 2), (2, 4)])
def test_gathering_two_sharded_dimensions_counts_one_all_gather_per_dimension(src, sizes):
    """XLA gathers a tensor sharded on two dimensions one dimension at a time, the last first:
    the bytes read from the compiled program are the predicted ones."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from autopar.cost.hardware import PROFILES
    from autopar.cost.resharding import reshard_collectives
    from autopar.mesh import mesh_shape
    from autopar.rules.factors import from_partition_spec
    from autopar.trace.ir import Tensor
    axes = dict(zip(("data", "model"), sizes))
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(sizes), tuple(axes))
    step = jax.jit(lambda x: x * 2, in_shardings=NamedSharding(mesh, P(*src)),
                   out_shardings=NamedSharding(mesh, P()))
    compiled = collective_bytes(step.lower(jax.ShapeDtypeStruct((64, 64), "float32"))
                                .compile().as_text())
    predicted = reshard_collectives(Tensor(0, (64, 64), "float32"), from_partition_spec(
        P(*src), 2), ((), ()), mesh_shape(axes), PROFILES["cpu"])
    assert compiled == predicted


@pytest.mark.slow
def test_every_resharding_of_a_matrix_compiles_without_xla_warnings(capfd):
    """Every resharding of a (16, 32) tensor between the shardings it can take on a 2x4 mesh
    (110 pairs), constrained through the stops the lowering uses, compiles without XLA's
    "Involuntary full rematerialization"; given only the two ends, 12 of them log it."""
    import itertools
    import os
    import tempfile

    import numpy as np
    from jax.sharding import NamedSharding

    from autopar.cost.resharding import reshard_stops
    from autopar.rules.factors import to_partition_spec
    names = ("a", "b")
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), names)
    specs = sorted({tuple(tuple(a for a in order if dims[names.index(a)] == d) for d in range(2))
                    for dims in itertools.product(range(3), repeat=2)
                    for order in itertools.permutations(names)})
    warned = []
    for src, dst in itertools.permutations(specs, 2):
        def resharded(x, stops=reshard_stops(src, dst), dst=dst):
            for stop in (*stops, dst):
                x = jax.lax.with_sharding_constraint(
                    x * 1, NamedSharding(mesh, to_partition_spec(stop)))
            return x
        with tempfile.TemporaryFile() as log:  # XLA logs from C++, to file descriptor 2
            saved = os.dup(2)
            os.dup2(log.fileno(), 2)
            try:
                jax.jit(resharded, in_shardings=NamedSharding(mesh, to_partition_spec(src))
                        ).lower(jax.ShapeDtypeStruct((16, 32), "float32")).compile()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            log.seek(0)
            if b"Involuntary full rematerialization" in log.read():
                warned.append((src, dst))
    assert len(specs) == 11 and not warned, warned


@pytest.mark.parametrize("sizes, src, dst", [
    # an axis changes dimension while another leaves the one it comes from: given the two
    # ends XLA gathers the whole tensor (the ResNet's Megatron + data parallel plan on 4x2 has
    # one); through the stops, the leaving axis is gathered and the other moves
    ((4, 2), (("data", "model"),), (None, "data")),
    ((2, 4), (None, ("data", "model")), ("model", None)),
    ((2, 4), (None, None, ("data", "model")), ("data", None, None)),
    # an axis changes dimension after another is gathered: the gathered shard moves
    ((4, 2), ("data", "model"), (None, "data")),
    ((2, 4), ("data", "model"), ("model", None)),
    # axes leave one dimension for two, or two for one (through the stops as above)
    ((4, 2), (None, None, ("data", "model")), ("data", "model", None)),
    ((2, 4), ("data", "model", None), (None, None, ("data", "model"))),
    # an axis dropped, another added
    ((4, 2), ("data", None), (None, "model")),
    # one axis changes dimension, nothing else
    ((4, 2), ("data", None), (None, "data")),
])
def test_resharding_compiles_to_the_predicted_collectives(sizes, src, dst, capfd):
    """The collectives XLA compiles for a resharding, constrained through the stops the
    lowering uses, are the predicted ones, kind by kind, and XLA logs no warning."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from autopar.cost.hardware import PROFILES
    from autopar.cost.resharding import reshard_collectives, reshard_stops
    from autopar.mesh import mesh_shape
    from autopar.rules.factors import from_partition_spec, to_partition_spec
    from autopar.trace.ir import Tensor
    axes = dict(zip(("data", "model"), sizes))
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(sizes), tuple(axes))
    target = NamedSharding(mesh, P(*dst))
    shape = (16, 64) if len(src) == 2 else (16, 32, 8)
    stops = reshard_stops(from_partition_spec(P(*src), len(shape)),
                          from_partition_spec(P(*dst), len(shape)))

    def resharded(x):
        x = x * 2
        for stop in stops:
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, to_partition_spec(stop)))
        return jax.lax.with_sharding_constraint(x, target) + 1

    step = jax.jit(resharded, in_shardings=NamedSharding(mesh, P(*src)), out_shardings=target)
    compiled = collective_bytes(step.lower(jax.ShapeDtypeStruct(shape, "float32"))
                                .compile().as_text())
    predicted = reshard_collectives(Tensor(0, shape, "float32"),
                                    from_partition_spec(P(*src), len(shape)),
                                    from_partition_spec(P(*dst), len(shape)), mesh_shape(axes),
                                    PROFILES["cpu"])
    assert compiled == predicted
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
