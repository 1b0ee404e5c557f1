"""Random bits drawn inside a loop (dropout in a scanned layer stack), for one microbatch.

- `why_not_drawable(eqn)`: None where a draw can be made per microbatch, else why not. It can
  where it is `random_bits` from one threefry key, with `jax_threefry_partitionable` on, of
  fewer than 2**32 bits, and 64-bit only with `jax_enable_x64`. For any other draw inside a
  loop, separable.py refuses the step with an AutoparError.
- `bits_at(key, full_shape, shape, dim, examples, bit_width)`: the bits of
  `random_bits(key, full_shape)` at a microbatch's positions: the full batch's examples
  `examples` along dimension `dim`, every index along the others. They equal those positions
  of the full draw.

Design and rationale: docs/internals-steps.md, "autopar/rewrite/draws.py".
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.random import threefry2x32_p

THREEFRY = "threefry2x32"
UINTS = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def why_not_drawable(eqn: Any) -> str | None:
    """Why a random draw inside a loop cannot be made per microbatch, or None where it can."""
    if eqn.primitive.name != "random_bits":
        return f"draws with {eqn.primitive.name}, which has no per-position form"
    key = eqn.invars[0].aval
    impl = getattr(getattr(key.dtype, "_impl", None), "name", None)
    if impl != THREEFRY:
        return (f"draws with the {impl or 'unknown'} generator, whose bits depend on the whole "
                "draw (only threefry's are computed per position)")
    if not jax.config.jax_threefry_partitionable:
        return "draws with jax_threefry_partitionable off (its bits depend on the whole draw)"
    if key.shape:
        return "draws from an array of keys at once"
    if math.prod(eqn.params["shape"]) >= 2**32:
        return "draws 2**32 or more bits at once"
    if eqn.params["bit_width"] == 64 and not jax.config.jax_enable_x64:
        return "draws 64-bit values"
    return None


def bits_at(key: Any, full_shape: tuple[int, ...], shape: tuple[int, ...], dim: int,
            examples: Any, bit_width: int) -> Any:
    """The bits of `random_bits(key, full_shape)` at a microbatch's positions: its draw of
    `shape` holds, along the batch dimension `dim`, the full batch's examples `examples`
    (their indices, [shape[dim]]), and the full draw's every index along the others."""
    strides = [math.prod(full_shape[k + 1:]) for k in range(len(full_shape))]
    index = jnp.zeros(shape, jnp.uint32)
    for k, stride in enumerate(strides):
        if k == dim:
            position = lax.broadcast_in_dim(examples.astype(jnp.uint32), shape, (dim,))
        else:
            position = lax.broadcasted_iota(jnp.uint32, shape, k)
        index = index + position * jnp.uint32(stride)
    # Every operand of the index's shape, and batched as it is where shares are vmapped:
    # zeros_like of a vmapped value is not, and the hash's lowering needs one shape.
    zero = index * jnp.uint32(0)
    k1, k2 = jax.random.key_data(key)
    bits1, bits2 = threefry2x32_p.bind(k1 + zero, k2 + zero, zero, index)
    if bit_width == 64:
        wide = UINTS[64]
        return (bits1.astype(wide) << wide(32)) | bits2.astype(wide)
    return (bits1 ^ bits2).astype(UINTS[bit_width])
