"""`autopar.shard(x, P(...))`: an identity primitive that carries a sharding the user fixes
into the jaxpr, where the planning reads it as a pin (autopar.planning.pins).

Outside autopar it does nothing (it lowers to its operand), under `grad` its cotangent passes
through unannotated, under `vmap` the batch dimension is left unsplit.
"""
from __future__ import annotations

from typing import Any

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec

SHARD_PRIMITIVE = "autopar_shard"

shard_p = Primitive(SHARD_PRIMITIVE)
shard_p.def_impl(lambda x, *, spec: x)
shard_p.def_abstract_eval(lambda x, *, spec: x)
mlir.register_lowering(shard_p, mlir.lower_fun(lambda x, *, spec: x, multiple_results=False))
# Linear: the tangent is annotated like the primal, the cotangent passes through as it is.
ad.deflinear2(shard_p, lambda ct, x, *, spec: [ct])


def _batch_rule(args: Any, dims: Any, *, spec: PartitionSpec) -> tuple[Any, Any]:
    (x,), (d,) = args, dims
    if d is None:  # not mapped
        return shard_p.bind(x, spec=spec), d
    entries = list(spec) + [None] * (x.ndim - 1 - len(spec))
    entries.insert(d, None)
    return shard_p.bind(x, spec=PartitionSpec(*entries)), d


batching.primitive_batchers[shard_p] = _batch_rule


def shard(x: Any, spec: PartitionSpec | tuple) -> Any:
    """Ask for `x` to be sharded as `spec` (a PartitionSpec over the mesh's axis names).

    Inside a step planned by autopar this is a hard constraint on the search; elsewhere it
    returns `x` unchanged, so model code keeps working on one device.
    """
    if not isinstance(spec, PartitionSpec):
        spec = PartitionSpec(*spec) if isinstance(spec, (tuple, list)) else PartitionSpec(spec)
    return shard_p.bind(x, spec=spec)
