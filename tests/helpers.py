"""Shared test helpers: run a step single-device and sharded, and compare."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

import autopar

# XLA's CPU compiler as users run it: the suite turns its fusion emitters off to compile
# faster (conftest.py); a test of the CPU buffer model against the compiler's program or its
# own memory figure compiles with them on, as XLA has them by default.
XLA_CPU_AS_USERS_HAVE_IT = {"xla_cpu_use_fusion_emitters": True}


def compile_as_users_do(lowered):
    """`lowered` (a jax Lowered) compiled with XLA's CPU defaults."""
    return lowered.compile(compiler_options=XLA_CPU_AS_USERS_HAVE_IT)


def float_leaves(tree):
    return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(tree)
            if jnp.issubdtype(jnp.result_type(x), jnp.floating)]

def global_relative_error(reference, other) -> float:
    """||other - reference|| / ||reference|| over all float leaves together."""
    ref, got = float_leaves(reference), float_leaves(other)
    assert len(ref) == len(got)
    num = sum(float(np.sum((a - b) ** 2)) for a, b in zip(ref, got))
    den = sum(float(np.sum(a ** 2)) for a in ref)
    return (num / den) ** 0.5

def run_steps(step, state, batch, n):
    losses = []
    for _ in range(n):
        state, loss = step(state, batch)
        losses.append(float(loss))
    return state, losses

def copy_tree(tree):
    """Fresh arrays (the sharded step donates its state)."""
    return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), tree)

def check_against_single_device(step, state, batch, mesh, steps=3, state_tol=1e-4, **options):
    """Train `steps` steps single-device and sharded; compare losses, state and shardings.

    Returns the sharded step's plan.
    """
    ref_state, ref_losses = run_steps(jax.jit(step), copy_tree(state), batch, steps)
    sharded = autopar.auto_parallel(step, mesh=mesh, **options)
    with warnings.catch_warnings():
        # every primitive of the test models has a rule: a fallback would be a regression
        warnings.simplefilter("error", autopar.AutoparWarning)
        new_state, losses = run_steps(sharded, copy_tree(state), batch, steps)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    err = global_relative_error(ref_state, new_state)
    assert err < state_tol, f"state differs from the single-device run by {err:.2e}"
    plan = sharded.plan(new_state, batch)
    mesh = sharded.mesh(new_state, batch)
    for leaf, want in zip(jax.tree_util.tree_leaves(new_state),
                          jax.tree_util.tree_leaves(plan.output_specs[0],
                                                    is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))):
        assert leaf.sharding.is_equivalent_to(
            jax.sharding.NamedSharding(mesh, want), leaf.ndim), (leaf.sharding, want)
    return plan


def dropout_setup(model):
    """(step, state, data) for a linen `model` with dropout, [16, 5, 8] -> [16, 3]: a squared
    error under adamw, the dropout key passed beside the batch, the gradient through
    autopar.value_and_grad (jax's own outside autopar)."""
    tx = optax.adamw(1e-2)
    x = jax.random.normal(jax.random.key(0), (16, 5, 8))
    data = {"x": x, "y": jax.random.normal(jax.random.key(1), (16, 3))}
    params = model.init({"params": jax.random.key(2), "dropout": jax.random.key(3)}, x)

    def step(state, batch, key):
        params, opt_state = state

        def loss_fn(p):
            out = model.apply(p, batch["x"], rngs={"dropout": key})
            return ((out - batch["y"]) ** 2).mean()
        loss, grads = autopar.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss
    return step, (params, tx.init(params)), data
