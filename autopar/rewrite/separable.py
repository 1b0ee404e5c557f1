"""Whether a loss is a sum over microbatches, and how to compute each microbatch's share.

The loss is traced at the full batch and at one microbatch (accumulate.py); the two jaxprs
have the same equations, and a value's batch dimension is the one whose size differs between
them (by the number of microbatches). Each value is then
- per-example ("example"): it has the batch dimension;
- a batch sum ("summed"): it depends on what is differentiated and is linear in sums over the
  batch of per-example values;
- batch-free ("constant"): everything else.
The loss of the full batch is the sum over microbatches of each microbatch's loss when
- a batch sum is only ever added, negated, scaled by a batch-free value or reshaped, and a
  batch-free value added to it counts 1/M in each microbatch;
- what reduces over the batch, from the batch alone (a token count), is computed once, at the
  full batch ("hoisted");
- per-example random numbers are drawn once for the full batch and sliced; inside a loop
  (dropout in a scanned stack) each microbatch draws its own examples' bits (draws.py);
- operations on per-example values keep examples apart (no reduction, slice or shift along the
  batch dimension), and nothing per-example is computed from a batch sum.
Anything else is refused with an AutoparError that names the operation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from jax.extend.core import Literal

from autopar.errors import AutoparError
from autopar.rewrite.draws import why_not_drawable
from autopar.rules.kinds import CUMULATIVE, ELEMENTWISE, REDUCTIONS
from autopar.trace.jaxpr import eqn_source, open_jaxpr
from autopar.trace.tracer import CALL_PRIMITIVES, scan_counts

RANDOM_DRAWS = frozenset({"random_bits", "rng_bit_generator", "rng_uniform"})
CREATING = RANDOM_DRAWS | {"iota", "broadcast_in_dim"}
LAYOUT = frozenset({"broadcast_in_dim", "squeeze", "expand_dims", "transpose", "copy",
                    "copy_p", "convert_element_type", "reduce_precision", "bitcast_convert_type"})
# Linear in their batch-sum operand (the others batch-free): what a loss may do with a sum.
LINEAR = LAYOUT | {"neg", "reduce_sum", "reshape", "mul", "div", "dot_general", "add", "sub",
                   "add_any", "select_n"}
ADDING = frozenset({"add", "sub", "add_any"})


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


def _examplewise(ef: Any, kinds: list[Kind], outs: list[Kind]) -> bool:
    """Whether an operation on per-example values keeps each example's values to itself."""
    name, p = ef.primitive.name, ef.params
    batch = [k.batch for k in kinds]
    b = next(x for x in batch if x is not None)
    if name in ELEMENTWISE or name in LAYOUT:
        return True
    if name == "reshape":  # (B, ...) <-> (B * k, ...): examples stay whole rows
        return b == 0 and outs[0].batch == 0
    if name in REDUCTIONS or name in ("argmax", "argmin"):
        return b not in p["axes"]
    if name in CUMULATIVE:
        return b != p["axis"]
    if name == "sort":
        return b != p["dimension"]
    if name == "concatenate":
        return outs[0].batch != p["dimension"]
    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        sides = [(batch[0], lc, lb), (batch[1], rc, rb)]
        if all(x is not None for x in batch[:2]):
            return (batch[0], batch[1]) in zip(lb, rb)
        return all(x is None or x not in c for x, c, _ in sides)
    if name == "conv_general_dilated":
        return batch[1] is None and batch[0] == p["dimension_numbers"].lhs_spec[0]
    if name == "gather":  # a lookup into a batch-free table, or each example's own
        if batch[0] is None:
            return True
        dn = p["dimension_numbers"]
        if batch[1] is None:  # a slice of every example (x[..., 0]), the batch kept whole
            b = batch[0]
            return (b not in dn.start_index_map and b not in dn.collapsed_slice_dims
                    and p["slice_sizes"][b] == ef.invars[0].aval.shape[b])
        return (batch[1] is not None and batch[0] in dn.operand_batching_dims
                and dn.start_indices_batching_dims[dn.operand_batching_dims.index(batch[0])]
                == batch[1])
    if name == "slice":
        full = ef.invars[0].aval.shape[b]
        return (p["start_indices"][b] == 0 and p["limit_indices"][b] == full
                and (p["strides"] is None or p["strides"][b] == 1))
    if name == "pad":
        return tuple(p["padding_config"][b]) == (0, 0, 0)
    return False


def _summing(ef: Any, kinds: list[Kind]) -> bool:
    """Whether an operation that removes the batch dimension sums over it."""
    name, p = ef.primitive.name, ef.params
    batch = [k.batch for k in kinds]
    if name == "reduce_sum":
        return batch[0] in p["axes"]
    if name == "dot_general":
        (lc, rc), _ = p["dimension_numbers"]
        return (batch[0], batch[1]) in zip(lc, rc)
    return False


def _linear(ef: Any, kinds: list[Kind], where: str) -> tuple[int, ...]:
    """Check an operation on a batch sum is linear in it; the positions of the batch-free
    operands an addition scales by 1/M."""
    name = ef.primitive.name
    summed = [k.summed for k in kinds]
    if name not in LINEAR:
        raise _refused(where, "is not linear in a sum over the batch, so the microbatches' "
                              "results cannot be added")
    if name in ADDING:
        return tuple(i for i, s in enumerate(summed) if not s)
    if name == "select_n" and (summed[0] or not all(summed[1:])):
        raise _refused(where, "selects between a sum over the batch and something else")
    if name in ("mul", "dot_general") and sum(summed) != 1:
        raise _refused(where, "multiplies two sums over the batch")
    if name == "div" and (not summed[0] or summed[1]):
        raise _refused(where, "divides by a sum over the batch")
    return ()


