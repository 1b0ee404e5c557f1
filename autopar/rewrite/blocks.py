"""A Python loop of layers found in the loss's jaxpr and re-traced as one loop over stacked
weights, so that the pipeline (gpipe.py) can run it as stages.

- `find_blocks(jaxpr, min_count=2)`: the longest chain of at least `min_count` copies of the
  same equations, as `Blocks`. In a chain a copy reads only its own values, the previous
  copy's carries, shared values, its own inputs of the loss and literals; after the run, only
  the last copy's carries are read. `chain` checks one run.
- `hoisted(closed)`, `rolled(closed, blocks)`: the same function, with checkpointed calls'
  integer literals as operands, or with the run as one `lax.scan` over the per-layer values
  stacked [L, ...].
Nothing raises: with no chain, `find_blocks` and `chain` return None.

Design and rationale: docs/internals-steps.md, "autopar/rewrite/blocks.py".
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, Var

from autopar.trace.jaxpr import bind_equation

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A run of `count` copies of `period` equations from equation `start`. `reads[(o, i)]`
    says where input i of the copy's o-th equation comes from: ("inner", o', n): output n of
    its equation o'; ("carry", c); ("shared", s); ("layer", j); ("literal", value);
    ("numbered", k): the copy's own of the literals `numbered[k]` (one per copy).
    `carries[c]` = (o', n): the copy's output that the next copy reads as carry c;
    `inits[c]`, `shared[s]`: variables from before the run; `layers[j]`: one per copy."""
    start: int
    period: int
    count: int
    reads: dict
    carries: list
    inits: list
    shared: list
    layers: list
    numbered: list = dataclasses.field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.period * self.count


def find_blocks(jaxpr: Any, min_count: int = 2) -> Blocks | None:
    """The run of repeated layers covering the most equations of `jaxpr`
    (docs/internals-steps.md), at least `min_count` copies long; None where there is none."""
    eqns = jaxpr.eqns
    signature = _signatures(eqns)
    candidates = []
    for period in range(1, len(eqns) // 2 + 1):
        same = np.concatenate([[False], signature[:-period] == signature[period:], [False]])
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        for lo, hi in zip(edges[::2].tolist(), edges[1::2].tolist()):
            length = hi - lo + period  # same[lo+1 .. hi]: eqns lo .. hi+period-1 repeat
            if length // period >= min_count:
                candidates.append((length // period * period, -period, lo, length))
    for _, minus_period, lo, length in sorted(candidates, reverse=True):
        period = -minus_period
        for phase in range(period):
            count = (length - phase) // period
            if count < min_count:
                break
            found = chain(jaxpr, lo + phase, period, count)
            if found is not None:
                return found
    return None


def chain(jaxpr: Any, start: int, period: int, count: int) -> Blocks | None:
    """The run of `count` copies of `period` equations from `start` as Blocks, or None where
    its copies are not a chain of layers (docs/internals-steps.md)."""
    eqns = jaxpr.eqns
    end = start + period * count
    defined: dict[Any, tuple[int, int, int]] = {}  # variable -> (copy, equation, output)
    for e in range(start, end):
        for n, v in enumerate(eqns[e].outvars):
            defined[v] = ((e - start) // period, (e - start) % period, n)
    inputs = set(jaxpr.invars)  # what per-layer values may be: the loss's own inputs
    reads, carries, inits, shared, layers, numbered = {}, [], [], [], [], []
    for o in range(period):
        for i, first in enumerate(eqns[start + o].invars):
            vs = [eqns[start + k * period + o].invars[i] for k in range(count)]
            if isinstance(first, Literal):
                if not all(isinstance(v, Literal) for v in vs):
                    return None
                values = [v.val for v in vs]
                if all(np.array_equal(x, values[0]) for x in values):
                    reads[(o, i)] = ("literal", first.val)
                else:
                    numbered.append(np.asarray(values, dtype=first.aval.dtype))
                    reads[(o, i)] = ("numbered", len(numbered) - 1)
                continue
            where = [defined.get(v) for v in vs]
            if all(w is not None and w[0] == k for k, w in enumerate(where)):
                if len({w[1:] for w in where}) != 1:
                    return None
                reads[(o, i)] = ("inner", *where[0][1:])
            elif where[0] is None and all(w is not None and w[0] == k - 1
                                          for k, w in enumerate(where) if k):
                source = where[1][1:]
                if any(w[1:] != source for w in where[1:]):
                    return None
                if source not in carries:
                    carries.append(source)
                    inits.append(vs[0])
                c = carries.index(source)
                if inits[c] is not vs[0]:
                    return None
                reads[(o, i)] = ("carry", c)
            elif all(w is None for w in where):
                if all(v is first for v in vs):
                    if first not in shared:
                        shared.append(first)
                    reads[(o, i)] = ("shared", shared.index(first))
                elif len(set(map(id, vs))) == count and all(v in inputs for v in vs):
                    layers.append(vs)
                    reads[(o, i)] = ("layer", len(layers) - 1)
                else:
                    return None
            else:
                return None
    if not carries or not _only_carries_leave(jaxpr, start, end, period, count, defined,
                                              carries):
        return None
    return Blocks(start, period, count, reads, carries, inits, shared, layers, numbered)


def _only_carries_leave(jaxpr: Any, start: int, end: int, period: int, count: int,
                        defined: dict, carries: list) -> bool:
    """Whether the run's values read outside their own copy are the carries: by the next
    copy, or after the run for the last copy's."""
    after = [v for eqn in jaxpr.eqns[end:] for v in eqn.invars] + list(jaxpr.outvars)
    for v in after:
        w = defined.get(v) if not isinstance(v, Literal) else None
        if w is not None and (w[0] != count - 1 or w[1:] not in carries):
            return False
    for e in range(start, end):
        copy = (e - start) // period
        for v in jaxpr.eqns[e].invars:
            w = defined.get(v) if not isinstance(v, Literal) else None
            if w is not None and w[0] != copy and (w[0] != copy - 1 or w[1:] not in carries):
                return False
    return True


def rolled(closed: Any, blocks: Blocks) -> Any:
    """`closed` (a ClosedJaxpr) re-traced with the run `blocks` as one lax.scan over the
    per-layer values stacked [L, ...]; same inputs and outputs."""
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns

    def run(*args: Any) -> list:
        env = dict(zip([*jaxpr.constvars, *jaxpr.invars], [*closed.consts, *args]))

        def read(v: Any) -> Any:
            return v.val if isinstance(v, Literal) else env[v]

        for eqn in eqns[:blocks.start]:
            env.update(zip(eqn.outvars, bind_equation(eqn, [read(v) for v in eqn.invars])))
        shared = [read(v) for v in blocks.shared]
        stacked = [jnp.stack([read(v) for v in vs]) for vs in blocks.layers]
        numbered = [jnp.asarray(x) for x in blocks.numbered]

        def layer(carry: list, xs: tuple[list, list]) -> tuple[list, None]:
            values: dict[tuple[int, int], Any] = {}
            weights, constants = xs
            given = {"carry": carry, "shared": shared, "layer": weights,
                     "numbered": constants}
            for o in range(blocks.period):
                eqn = eqns[blocks.start + o]
                ins = []
                for i in range(len(eqn.invars)):
                    kind, *at = blocks.reads[(o, i)]
                    ins.append(at[0] if kind == "literal" else values[tuple(at)]
                               if kind == "inner" else given[kind][at[0]])
                values.update(((o, n), x) for n, x in enumerate(bind_equation(eqn, ins)))
            return [values[c] for c in blocks.carries], None

        final, _ = jax.lax.scan(layer, [read(v) for v in blocks.inits], (stacked, numbered),
                                length=blocks.count)
        last = blocks.start + (blocks.count - 1) * blocks.period
        for (o, n), x in zip(blocks.carries, final):
            env[eqns[last + o].outvars[n]] = x
        for eqn in eqns[blocks.end:]:
            env.update(zip(eqn.outvars, bind_equation(eqn, [read(v) for v in eqn.invars])))
        return [read(v) for v in jaxpr.outvars]

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
             for v in jaxpr.invars]
    out = jax.make_jaxpr(run)(*avals)
    return ClosedJaxpr(out.jaxpr, out.consts)


# Calls whose body takes its operands as they come, so one more operand is one more input of
# the body: jax.checkpoint / nn.remat, and closed_call. (A pjit's operands also have
# shardings and layouts each; none was seen holding a layer's constant.)
_HOISTED_FROM = {"remat2": "jaxpr", "closed_call": "call_jaxpr"}


def hoisted(closed: Any) -> Any:
    """`closed` (a ClosedJaxpr) with the integer literals inside its calls (_HOISTED_FROM)
    passed to the calls as operands: the same function, whose repeated checkpointed layers
    are the same equations (docs/internals-steps.md)."""
    jaxpr, _ = _hoist(closed.jaxpr, inner=False)
    return closed if jaxpr is closed.jaxpr else ClosedJaxpr(jaxpr, closed.consts)


def _hoist(jaxpr: Any, inner: bool) -> tuple[Any, list]:
    """(`jaxpr` with its calls' integer literals hoisted to their operands and, if `inner`,
    its own integer literals turned into new inputs after its others; those literals)."""
    eqns, literals, new_inputs = [], [], []

    def lift(v: Any) -> Any:
        if inner and isinstance(v, Literal) and np.issubdtype(v.aval.dtype, np.integer):
            literals.append(v)
            new_inputs.append(Var(v.aval))
            return new_inputs[-1]
        return v
    for eqn in jaxpr.eqns:
        key = _HOISTED_FROM.get(eqn.primitive.name)
        if key is not None:
            body = eqn.params[key]
            body_jaxpr, body_literals = _hoist(getattr(body, "jaxpr", body), inner=True)
            if body_literals:
                if isinstance(body, ClosedJaxpr):
                    body_jaxpr = ClosedJaxpr(body_jaxpr, body.consts)
                eqn = eqn.replace(invars=[*eqn.invars, *body_literals],
                                  params={**eqn.params, key: body_jaxpr})
        invars = [lift(v) for v in eqn.invars]
        changed = any(a is not b for a, b in zip(invars, eqn.invars))
        eqns.append(eqn.replace(invars=invars) if changed else eqn)
    if all(a is b for a, b in zip(eqns, jaxpr.eqns)):
        return jaxpr, []
    # the new inputs have no names: the debug info's names are dropped
    return jaxpr.replace(invars=[*jaxpr.invars, *new_inputs], eqns=eqns,
                         debug_info=jaxpr.debug_info.with_unknown_names()), literals


def _signatures(eqns: list) -> np.ndarray:
    """One integer per equation, equal where the equations do the same thing but for their
    literals' values (a layer's own constants, see `chain`): primitive, params (function
    objects' addresses blanked), operand and result types."""
    ids: dict[str, int] = {}
    out = []
    for eqn in eqns:
        ins = [f"lit {v.aval}" if isinstance(v, Literal) else str(v.aval) for v in eqn.invars]
        key = _ADDRESS.sub("", f"{eqn.primitive.name} {eqn.params} {ins} "
                               f"{[str(v.aval) for v in eqn.outvars]}")
        out.append(ids.setdefault(key, len(ids)))
    return np.asarray(out, dtype=np.int64)
