"""What is known about each primitive's kind, in one place. Every set the rules, the search
problem, the cost model, the buffer models and the lowering test a primitive against is
derived here, so that a new primitive is classified once.

Facts about one compiler (what XLA CPU fuses or recomputes) are derived from these kinds in
that compiler's module (autopar.cost.xla), not listed again by name.
"""
from __future__ import annotations

import math
from typing import Sequence

# Elementwise arithmetic that XLA's fusion deems cheap (InstructionFusion::IsExpensive is
# false): a fused result of one of these can be recomputed inside its reader. one_minus_square
# (1 - x*x, tanh's derivative since jax 0.11.2) lowers to a multiply and a subtract.
CHEAP_ELEMENTWISE = frozenset({
    "abs", "add", "add_any", "and", "ceil", "clamp", "convert_element_type", "copy", "copy_p",
    "eq", "floor", "ge", "gt", "imag", "integer_pow", "is_finite", "le", "lt", "max", "min",
    "mul", "ne", "neg", "not", "one_minus_square", "or", "population_count", "real",
    "reduce_precision", "round", "select_n", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "square", "stop_gradient", "sub", "xor",
})
# The other elementwise primitives: transcendental functions and divisions, which XLA deems
# expensive, and some not measured yet, which are treated as expensive too (their results are
# kept, the side that overestimates memory).
OTHER_ELEMENTWISE = frozenset({
    "acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "bessel_i0e", "bessel_i1e",
    "cbrt", "clz", "complex", "conj", "cos", "cosh", "digamma", "div", "erf", "erf_inv", "erfc",
    "exp", "exp2", "expm1", "igamma", "igamma_grad_a", "igammac", "le_to", "lgamma", "log",
    "log1p", "logistic", "lt_to", "nextafter", "polygamma", "pow", "regularized_incomplete_beta",
    "rem", "rsqrt", "sin", "sinh", "sqrt", "tan", "tanh", "zeta",
})
# Elementwise by their shapes, with no arithmetic: marks and loop carries.
# The autopar.shard primitive (autopar.trace.shard), by name: rules come before the tracer.
SHARD_MARK = "autopar_shard"
# The pipelined stack's read of a per-layer input, and of its gradient
# (autopar.primitives.stack_read).
STACK_READ = "autopar_stack_read"
# A loop's carried value, in and out (autopar.trace): elementwise as shapes go, but its rows
# along the loop are its iterations' values.
LOOP_CARRIES = frozenset({"scan_carry", "scan_carry_out"})
MARKS = frozenset({SHARD_MARK, STACK_READ, "optimization_barrier"}) | LOOP_CARRIES
ELEMENTWISE = CHEAP_ELEMENTWISE | OTHER_ELEMENTWISE | MARKS

# Elementwise too, but not fused: random numbers, one key (a key array's element) or one
# counter at a time. Seeding, folding data into keys, copying them, the hash itself on uint32
# words (a loop of rounds on CPU: XLA does not fuse it into its readers), and gamma draws (a
# rejection loop per element).
RANDOM_ELEMENTWISE = frozenset({"random_seed", "random_fold_in", "random_clone", "threefry2x32",
                                "threefry4x32", "random_gamma"})

# The circular pipeline's roll along the stages (autopar.primitives.rotate), by name.
ROTATE = "autopar_rotate"
# Operators whose rule may shift rows along a dimension (rules.layout.shifts): a pad low k and
# high -k, a rotation.
SHIFTING = frozenset({"pad", ROTATE})
# Layout operators that are one HLO instruction, cheap to XLA's fusion like CHEAP_ELEMENTWISE;
# a rotation lowers to three (two slices and a concatenation), as cheap, and is listed here.
LAYOUT = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose",
                    "slice", "pad", "concatenate", "iota", "rev", "dynamic_slice", ROTATE})
# Layout primitives of jax that lower to several HLO instructions (or a bitcast); fused, but
# not measured as cheap.
COMPOSITE_LAYOUT = frozenset({"split", "bitcast_convert_type", "stack", "unstack", "tile"})

# Operators XLA fuses into their reader (on every platform: loop fusion of elementwise chains).
FUSED = ELEMENTWISE | LAYOUT | COMPOSITE_LAYOUT
# Fused operators cheap enough that XLA recomputes them inside a reader's fusion.
CHEAP = CHEAP_ELEMENTWISE | LAYOUT

REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                        "reduce_or", "reduce_xor"})
ARG_REDUCTIONS = frozenset({"argmax", "argmin"})
# Readers that take fused producers in: loop fusions and reductions' input fusions.
FUSING_READERS = FUSED | REDUCTIONS | ARG_REDUCTIONS
CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})

# Operators that sum over an operand's dimension: split there, each device holds a partial
# sum (a plan all-reduces or reduce-scatters it).
CONTRACTING = frozenset({"dot_general", "conv_general_dilated", "reduce_sum"})
SCATTER_ADD = frozenset({"scatter-add", "scatter_add"})
SUMMING = CONTRACTING | SCATTER_ADD
SCATTERS = SCATTER_ADD | {"scatter", "scatter-mul", "scatter-min", "scatter-max", "scatter-sub"}

# Draws of random numbers, and operators that make values from none (rewrite/separable.py:
# per-example values a loss may make without reading the batch).
RANDOM_DRAWS = frozenset({"random_bits", "rng_bit_generator", "rng_uniform"})
CREATING = RANDOM_DRAWS | {"iota", "broadcast_in_dim"}
# How an operator is linear in operands that are sums over the batch, the others free of it
# (rewrite/separable.py: what a loss may do with a sum): "each" (one operand, or any), "added"
# (a sum: a batch-free term counts once in the whole), "one" (a product: exactly one operand a
# sum), "first" (a division: the numerator alone), "cases" (select_n: every case, not the
# predicate).
LINEAR: dict[str, str] = {
    **dict.fromkeys(("broadcast_in_dim", "squeeze", "expand_dims", "transpose", "copy",
                     "copy_p", "convert_element_type", "reduce_precision",
                     "bitcast_convert_type", "neg", "reduce_sum", "reshape"), "each"),
    **dict.fromkeys(("add", "sub", "add_any"), "added"),
    "mul": "one", "dot_general": "one", "div": "first", "select_n": "cases",
}

# Operators with bodies of their own (a while loop, a conditional): their rules speak for
# their carried values, not for what their bodies compute.
WITH_BODIES = frozenset({"while", "cond"})

# Operators that choose their own strategy in the search; every other operator with a rule
# follows the sharding of its main operand (reductions keep their input's split and all-reduce
# the partials). Loops and conditionals decide for their bodies.
DECIDERS = frozenset({"dot_general", "conv_general_dilated", "gather"}) | WITH_BODIES | SCATTERS
# An operator whose result holds this many times its main operand's elements decides its own
# split (a broadcast, a concatenation).
GROWTH = 2


def decides(primitive: str, in_shapes: Sequence[tuple[int, ...]],
            out_shapes: Sequence[tuple[int, ...]]) -> bool:
    """Whether an operator chooses its own strategy in the search (planning.problem._group), as
    far as its primitive and shapes tell: deciders and `autopar.shard` marks; an operator whose
    result is GROWTH times an operand it could follow (a broadcast, a concatenation); not one
    with an operand of its result's shape, which it follows (an elementwise operator), nor one
    with nothing to split. The test sees no constants: an operator whose operands of the result's
    shape are all constants follows a smaller operand, and may decide where this says it does
    not; applying such a plan names the operator (planning/saved.py)."""
    if primitive in DECIDERS or primitive == SHARD_MARK:
        return True
    if primitive == "scan_carry":  # its initial value may be a constant (an accumulator's
        return True               # zeros), and then it decides: recorded, loops being few
    if not any(d > 1 for shape in (*in_shapes, *out_shapes) for d in shape):
        return False  # nothing to split: one strategy
    if not in_shapes or not out_shapes:
        return True
    out = out_shapes[0]
    if any(tuple(s) == tuple(out) for s in in_shapes):
        return False
    return any(math.prod(out) >= GROWTH * math.prod(s) for s in in_shapes)
