"""Equinox: an eqx.nn.MLP trained with optax, partitioned (eqx.partition) and as the whole
module's arrays with Equinox's filtered transforms, equal to jax.jit (examples/equinox_mlp.py);
the module itself, functions and all, is refused with the way to pass it."""
import equinox as eqx
import equinox_mlp  # examples/, on the path from conftest
import jax
import numpy as np
import pytest

import autopar
from helpers import check_against_single_device, copy_tree, global_relative_error

MESH = {"data": 2, "model": 4}


@pytest.mark.slow
def test_partitioned_module_trains_as_one_device():
    model, tx, batch = equinox_mlp.setup()
    step, state = equinox_mlp.partitioned(model, tx)
    check_against_single_device(step, state, batch, autopar.make_mesh(MESH))


@pytest.mark.slow
def test_whole_modules_arrays_train_as_one_device():
    model, tx, batch = equinox_mlp.setup()
    step, (arrays, opt_state) = equinox_mlp.whole(model, tx)
    ref = jax.jit(step)
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESH))
    ref_arrays, ref_opt = copy_tree(arrays), copy_tree(opt_state)
    for _ in range(3):
        ref_arrays, ref_opt, ref_loss = ref(ref_arrays, ref_opt, batch)
        arrays, opt_state, loss = sharded(arrays, opt_state, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert global_relative_error((ref_arrays, ref_opt), (arrays, opt_state)) < 1e-4


def test_the_module_itself_is_refused_with_the_way_to_pass_it():
    model, tx, batch = equinox_mlp.setup()

    def step(model, batch):
        return eqx.filter_value_and_grad(equinox_mlp.loss)(model, batch)[0]

    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh(MESH))
    with pytest.raises(autopar.AutoparError, match="model/activation.*eqx.filter"):
        sharded(model, batch)
