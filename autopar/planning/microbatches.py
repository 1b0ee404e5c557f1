"""How a step's gradient accumulation is planned: how many microbatches, and where they reduce.

- `check_microbatches(microbatches)`: AutoparError unless it is a positive int or "auto".
- `weigh_microbatches(call, microbatches, batch_argnums, shape, limit, stages=1, rounds=1)`:
  a search of schedules (driver.Weighing) that plans the step on `shape` within `limit` with
  `microbatches=M`, or for "auto" with the fewest whose plan fits. They run as shares reduced
  once after the loop (`Schedule.shares`, see accumulate.py) where that is estimated no slower and
  fits; else each reduces, and search_stats.reduced_per_microbatch says why. With `stages`,
  the layer stack is pipelined (gpipe.py).
- `fewest_fitting(plan_with, microbatches, call, batch_argnums)`: the plan and the counts
  tried; for "auto", MemoryLimitError where no count fits.
- `batch_groups(plan, positions)`: the device groups a plan splits the batch over.

Design and rationale: docs/internals-planning.md, "autopar/planning/microbatches.py".
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence, TypeVar

import jax
from jax.sharding import PartitionSpec

from autopar.calling import Call
from autopar.decisions import Decisions
from autopar.errors import AutoparError, MemoryLimitError
from autopar.mesh import MeshShape, mesh_shape
from autopar.plan import Plan
from autopar.planning.driver import Ask, Planned, Weighing, ask
from autopar.rewrite.accumulate import batch_size
from autopar.rewrite.ticks import STAGE_AXIS
from autopar.schedule import Schedule
from autopar.trace.ir import OpGraph

T = TypeVar("T")


def check_microbatches(microbatches: int | str) -> None:
    """An AutoparError unless `microbatches` is a positive int or "auto"."""
    if microbatches == "auto":
        return
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise AutoparError(f"microbatches={microbatches!r}: a positive int is needed (1: no "
                           "gradient accumulation), or 'auto' (the fewest that fit "
                           "memory_limit).")


def weigh_microbatches(call: Call, microbatches: int | str, batch_argnums: int | Sequence[int],
                       shape: MeshShape | int, limit: int | None, stages: int = 1,
                       rounds: int = 1) -> Weighing:
    """A search of schedules (driver.Weighing): the step planned on `shape` within `limit`,
    with the microbatches asked, or with the fewest that fit ("auto"), the counts tried
    recorded in the plan's search_stats; reduced once after the loop where that is no slower
    and fits (else search_stats.reduced_per_microbatch says why not). With `stages`, the
    loss's layer stack pipelined (gpipe.py; `rounds` times round), in shares on the other
    axes where that is no slower."""
    def plan_with(m: int) -> Weighing:
        return ask(Schedule(m, stages=stages, rounds=rounds), shape, limit)

    stage_shares = yield from _stage_shares_first(call, microbatches, batch_argnums, shape,
                                                  limit, stages, rounds)
    if stage_shares is not None and stage_shares.alone:
        return stage_shares.planned
    try:
        planned, tried = yield from fewest_fitting(plan_with, microbatches, call, batch_argnums)
    except AutoparError:
        if stage_shares is not None and stage_shares.planned is not None:  # the shares,
            return stage_shares.planned  # kept together, are all that could be planned
        raise
    if planned.plan.microbatches > 1:
        planned = yield from _reduced_once(call, batch_argnums, limit, planned, stages,
                                           rounds, stage_shares)
    return planned.noting(microbatches_tried=tuple(tried)) if len(tried) > 1 else planned


@dataclass(frozen=True)
class Shares:
    """A pipeline's shares planned first: their plan and whether to keep it without planning
    the microbatches reducing in each (`alone`), or why they could not be planned (`why_not`,
    for the plan's statistics)."""

    planned: Planned | None = None
    alone: bool = False
    why_not: str | None = None


def _stage_shares_first(call: Call, microbatches: int | str,
                        batch_argnums: int | Sequence[int], shape: MeshShape | int,
                        limit: int | None, stages: int, rounds: int
                        ) -> Generator[Ask, Any, Shares | None]:
    """A pipeline on a mesh with one axis of G > 1 devices besides 'stage': the step with G
    shares per microbatch planned on it, and whether to keep it without planning the
    microbatches reducing in each (docs/internals-planning.md), or why it could not be
    planned; None where the shares are not planned first."""
    if stages == 1 or not isinstance(shape, MeshShape) or not isinstance(microbatches, int):
        return None
    others = [(n, k) for n, k in shape.as_dict().items() if n != STAGE_AXIS and k > 1]
    if len(others) != 1:
        return None
    (axis, shares), = others
    positions = call.traced_positions(batch_argnums, "batch_argnums")
    if batch_size(call.abstract(), positions, 1) % (microbatches * shares):
        return None  # _reduced_once says why
    try:
        planned = yield from ask(Schedule(microbatches, shares, stages, rounds), shape, limit)
    except AutoparError as e:  # a share too small for the loss's code, or no fit
        return Shares(why_not=f"in {shares} shares: {e}")
    graph = planned.planning.graph
    return Shares(planned, _splits_loop_products(graph, planned.decisions, axis)
                  and _loop_communicates_less(graph, planned.plan))


def _loop_communicates_less(graph: OpGraph, p: Plan) -> bool:
    """Whether the operators inside `graph`'s loops take no longer to communicate than to
    compute in plan `p`."""
    in_loop = {op.id for op in graph.ops if op.repeat > 1}
    ops = [o for o in p.ops if o.index in in_loop]
    return sum(o.communication_s for o in ops) <= sum(o.compute_s for o in ops)


def _splits_loop_products(graph: OpGraph, decisions: Decisions, axis: str) -> bool:
    """Whether `decisions` split every matrix product and convolution inside `graph`'s loops
    over the mesh axis `axis`: where one runs whole on each of its devices, they repeat each
    other's work there (a pipeline's shares kept together)."""
    products = [st for op, st in zip(graph.ops, decisions.ops)
                if op.repeat > 1 and op.primitive in ("dot_general", "conv_general_dilated")]
    return bool(products) and all(
        any(axis in axes for _, axes in st.assignment) for st in products)


def _reduced_once(call: Call, batch_argnums: int | Sequence[int], limit: int | None,
                  first: Planned, stages: int = 1, rounds: int = 1,
                  stage_shares: Shares | None = None) -> Weighing:
    """`first` (a plan accumulating per microbatch, or pipelining over `stages`), or the same
    step with its gradient kept per share of G device groups and reduced once after the loop,
    planned on `first`'s mesh, where that is estimated no slower and fits (`_share_count`
    gives G; the 'stage' axis is not one of them: the stages hold different layers).
    `stage_shares`: what `_stage_shares_first` found, used instead of planning the shares
    again."""
    p = first.plan

    def per_microbatch(why: str) -> Planned:
        return first.noting(reduced_per_microbatch=why)

    if stage_shares is not None and stage_shares.why_not is not None:
        return per_microbatch(stage_shares.why_not)
    positions = call.traced_positions(batch_argnums, "batch_argnums")
    shape = mesh_shape(dict(p.mesh))
    shares = yield from _share_count(p, positions, shape, stages > 1)
    size = batch_size(call.abstract(), positions, 1)
    if shares == 1:
        return per_microbatch("no plan splits the batch")
    if size % (p.microbatches * shares):
        return per_microbatch(f"{p.microbatches} microbatches of {shares} shares do not "
                              f"divide the batch of {size}")
    try:
        in_shares = stage_shares.planned if stage_shares is not None else (yield from ask(
            Schedule(p.microbatches, shares, stages, rounds), shape, limit))
    except AutoparError as e:  # a share too small for the loss's code (one example, whose
        return per_microbatch(f"in {shares} shares: {e}")  # batch dimension a reshape drops),
    if in_shares.plan.cost.total_s > p.cost.total_s:       # or no fit
        return per_microbatch(f"in {shares} shares it is estimated slower "
                              f"({in_shares.plan.cost.total_s * 1e3:.3f} ms)")
    return dataclasses.replace(in_shares, mesh=first.mesh)  # planned again as first would be


def _share_count(p: Plan, positions: Sequence[int], shape: MeshShape, staged: bool = False
                 ) -> Generator[Ask, Any, int]:
    """G: the device groups `p` splits its batch over, else those of the step planned in one
    batch without a memory limit (reducing per microbatch can make a plan keep the batch
    whole, which the shares would not have to); 1 where neither splits it. `staged`: the
    'stage' axis does not count, and where one other axis is left the shares are over it
    without planning the whole step: that plan could only split the batch over it or not,
    and the shares' plan is kept only where it is estimated no slower anyway."""
    shares = batch_groups(p, positions, staged)
    if shares > 1:
        return shares
    others = [n for n, k in dict(p.mesh).items() if n != STAGE_AXIS and k > 1]
    if staged and len(others) == 1:
        return dict(p.mesh)[others[0]]
    try:
        whole = (yield from ask(Schedule(), shape, None)).plan
    except AutoparError:
        return 1
    return batch_groups(whole, positions, staged)


def batch_groups(p: Plan, positions: Sequence[int], staged: bool = False) -> int:
    """How many device groups `p` splits the batch arguments (`positions`) over: the product
    of the mesh axes on their first dimension, where every batch leaf has the same ones
    (`staged`: the 'stage' axis left out)."""
    specs = [s for i in positions for s in jax.tree_util.tree_leaves(
        p.input_specs[i], is_leaf=lambda x: isinstance(x, PartitionSpec)) if len(s)]
    firsts = {_axes(s[0]) for s in specs}
    if len(firsts) != 1:
        return 1
    sizes = dict(p.mesh)
    return math.prod(sizes[a] for a in firsts.pop() if not (staged and a == STAGE_AXIS))


def _axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def fewest_fitting(plan_with: Callable[[int], Generator[Ask, Any, T]],
                   microbatches: int | str, call: Call, batch_argnums: int | Sequence[int]
                   ) -> Generator[Ask, Any, tuple[T, list[int]]]:
    """`plan_with(M)` for the M asked (a search of schedules: `yield from` it), and the counts
    tried. For "auto": the fewest
    microbatches whose plan fits the memory limit, 1 first, then a bisection over the batch
    size's divisors, assuming that a count that fits leaves every larger count fitting.
    Each count traces the step again."""
    if microbatches != "auto":
        return (yield from plan_with(microbatches)), [microbatches]
    tried = [1]
    try:
        return (yield from plan_with(1)), tried
    except MemoryLimitError as e:
        alone = unfit = e
    positions = call.traced_positions(batch_argnums, "batch_argnums")
    size = batch_size(call.abstract(), positions, 1)
    counts = [m for m in range(2, size + 1) if size % m == 0]
    best, refused, lo, hi = None, None, 0, len(counts) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        tried.append(counts[mid])
        try:
            best, hi = (yield from plan_with(counts[mid])), mid - 1
        except MemoryLimitError as e:
            unfit, lo = e, mid + 1
        except AutoparError as e:  # not accumulated over so many: a microbatch of one
            refused, hi = e, mid - 1  # example may change the loss's code; try fewer
    if best is not None:
        return best, tried
    if unfit is alone and refused is not None:
        raise AutoparError(f"microbatches='auto': the step does not fit in one batch ({alone}), "
                           f"and accumulating it over microbatches fails: {refused}") from refused
    raise MemoryLimitError(f"microbatches='auto': no count of microbatches fits (tried {tried}). "
                           f"With the most that could be planned: {unfit}") from unfit
