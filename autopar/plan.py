"""The Plan: every input, output and operator decision, readable and saved as JSON: the
record (plan_record.py) with its views as methods (plan_text, plan_json, explain,
plan_html)."""
from __future__ import annotations

import json
from typing import Any

import jax

from autopar.errors import AutoparError
from autopar.explain import explain
from autopar.plan_html import plan_page
from autopar.plan_json import dumps, plan_body, plan_fields
from autopar.plan_record import (Decision, OpDecision, PlanRecord, Redistribution, Repeat,
                                 TensorPlan)
from autopar.plan_text import summary

__all__ = ["Decision", "OpDecision", "Plan", "Redistribution", "Repeat", "TensorPlan",
           "load_plan"]


class Plan(PlanRecord):
    """A sharding plan for one step function on one mesh.

    `specs` maps every input and output path to its PartitionSpec; `ops` holds every operator
    decision, `decisions` those the search made (the rest follow them); `cost` the totals per
    device (a Cost) and `search_stats` what the search found out (a SearchStats): records
    read by field (`plan.cost.total_s`) that also read as the JSON's flat mappings
    (`plan.cost["total_s"]`; `dict(plan.cost)` for json.dumps). A plan read from compact
    JSON has `decisions` but no `ops` (`decided` holds them).
    Plans are equal when all but `ops` are: the same decisions make the same operators.
    Its views are its methods: `summary()`, `explain()`, `to_html()`, `to_json()` /
    `from_json()` and `save()`.
    """

    def summary(self, limit: int = 40) -> str:
        """Every input path -> PartitionSpec (instances of a repeated layer with equal specs as
        one row, block_{0..3}/...), then the predicted cost; `limit` redistributions at most."""
        return summary(self, limit)

    def explain(self, path: str, alternatives: int = 6) -> Any:
        """Why input `path` has its spec (autopar.explain.Explanation; print it): its bytes,
        its reshardings, then up to `alternatives` other specs, each with the step planned
        again around it (its time and memory, or that it does not fit memory_limit and its
        time without), and what decided: an annotation, the memory limit, the cost model, or
        a search that missed a faster plan. A search per alternative, and a second where it
        does not fit memory_limit. `path` may also be
        a scope of the step's operators (`OpDecision.scope`, "GPT/block_0/mlp_in"): its
        intermediates' specs, compute, collectives and reshardings
        (autopar.explain.ScopeExplanation)."""
        return explain(self, path, self.replanner, alternatives)

    def to_html(self, path: str, title: str = "autopar plan") -> None:
        """Write the plan as one self-contained HTML page (autopar/plan_html.py): the mesh,
        each layer's specs, the collectives by layer, kind and mesh axes, the memory over the
        step with its peak, and the compiled peak beside the predicted one where known."""
        with open(path, "w") as f:
            f.write(plan_page(self, title))

    # -- JSON --------------------------------------------------------------------------------------
    def to_json(self, detail: bool = False) -> str:
        """The plan as JSON, one entry per line (layout: plan_json). Compact by default: the
        decisions the search made; `detail` adds every operator's strategy and cost."""
        if detail and not self.ops and self.decided:
            raise AutoparError("this plan was read from compact JSON and holds no per-operator "
                               "detail. Fix: apply it (auto_parallel(step, mesh=..., plan=p)"
                               ".plan(*args)) and save that plan with detail=True.")
        return dumps(plan_body(self, detail))

    @staticmethod
    def from_json(text: str) -> "Plan":
        """A plan from its JSON, compact or detailed, of this format or the one before. A
        partial plan (only `mesh` and some `inputs`, each with path, shape and spec) reads too:
        it serves as annotations, not to run a step."""
        try:
            return Plan(**plan_fields(json.loads(text)))
        except json.JSONDecodeError as e:
            raise AutoparError(f"a plan file holds JSON, and this text does not parse ({e}); "
                               "it may have been cut short. Fix: load a file written by "
                               "Plan.save or Plan.to_json.") from e
        except (KeyError, TypeError, ValueError, IndexError) as e:  # what the schema cannot see
            raise AutoparError(f"not a valid autopar plan JSON ({e!r}). Fix: load a file written "
                               "by Plan.save or Plan.to_json.") from e

    def save(self, path: str, detail: bool = False) -> None:
        """Write the plan's JSON (compact; `detail` adds every operator) to `path`. In several
        processes (jax.distributed) only process 0 writes: every process holds the same plan."""
        if jax.process_index() != 0:
            return
        with open(path, "w") as f:
            f.write(self.to_json(detail))


def load_plan(path: str) -> Plan:
    """Read a plan written by `Plan.save`."""
    try:
        with open(path) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise AutoparError(f"cannot read a plan from {path}: {e}. Fix: pass the path of a file "
                           "written by Plan.save.") from e
    return Plan.from_json(text)
