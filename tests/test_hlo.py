"""Reading collectives from compiled HLO, and the cost model's prediction of them."""
import jax
import models
import pytest

import autopar
from autopar.hlo import collective_bytes, collective_counts

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
