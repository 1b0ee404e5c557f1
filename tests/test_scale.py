"""Planning at scale on abstract devices: nothing runs, nothing is allocated at full size."""
import models
import pytest

import autopar

pytestmark = pytest.mark.slow  # the slow tier: `make test-fast` leaves it out


def test_integer_label_gpt_plans_on_1024_devices_within_16_gib():
    """A 12-layer d_model-2048 GPT with a 32k vocabulary, batch 1024 x 256 tokens, whose loss
    takes its labels' logits with take_along_axis (optax's integer-label cross entropy): with
    the logits replicated for the loss its leanest plan needed a 31.9 GB buffer; split over
    the batch, both searches fit 16 GiB per device of 64 x 16."""
    step, state, batch = models.gpt_abstract(batch=1024, seq=256, vocab=32768, d_model=2048,
                                             heads=16, layers=12)
    for search in ("recursive_programming", "dynamic_programming"):
        plan = autopar.plan(step, state, batch, mesh={"data": 64, "model": 16}, hardware="h100",
                            memory_limit="16GiB", search=search)
        assert plan.cost["peak_memory_bytes"] <= 16 * 2**30
        assert any(plan.specs["batch/targets"])  # the labels, and their loss, are split
