"""A step's calling conventions, read as jax.jit reads them: which arguments are static
(baked into the trace, part of the cache key) and which donated, keyword arguments traced like
positional ones, and a clear error for an argument JAX cannot trace; and the arguments put
where a plan wants them (`place`)."""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

from autopar.distributed import multiprocess, place_everywhere
from autopar.errors import AutoparError, collect_errors
from autopar.placement.lanes import LayerRow
from autopar.placement.stored import unwrapped
from autopar.trace.tracer import argument_names, path_to_str


@dataclasses.dataclass(frozen=True)
class Conventions:
    """Which arguments of a step are static and which donated, read as jax.jit reads
    static_argnums/static_argnames and donate_argnums/donate_argnames: a parameter numbered in
    one is also named in the other (and the reverse), so that an argument counts however it
    is passed. Negative numbers count from the end of a call's positional arguments."""

    static_nums: frozenset[int] = frozenset()
    static_names: frozenset[str] = frozenset()
    donate_nums: frozenset[int] = frozenset()
    donate_names: frozenset[str] = frozenset()

    @classmethod
    def of(cls, fn: Callable, static_argnums: Any = (), static_argnames: Any = (),
           donate_argnums: Any = (), donate_argnames: Any = ()) -> Conventions:
        static = _argnums(fn, "static", static_argnums, static_argnames)
        donate = _argnums(fn, "donate", donate_argnums, donate_argnames)
        both = sorted(static[0] & donate[0]) + sorted(static[1] & donate[1])
        if both:
            raise AutoparError(f"arguments {both} of {function_name(fn)} are both static and "
                               "donated; "
                               "a static argument is a Python value with no buffer to donate. "
                               "Fix: drop them from static_argnums/static_argnames or from "
                               "donate_argnums/donate_argnames.")
        return cls(*static, *donate)


def _argnums(fn: Callable, option: str, argnums: Any, argnames: Any
             ) -> tuple[frozenset[int], frozenset[str]]:
    """One option pair (`static` or `donate`) as positions and names, each completed from the
    other through fn's signature, as jax.jit does."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums or ())
    names = (argnames,) if isinstance(argnames, str) else tuple(argnames or ())
    if (not all(isinstance(i, int) and not isinstance(i, bool) for i in nums)
            or not all(isinstance(n, str) for n in names)):
        raise AutoparError(f"{option}_argnums={argnums!r} / {option}_argnames={argnames!r}: "
                           "argnums are ints (positions) and argnames strings (parameter "
                           f"names), as in jax.jit. Fix: e.g. {option}_argnums=1 or "
                           f"{option}_argnames='train'.")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to complete them from
        return frozenset(nums), frozenset(names)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = {p.name: i for i, p in enumerate(positional) if p.kind == p.POSITIONAL_OR_KEYWORD}
    keywords.update({p.name: None for p in params if p.kind == p.KEYWORD_ONLY})
    unknown = [n for n in names if n not in keywords]
    if unknown and not any(p.kind == p.VAR_KEYWORD for p in params):
        raise AutoparError(f"{option}_argnames names {unknown}, which {function_name(fn)} does "
                           "not take "
                           f"by keyword (its parameters: {[p.name for p in params]}). Fix: name "
                           f"its parameters, or use {option}_argnums for positions.")
    nums += tuple(keywords[n] for n in names if keywords.get(n) is not None)
    names += tuple(positional[i].name for i in nums if 0 <= i < len(positional)
                   and positional[i].name in keywords)
    return frozenset(nums), frozenset(names)


class Call:
    """One call's arguments split as jax.jit splits them: the static ones, baked into the
    trace (hashable: they are part of the cache key), and the traced ones, positional then
    keyword by name, with their flat leaves and the positions of the donated leaves. A traced
    argument is named, for its paths, after its parameter (argN where it has none) or its
    keyword. An autopar.Placed argument is taken as the tree it wraps (`placed` says where
    and how it is stored, placement/stored.py)."""

    def __init__(self, fn: Callable, conventions: Conventions, args: tuple, kwargs: dict
                 ) -> None:
        args, kwargs, self.placed = unwrapped(args, kwargs)
        n = len(args)
        static_nums = {i + n if i < 0 else i for i in conventions.static_nums}
        donate_nums = {i + n if i < 0 else i for i in conventions.donate_nums}
        self.fn, self.positional = fn, n
        self.static: list[tuple[int | str, Any]] = []
        self.slots: list[int | str] = []  # where each traced argument goes: position or keyword
        self.traced: list[Any] = []
        donates = []
        for where, value in [*enumerate(args), *sorted(kwargs.items())]:
            if where in static_nums or where in conventions.static_names:
                self.static.append((where, value))
                continue
            self.slots.append(where)
            self.traced.append(value)
            donates.append(where in donate_nums or where in conventions.donate_names)
        self.leaves: list[Any] = []
        self.trees = []
        donated = []
        for value, donate in zip(self.traced, donates):
            leaves, tree = jax.tree_util.tree_flatten(value)
            if donate:
                donated += range(len(self.leaves), len(self.leaves) + len(leaves))
            self.leaves += leaves
            self.trees.append(tree)
        self.donated = frozenset(donated)
        self._check()

    @functools.cached_property
    def names(self) -> list[str]:
        """The traced arguments' names (read from fn's signature only when needed)."""
        positional = argument_names(self.fn, self.positional)
        return [positional[w] if isinstance(w, int) else w for w in self.slots]

    @functools.cached_property
    def paths(self) -> list[str]:
        """Each leaf's path, as the plan names it: the argument's name, then its pytree path."""
        return ["/".join(p for p in (name, path_to_str(keys)) if p)
                for name, value in zip(self.names, self.traced)
                for keys, _ in jax.tree_util.tree_flatten_with_path(value)[0]]

    def _needs_static(self, error: Exception) -> Exception:
        """`error` (the step needed the value of a traced argument, as under jax.jit), as an
        AutoparError naming the Python scalars passed traced, where there are any."""
        scalars = [name for name, value in zip(self.names, self.traced)
                   if isinstance(value, (bool, int, float))]
        if not scalars:
            return error
        return AutoparError(
            f"{function_name(self.fn)}{_where(self.fn, error)} uses the value of an argument that "
            f"autopar traces, as jax.jit does ({type(error).__name__}); it was passed the "
            f"Python value(s) "
            f"{', '.join(repr(n) for n in scalars)}. Fix: mark them static, "
            f"auto_parallel(..., static_argnames={tuple(scalars)!r}), or compute with "
            "jnp.where / lax.cond rather than Python `if`.")

    def _check(self) -> None:
        """Static values must be hashable and traced leaves arrays or numbers, as jax.jit
        needs; each problem named by argument, path and type, with the fix."""
        problems = []
        for where, value in self.static:
            try:
                hash(value)
            except TypeError:
                problems.append(f"static {_which(where)} is a {type(value).__name__}, which is "
                                "not hashable; static values are part of the cache key, as in "
                                "jax.jit. Fix: pass a hashable value (a tuple, a frozen "
                                "dataclass), or trace it (drop it from static_argnums/names)")
        if not all(map(_traceable, self.leaves)):
            for where, name, value in zip(self.slots, self.names, self.traced):
                for keys, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
                    if _traceable(leaf):
                        continue
                    path = "/".join(p for p in (name, path_to_str(keys)) if p)
                    option = (f"static_argnums={where}" if isinstance(where, int) else
                              f"static_argnames={where!r}")
                    inside = (" (the whole argument becomes static, so it must be hashable), "
                              "or take this value out of the pytree" if keys else "")
                    if keys and callable(leaf):  # an Equinox module's activation, say
                        inside += (" (an Equinox module: pass eqx.filter(model, eqx.is_array) "
                                   "and eqx.combine it with the rest inside the step, "
                                   "examples/equinox_mlp.py)")
                    problems.append(
                        f"{_which(where, name)}, at path {path!r}, has type "
                        f"{type(leaf).__name__} ({_short(leaf)}), which JAX cannot trace: "
                        f"only arrays and numbers can be. Fix: auto_parallel(..., {option}) "
                        f"bakes it into the trace, one plan per value, as jax.jit{inside}")
        collect_errors(problems, f"{function_name(self.fn)} got arguments autopar cannot take:")

    def key(self) -> Any:
        """The cache key: what a plan and its executable depend on."""
        return (tuple((where, type(v), v) for where, v in self.static), tuple(self.slots),
                tuple(self.trees), tuple((shape, str(dtype)) for shape, dtype in
                                         map(shape_and_dtype, self.leaves)))

    @functools.cached_property
    def jaxpr(self) -> tuple[Any, Any]:
        """The plain step's closed jaxpr and output shapes, traced once per call: the plan
        cache's key, and the trace a cached plain plan is applied to."""
        return jax.make_jaxpr(self.step(), return_shape=True)(*self.abstract())

    def abstract(self) -> list[Any]:
        """The traced arguments as shapes and dtypes (weak types kept), for tracing: without
        the shardings they arrive in, which on a mesh of Explicit axes would trace the step
        under JAX's sharding-in-types rules rather than as the single-device step it is."""
        def shape_of(x: Any) -> jax.ShapeDtypeStruct:
            aval = x if isinstance(x, (jax.ShapeDtypeStruct, LayerRow)) else jax.typeof(x)
            return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)

        return [jax.tree_util.tree_map(shape_of, value) for value in self.traced]

    def traced_positions(self, argnums: int | Sequence[int], option: str) -> list[int]:
        """Where the positional arguments `argnums` (negative: from the end) are among the
        traced ones."""
        nums = [argnums] if isinstance(argnums, int) else list(argnums)
        out = []
        for i in nums:
            where = i + self.positional if isinstance(i, int) and i < 0 else i
            if where not in self.slots:
                raise AutoparError(
                    f"{option}={argnums!r} names positional argument {i}, and this call of "
                    f"{function_name(self.fn)} has {self.positional} positional argument(s), "
                    "of which "
                    f"{sorted(w for w in self.slots if isinstance(w, int))} are traced. Fix: "
                    f"name the batch's position among the traced positional arguments.")
            out.append(self.slots.index(where))
        return out

    def step(self) -> Callable:
        """fn of the traced arguments alone, the static ones baked in; its parameters carry
        the arguments' names, which trace reads from the signature for the paths."""
        fn, slots = self.fn, tuple(self.slots)
        args: list[Any] = [None] * self.positional
        kwargs = {}
        for where, value in self.static:
            if isinstance(where, int):
                args[where] = value
            else:
                kwargs[where] = value

        def step(*traced: Any) -> Any:
            a, kw = list(args), dict(kwargs)
            for where, value in zip(slots, traced):
                if isinstance(where, int):
                    a[where] = value
                else:
                    kw[where] = value
            try:
                return fn(*a, **kw)
            except jax.errors.ConcretizationTypeError as e:  # a bool(tracer) among them
                raise self._needs_static(e) from e

        step.__name__ = step.__qualname__ = function_name(fn)
        step.__wrapped__ = fn  # type: ignore[attr-defined]  # JAX's messages name fn's source
        step.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY)
             for name in self.names], __validate_parameters__=False)
        return step


def shape_and_dtype(x: Any) -> tuple[tuple[int, ...], Any]:
    """A flat argument's shape and dtype (a layer of a stored stack's too)."""
    if isinstance(x, LayerRow):
        return x.shape, x.dtype
    return tuple(jax.numpy.shape(x)), jax.numpy.result_type(x)


def _traceable(x: Any) -> bool:
    """Whether jax can trace `x` as an argument: an array or a number (or their shapes)."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct, LayerRow, bool, int, float, complex)):
        return True
    if isinstance(x, (np.ndarray, np.generic)):
        try:
            jax.numpy.result_type(x)  # numeric dtypes only: not strings or objects
        except TypeError:
            return False
        return True
    return hasattr(x, "__jax_array__")


def _which(where: int | str, name: str | None = None) -> str:
    if isinstance(where, str):
        return f"keyword argument {where!r}"
    return f"argument {where}" + (f" ({name!r})" if name else "")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _where(fn: Callable, error: Exception) -> str:
    """' (file:line)' of the line in `fn` where `error` was raised, or ''."""
    code, line = getattr(inspect.unwrap(fn), "__code__", None), None
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" ({code.co_filename}:{line})" if line is not None else ""


def function_name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def place(call: Call, shardings: Sequence[NamedSharding], leaves: list[Any] | None = None
          ) -> list[Any]:
    """Put the call's inputs (or `leaves` in their stead) where the plan wants them: those
    not there already, in one batched device_put (several processes:
    distributed.place_everywhere).

    An array in host memory (the CPU platform's) is sliced from a numpy view of it: from a
    device array, device_put compiles a slicing program per shape and sharding (several
    times slower: docs/decisions.md, "Constraints only where XLA's propagation would not keep
    the plan"). A donated device array that has to move
    is copied first: device_put reuses the caller's buffer for a shard that is the whole
    array (a replicated leaf, such as optax's scalar count), and donating the mesh array would
    then delete the caller's."""
    leaves = call.leaves if leaves is None else leaves
    _check_alive(call, leaves)
    placed = list(leaves)
    moves = [k for k, (x, sharding) in enumerate(zip(leaves, shardings))
             if not (isinstance(x, jax.Array) and x.sharding == sharding)]
    if not moves:
        return placed
    if multiprocess():
        for k, x in place_everywhere(leaves, shardings, moves, call.paths).items():
            placed[k] = x
        return placed
    sources = []
    for k in moves:
        x = leaves[k]
        if isinstance(x, jax.Array) and _in_host_memory(x):
            x = np.asarray(x)
        elif isinstance(x, jax.Array) and k in call.donated:
            x = jax.numpy.array(x, copy=True)
        sources.append(x)
    for k, x in zip(moves, jax.device_put(sources, [shardings[k] for k in moves])):
        placed[k] = x
    return placed


def _check_alive(call: Call, leaves: Sequence[Any]) -> None:
    """An AutoparError for arrays deleted (donated to an earlier call, say): XLA CPU
    (jax 0.10.2) crashes the process when a cached executable is given one."""
    gone = [k for k, x in enumerate(leaves) if isinstance(x, jax.Array) and x.is_deleted()]
    if gone:
        paths = [call.paths[k] for k in gone]
        raise AutoparError(
            f"{len(gone)} argument array(s) of {function_name(call.fn)} were deleted, e.g. "
            f"{paths[:3]}: an earlier call donated them (donate_argnums / donate_argnames), "
            "or they were deleted by hand. Fix: pass the state that call returned, or copy "
            "the arrays before a call that donates them.")


def _in_host_memory(x: jax.Array) -> bool:
    """Whether numpy can view `x` without a transfer (key arrays have no numpy dtype)."""
    return (x.is_fully_addressable and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            and all(d.platform == "cpu" for d in x.sharding.device_set))
