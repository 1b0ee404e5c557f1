"""The schedule of a train step: how its gradient is accumulated and its layer stack
pipelined. One record, read by the loss's rewrite (rewrite/accumulate.py), the planning
driver and the plan."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    microbatches: int = 1  # the gradient accumulated over this many (rewrite/accumulate.py)
    # each microbatch computed as this many shares, one per device group along the batch's
    # axes, their gradients summed once after the loop (1: reduced in every microbatch)
    shares: int = 1
    stages: int = 1  # pipeline stages of the loss's layer stack (rewrite/gpipe.py)
    rounds: int = 1  # rounds each microbatch makes through them (the circular schedule)

    @property
    def rewrites(self) -> bool:
        """Whether the step is rewritten (accumulated or pipelined), not traced as written."""
        return self.microbatches > 1 or self.stages > 1

    def plan_fields(self) -> dict[str, int]:
        """The schedule as the Plan's fields (and its JSON's keys) name it."""
        return {"microbatches": self.microbatches, "microbatch_groups": self.shares,
                "pipeline_stages": self.stages, "pipeline_repeats": self.rounds}
