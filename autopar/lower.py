"""Lowering: re-run the traced program under jax.jit with the plan pinned.

- `jit_step(graph, decisions, mesh, out_specs)`: the jitted flat step, its inputs and outputs
  sharded as planned, the inputs in `graph.donated` donated.
- `interpreter(...)`: the function it jits: each equation bound in turn, with
  `with_sharding_constraint`s at every resharding point and on every result XLA's
  propagation would not carry as planned. A scan the plan splits runs as a pinned while loop
  (lower_loop.py). With `Decisions.pinned_inside` False, only inputs and outputs are pinned.
  Recomputed steps (`Decisions.recompute`, and the user's own) run again in the backward
  pass, behind an `optimization_barrier`.
- `explicit_collectives`, `bind_explicit`: partial sums XLA would not reduce as planned,
  written out under shard_map.
Nothing here raises an error of its own.

Design and rationale: docs/internals-planning.md, "autopar/lower.py".
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from autopar.cost.model import partial_split
from autopar.cost.resharding import reshard_stops
from autopar.decisions import Decisions
from autopar.lower_loop import (pinnable_loop, remat_inputs, run_loop, sharded_inside,
                                side_results)
from autopar.rules.factors import Spec, Strategy, to_partition_spec
from autopar.rules.kinds import CONTRACTING, ELEMENTWISE
from autopar.trace.analysis import backward_steps, recomputed_layer_of
from autopar.trace.ir import OpGraph, Equation


def interpreter(graph: OpGraph, decisions: Decisions, mesh: Mesh,
                out_specs: Sequence[Spec]) -> Callable[..., list[Any]]:
    """A function of the flat inputs that computes the flat outputs under the plan."""
    lowering = _Lowering(graph, decisions, mesh)

    def run(*flat_args: Any) -> list[Any]:
        return _Run(lowering, flat_args).outputs(out_specs)

    return run


class _Lowering:
    """What the plan says of each program step: the specs its operands are read in and its
    results constrained to, which steps run with explicit collectives, which are recomputed."""

    def __init__(self, graph: OpGraph, decisions: Decisions, mesh: Mesh) -> None:
        self.graph, self.decisions, self.mesh = graph, decisions, mesh
        self.produced = decisions.tensor_specs(graph)
        self.recompute = decisions.recompute
        self.made_by = {t: i for i, step in enumerate(graph.program) for t in step.outputs}
        self.layer_of = recomputed_layer_of(graph, self.recompute)
        self.outside = remat_inputs(graph, graph.program)
        self.backward = (backward_steps(graph) if self.recompute or self.outside else set())
        # Steps that are one planning op whose partial sums need explicit collectives: run
        # under shard_map with psum / psum_scatter (see `explicit_collectives`).
        self.op_of = {op.outputs[0]: op for op in graph.ops if len(op.outputs) == 1}
        self.explicit = {i: how for i, step in enumerate(graph.program)
                         if (how := self.explicit_of(step)) is not None}
        self.resharded = {t for step in graph.program for t, need in zip(step.inputs, step.requires)
                          if need is not None
                          and decisions.ops[need[0]].in_specs[need[1]] != self.produced.get(t)}
        self.ahead = side_results(graph, self.backward or backward_steps(graph))

    def explicit_of(self, step: Equation) -> tuple | None:
        """How `step` runs with explicit collectives, where it is one planning op whose
        partial sums need them (see `explicit_collectives`); None otherwise."""
        op = self.op_of.get(step.outputs[0]) if _one_result(step) else None
        if op is None or op.inputs != step.inputs:
            return None
        return explicit_collectives(op.primitive, self.decisions.ops[op.id], op.params)

    def carried(self, step: Equation, t: int, read_as: list[tuple[tuple[int, ...], Spec | None]]
                ) -> bool:
        """Whether XLA's propagation gives result `t` of `step` its planned sharding unasked
        (docs/internals-planning.md)."""
        if step.eqn is None or step.eqn.primitive.name not in ELEMENTWISE or t in self.resharded:
            return False
        alike = [spec for shape, spec in read_as if shape == self.graph.tensors[t].shape]
        return bool(alike) and all(spec == self.produced[t] for spec in alike)

    def constrain(self, value: Any, spec: Spec) -> Any:
        if not self.decisions.pinned_inside:  # jax.jit's in/out shardings pin the ends
            return value
        primitive, params = _constraint(self.mesh, spec)
        return primitive.bind(value, **params)

    def pinned(self, t: int, value: Any) -> Any:
        """`value`, read through a barrier, pinned as `t` was produced: past the barrier it
        is a new value, XLA's to place. Left free, XLA split a depthwise convolution's input
        over the channels there, then could not give the result the batch split the plan
        pins ("Involuntary full rematerialization")."""
        spec = self.produced.get(t)
        return self.constrain(value, spec) if spec else value

    def execute(self, i: int, read: Callable[[int], Any]) -> list[Any]:
        """Run program step i on the values `read` gives; results constrained as planned."""
        return self.run_step(self.graph.program[i], read, self.explicit.get(i))

    def run_step(self, step: Equation, read: Callable[[int], Any], explicit: tuple | None = None,
                 in_loop: bool = False) -> list[Any]:
        """Run `step`, of the program or (`in_loop`) of a loop's body, on the values `read`
        gives. Inside a loop every result is constrained: the loop's values are XLA's to
        place wherever nothing pins them, and it placed them apart from the plan."""
        produced = self.produced
        values, read_as = [], []
        for t, need in zip(step.inputs, step.requires):
            value, spec = read(t), produced.get(t)
            if need is not None:
                spec = self.decisions.ops[need[0]].in_specs[need[1]]
                if spec != produced.get(t):
                    source = produced.get(t)
                    for stop in reshard_stops(source, spec) if source is not None else ():
                        value = self.constrain(value, stop)
                    value = self.constrain(value, spec)
            values.append(value)
            read_as.append((self.graph.tensors[t].shape, spec))
        if step.eqn is None:
            results = values
        else:
            eqn = step.eqn
            params = eqn.primitive.get_bind_params(eqn.params)
            with eqn.ctx.manager:
                if explicit is not None:
                    out = bind_explicit(self.mesh, eqn.primitive, params, values, *explicit)
                elif (self.decisions.pinned_inside and pinnable_loop(self.graph, step)
                      and sharded_inside(self, step)):
                    out = run_loop(self, step, values, params)
                else:
                    out = eqn.primitive.bind(*values, **params)
            results = out if eqn.primitive.multiple_results else [out]
        return [self.constrain(v, produced[t])
                if produced.get(t) and (in_loop or not self.carried(step, t, read_as)) else v
                for t, v in zip(step.outputs, results)]


class _Run:
    """One run of the program under the plan: the forward and backward values, and the
    recomputations the plan asks for, ordered after the backward pass reaches them."""

    def __init__(self, lowering: _Lowering, flat_args: Sequence[Any]) -> None:
        self.lowering, self.graph = lowering, lowering.graph
        self.env: dict[int, Any] = dict(zip(self.graph.inputs, flat_args))
        self.again: dict[int, Any] = {}  # values of the recomputed steps' second run
        self.held: dict[int, Any] = {}  # their outside inputs, read through the barrier
        self.barred: dict[int, dict[int, Any]] = {}  # remat -> its outside inputs, barred together
        self.latest: Any = None  # the backward pass's latest value: what a recomputation waits for

    def read(self, t: int) -> Any:
        return self.env[t] if t in self.env else self.graph.const_values[t]

    def recomputed(self, t: int) -> bool:
        return self.lowering.made_by.get(t) in self.lowering.recompute

    def reread(self, t: int, anchor: Any, layer: str | None = None) -> Any:
        """A value for a recomputation (of `layer`) or for the backward pass: a result of a
        recomputed step of that layer is recomputed (once); any other value, such as the
        layer's input from the layer before, is the forward pass's, read after `anchor`."""
        low = self.lowering
        i = low.made_by.get(t)
        if i not in low.recompute or layer not in (None, low.layer_of[i]):
            if t not in self.env:  # a constant
                return self.read(t)
            if t not in self.held:
                self.held[t] = low.pinned(t, _hold([self.env[t]], anchor)[0])
            return self.held[t]
        if t not in self.again:
            self.again.update(zip(self.graph.program[i].outputs, low.execute(
                i, lambda u: self.reread(u, anchor, low.layer_of[i]))))
        return self.again[t]

    def inside(self, path: tuple[int, ...], t: int) -> Any:
        """A value as the remat `path[-1]`, inside the remats `path[:-1]`, reads it: a value
        from outside it through its barrier, which reads the value as the enclosing remat
        does (or the plan's recomputation, or the forward pass)."""
        low, g = self.lowering, path[-1]
        if t not in low.outside[g]:
            return self.read(t)
        if g not in self.barred:
            anchor = self.anchor(low.outside[g])
            values = [self.inside(path[:-1], u) if len(path) > 1 else
                      self.reread(u, anchor) if self.recomputed(u) else self.read(u)
                      for u in low.outside[g]]
            self.barred[g] = {u: low.pinned(u, v)
                              for u, v in zip(low.outside[g], _hold(values, anchor))}
        return self.barred[g][t]

    def anchor(self, inputs: Sequence[int]) -> Any:
        """What a recomputation for these inputs waits for: one of them from the backward
        pass, else the backward pass's latest value."""
        low = self.lowering
        return next((self.env[t] for t in inputs if low.made_by.get(t) in low.backward),
                    self.latest)

    def tie(self, inputs: Sequence[int], side: Sequence[int]) -> None:
        """The loop's smallest input read through one optimization barrier with the `side`
        results (see `side_results`): what computes them runs before the loop. One input:
        all of them through the barrier made the TPU compiler hold 6% more of a small
        decoder's memory."""
        mine = [t for t in inputs if t in self.env]
        if not mine:
            return
        t = min(mine, key=lambda u: self.graph.tensors[u].nbytes)
        value, *_ = jax.lax.optimization_barrier((self.env[t], *(self.env[u] for u in side)))
        self.env[t] = self.lowering.pinned(t, value)

    def outputs(self, out_specs: Sequence[Spec]) -> list[Any]:
        low = self.lowering
        for i, step in enumerate(self.graph.program):
            reader = self.read
            if step.remat:
                reader = functools.partial(self.inside, step.remat)
            elif i in low.backward and any(self.recomputed(t) for t in step.inputs):
                anchor = self.anchor(step.inputs)
                reader = (lambda t, a=anchor: self.reread(t, a) if self.recomputed(t)
                          else self.read(t))
            if i in low.ahead and reader == self.read:
                self.tie(step.inputs, low.ahead[i])
            results = low.execute(i, reader)
            self.env.update(zip(step.outputs, results))
            if i in low.backward and results:
                self.latest = results[0]
        return [low.constrain(self.read(t), s) for t, s in zip(self.graph.outputs, out_specs)]


def jit_step(graph: OpGraph, decisions: Decisions, mesh: Mesh,
             out_specs: Sequence[Spec]) -> Any:
    """The jitted flat step: inputs and outputs sharded per plan, the inputs the caller
    donates (graph.donated) donated."""
    def named(spec: Spec) -> NamedSharding:
        return NamedSharding(mesh, to_partition_spec(spec))

    return jax.jit(
        interpreter(graph, decisions, mesh, out_specs),
        in_shardings=tuple(named(s) for s in decisions.inputs),
        out_shardings=[named(s) for s in out_specs],
        donate_argnums=tuple(sorted(graph.donated)),
    )


def _one_result(step: Equation) -> bool:
    return (step.eqn is not None and not step.eqn.primitive.multiple_results
            and len(step.outputs) == 1)


# Primitives whose partial sums the lowering may resolve itself: their local result on each
# device is its share of the sum (no replicated operand added in, as scatter-add has). A
# convolution's rule splits batch and features only (spatial dimensions stay whole), so its
# shards need no halo.
def explicit_collectives(primitive: str, st: Strategy, params: dict | None = None
                         ) -> tuple | None:
    """(strategy, axes to all-reduce, axes to reduce-scatter, the result dimension they
    scatter) where the plan's collective for the op's partial sums must be written out, None
    where sharding constraints get it from XLA as planned.

    Two cases XLA's partitioner, given only the shardings, does not compile as planned:
    - partial sums over reduction factors sharded over different axes (a contraction over heads
      on one axis and head_dim on another): one all-reduce per factor, chained, each of the
      full result, where the plan has one over all the axes;
    - a reduce-scatter: an all-reduce of the full result and a dynamic-slice, which only the
      GPU compiler's ReduceScatterCreator pass turns into a reduce-scatter (the CPU compiler
      has no such pass);
    - a batch-grouped convolution (a depthwise kernel's gradient) whose contraction is split
      while some mesh axis is left unused: XLA's partitioner (jax 0.10.2) computes it wrongly
      (a (16, 4, 16) input's batch split over 'b' of a 4x2 mesh gave errors of 84; split
      over both axes, or with the channels over 'a', it is right).
    psum_scatter splits each device's block, so the scattered axes must come after any axes
    already on that dimension; otherwise (rare) XLA is left to it."""
    if primitive not in CONTRACTING or len(st.out_specs) != 1 or not st.partial_axes:
        return None
    spec = st.out_specs[0]
    scatter, reduce = partial_split(st, spec)
    factors = sum(1 for _, axes in st.assignment if set(axes) <= set(st.partial_axes))
    if not scatter:
        batch_grouped = (params or {}).get("batch_group_count", 1) > 1
        return (st, tuple(reduce), (), 0) if factors > 1 or batch_grouped else None
    dims = [d for d, axes in enumerate(spec) if set(axes) & set(scatter)]
    if len(dims) != 1:
        return None
    axes = spec[dims[0]]
    if tuple(a for a in axes if a in scatter) != tuple(axes[len(axes) - len(scatter):]):
        return None
    return st, tuple(reduce), tuple(axes[len(axes) - len(scatter):]), dims[0]


def bind_explicit(mesh: Mesh, primitive: Any, params: dict, values: list, st: Strategy,
                   reduce: tuple, scatter: tuple, dim: int) -> Any:
    """`primitive` on each device's shards, its partial sums all-reduced over `reduce` (one
    collective) and reduce-scattered over `scatter` along `dim`."""
    params = _local_params(mesh, primitive.name, params, st)

    def local(*xs: Any) -> Any:
        y = primitive.bind(*xs, **params)
        if reduce:
            y = jax.lax.psum(y, reduce)
        if scatter:
            y = jax.lax.psum_scatter(y, scatter, scatter_dimension=dim, tiled=True)
        return y

    return jax.shard_map(local, mesh=mesh,
                         in_specs=tuple(to_partition_spec(s) for s in st.in_specs),
                         out_specs=to_partition_spec(st.out_specs[0]),
                         check_vma=False)(*values)


def _local_params(mesh: Mesh, name: str, params: dict, st: Strategy) -> dict:
    """`params` for one device's shards: a grouped convolution whose group factor is split
    holds fewer groups on each device (its rule splits the grouped lhs dim in whole groups)."""
    if name != "conv_general_dilated":
        return params
    dn = params["dimension_numbers"]
    lhs = st.in_specs[0]
    local = dict(params)
    for key, dim in (("feature_group_count", dn.lhs_spec[1]),
                     ("batch_group_count", dn.lhs_spec[0])):
        if params.get(key, 1) > 1:
            local[key] = params[key] // math.prod(mesh.shape[a] for a in lhs[dim])
    return local


def _hold(values: list[Any], anchor: Any) -> list[Any]:
    """`values` read through one optimization barrier with `anchor`, each tied to it (see
    `after_anchor`): what reads them runs after `anchor` is computed, and XLA cannot merge it with
    what read the same values before."""
    *values, _ = jax.lax.optimization_barrier((*values, anchor))
    return [after_anchor(v, anchor) for v in values]


def after_anchor(value: Any, anchor: Any) -> Any:
    """`value`, made to depend on `anchor` through arithmetic XLA keeps: XLA's CPU compiler
    drops optimization barriers before it schedules, and without this it would recompute in
    the forward pass. min(|a|, 0), with NaN taken for 0, is zero for every float, infinities
    included, and XLA does not fold it (`a * 0`, used before, is NaN for an infinite anchor;
    XLA folded `|a| < 0`, and the recomputation moved back into the forward pass)."""
    if anchor is None or not jax.numpy.issubdtype(value.dtype, jax.numpy.inexact):
        return value
    first = jax.numpy.ravel(anchor)[0]
    jnp = jax.numpy
    zero = jnp.where(jnp.isnan(first), 0, jnp.minimum(jnp.abs(first), 0)).astype(value.dtype)
    return value + zero


@functools.lru_cache(maxsize=4096)
def _constraint(mesh: Mesh, spec: Spec) -> tuple[Any, dict]:
    """The equation `with_sharding_constraint` makes for a value sharded as `spec`, as a
    primitive and its parameters. The lowering binds it directly, as it binds every other
    equation: the public function checks its arguments on every call, which made up a third
    of the lowering's time, and the plan's shardings are valid by construction."""
    sharding = NamedSharding(mesh, to_partition_spec(spec))
    shape = tuple(math.prod(mesh.shape[a] for a in axes) for axes in spec)
    jaxpr = jax.make_jaxpr(lambda x: jax.lax.with_sharding_constraint(x, sharding))(
        jax.ShapeDtypeStruct(shape, np.float32))
    (eqn,) = jaxpr.eqns
    return eqn.primitive, eqn.params
