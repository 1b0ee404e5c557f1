"""The benchmark suite's model families train sharded exactly as on one device."""
import architectures
import pytest

import autopar
from helpers import check_against_single_device


@pytest.mark.slow
@pytest.mark.parametrize("setup", [architectures.moe_setup, architectures.resnet_setup,
                                   architectures.encdec_setup])
def test_architecture_matches_single_device(setup):
    step, state, batch = setup()
    plan = check_against_single_device(step, state, batch,
                                       autopar.make_mesh({"data": 2, "model": 4}))
    assert plan.cost["total_s"] > 0


@pytest.mark.slow
def test_moe_routes_with_top_k():
    step, state, batch = architectures.moe_setup()
    plan = autopar.plan(step, state, batch, mesh={"data": 2, "model": 4})
    assert any(o.primitive == "top_k" for o in plan.ops)
