"""Rules for jnp.stack (stack, and unstack in its gradient), jnp.tile, jnp.searchsorted's
comparisons, complex and special functions, and batched cholesky / triangular_solve: each step
equals one device with no operator left replicated, and the batch stays split through them."""
import jax
import jax.numpy as jnp
import pytest

import autopar
from helpers import check_against_single_device


def step(w, x):
    def loss(w):
        h = jnp.tanh(x @ w)  # (64, 16): the batch splits here
        gram = jnp.einsum("bi,bj->bij", h[:, :4], h[:, :4]) + 2 * jnp.eye(4)
        factor = jnp.linalg.cholesky(gram)  # one 4x4 matrix per example
        solved = jax.scipy.linalg.solve_triangular(factor, h[:, :4, None], lower=True)
        stacked = jnp.stack([h, 2 * h], axis=1).sum(1)
        tiled = jnp.tile(h, (1, 2))[:, :16]
        bins = jnp.searchsorted(jnp.linspace(-1, 1, 8), h) + jnp.searchsorted(
            jnp.linspace(-1, 1, 8), h, side="right")
        special = jax.scipy.special.i0e(h) + jnp.real((h + 1j * h) * jnp.conj(h - 1j))
        return (jnp.mean(solved ** 2) + jnp.mean(stacked * tiled) + jnp.mean(bins * h)
                + jnp.mean(special ** 2))
    value, grad = jax.value_and_grad(loss)(w)
    return w - 0.1 * grad, value


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [{"data": 8}, {"data": 2, "model": 4}])
def test_stack_tile_and_batched_linear_algebra_match_one_device(mesh):
    w = jax.random.normal(jax.random.key(0), (32, 16)) * 0.2
    x = jax.random.normal(jax.random.key(1), (64, 32))
    plan = check_against_single_device(step, w, x, autopar.make_mesh(mesh), steps=2)
    for primitive in ("cholesky", "triangular_solve", "stack", "unstack", "tile"):
        assert any(op.primitive == primitive and any(op.out_specs[0])
                   for op in plan.ops), f"{primitive} runs unsplit"


def test_batched_cholesky_compiles_without_gathers():
    w = jax.random.normal(jax.random.key(0), (32, 16)) * 0.2
    x = jax.random.normal(jax.random.key(1), (64, 32))
    sharded = autopar.auto_parallel(step, mesh=autopar.make_mesh({"data": 8}))
    hlo = sharded.lower(w, x).compile().as_text()
    assert "all-gather" not in hlo
