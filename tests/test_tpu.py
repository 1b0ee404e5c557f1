"""Planning for TPU topologies without a TPU: compile-only devices from libtpu.

A mesh of `jax.experimental.topologies` devices plans, lowers and compiles with the TPU
compiler on this machine; the profile and the memory limit come from the devices' kind, and
a memory limit is checked against the TPU compiler's own peak.
"""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("libtpu")

import jax  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import autopar  # noqa: E402
from autopar.cost.hlo import compiled_memory_bytes  # noqa: E402
from models import gpt_abstract  # noqa: E402


@pytest.fixture(scope="module")
def v5e() -> Mesh:
    devices = topologies.get_topology_desc(topology_name="v5e:2x4", platform="tpu").devices
    return Mesh(np.array(devices).reshape(2, 4), ("data", "model"))


@pytest.fixture(scope="module")
def decoder():
    return gpt_abstract(batch=16, seq=128, vocab=1024, d_model=256, heads=4, layers=2)


@pytest.fixture(scope="module")
def planned(v5e, decoder):
    step, state, batch = decoder
    sharded = autopar.auto_parallel(step, mesh=v5e, donate_argnums=0)
    return sharded, sharded.plan(state, batch), sharded.lower(state, batch).compile()


def test_the_profile_and_memory_limit_come_from_the_topology(planned):
    _, plan, _ = planned
    assert plan.hardware == "tpu_v5e"
    assert plan.memory["limit_bytes"] == autopar.PROFILES["tpu_v5e"].memory_bytes


def test_a_v5e_mesh_plans_and_compiles_with_the_tpu_compiler(planned, v5e, decoder):
    sharded, plan, compiled = planned
    text = compiled.as_text()
    assert "T(8,128)" in text  # the TPU compiler's tiled layouts
    step, state, batch = decoder
    (state_shardings, _), _ = sharded.input_shardings(state, batch)
    leaves = jax.tree.leaves(state_shardings)
    assert leaves and all(s.mesh is v5e for s in leaves)
    specs = [s.spec for s in leaves]
    assert specs == [t.partition_spec for t in plan.inputs[:len(specs)]]


def test_the_estimate_is_the_tpu_models_and_the_compiled_figure_the_peak(planned):
    _, plan, compiled = planned
    assert plan.memory["buffer_model"] == "xla-tpu"
    peak = compiled.memory_analysis().peak_memory_in_bytes
    assert compiled_memory_bytes(compiled) == peak > 0


def test_a_memory_limit_is_checked_against_the_tpu_compilers_peak(planned, v5e, decoder):
    """The TPU model's estimate is not calibrated (docs/decisions.md): a plan near the limit
    is compiled, and the TPU compiler's peak decides."""
    step, state, batch = decoder
    _, _, unlimited = planned
    limit = int(0.9 * compiled_memory_bytes(unlimited))
    sharded = autopar.auto_parallel(step, mesh=v5e, donate_argnums=0, memory_limit=limit)
    plan = sharded.plan(state, batch)
    compiled = sharded.lower(state, batch).compile()
    assert compiled_memory_bytes(compiled) <= limit
    assert plan.memory["compiled_bytes"] == compiled_memory_bytes(compiled)


def test_the_step_cannot_run_on_compile_only_devices(planned, decoder):
    sharded, _, _ = planned
    _, state, batch = decoder
    concrete = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), (state, batch))
    with pytest.raises(autopar.AutoparError, match="compile-only"):
        sharded(*concrete)


def test_plan_takes_the_topology_mesh(v5e, decoder):
    step, state, batch = decoder
    plan = autopar.plan(step, state, batch, mesh=v5e, search="recursive_programming")
    assert plan.hardware == "tpu_v5e" and dict(plan.mesh) == {"data": 2, "model": 4}
