"""Small helpers on jaxprs that the tracer and the loss rewrites share."""
from __future__ import annotations

from typing import Any

from jax.extend import source_info_util


def open_jaxpr(jaxpr: Any) -> tuple[Any, list]:
    """(the open jaxpr, its constants) of a closed jaxpr, or of an open one (no constants)."""
    if hasattr(jaxpr, "jaxpr") and hasattr(jaxpr, "consts"):
        return jaxpr.jaxpr, list(jaxpr.consts)
    return jaxpr, []


def eqn_source(eqn: Any) -> str:
    """The user's line an equation came from, as JAX summarises it."""
    return source_info_util.summarize(eqn.source_info)


def bind_equation(eqn: Any, values: list) -> list:
    """`eqn`'s primitive bound on `values` in its context: its results. The user's line stays
    the equation's source (plans and errors name it)."""
    with eqn.ctx.manager, source_info_util.user_context(eqn.source_info.traceback):
        out = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]
