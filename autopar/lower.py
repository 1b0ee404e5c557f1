"""Lowering: re-run the traced program under jax.jit with the plan pinned.

Input shardings alone leave XLA's propagation free to pick other strategies for the
intermediates, so every operand whose required sharding differs from how it was produced, and
every result, gets a `with_sharding_constraint`. The interpreter binds each equation's primitive
as `jax.core.eval_jaxpr` does, inserting the constraints between equations.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from autopar.ir import OpGraph
from autopar.planner import Decisions
from autopar.rules.factors import Spec, to_partition_spec


def interpreter(graph: OpGraph, decisions: Decisions, mesh: Mesh,
                out_specs: Sequence[Spec]) -> Callable[..., list[Any]]:
    """A function of the flat inputs that computes the flat outputs under the plan."""
    produced = decisions.tensor_specs(graph)
    shardings: dict[Spec, NamedSharding] = {}

    def constrain(value: Any, spec: Spec) -> Any:
        if spec not in shardings:
            shardings[spec] = NamedSharding(mesh, to_partition_spec(spec))
        return jax.lax.with_sharding_constraint(value, shardings[spec])

    def run(*flat_args: Any) -> list[Any]:
        env: dict[int, Any] = dict(zip(graph.inputs, flat_args))

        def read(t: int) -> Any:
            return env[t] if t in env else graph.const_values[t]

        for step in graph.program:
            values = []
            for t, need in zip(step.inputs, step.requires):
                value = read(t)
                if need is not None:
                    spec = decisions.ops[need[0]].in_specs[need[1]]
                    if spec != produced.get(t):
                        value = constrain(value, spec)
                values.append(value)
            if step.eqn is None:
                results = values
            else:
                eqn = step.eqn
                params = eqn.primitive.get_bind_params(eqn.params)
                with eqn.ctx.manager:
                    out = eqn.primitive.bind(*values, **params)
                results = out if eqn.primitive.multiple_results else [out]
            for t, value in zip(step.outputs, results):
                spec = produced.get(t)
                env[t] = constrain(value, spec) if spec is not None and spec else value
        return [constrain(read(t), s) for t, s in zip(graph.outputs, out_specs)]

    return run


def jit_step(graph: OpGraph, decisions: Decisions, mesh: Mesh,
             out_specs: Sequence[Spec]) -> Any:
    """The jitted flat step: inputs and outputs sharded per plan, state donated."""
    def named(spec: Spec) -> NamedSharding:
        return NamedSharding(mesh, to_partition_spec(spec))

    return jax.jit(
        interpreter(graph, decisions, mesh, out_specs),
        in_shardings=tuple(named(s) for s in decisions.inputs),
        out_shardings=[named(s) for s in out_specs],
        donate_argnums=tuple(sorted(set(graph.state_pairs.values()))),
    )
