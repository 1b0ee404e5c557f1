"""Tracing: a step function and its arguments become an OpGraph.

The whole step goes through `jax.make_jaxpr`, so the backward pass and the optimizer update are
in the graph. Calls (`jit`, `closed_call`, custom derivatives, `remat2`) are inlined; the steps of
a differentiated `remat2` (the backward pass of jax.checkpoint) are marked as its recomputation
(Equation.remat), which the lowering keeps apart from the forward pass. A `scan` is
kept whole for execution, and its body is inlined once into the planning view with its costs
scaled by the trip count, so the body's operators are planned like any other and the loop carry is
tied to one sharding across iterations.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend.core import Literal

from autopar.trace.ir import Op, OpGraph, Equation, Tensor
from autopar.trace.jaxpr import eqn_source, open_jaxpr

# Primitives whose body is inlined: they only group equations, they do not change semantics.
# JAX 0.10 emits jit, closed_call, call, the custom derivatives' calls (jax.nn.relu, gelu and
# optax's losses are custom_jvp), custom_vmap_call, linear_call, remat_opt (custom_vjp with
# optimize_remat) and remat2 (jax.checkpoint, nn.remat, nnx.remat); named_call and named_scope
# are only name stack. pjit, core_call, custom_vjp_call_jaxpr, checkpoint and remat are the
# names older JAX gave these; jax 0.11 names closed_call eval_jaxpr.
CALL_PRIMITIVES = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "call": "call_jaxpr",
    "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr", "custom_vmap_call": "call", "linear_call": "callee",
    "remat_opt": "fwd_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr", "remat": "jaxpr",
    "eval_jaxpr": "call_jaxpr",  # jax 0.11's closed_call (and custom rules' calls)
}


def path_to_str(keypath: Sequence[Any]) -> str:
    """'params/Dense_0/kernel' from a jax key path."""
    parts = []
    for key in keypath:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def argument_names(fn: Callable, count: int) -> list[str]:
    """The names of fn's first `count` positional parameters (arg0, arg1, ... where unknown)."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params[:count]]
    return names + [f"arg{i}" for i in range(len(names), count)]


def leaf_paths(tree: Any, prefix: str) -> list[str]:
    """Slash-joined path of every leaf of `tree`, under `prefix`."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return ["/".join(p for p in (prefix, path_to_str(kp)) if p) for kp, _ in leaves]


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype: Any) -> str:  # str() of a numpy dtype is slow, and asked per tensor
    return str(dtype)


@functools.lru_cache(maxsize=None)
def _itemsize(dtype: Any) -> int | None:
    """Bytes per element of a dtype numpy does not know, None for the others: a PRNG key
    array's element is its implementation's key data (threefry: 2 x uint32)."""
    if isinstance(dtype, str) or not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
    return math.prod(data.shape) * data.dtype.itemsize


@dataclass
class _Builder:
    tensors: list[Tensor] = field(default_factory=list)
    ops: list[dict] = field(default_factory=list)
    program: list[Equation] = field(default_factory=list)
    const_values: dict[int, Any] = field(default_factory=dict)
    recomputations: int = 0  # differentiated remat2 bodies seen (see Equation.remat)
    loop_ops: dict[int, tuple[int, ...]] = field(default_factory=dict)  # see OpGraph
    loop_bodies: dict[int, tuple] = field(default_factory=dict)  # see OpGraph

    def tensor(self, aval: Any, path: str | None = None, const: bool = False) -> int:
        shape = tuple(int(d) for d in getattr(aval, "shape", ()))
        dtype = getattr(aval, "dtype", "token")
        self.tensors.append(Tensor(len(self.tensors), shape, _dtype_name(dtype), path, const,
                                   _itemsize(dtype)))
        return len(self.tensors) - 1

    def constant(self, value: Any, aval: Any) -> int:
        tid = self.tensor(aval, const=True)
        self.const_values[tid] = value
        return tid

    def is_const(self, tid: int) -> bool:
        return self.tensors[tid].const

    def add_op(self, primitive: str, inputs: Sequence[int], outputs: Sequence[int],
               params: dict, source: str, repeat: int, names: Any = None,
               backward: bool | None = None) -> int:
        """`backward` (default: whether `names` is inside a transposition) marks the op as
        part of the backward pass."""
        stack = getattr(names, "stack", ())
        self.ops.append(dict(
            primitive=primitive, inputs=tuple(inputs), outputs=tuple(outputs), params=params,
            source=source, repeat=repeat,
            scope="/".join(e.name for e in stack if type(e).__name__ == "Scope"),
            backward=transposed(names) if backward is None else backward))
        return len(self.ops) - 1

    # -- the walk ------------------------------------------------------------------------------
    def walk(self, jaxpr: Any, consts: Sequence[int], args: Sequence[int], repeat: int,
             sink: list[Equation] | None, names: Any = None, remat: tuple[int, ...] = ()
             ) -> list[int]:
        """Add jaxpr's equations; returns the tensor ids of its outputs.

        `names` is the name stack of the enclosing call: an inlined equation's own name stack
        is relative to it. `remat`: the recomputations (see Equation.remat) the jaxpr is inside.
        `sink`: where its execution steps go (the program, a loop body's steps; None: nowhere).
        """
        env: dict[Any, int] = {}
        for var, tid in zip(jaxpr.constvars, consts):
            env[var] = tid
        for var, tid in zip(jaxpr.invars, args):
            env[var] = tid

        def read(atom: Any) -> int:
            if isinstance(atom, Literal):
                return self.constant(atom.val, atom.aval)
            return env[atom]

        for eqn in jaxpr.eqns:
            inputs = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            source = eqn_source(eqn)
            eqn_names = eqn.source_info.name_stack
            if names is not None:
                eqn_names = names + eqn_names
            if name in CALL_PRIMITIVES and CALL_PRIMITIVES[name] in eqn.params:
                inner = eqn.params[CALL_PRIMITIVES[name]]
                inner_jaxpr, inner_consts = open_jaxpr(inner)
                const_ids = [self.constant(c, getattr(c, "aval", None) or jax.typeof(c))
                             for c in inner_consts]
                inside = remat
                if eqn.params.get("differentiated") and np.any(eqn.params.get("prevent_cse")):
                    # The backward pass of a checkpointed function: it recomputes the forward
                    # values it needs, which the lowering keeps apart from the forward pass.
                    inside = (*remat, self.recomputations)
                    self.recomputations += 1
                outs = self.walk(inner_jaxpr, const_ids, inputs, repeat, sink, eqn_names,
                                 inside)
            elif name == "name":
                # checkpoint_name: it marks a value for a checkpoint policy, which JAX's partial
                # evaluation has applied by now (the saved values are the remat's operands).
                outs = inputs
            elif name == "scan":
                outs = self.scan(eqn, inputs, source, repeat, sink, eqn_names, remat)
            else:
                outs = [self.tensor(v.aval) for v in eqn.outvars]
                const = all(self.is_const(t) for t in inputs) and not eqn.effects
                if const:
                    self._mark_const(outs)
                    requires: tuple = (None,) * len(inputs)
                else:
                    op = self.add_op(name, inputs, outs, dict(eqn.params), source, repeat,
                                     eqn_names)
                    requires = tuple(None if self.is_const(t) else (op, i)
                                     for i, t in enumerate(inputs))
                if sink is not None:
                    sink.append(Equation(eqn, tuple(inputs), tuple(outs), requires, remat))
            for var, tid in zip(eqn.outvars, outs):
                env[var] = tid
        return [read(v) for v in jaxpr.outvars]

    def _mark_const(self, ids: Sequence[int]) -> None:
        for t in ids:
            old = self.tensors[t]
            self.tensors[t] = dataclasses.replace(old, const=True)

    def scan(self, eqn: Any, inputs: list[int], source: str, repeat: int,
             sink: list[Equation] | None, names: Any, remat: tuple[int, ...] = ()) -> list[int]:
        """Plan a scan's body once (costs x length); execute the scan whole, its body's own
        steps kept apart (OpGraph.loop_bodies). `remat`: the recomputations the scan is
        inside (its step's Equation.remat; its body's steps are a scope of their own)."""
        p = eqn.params
        body, body_consts = open_jaxpr(p["jaxpr"])
        (n_const, n_carry), length = scan_counts(p), int(p["length"])
        consts = inputs[:n_const]
        carries = inputs[n_const:n_const + n_carry]
        xs = inputs[n_const + n_carry:]
        outs = [self.tensor(v.aval) for v in eqn.outvars]
        requires: list = [None] * len(inputs)
        # The loop's own ops (carry, slice, stack) belong to the pass the scan is in: the
        # backward scan's slices read the forward pass's stacked activations, and its stacks
        # are the weight gradients (trace.analysis.roles), whatever scope they keep.
        backward = transposed(names)

        body_const_ids = [self.constant(c, jax.typeof(c)) for c in body_consts]
        carry_in, carry_ops = [], []
        for i, (var, init) in enumerate(zip(body.invars[n_const:n_const + n_carry], carries)):
            # Not a constant even where its initial value is one (an accumulator's zeros): it
            # changes from one iteration to the next, and its readers' resharding costs.
            tid = self.tensor(var.aval)
            carry_in.append(tid)
            # The carry op ties the initial value and the body's carry-out to one sharding; its
            # second operand is filled in once the body has been walked.
            op = self.add_op("scan_carry", (init,), (tid,), {"length": length}, source, repeat,
                             backward=backward)
            carry_ops.append(op)
            requires[n_const + i] = (op, 0)
        x_in = []
        for i, (var, x) in enumerate(zip(body.invars[n_const + n_carry:], xs)):
            tid = self.tensor(var.aval, const=self.is_const(x))
            x_in.append(tid)
            if not self.is_const(x):
                op = self.add_op("scan_slice", (x,), (tid,), {"reverse": p["reverse"]}, source,
                                 repeat, backward=backward)
                requires[n_const + n_carry + i] = (op, 0)
        first_op = len(self.ops)
        body_in = [*consts, *carry_in, *x_in]
        body_steps: list[Equation] | None = None if sink is None else []
        body_outs = self.walk(body, body_const_ids, body_in, repeat * length, body_steps,
                              names=names)
        body_ops = tuple(range(first_op, len(self.ops)))
        for op, out in zip(carry_ops, body_outs[:n_carry]):
            self.ops[op]["inputs"] = self.ops[op]["inputs"] + (out,)
        for k, (body_out, out) in enumerate(zip(body_outs, outs)):
            kind = "scan_carry_out" if k < n_carry else "scan_stack"
            if self.is_const(body_out):
                self._mark_const([out])
            else:
                self.add_op(kind, (body_out,), (out,), {"length": length}, source, repeat,
                            backward=backward)
        if sink is not None:
            if sink is self.program:
                self.loop_ops[len(self.program)] = body_ops
            self.loop_bodies[outs[0]] = (tuple(body_steps), tuple(body_in), tuple(body_outs))
            sink.append(Equation(eqn, tuple(inputs), tuple(outs), tuple(requires), remat))
        return outs


def transposed(names: Any) -> bool:
    """Whether a name stack is inside a transposition: the backward pass."""
    return any(type(e).__name__ == "Transform" and e.name == "transpose"
               for e in getattr(names, "stack", ()))


def scan_counts(params: dict) -> tuple[int, int]:
    """(constants, carries) among a scan equation's operands, the stacked inputs after them.
    jax 0.10 names the counts (num_consts, num_carry); jax 0.11 packs the operands' grouping
    in a FlatTree (ft_in: constants, carries, stacked inputs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carries, _ = params["ft_in"].unpack()
    return len(consts), len(carries)


def trace(fn: Callable, args: Sequence[Any], donated: frozenset[int] = frozenset(),
          compiler: str = "", jaxpr: tuple[Any, Any] | None = None) -> tuple[OpGraph, Any, Any]:
    """Trace `fn(*args)` into an OpGraph; `donated`: the flat input indices the caller donates;
    `compiler`: the platform that compiles it (OpGraph.compiler); `jaxpr`: its closed jaxpr
    and output shapes where the caller has them already.

    Returns the graph, the treedef of the arguments and the output shapes (a pytree of
    ShapeDtypeStruct).
    """
    names = argument_names(fn, len(args))
    closed, out_shape = jaxpr or jax.make_jaxpr(fn, return_shape=True)(*args)
    b = _Builder()
    in_paths = [p for name, a in zip(names, args) for p in leaf_paths(a, name)]
    inputs = [b.tensor(v.aval, path) for v, path in zip(closed.jaxpr.invars, in_paths)]
    consts = [b.constant(c, jax.typeof(c)) for c in closed.consts]
    outs = b.walk(closed.jaxpr, consts, inputs, repeat=1, sink=b.program)

    out_paths = leaf_paths(out_shape, "out")
    # An output that is an input passed through, a constant, or listed twice gets its own tensor
    # so that every output path has one.
    seen: set[int] = set()
    final_outs = []
    for tid, path in zip(outs, out_paths):
        t = b.tensors[tid]
        if tid in seen or t.path is not None or t.const:
            # eqn None: the lowering copies the value through.
            new = len(b.tensors)
            b.tensors.append(dataclasses.replace(t, id=new, path=path))
            requires: tuple = (None,)
            if not t.const:
                requires = ((b.add_op("copy_p", (tid,), (new,), {}, "output", 1), 0),)
            b.program.append(Equation(None, (tid,), (new,), requires))
            tid = new
        else:
            b.tensors[tid] = dataclasses.replace(t, path=path)
        seen.add(tid)
        final_outs.append(tid)

    ops = tuple(Op(i, **o) for i, o in enumerate(b.ops))
    graph = OpGraph(tuple(b.tensors), ops, tuple(b.program), tuple(inputs), tuple(final_outs),
                    b.const_values, state_pairs(args, out_shape, len(inputs)),
                    frozenset(donated), dict(b.loop_ops), compiler, dict(b.loop_bodies))
    return graph, jax.tree_util.tree_structure(tuple(args)), out_shape


def state_pairs(args: Sequence[Any], out_shape: Any, n_inputs: int) -> dict[int, int]:
    """Output leaf index -> input leaf index, for outputs that are the next value of an input.

    A train step returns its new state; the state's next sharding must equal its current one,
    or every call would start with a resharding. An argument pairs with the whole output or one
    top-level element of it when the tree structures and leaf shapes agree.
    """
    def signature(tree: Any) -> tuple:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return treedef, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", ""))) for x in leaves)

    candidates = [(0, out_shape)]
    if isinstance(out_shape, (tuple, list)):
        offsets = np.cumsum([0] + [len(jax.tree_util.tree_leaves(o)) for o in out_shape])
        candidates += [(int(off), o) for off, o in zip(offsets, out_shape)]
    pairs: dict[int, int] = {}
    used: set[int] = set()
    in_offset = 0
    for arg in args:
        n = len(jax.tree_util.tree_leaves(arg))
        sig = signature(arg)
        for k, (off, cand) in enumerate(candidates):
            if k not in used and n and signature(cand) == sig:
                used.add(k)
                pairs.update({off + j: in_offset + j for j in range(n)})
                break
        in_offset += n
    return pairs
