"""Whether a loss is a sum over microbatches, and how to compute each microbatch's share.

`Separability(full, micro, microbatches, diff_leaves)` reads the loss traced at the full batch
and at one microbatch (accumulate.py), and records what each equation does in a microbatch
(`actions`) and which outputs are summed or per-example (`out_kinds`); `split_outputs` and
`outputs` combine the microbatches' results. Whether an operation keeps each example's values
to itself, or sums over the examples, is asked of its sharding rule (the batch dimension a
pass-through or a summed factor). What is no sum over microbatches (a batch statistic,
examples mixed or paired, a sum multiplied by a sum) raises an AutoparError that names the
operation and the fix.

Design and rationale: docs/internals-steps.md, "autopar/rewrite/separable.py".
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from jax.extend.core import Literal

from autopar.errors import AutoparError
from autopar.rewrite.draws import why_not_drawable
from autopar.rules.factors import PASS_THROUGH, SUMMED, Rule
from autopar.rules.kinds import CREATING, LINEAR, RANDOM_DRAWS, WITH_BODIES
from autopar.rules.table import rule_for
from autopar.trace.jaxpr import eqn_source, open_jaxpr
from autopar.trace.tracer import CALL_PRIMITIVES, scan_counts


@dataclasses.dataclass(frozen=True)
class Kind:
    batch: int | None = None  # the batch dimension of a per-example value
    dep: bool = False  # depends on what is differentiated
    summed: bool = False  # a batch sum


CONSTANT = Kind()


class Separability:
    """The analysis of one loss: what each equation does in a microbatch (`actions`), which
    outputs are summed and which are per-example (`out_kinds`)."""

    def __init__(self, full: Any, micro: Any, microbatches: int, diff_leaves: Sequence[int]):
        self.full, self.microbatches, self.diff_leaves = full, microbatches, list(diff_leaves)
        # Equations are keyed by where they are: the ids of the calls and loops around them,
        # then their own. An id alone is not enough: a jitted function (jax.random.bernoulli,
        # say) called twice with the same shapes puts one jaxpr object at both call sites.
        self.scope: tuple[int, ...] = ()
        self.actions: dict[tuple[int, ...], tuple] = {}
        self.randoms: list[tuple[tuple, int]] = []  # (key of the drawing equation, batch dim)
        self.hoisted: list[tuple] = []  # keys of the equations computed at the full batch
        # key of an examplewise scan -> its inputs' kinds, and its equation at one microbatch
        self.loops: dict[tuple[int, ...], tuple[list[Kind], Any]] = {}
        self.depth = 0  # loops around the equations being analysed
        self.draws_in_loops = False  # a loop draws per-example bits: evaluate needs `examples`
        dep = set(self.diff_leaves)
        ins = [self._kind(f.aval, m.aval, False, "an input of the loss")
               for f, m in zip(full.jaxpr.constvars, micro.jaxpr.constvars)]
        ins += [self._kind(f.aval, m.aval, k in dep, "an input of the loss")
                for k, (f, m) in enumerate(zip(full.jaxpr.invars, micro.jaxpr.invars))]
        outs = self._analyse(full.jaxpr, micro.jaxpr, ins)
        if outs and outs[0].batch is not None:
            raise AutoparError("the loss value is per-example; value_and_grad needs a scalar.")
        self.out_kinds = ["example" if k.batch is not None else
                          "summed" if k.summed else "constant" for k in outs]

    # -- analysis ---------------------------------------------------------------------------
    def _kind(self, full_aval: Any, micro_aval: Any, dep: bool, what: str) -> Kind:
        fs, ms = tuple(full_aval.shape), tuple(micro_aval.shape)
        if len(fs) != len(ms):
            raise AutoparError(f"{what} has rank {len(fs)} at the full batch and {len(ms)} at "
                               "a microbatch: the loss's code depends on the batch size.")
        dims = [d for d, (a, b) in enumerate(zip(fs, ms)) if a != b]
        if not dims:
            return Kind(None, dep)
        if len(dims) > 1 or fs[dims[0]] != self.microbatches * ms[dims[0]]:
            raise AutoparError(
                f"{what} has shape {fs} at the full batch and {ms} at a microbatch: it pairs "
                "examples with each other (in-batch negatives, say), and a sum over microbatches "
                "cannot give it. Fix: train without microbatches=.")
        return Kind(dims[0], dep)

    def _analyse(self, full: Any, micro: Any, ins: list[Kind]) -> list[Kind]:
        env: dict[Any, Kind] = dict(zip([*full.constvars, *full.invars], ins))

        def kind(v: Any) -> Kind:
            return CONSTANT if isinstance(v, Literal) else env[v]

        for ef, em in zip(full.eqns, micro.eqns, strict=True):
            name = ef.primitive.name
            if name != em.primitive.name:
                raise AutoparError("the loss traces to other operations at a microbatch than at "
                                   "the full batch: its code depends on the batch size.")
            where = f"{name} at {eqn_source(ef)}" if eqn_source(ef) else name
            kinds = [kind(v) for v in ef.invars]
            dep = any(k.dep for k in kinds)
            outs = [self._kind(f.aval, m.aval, dep, f"the result of {where}")
                    for f, m in zip(ef.outvars, em.outvars)]
            if name in CALL_PRIMITIVES and CALL_PRIMITIVES[name] in ef.params:
                outs = self._call(ef, em, kinds)
            elif name == "scan":
                outs = self._scan(ef, em, kinds, where)
            else:
                outs = self._decide(ef, kinds, outs, where)
            env.update(zip(ef.outvars, outs))
        return [kind(v) for v in full.outvars]

    def _call(self, ef: Any, em: Any, kinds: list[Kind]) -> list[Kind]:
        key = CALL_PRIMITIVES[ef.primitive.name]
        inner_f, consts_f = open_jaxpr(ef.params[key])
        inner_m, consts_m = open_jaxpr(em.params[key])
        before = len(self.actions)
        ins = [self._kind(f.aval, m.aval, False, "a constant of the loss")
               for f, m in zip(inner_f.constvars, inner_m.constvars)]
        outer, self.scope = self.scope, (*self.scope, id(ef))
        try:
            outs = self._analyse(inner_f, inner_m, ins + kinds)
        finally:
            self.scope = outer
        if len(self.actions) > before:
            self.actions[(*self.scope, id(ef))] = ("inline",)
        return outs

    def _scan(self, ef: Any, em: Any, kinds: list[Kind], where: str) -> list[Kind]:
        """A loop (a scanned layer stack, say) whose body keeps examples apart: each
        iteration's per-example values stay per-example, along the same dimension, and its
        body needs nothing done at the full batch."""
        p = ef.params
        nc, ncarry = scan_counts(p)
        body_f, consts_f = open_jaxpr(p["jaxpr"])
        body_m, consts_m = open_jaxpr(em.params["jaxpr"])
        xs = kinds[nc + ncarry:]
        if any(k.batch == 0 for k in xs):
            raise _refused(where, "loops over the examples of the batch")
        inner = [dataclasses.replace(k, batch=None if k.batch is None else k.batch - 1)
                 for k in xs]
        before = len(self.actions)
        ins = [self._kind(f.aval, m.aval, False, "a constant of a loop")
               for f, m in zip(body_f.constvars, body_m.constvars)]
        self.depth += 1
        outer, self.scope = self.scope, (*self.scope, id(ef))
        try:
            outs = self._analyse(body_f, body_m, ins + kinds[:nc + ncarry] + inner)
        finally:
            self.depth -= 1
            self.scope = outer
        added = [a[0] for a in list(self.actions.values())[before:]]
        if set(added) - {"drawn", "inline", "loop_draws"}:
            raise _refused(where, "computes from the batch alone what microbatches take from "
                                  "the full batch, inside a loop")
        if added:  # per-example random bits, drawn for each microbatch's own examples
            self.actions[(*self.scope, id(ef))] = ("loop_draws",)
            self.draws_in_loops = True
        carry_in, carry_out = kinds[nc:nc + ncarry], outs[:ncarry]
        if any((a.batch, a.summed) != (b.batch, b.summed) for a, b in zip(carry_in, carry_out)):
            raise _refused(where, "carries a value that changes how it depends on the batch "
                                  "from one iteration to the next (a sum over the batch, say)")
        self.loops[(*self.scope, id(ef))] = (kinds, em)
        return carry_out + [dataclasses.replace(k, batch=None if k.batch is None
                                                else k.batch + 1) for k in outs[ncarry:]]

    def _decide(self, ef: Any, kinds: list[Kind], outs: list[Kind], where: str) -> list[Kind]:
        name = ef.primitive.name
        per_example = [k for k in kinds if k.batch is not None]
        summed = any(k.summed for k in kinds)
        dep = any(k.dep for k in kinds)
        if any(o.batch is not None for o in outs):
            if summed:
                raise _refused(where, "computes per-example values from a sum over the batch "
                                      "(a batch statistic, as batch normalisation keeps)")
            if not per_example:
                if name in RANDOM_DRAWS and self.depth:
                    why = why_not_drawable(ef)
                    if why:
                        raise _refused(where, f"draws per-example random numbers inside a "
                                              f"loop, and {why}")
                    self.actions[(*self.scope, id(ef))] = ("drawn", outs[0].batch)
                elif name in RANDOM_DRAWS:
                    self.actions[(*self.scope, id(ef))] = ("random", len(self.randoms))
                    self.randoms.append(((*self.scope, id(ef)), outs[0].batch))
                elif name not in CREATING:
                    raise _refused(where, "makes per-example values from none")
                return outs
            if not _examplewise(ef, kinds, outs):
                raise _refused(where, "mixes examples along the batch dimension")
            return outs
        if per_example:
            if not dep:
                self.actions[(*self.scope, id(ef))] = ("hoist",)
                self.hoisted.append((*self.scope, id(ef)))
                return [Kind() for _ in outs]
            if not _summing(ef, kinds):
                raise _refused(where, "reduces over the batch other than by a sum")
            return [Kind(None, True, True) for _ in outs]
        if summed:
            scaled = _linear(ef, kinds, where)
            if scaled:
                self.actions[(*self.scope, id(ef))] = ("affine", scaled)
            return [Kind(None, True, True) for _ in outs]
        return outs

    # -- results ----------------------------------------------------------------------------
    def split_outputs(self, outs: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """A microbatch's outputs as (summed ones, a constant counting 1/M; per-example ones)."""
        m = self.microbatches
        summed = [o if k == "summed" else o / m
                  for o, k in zip(outs, self.out_kinds) if k != "example"]
        return summed, [o for o, k in zip(outs, self.out_kinds) if k == "example"]

    def outputs(self, summed: Sequence[Any], examples: Sequence[Any]) -> list[Any]:
        """The loss function's outputs from the microbatches' sums and per-example outputs."""
        it_s, it_e = iter(summed), iter(examples)
        return [next(it_e) if k == "example" else next(it_s) for k in self.out_kinds]


def _refused(where: str, why: str) -> AutoparError:
    return AutoparError(
        f"microbatches= needs a loss that is a sum over microbatches, and {where} {why}. "
        "Fix: train without microbatches=, or compute this outside the loss (batch "
        "statistics from the full batch, say).")


def _batch_factor(ef: Any, kinds: list[Kind]) -> tuple[Rule | None, str | None]:
    """The equation's sharding rule, and the factor its per-example operands' batch
    dimensions all are (None: none, or several). An equation with a body (a while loop, a
    conditional) is not judged by its rule, which speaks for its carries, not its body."""
    if ef.primitive.name in WITH_BODIES:
        return None, None
    rule = rule_for(ef.primitive.name, [tuple(v.aval.shape) for v in ef.invars],
                    [tuple(v.aval.shape) for v in ef.outvars], ef.params)
    if rule is None or len(rule.operands) != len(kinds):
        return None, None
    factors = {rule.operands[i][k.batch] if k.batch < len(rule.operands[i]) else None
               for i, k in enumerate(kinds) if k.batch is not None}
    return rule, (factors.pop() if len(factors) == 1 else None)


def _examplewise(ef: Any, kinds: list[Kind], outs: list[Kind]) -> bool:
    """Whether an operation on per-example values keeps each example's values to itself: its
    rule passes the batch dimensions through, as one factor, to each per-example result's."""
    rule, f = _batch_factor(ef, kinds)
    if rule is None or rule.kind(f) != PASS_THROUGH:
        return False
    return all(o.batch is None or o.batch < len(dims) and dims[o.batch] == f
               for o, dims in zip(outs, rule.results))


def _summing(ef: Any, kinds: list[Kind]) -> bool:
    """Whether an operation that removes the batch dimension sums over it: every operand is
    per-example, and their batch dimensions are one factor the rule sums."""
    rule, f = _batch_factor(ef, kinds)
    return (rule is not None and all(k.batch is not None for k in kinds)
            and rule.kind(f) == SUMMED)


# Why an operation is not linear in its operands' batch sums, by how it is linear in them
# (kinds.LINEAR), where `summed` says which operands are sums.
_NOT_LINEAR: dict[str, tuple[Callable[[list[bool]], bool], str]] = {
    "each": (lambda summed: False, ""),
    "one": (lambda summed: sum(summed) != 1, "multiplies two sums over the batch"),
    "first": (lambda summed: not summed[0] or any(summed[1:]),
              "divides by a sum over the batch"),
    "cases": (lambda summed: summed[0] or not all(summed[1:]),
              "selects between a sum over the batch and something else"),
}


def _linear(ef: Any, kinds: list[Kind], where: str) -> tuple[int, ...]:
    """Check an operation on a batch sum is linear in it; the positions of the batch-free
    operands an addition scales by 1/M."""
    how = LINEAR.get(ef.primitive.name)
    summed = [k.summed for k in kinds]
    if how is None:
        raise _refused(where, "is not linear in a sum over the batch, so the microbatches' "
                              "results cannot be added")
    if how == "added":
        return tuple(i for i, s in enumerate(summed) if not s)
    refuses, why = _NOT_LINEAR[how]
    if refuses(summed):
        raise _refused(where, why)
    return ()


