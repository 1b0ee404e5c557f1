"""How a batch is laid out in microbatches (and shares), and the gradients' trees: what the
accumulation loop (accumulate.py) and the pipeline (gpipe.py) share."""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp


def diff_leaves(args: tuple, argnums: int | Sequence[int]) -> list[int]:
    """The flat positions of the differentiated arguments' leaves."""
    nums = {argnums} if isinstance(argnums, int) else set(argnums)
    out, offset = [], 0
    for i, a in enumerate(args):
        n = len(jax.tree_util.tree_leaves(a))
        if i in nums:
            out += range(offset, offset + n)
        offset += n
    return out


def grads_shape(args: tuple, argnums: int | Sequence[int]) -> Any:
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x),
                                                                   jnp.result_type(x)), args)
    if isinstance(argnums, int):
        return shapes[argnums]
    return tuple(shapes[i] for i in argnums)


def regroup(grads: Sequence[Any], args: tuple, argnums: int | Sequence[int]) -> Any:
    """Flat gradients back in the differentiated arguments' trees (jax.grad's layout)."""
    nums = [argnums] if isinstance(argnums, int) else list(argnums)
    out, k = [], 0
    for i in nums:
        leaves, tree = jax.tree_util.tree_flatten(args[i])
        out.append(jax.tree_util.tree_unflatten(tree, grads[k:k + len(leaves)]))
        k += len(leaves)
    return out[0] if isinstance(argnums, int) else tuple(out)


def lead(m: int, g: int = 1) -> tuple[int, ...]:
    """The loop's leading dimensions: microbatches, then shares where there are several."""
    return (m,) if g == 1 else (m, g)


def strided(x: Any, m: int, g: int = 1) -> Any:
    """[B, ...] -> [M, B/M, ...], microbatch j holding the examples j, j+M, ...; with g
    shares [M, G, B/(M G), ...], share s of microbatch j holding those of the s-th of G
    contiguous blocks of the batch (what the s-th device group keeps of a batch split G
    ways)."""
    if g == 1:
        return jnp.swapaxes(jnp.reshape(x, (x.shape[0] // m, m, *x.shape[1:])), 0, 1)
    return jnp.moveaxis(jnp.reshape(x, (g, x.shape[0] // (m * g), m, *x.shape[1:])), 2, 0)


def unstrided(x: Any, size: int, g: int = 1) -> Any:
    """[M, B/M, ...] (or [M, G, B/(M G), ...]) -> [B, ...], inverting `strided`."""
    if g == 1:
        return jnp.reshape(jnp.swapaxes(x, 0, 1), (size, *x.shape[2:]))
    return jnp.reshape(jnp.moveaxis(x, 0, 2), (size, *x.shape[3:]))


def strided_dim(v: Any, dim: int, size: int, m: int, g: int = 1) -> Any:
    """A per-example value whose dimension `dim` holds the batch (maybe merged with an inner
    dimension: B * k) as [M, B/M * k, ...] (or [M, G, B/(M G) * k, ...]) with that dimension
    first, its examples in microbatches (and shares) as `strided` puts them."""
    v = jnp.moveaxis(v, dim, 0)
    k = v.shape[0] // size
    if g == 1:
        v = jnp.reshape(v, (size // m, m, k, *v.shape[1:]))
        return jnp.reshape(jnp.swapaxes(v, 0, 1), (m, (size // m) * k, *v.shape[3:]))
    v = jnp.moveaxis(jnp.reshape(v, (g, size // (m * g), m, k, *v.shape[1:])), 2, 0)
    return jnp.reshape(v, (m, g, (size // (m * g)) * k, *v.shape[4:]))
