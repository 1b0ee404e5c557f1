"""Planning within a memory budget: a price on memory, then recompute, then a clear refusal.

`plan_within(attempt, graph, mesh, limit, buffers, prove=False)` returns the fastest
candidate `attempt` finds whose peak, estimated with the buffer model `buffers`, fits `limit`
bytes per device. With no limit, or where the plan at no price fits, that plan is returned.
Otherwise `attempt` is called again with a price on each kept byte, then with layers
recomputed. With `prove` (dynamic_programming), `attempt` also takes a cap on kept bytes, and
the answer is proven fastest under a cap where it can be. Where no plan fits, it raises
MemoryLimitError (`nothing_fits`): the least memory found and what fills it.

Design and rationale: docs/internals-planning.md, "autopar/planning/budget.py".
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable

from autopar import progress
from autopar.cost.estimate import mib
from autopar.cost.memory import kept_bytes, plan_memory
from autopar.cost.model import shard_bytes
from autopar.cost.xla import BufferModel
from autopar.decisions import Decisions
from autopar.errors import MemoryLimitError
from autopar.mesh import MeshShape
from autopar.planning.assemble import Candidate
from autopar.trace.analysis import layer_steps, recomputed_layers, roles
from autopar.trace.ir import OpGraph
from autopar_search import SearchTooLargeError

RAISES = 12  # price rises of 8x before giving up on prices alone (8**12 ~ 7e10)
BISECTIONS = 5
# Prices below the first, 8x apart, tried where the first does not fit: the peak is not
# monotone in the price (see plan_within).
DESCENTS = 3
CAP_BISECTIONS = 3  # proven searches that raise the kept-bytes cap
# A price rise whose plan peaks above this share of the last plan's has stalled: the price no
# longer buys memory (activations the price cannot shard away), and recompute is tried.
STALL = 0.95

# (memory price in seconds per byte, forward steps to recompute, cap on kept bytes or None)
#  -> the search's candidate; with a cap, SearchTooLargeError where the answer cannot be proven
Attempt = Callable[[float, frozenset, "float | None"], Candidate]


def plan_within(attempt: Attempt, graph: OpGraph, mesh: MeshShape, limit: int | None,
                buffers: BufferModel, prove: bool = False,
                excluded: tuple[Decisions, ...] = ()) -> Candidate:
    """The fastest candidate `attempt` finds that fits `limit` bytes per device (see module
    doc), estimated as `buffers` (the compiler's buffer model) says. `prove`: `attempt` takes
    a cap on kept bytes (dynamic_programming), and the price search's answer is proven.
    `excluded`: plans not to return (compiled over the limit): the fastest other candidate the
    search found within the limit instead."""
    free = attempt(0.0, frozenset(), None)
    if limit is None or free.peak_bytes <= limit and free.decisions not in excluded:
        return free
    tried = [(0.0, free)]
    start = free.tally.total_s / max(free.peak_bytes, 1)
    attempt = _reported(attempt, tried)

    counted: dict[int, float] = {}  # id of a candidate (all kept in `tried`) -> kept bytes

    def kept(c: Candidate) -> float:
        if id(c) not in counted:
            counted[id(c)] = kept_bytes(graph, c.decisions, mesh)
        return counted[id(c)]

    def branch(recompute: frozenset, first: float | None = None) -> _Prices:
        """Prices 8x apart from `first`, or from the plain branch's first (with recompute, from
        no price at all), with the descents below it where that does not fit."""
        raises = [(first or start) * 8.0 ** k for k in range(RAISES + 1)]
        if first is None and recompute:
            raises[0] = 0.0
        return _Prices(attempt, tried, limit, start, recompute, raises, descend=first is None,
                       kept=kept, floor=None if recompute else free)

    def settled(prices: _Prices) -> tuple[float | None, Candidate]:
        price, c = prices.settle()
        proven = _proven(attempt, graph, mesh, limit, prices.recompute, c, tried) if prove else None
        return (None, proven) if proven is not None else (price, c)

    plain = branch(frozenset())
    outcome = plain.rise(stall=True)
    found = [settled(plain)] if outcome == "fits" else []
    if outcome != "fits":
        # Prices alone stalled or failed: recompute layers, planned from the leanest plan yet.
        # After a stall, from the price that plan was found at, and the plain prices go on
        # rising only while their plans stay faster than the fastest that fits with recompute
        # (docs/internals-planning.md).
        lean_price, lean = _leanest(tried)
        recompute = _layers_to_recompute(graph, lean.decisions, lean.peak_bytes, mesh, limit,
                                         buffers)
        if recompute:
            again = branch(recompute, lean_price if outcome == "stalled" and lean_price > 0
                           else None)
            found += [settled(again)] if again.rise() == "fits" else []
        if outcome == "stalled":
            bound = min((c.tally.total_s for _, c in found), default=math.inf)
            found += [settled(plain)] if plain.rise(faster_than=bound) == "fits" else []
    if not found:
        # The peak is not monotone in the price: below the first price, where a plan that fits
        # is searched after a rise (_Prices.settle), one can peak lower than any the rising
        # prices found (the Mixtral-width MoE on 8 x 8 v5p chips: 3,378 MiB at every price
        # from 9.9e-11 up, 2,824 MiB at 1.9e-13). Tried last, where nothing else fits.
        found = [(price, c) for price in plain.below() for c in [plain.trial(price)]
                 if c.peak_bytes <= limit]
    if excluded:
        found = [(p, c) for p, c in found + tried
                 if c.peak_bytes <= limit and c.decisions not in excluded]
    if not found:
        raise nothing_fits(_leanest(tried)[1], limit, graph, mesh)
    price, c = min(found, key=lambda pc: pc[1].tally.total_s)
    return _with_stats(c, price, tried, limit)


@dataclasses.dataclass
class _Prices:
    """One branch of the price search: the plans at `prices` in turn, `recompute` fixed."""

    attempt: Attempt
    tried: list
    limit: int
    start: float  # the first price of the plain branch: descents go below it
    recompute: frozenset
    prices: list[float]
    descend: bool  # try prices below `start` where the first of `prices` does not fit
    kept: Callable[[Candidate], float]  # the bytes a candidate keeps, as the price charges them
    floor: Candidate | None = None  # the plan at no price, where the branch's is known
    k: int = 0  # the next of `prices` to try
    lo: float = 0.0  # the highest price tried whose plan did not fit
    last: Candidate | None = None  # its plan
    fits: list = dataclasses.field(default_factory=list)

    def trial(self, price: float) -> Candidate:
        c = self.attempt(price, self.recompute, None)
        self.tried.append((price, c))
        if c.peak_bytes <= self.limit:
            self.fits.append((price, c))
        return c

    def rise(self, stall: bool = False, faster_than: float = math.inf) -> str:
        """Raise the price until a plan fits ("fits"), the prices run out ("exhausted"), a
        plan is no faster than `faster_than` ("slower"), or, with `stall`, a rise bought
        less than 1 - STALL of the last plan's peak ("stalled")."""
        while self.k < len(self.prices):
            if self.last is not None and self.last.tally.total_s >= faster_than:
                return "slower"
            price = self.prices[self.k]
            self.k += 1
            c = self.trial(price)
            if c.peak_bytes <= self.limit:
                return "fits"
            previous, self.lo, self.last = self.last, price, c
            if stall and previous is not None and c.peak_bytes > STALL * previous.peak_bytes:
                return "stalled"
        return "exhausted"

    def below(self) -> list[float]:
        """The prices below `start` tried where the peak may fall with the price: DESCENTS of
        them, 8x apart."""
        return [self.start / 8.0 ** j for j in range(1, DESCENTS + 1)]

    def settle(self) -> tuple[float, Candidate]:
        """After a rise that fits: where the branch's first price did not (and `descend`), try
        the prices below `start`, else lower prices below the one that fits
        (docs/internals-planning.md); the fastest that fits."""
        hi, above = self.fits[-1]
        for price in self.below() if self.k > 1 and self.descend else ():
            c = self.trial(price)
            if c.peak_bytes > self.limit and len(self.fits) > 1:
                break  # past the lowest price that fits
        # Between the last price over the limit and the first within it, unless a lower price
        # fits (the prices between would keep fewer bytes, at a higher cost). Where exact
        # searches found the plans at both ends, the price at which they cost the same (time
        # plus price times kept bytes): an exact plan found there that costs no less than they
        # do there shows that none lies between, and the search is done. Else bisection (an
        # inexact search's plans need not lie on the hull: a higher price can find a faster
        # plan), from an eighth of the price that fits.
        lo, below = self.lo, self.last or self.floor
        for _ in range(BISECTIONS if hi > 0 and len(self.fits) == 1 else 0):
            even = (below is not None and below.stats["exact"] and above.stats["exact"]
                    and self.kept(below) > self.kept(above)
                    and above.tally.total_s > below.tally.total_s)
            price = ((above.tally.total_s - below.tally.total_s)
                     / (self.kept(below) - self.kept(above)) if even
                     else math.sqrt(lo * hi) if lo > 0 else hi / 8)
            c = self.trial(price)
            if even and c.stats["exact"] and (c.tally.total_s + price * self.kept(c) >= (
                    1 - 1e-9) * (above.tally.total_s + price * self.kept(above))):
                break
            if c.peak_bytes <= self.limit:
                hi, above = price, c
            else:
                lo, below = price, c
        return min(self.fits, key=lambda f: f[1].tally.total_s)


def _reported(attempt: Attempt, tried: list) -> Attempt:
    """`attempt`, saying on the progress line which memory round it is."""
    def run(price: float, recompute: frozenset, cap: float | None) -> Candidate:
        progress.update("round", f"memory round {len(tried) + 1}: " + (
            f"proving a cap of {mib(cap)} kept" if cap is not None else
            f"price {price:.3g} s/byte") + (", layers recomputed" if recompute else ""))
        return attempt(price, recompute, cap)
    return run


def _leanest(tried: list[tuple[float | None, Candidate]]) -> tuple[float | None, Candidate]:
    """The price and candidate of the plan peaking lowest (the first, where several do)."""
    return min(tried, key=lambda pc: pc[1].peak_bytes)


def _proven(attempt: Attempt, graph: OpGraph, mesh: MeshShape, limit: int,
            recompute: frozenset, fitting: Candidate, tried: list) -> Candidate | None:
    """The proven fastest candidate under the largest kept-bytes cap tried whose plan fits
    `limit`, starting at the kept bytes of `fitting` (the price search's answer) and bisecting
    towards the least kept bytes among the faster plans that did not fit
    (docs/internals-planning.md). None where the search cannot prove (tables too large) or the
    first proven plan does not fit."""
    lo = kept_bytes(graph, fitting.decisions, mesh)
    over = [kept_bytes(graph, c.decisions, mesh) for _, c in tried
            if c.peak_bytes > limit and c.decisions.recompute == recompute]
    hi = min((k for k in over if k > lo), default=None)
    cap, best = float(lo), None
    for _ in range(1 + CAP_BISECTIONS):
        try:
            c = attempt(0.0, recompute, cap)
        except SearchTooLargeError:
            return None
        tried.append((None, c))
        if c.peak_bytes <= limit:
            best, lo = c, cap
        else:
            hi = cap
        if best is None or hi is None:
            break
        cap = (lo + hi) / 2
    return best


def _with_stats(chosen: Candidate, price: float | None, tried: list, limit: int) -> Candidate:
    """The candidate's stats with the price found (None: proven under a kept-bytes cap), and
    the searches it took: their number and their seconds together (`search_s` is the last
    search's alone)."""
    stats = chosen.stats.noting(memory_price_s_per_byte=price or 0.0, memory_solves=len(tried),
                                memory_limit_bytes=limit,
                                memory_search_s=sum(c.stats.seconds["search_s"] for _, c in tried))
    if price is not None and price > 0:  # the fastest fitting found; no proof none faster fits
        stats = dataclasses.replace(stats, exact=False)
    return dataclasses.replace(chosen, stats=stats)


def _layers_to_recompute(graph: OpGraph, decisions: Decisions, peak_bytes: int,
                         mesh: MeshShape, limit: int, buffers: BufferModel) -> frozenset:
    """Layers to recompute, most activation bytes first, until `decisions` (peaking at
    `peak_bytes` as they are) fit (or all are)."""
    specs = decisions.tensor_specs(graph)
    kind = roles(graph)
    layers = layer_steps(graph)

    def kept(steps: list[int]) -> float:  # activations are results of ops: all have a spec
        return sum(shard_bytes(graph.tensors[t], specs[t], mesh)
                   for i in steps for t in graph.program[i].outputs
                   if kind.get(t) == "activations")

    kept_by_layer = {name: kept(steps) for name, steps in layers.items()}
    order = sorted(layers, key=lambda name: -kept_by_layer[name])

    def first(n: int) -> frozenset:
        return frozenset(i for name in order[:n] for i in layers[name])

    def fits(n: int) -> bool:
        trial = decisions.recomputing(first(n))
        return plan_memory(graph, trial, mesh, buffers).peak_bytes <= limit

    # The fewest layers that fit (recomputing more layers keeps less). A deep model has too many
    # layers to estimate the plan once per layer: from a guess, the fewest layers whose kept
    # activations add up to the excess, the search gallops to a bracket and bisects it, two
    # estimates where the guess is right.
    kept_first = itertools.accumulate(kept_by_layer[name] for name in order)
    guess = next((n for n, k in enumerate(kept_first, 1) if k >= peak_bytes - limit), len(order))
    lo, hi, step = 0, len(order), 1  # fits(hi) is assumed: with none fitting, all are recomputed
    if guess < hi and fits(guess):
        hi = guess
        while hi - step > lo and fits(hi - step):
            hi, step = hi - step, step * 2
        lo = max(lo, hi - step)
    elif guess < hi:
        lo = guess
        while lo + step < hi and not fits(lo + step):
            lo, step = lo + step, step * 2
        hi = min(hi, lo + step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return first(hi)


def nothing_fits(lean: Candidate, limit: int, graph: OpGraph, mesh: MeshShape
                 ) -> MemoryLimitError:
    """The error for a budget no plan meets: the least memory found, and what fills it."""
    m = lean.memory
    kinds = ", ".join(f"{k.replace('_', ' ')} {mib(v)}" for k, v in m.at_peak.items() if v)
    largest = "; ".join(f"{what} {mib(b)}" for what, b in m.largest)
    layers = recomputed_layers(graph, lean.decisions.recompute)
    recomputed = f" with {len(layers)} layer(s) recomputed" if layers else ""
    return MemoryLimitError(
        f"no plan fits memory_limit={mib(limit)} per device on mesh {mesh}. The leanest plan "
        f"found{recomputed} needs {mib(m.peak_bytes)} per device, at {m.where}: {kinds}. "
        f"Largest buffers then: {largest}. Fix: allow at least {mib(m.peak_bytes)} "
        "(memory_limit=), use more devices, a smaller batch, gradient accumulation "
        "(microbatches=), or smaller dtypes.")
