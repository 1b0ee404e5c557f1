"""Factor notation: how an operator's dimensions map onto shared factors, and strategies.

A rule names, for each operand and result dimension, a factor (or None: that dimension is never
split). `dot_general` of `b i, i o -> b o` has factors b, i, o; `i` appears in no result, so it is
a reduction factor: splitting it over a mesh axis leaves partial sums that need an all-reduce.
A strategy assigns mesh axes to factors; the operand and result shardings, and the collectives the
operator needs, follow from that. One rule per primitive covers every strategy.
"""
from __future__ import annotations

import functools
import itertools
import math
import string
from dataclasses import dataclass, field

from jax.sharding import PartitionSpec

from autopar.mesh import MeshShape

Dims = tuple[str | None, ...]  # one factor name (or None) per dimension
Spec = tuple[tuple[str, ...], ...]  # one tuple of mesh axes per dimension; () is replicated


# What a factor is to its operator (Rule.kind): in the operands and the results, split alike
# on both sides; the same, but the rows move along it (a shift or a rotation: each device
# sends its neighbour the rows that cross into its block); in the operands only, split into
# partial results that a sum combines; in the operands only, combined otherwise (a maximum, a
# product, a lookup's rows); a dimension with no factor (None) must stay whole.
PASS_THROUGH, SHIFTED, SUMMED, COMBINED, WHOLE = (
    "pass-through", "shifted", "summed", "combined", "whole")


@dataclass(frozen=True)
class Rule:
    """Factor notation of one operator instance. `combine` says how the partial results of a
    split reduction factor are combined: "sum" (a matrix product, reduce_sum, scatter-add),
    or an operation's name ("max", "and", ...; "lookup" for a gather's indexed rows, where each
    device's rows are summed with the others' zeros, which is a selection, not a sum of the
    rows); `shifted`, the factors along which rows move. The strategies do not depend on
    either, so rules equal but for them are equal."""

    operands: tuple[Dims, ...]
    results: tuple[Dims, ...]
    sizes: dict[str, int] = field(hash=False)
    combine: str = field(default="sum", compare=False)
    shifted: frozenset[str] = field(default=frozenset(), compare=False)

    @functools.cached_property
    def key(self) -> tuple:
        """Equal for rules of equal structure (factor names are assigned in a fixed order)."""
        return self.operands, self.results, tuple(sorted(self.sizes.items()))

    def __hash__(self) -> int:  # with the sizes: rules that differ only in them are many
        return self._hash

    def __getstate__(self) -> dict:  # a string's hash differs between processes: not pickled
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @functools.cached_property
    def _hash(self) -> int:  # rules key the strategy caches: hashed on every lookup
        return hash(self.key)

    def notation(self) -> str:
        """The rule in one line: each factor a letter, by first appearance, and `_` for a
        dimension never split; a scalar is `()`. `dot_general` of [B, I] x [I, O] reads
        `ab, bc -> ac`: b, in no result, is summed. Factors of other kinds are named after
        it: `reduce_max` of [B, I] over I reads `ab -> a (b by max)`, a shift along B of a
        pad `ab -> ab (a shifted)`."""
        letters: dict[str, str] = {}

        def letter(f: str | None) -> str:
            if f is None:
                return "_"
            if f not in letters:
                n = len(letters)
                letters[f] = string.ascii_letters[n] if n < len(string.ascii_letters) else f"<{n}>"
            return letters[f]

        def side(tensors: tuple[Dims, ...]) -> str:
            return ", ".join("".join(map(letter, dims)) or "()" for dims in tensors)
        text = f"{side(self.operands)} -> {side(self.results)}"

        def typed(f: str) -> str | None:  # summed and pass-through factors read as such
            kind = self.kind(f)
            return (f"{letters[f]} {SHIFTED}" if kind == SHIFTED else
                    f"{letters[f]} by {self.combine}" if kind == COMBINED else None)
        marks = [m for f in list(letters) if (m := typed(f))]
        return text + (f" ({', '.join(marks)})" if marks else "")

    @property
    def reduction_factors(self) -> frozenset[str]:
        in_results = {f for dims in self.results for f in dims if f}
        return frozenset(f for dims in self.operands for f in dims if f and f not in in_results)

    def kind(self, factor: str | None) -> str:
        """PASS_THROUGH, SHIFTED, SUMMED, COMBINED or WHOLE (`factor` None: a dimension never
        split)."""
        if factor is None:
            return WHOLE
        if factor not in self.reduction_factors:
            return SHIFTED if factor in self.shifted else PASS_THROUGH
        return SUMMED if self.combine == "sum" else COMBINED


@dataclass(frozen=True)
class Strategy:
    """Mesh axes per factor, and the shardings and partial sums that follow."""

    assignment: tuple[tuple[str, tuple[str, ...]], ...]
    in_specs: tuple[Spec, ...]
    out_specs: tuple[Spec, ...]
    partial_axes: tuple[str, ...]  # partial sums over these axes: all-reduce, or reduce-scatter
    # where the axis also shards the result (see `scattered`)
    parallel: int  # how many devices share the work

    def __hash__(self) -> int:  # strategies key the costs of every tally: hashed once
        return self._hash

    def __getstate__(self) -> dict:  # a string's hash differs between processes: not pickled
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.assignment, self.in_specs, self.out_specs, self.partial_axes,
                     self.parallel))

    def describe(self) -> str:
        ins = ", ".join(spec_str(s) for s in self.in_specs)
        outs = ", ".join(spec_str(s) for s in self.out_specs)
        placed = {a for spec in self.out_specs for axes in spec for a in axes}
        scatter = tuple(a for a in self.partial_axes if a in placed)
        reduce = tuple(a for a in self.partial_axes if a not in placed)
        extra = (f" reduce-scatter over {scatter}" if scatter else "") + (
            f" all-reduce over {reduce}" if reduce else "")
        return f"({ins}) -> ({outs}){extra}"


def replicated(rank: int) -> Spec:
    return ((),) * rank


def spec_str(spec: Spec) -> str:
    return str(to_partition_spec(spec))


def to_partition_spec(spec: Spec) -> PartitionSpec:
    """Our spec as a PartitionSpec, trailing replicated dimensions dropped."""
    entries = [None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def from_partition_spec(pspec: PartitionSpec, rank: int) -> Spec:
    """A PartitionSpec (or tuple of its entries) as our spec of the given rank."""
    entries = list(pspec) + [None] * (rank - len(pspec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def strategy(rule: Rule, mesh: MeshShape, assignment: dict[str, tuple[str, ...]]) -> Strategy:
    """The strategy that puts `assignment`'s mesh axes on its factors."""
    order = {a: i for i, a in enumerate(mesh.names)}

    def spec(dims: Dims) -> Spec:
        return tuple(tuple(sorted(assignment.get(f, ()), key=order.get)) if f else () for f in dims)

    reductions = rule.reduction_factors
    partial = tuple(sorted((a for f in reductions for a in assignment.get(f, ())), key=order.get))
    used = [a for axes in assignment.values() for a in axes]
    return Strategy(
        assignment=tuple(sorted((f, tuple(a)) for f, a in assignment.items() if a)),
        in_specs=tuple(spec(d) for d in rule.operands),
        out_specs=tuple(spec(d) for d in rule.results),
        partial_axes=partial,
        parallel=math.prod(mesh.axis_size(a) for a in used),
    )


def enumerate_strategies(rule: Rule, mesh: MeshShape, limit: int = 512,
                         scatter: bool | str = False) -> list[Strategy]:
    """Every way to put each mesh axis on at most one factor that its size divides; with
    `scatter`, also the reduce-scattering variants of each strategy with partial sums (with
    "first", only the variant along the first result dimension they divide).

    The replicated strategy comes first. Above `limit` strategies, those using fewer axes are
    kept: an operator with that many factors (a loop with many carried values) rarely profits
    from the rest, and the search stays small.
    """
    return list(_strategies(rule, mesh, limit, scatter))


@functools.lru_cache(maxsize=1 << 16)
def canonical(value: Rule | MeshShape) -> Rule | MeshShape:
    """The first object seen equal to `value`. Rules and meshes passed through this are found
    by identity in the strategy caches below, not compared field by field on every hit."""
    return value


# Rules repeat (every layer, the forward and backward pass, each round of the device recursion):
# strategies are computed once per rule structure and mesh.
@functools.lru_cache(maxsize=1 << 16)
def _strategies(rule: Rule, mesh: MeshShape, limit: int, scatter: bool | str
                ) -> tuple[Strategy, ...]:
    if scatter:  # the same objects as the plain strategies: caches keyed by identity hit
        options = _strategies(rule, mesh, limit, False)
        first = scatter == "first"
        return options + tuple(v for s in options
                               for v in scattered(s, rule, mesh)[:1 if first else None])
    factors = sorted(rule.sizes)
    axes = [a for a, s in zip(mesh.names, mesh.sizes) if s > 1]
    found: list[tuple[int, dict]] = []
    for choice in itertools.product([None, *factors], repeat=len(axes)):
        assignment: dict[str, tuple[str, ...]] = {}
        for axis, f in zip(axes, choice):
            if f is not None:
                assignment[f] = assignment.get(f, ()) + (axis,)
        if all(rule.sizes[f] % math.prod(mesh.axis_size(a) for a in ax) == 0
               for f, ax in assignment.items()):
            found.append((sum(c is not None for c in choice), assignment))
    found.sort(key=lambda item: item[0])
    return tuple(strategy(rule, mesh, a) for _, a in found[:limit])


@functools.lru_cache(maxsize=1 << 16)
def scattered(s: Strategy, rule: Rule, mesh: MeshShape) -> tuple[Strategy, ...]:
    """The variants of `s` that reduce-scatter its partial sums along a result dimension they
    divide, one per such dimension, instead of all-reducing them: half the bytes, and the
    result comes out sharded. A weight gradient reaches a sharded optimizer state this way;
    an activation's gradient reaches the token split of the layer below (a mixture of
    experts' combine: the first dimension is the model's, the second the tokens'). The
    scattered axes come after those already on the dimension: a reduce-scatter splits each
    device's block, and XLA, given the other order, gathers the whole result first
    (docs/decisions.md, "Where experts won, and the three fixes")."""
    if not s.partial_axes or len(rule.results) != 1:
        return ()
    n = math.prod(mesh.axis_size(a) for a in s.partial_axes)
    variants = []
    for d, f in enumerate(rule.results[0]):
        out = list(s.out_specs[0])
        if f and rule.sizes[f] % (n * math.prod(mesh.axis_size(a) for a in out[d])) == 0:
            out[d] = (*out[d], *s.partial_axes)
            variants.append(Strategy(s.assignment, s.in_specs, (tuple(out),), s.partial_axes,
                                     s.parallel))
    return tuple(variants)


@functools.lru_cache(maxsize=1 << 16)
def follow(rule: Rule, mesh: MeshShape, operand: int, spec: Spec) -> Strategy:
    """The strategy that keeps operand `operand` as `spec` arrives, as far as the rule allows.

    Axes on a dimension the rule cannot split, or that do not divide its factor, are dropped
    (the operand is gathered on that dimension).
    """
    assignment: dict[str, tuple[str, ...]] = {}
    for f, axes in zip(rule.operands[operand], spec):
        if f is None or not axes or f in assignment:
            continue
        kept: tuple[str, ...] = ()
        for a in axes:
            if rule.sizes[f] % (math.prod(mesh.axis_size(x) for x in kept) * mesh.axis_size(a)) == 0:
                kept += (a,)
        if kept:
            assignment[f] = kept
    return strategy(rule, mesh, assignment)
