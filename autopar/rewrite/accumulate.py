"""Gradient accumulation: the loss's gradient over microbatches, in one loop inside the step.

- `value_and_grad`, `grad`: `jax.value_and_grad` and `jax.grad` outside `auto_parallel`. Under
  `microbatches=M` they give the full batch's loss and gradient, computed one microbatch at a
  time (microbatch j: examples j, j+M, ...).
- `step_of`, `accumulating`: the step with its value_and_grad accumulated as its `Schedule`
  says, and pipelined where it has stages (gpipe.py).
- `batch_size(args, batch, m)`: the batch arguments' one batch size.

They raise an AutoparError for a loss that is not a sum over microbatches (naming the
operation), a step that calls `autopar.value_and_grad` never or twice, a value_and_grad not run
for a microbatch, and batch leaves of different sizes or of a size M does not divide.

Design and rationale: docs/internals-steps.md, "autopar/rewrite/accumulate.py".
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from autopar.calling import Call
from autopar.errors import AutoparError
from autopar.rewrite.batches import (diff_leaves, grads_shape, lead, regroup, strided,
                                       strided_dim, unstrided)
from autopar.rewrite.gpipe import pipelined_value_and_grad
from autopar.rewrite.microbatch import evaluate, hoisted_values
from autopar.rewrite.separable import Separability
from autopar.schedule import Schedule

_ACTIVE: contextvars.ContextVar[_Accumulation | None] = contextvars.ContextVar(
    "autopar_accumulation", default=None)


class _Captured(BaseException):
    """Ends a trace of the step at its value_and_grad (BaseException: user code that catches
    Exception lets it through)."""


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   **options: Any) -> Callable:
    """`jax.value_and_grad`, accumulated over microbatches inside a step that
    `auto_parallel(..., microbatches=M)` runs (docs/internals-steps.md)."""
    plain = jax.value_and_grad(fun, argnums, has_aux, **options)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        accumulation = _ACTIVE.get()
        if accumulation is None:
            return plain(*args, **kwargs)
        return accumulation.value_and_grad(fun, argnums, has_aux, options, args, kwargs)
    return wrapped


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         **options: Any) -> Callable:
    """`jax.grad`, accumulated over microbatches as `value_and_grad` is."""
    both = value_and_grad(fun, argnums, has_aux, **options)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        value, grads = both(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads
    return wrapped


def step_of(call: Call, schedule: Schedule, batch_argnums: int | Sequence[int]) -> Callable:
    """The step autopar traces: the call's, or with its gradient accumulated and its loss's
    layer stack pipelined as `schedule` says (docs/internals-steps.md)."""
    if not schedule.rewrites:
        return call.step()
    return accumulating(call.step(), schedule,
                        call.traced_positions(batch_argnums, "batch_argnums"))


def accumulating(step: Callable, schedule: Schedule, batch: Sequence[int]) -> Callable:
    """`step` (a function of its traced arguments) with its value_and_grad accumulated over
    the schedule's microbatches, each computed in its shares side by side, and its loss's
    layer stack pipelined over its stages, its rounds times; `batch`: the positions of the
    arguments split into microbatches."""
    @functools.wraps(step)  # the step's name and signature: its inputs' paths
    def run(*args: Any) -> Any:
        accumulation = _Accumulation(step, schedule, tuple(batch), args)
        token = _ACTIVE.set(accumulation)
        try:
            out = step(*args)
        finally:
            _ACTIVE.reset(token)
        if not accumulation.calls:
            what = (f"pipeline={schedule.stages} pipelines" if schedule.stages > 1 else
                    f"microbatches={schedule.microbatches} accumulates the gradient of")
            raise AutoparError(
                f"{what} the step's loss, and this step took its gradient with something "
                "autopar cannot see. Fix: use autopar.value_and_grad (or autopar.grad) in "
                "place of jax.value_and_grad; outside auto_parallel they are jax's own.")
        return out
    return run


@dataclasses.dataclass
class _Accumulation:
    step: Callable
    schedule: Schedule
    batch: tuple[int, ...]
    args: tuple
    calls: int = 0
    mode: str = "full"  # "probe": trace a microbatch's loss; "microbatch": run one
    captured: Any = None
    inside: Any = None  # in "microbatch" mode: (analysis, hoisted values, this microbatch's)

    def value_and_grad(self, fun: Callable, argnums: int | Sequence[int], has_aux: bool,
                       options: dict, args: tuple, kwargs: dict) -> Any:
        loss = functools.partial(fun, **kwargs)
        if self.mode == "probe":
            self.captured = jax.make_jaxpr(loss)(*args)
            raise _Captured
        if self.mode == "microbatch":
            self.captured = self._one_microbatch(loss, argnums, options, args)
            raise _Captured
        self.calls += 1
        if self.calls > 1:
            raise AutoparError(
                f"microbatches={self.schedule.microbatches} accumulates one loss per step, "
                "and this step calls autopar.value_and_grad twice. Fix: add the losses into "
                "one function and take one value_and_grad of it.")
        full, out_shape = jax.make_jaxpr(loss, return_shape=True)(*args)
        schedule = self.schedule
        probe, parts = self._probe(), schedule.microbatches * schedule.shares
        diff = diff_leaves(args, argnums)
        if schedule.stages > 1:
            return pipelined_value_and_grad(
                full, probe, parts, diff, jax.tree_util.tree_structure(out_shape), args,
                argnums, options, schedule.stages, schedule.microbatches, schedule.shares,
                schedule.rounds)
        analysis = Separability(full, probe, parts, diff)
        hoisted, randoms = hoisted_values(analysis, full, jax.tree_util.tree_leaves(args))
        return self._loop(analysis, hoisted, randoms, out_shape, argnums, args)

    # -- the traces -------------------------------------------------------------------------
    def _probe(self) -> Any:
        """The loss's jaxpr at one microbatch: the step traced with a microbatch, to its
        value_and_grad."""
        sizes = self._sizes()

        def probe(*args: Any) -> None:
            try:
                self.step(*args)
            except _Captured:
                return
            raise AutoparError("the step's value_and_grad ran for the full batch and not for a "
                               "microbatch. Fix: keep the batch's size out of Python control "
                               "flow in the step.")

        previous, self.mode = self.mode, "probe"
        try:
            jax.make_jaxpr(probe)(*[self._microbatch_shape(i, a, sizes)
                                    for i, a in enumerate(self.args)])
        finally:
            self.mode = previous
        return self.captured

    def _sizes(self) -> tuple[int, int]:
        """(batch size, size of a microbatch's share), checked."""
        parts = self.schedule.microbatches * self.schedule.shares
        size = batch_size(self.args, self.batch, parts)
        return size, size // parts

    def _microbatch_shape(self, i: int, arg: Any, sizes: tuple[int, int]) -> Any:
        def shape(x: Any) -> Any:
            aval = jax.typeof(x)
            if not aval.shape:
                return x
            return jax.ShapeDtypeStruct((sizes[1], *aval.shape[1:]), aval.dtype,
                                        weak_type=aval.weak_type)
        return jax.tree_util.tree_map(shape, arg) if i in self.batch else arg

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self, analysis: Separability, hoisted: dict, randoms: list, out_shape: Any,
              argnums: int | Sequence[int], args: tuple) -> Any:
        m, g = self.schedule.microbatches, self.schedule.shares
        size, _ = self._sizes()
        split = [jax.tree_util.tree_map(lambda x: strided(x, m, g) if jnp.ndim(x) else
                                        jnp.broadcast_to(x, lead(m, g) + jnp.shape(x)),
                                        self.args[i])
                 for i in self.batch]
        random_xs = [strided_dim(v, dim, size, m, g) for v, dim in randoms]
        # Each microbatch's (share's) examples, by index in the batch: draws inside loops
        # take the full batch's bits at them (draws.py).
        example_xs = (strided(jnp.arange(size, dtype=jnp.int32), m, g)
                      if analysis.draws_in_loops else None)

        def share(batch_j: list, randoms_j: list, examples_j: Any) -> tuple[Any, Any]:
            args_j = list(self.args)
            for i, b in zip(self.batch, batch_j):
                args_j[i] = b
            previous, self.mode = self.mode, "microbatch"
            self.inside = (analysis, hoisted, [jnp.moveaxis(r, 0, dim)
                                               for r, (_, dim) in zip(randoms_j, randoms)],
                           examples_j)
            try:
                self.step(*args_j)
            except _Captured:
                pass
            else:
                raise AutoparError("the step's value_and_grad did not run for a microbatch.")
            finally:
                self.mode = previous
            return self.captured

        def body(carry: Any, xs: Any) -> tuple[Any, Any]:
            sums, examples = (share if g == 1 else jax.vmap(share))(*xs)
            return jax.tree_util.tree_map(jnp.add, carry, sums), examples

        per_share = (g,) if g > 1 else ()
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(per_share + s.shape, s.dtype),
                                       self._summed_shape(analysis, out_shape, argnums, args))
        (summed, grads), examples = jax.lax.scan(body, zeros, (split, random_xs, example_xs))
        if g > 1:  # the shares' sums, added once: the loop's only reduction over the batch
            summed, grads = jax.tree_util.tree_map(lambda x: x.sum(0), (summed, grads))
        value = analysis.outputs(summed, [unstrided(e, size, g) for e in examples])
        value = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), value)
        return value, grads

    def _summed_shape(self, analysis: Separability, out_shape: Any,
                      argnums: int | Sequence[int], args: tuple) -> Any:
        outs = jax.tree_util.tree_leaves(out_shape)
        summed = [o for o, kind in zip(outs, analysis.out_kinds) if kind != "example"]
        return summed, grads_shape(args, argnums)

    def _one_microbatch(self, loss: Callable, argnums: int | Sequence[int], options: dict,
                        args: tuple) -> Any:
        """This microbatch's summed outputs (loss, and aux sums), gradients and per-example
        outputs, as the analysis says to compute them."""
        analysis, hoisted, randoms, positions = self.inside
        closed = jax.make_jaxpr(loss)(*args)
        flat, tree = jax.tree_util.tree_flatten(args)
        diff = analysis.diff_leaves

        def summed_loss(*diff_values: Any) -> Any:
            leaves = list(flat)
            for k, v in zip(diff, diff_values):
                leaves[k] = v
            outs = evaluate(analysis, closed, leaves, hoisted, randoms, positions)
            summed, examples = analysis.split_outputs(outs)
            return summed[0], (summed, examples)

        (_, (summed, examples)), grads = jax.value_and_grad(
            summed_loss, argnums=tuple(range(len(diff))), has_aux=True, **options)(
            *[flat[k] for k in diff])
        return (summed, regroup(grads, args, argnums)), examples


def batch_size(args: Sequence[Any], batch: Sequence[int], m: int) -> int:
    """The batch arguments' one batch size (their leaves' first dimension), checked to be one
    and divisible by `m`."""
    leaves = [x for i in batch for x in jax.tree_util.tree_leaves(args[i])
              if jnp.ndim(x)]  # a scalar (a key, a flag) goes to every microbatch
    sizes = {jnp.shape(x)[0] for x in leaves}
    if len(sizes) != 1:
        shapes = sorted({str(jnp.shape(x)) for x in leaves})
        raise AutoparError(
            f"microbatches={m} splits the batch arguments {list(batch)} along their first "
            f"dimension, and their leaves have shapes {', '.join(shapes) or 'none'}: not one "
            "batch size. Fix: pass per-example arrays only in the batch (close over the "
            "rest), or set batch_argnums.")
    (size,) = sizes
    if size % m:
        raise AutoparError(f"microbatches={m} does not divide the batch of {size}. Fix: use "
                           f"a divisor of {size}.")
    return size
