"""One microbatch's share of the loss, computed as the separability analysis says
(separable.py): the loss's microbatch trace evaluated equation by equation beside its full-batch
trace, with what the full batch computes once (hoisted values, random draws) taken from it, and
draws inside loops made at the microbatch's examples (draws.py)."""
from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.extend.core import Literal

from autopar.rewrite.draws import bits_at
from autopar.rewrite.separable import Separability
from autopar.trace.jaxpr import bind_equation, open_jaxpr
from autopar.trace.tracer import CALL_PRIMITIVES, scan_counts


def hoisted_values(analysis: Separability, full: Any, leaves: Sequence[Any]
                   ) -> tuple[dict[int, list[Any]], list[tuple[Any, int]]]:
    """The values computed once at the full batch: the hoisted equations' results, and the
    random draws with their batch dimension."""
    values: dict[int, list[Any]] = {}
    wanted = set(analysis.hoisted) | {e for e, _ in analysis.randoms}
    diff = set(analysis.diff_leaves)
    inputs = [_MISSING if k in diff else x for k, x in enumerate(leaves)]
    run_equations(full.jaxpr, full.jaxpr, list(full.consts), inputs, analysis, wanted=wanted,
                  record=values)
    randoms = [(values[e][0], dim) for e, dim in analysis.randoms]
    return values, randoms


def evaluate(analysis: Separability, micro: Any, leaves: Sequence[Any],
             hoisted: dict[int, list[Any]], randoms: Sequence[Any], examples: Any = None
             ) -> list[Any]:
    """The loss's outputs on one microbatch (`micro`: its jaxpr, traced for this microbatch);
    `examples`: the indices of its examples in the full batch, for draws inside loops."""
    return run_equations(analysis.full.jaxpr, micro.jaxpr, list(micro.consts), list(leaves),
                         analysis, hoisted=hoisted, randoms=randoms, examples=examples)


def run_equations(full: Any, micro: Any, consts: list, args: list, analysis: Separability,
                  hoisted: dict | None = None, randoms: Sequence[Any] = (),
                  wanted: set | None = None, record: dict | None = None, examples: Any = None,
                  scope: tuple[int, ...] = ()) -> list[Any]:
    """Evaluate `micro`, equation by equation beside `full`, doing what the analysis says:
    its literals are the full trace's (a mean's 1/B), hoisted values and random draws come
    from the full batch, and draws inside loops are the full batch's bits at `examples`. With
    `wanted`, evaluate only what the full batch computes (every equation independent of what
    is differentiated) and `record` the wanted results."""
    env: dict[Any, Any] = dict(zip([*micro.constvars, *micro.invars], [*consts, *args]))
    m = analysis.microbatches

    def read(vm: Any, vf: Any) -> Any:
        if isinstance(vf, Literal):
            return vf.val
        if isinstance(vm, Literal):
            return vm.val
        return env.get(vm, _MISSING)

    for ef, em in zip(full.eqns, micro.eqns):
        at = (*scope, id(ef))  # the equation's key, as Separability makes it
        action = analysis.actions.get(at, ())
        values = [read(vm, vf) for vm, vf in zip(em.invars, ef.invars)]
        # (full-batch pass) what depends on what is differentiated is not computed here; a
        # call (a checkpointed layer, say) is entered all the same, for the draws inside it
        if any(v is _MISSING for v in values) and action[:1] != ("inline",):
            continue
        if action[:1] == ("hoist",) and hoisted is not None:
            outs = hoisted[at]
        elif action[:1] == ("random",) and wanted is None:
            outs = [randoms[action[1]]]
        elif action[:1] == ("inline",):
            key = CALL_PRIMITIVES[ef.primitive.name]
            inner_f, _ = open_jaxpr(ef.params[key])
            inner_m, inner_consts = open_jaxpr(em.params[key])
            outs = run_equations(inner_f, inner_m, inner_consts, values, analysis, hoisted,
                                 randoms, wanted, record, examples, at)
        elif action[:1] == ("loop_draws",) and wanted is None:
            outs = _drawing_loop(ef, em, values, analysis, examples, at)
        elif action[:1] == ("drawn",) and wanted is None:
            assert examples is not None, "a draw inside a loop needs the microbatch's examples"
            outs = [bits_at(values[0], ef.params["shape"], em.params["shape"], action[1],
                            examples, em.params["bit_width"])]
        else:
            if action[:1] == ("affine",):
                values = [v / m if i in action[1] else v for i, v in enumerate(values)]
            outs = bind_equation(em, values)
        if record is not None and at in wanted:
            record[at] = list(outs)
        env.update(zip(em.outvars, outs))
    return [read(vm, vf) for vm, vf in zip(micro.outvars, full.outvars)]


def _drawing_loop(ef: Any, em: Any, values: list, analysis: Separability, examples: Any,
                  scope: tuple[int, ...]) -> list[Any]:
    """A scan whose body draws per-example bits, run for one microbatch: its body evaluated
    beside the full trace's, each draw the full batch's bits at `examples`; `scope`: the
    scan's key."""
    p = em.params
    nc, ncarry = scan_counts(p)
    body_f, _ = open_jaxpr(ef.params["jaxpr"])
    body_m, body_consts = open_jaxpr(p["jaxpr"])
    consts, init, xs = values[:nc], values[nc:nc + ncarry], values[nc + ncarry:]

    def body(carry: list, x: list) -> tuple[list, list]:
        outs = run_equations(body_f, body_m, body_consts, [*consts, *carry, *x], analysis,
                             examples=examples, scope=scope)
        return outs[:ncarry], outs[ncarry:]

    carry, ys = jax.lax.scan(body, list(init), list(xs), length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]


_MISSING = object()
