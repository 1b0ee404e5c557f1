"""The planner's decisions: the sharding of every input and the strategy of every operator.
What the search hands to the cost model's estimates and to lowering, below the Plan record
that reports them."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from autopar.rules.factors import Spec, Strategy
from autopar.trace.ir import OpGraph


@dataclass
class Decisions:
    """The sharding of every input and the strategy of every op: what lowering needs."""

    inputs: list[Spec]  # per graph input
    ops: list[Strategy]  # per op id
    recompute: frozenset[int] = frozenset()  # forward program steps the backward recomputes
    # False: lowered with the inputs' and outputs' shardings alone, XLA propagating the rest
    # (fitting._propagated: where that program fits memory_limit and the pinned one does not).
    pinned_inside: bool = True

    def tensor_specs(self, graph: OpGraph) -> Mapping[int, Spec]:
        """The sharding each tensor has when produced: made once per graph (a candidate's tally
        and memory estimate each ask for it), and shared, so read it, never write it."""
        made = self.__dict__.get("_specs")
        if made is not None and made[0] is graph:
            return made[1]
        specs = {t: s for t, s in zip(graph.inputs, self.inputs)}
        for op, st in zip(graph.ops, self.ops):
            specs.update(zip(op.outputs, st.out_specs))
        self.__dict__["_specs"] = (graph, specs)
        return specs

    def recomputing(self, recompute: frozenset[int]) -> Decisions:
        """The same decisions with `recompute` the steps recomputed: the tensors' shardings,
        which recompute does not change, are shared (a memory budget tries each plan with and
        without recompute)."""
        out = dataclasses.replace(self, recompute=recompute)
        if "_specs" in self.__dict__:
            out.__dict__["_specs"] = self.__dict__["_specs"]
        return out
