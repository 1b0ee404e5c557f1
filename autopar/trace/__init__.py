"""Tracing: a step's jaxpr as an operator graph (`OpGraph`), with the facts the program alone
gives (`analysis`), its repeated layers (`layers`) and the `shard` primitive."""
from autopar.trace.ir import Op, OpGraph, Equation, Tensor
from autopar.trace.tracer import trace

__all__ = ["Op", "OpGraph", "Equation", "Tensor", "trace"]
