"""Pinned baselines, a diagnostic of the cost model (the `fidelity` suite), not hand-written
plans: the input specs of an expert's rules (`experts.py`) pinned as annotations, and every
operator in between chosen by our own search under those pins.

That gives each pinned baseline the best operator strategies its input specs allow under our
cost model, which is not what `jax.jit` with those specs compiles to (XLA's propagation decides
the operators there). The hand-written plans the `quality` suite judges are in `experts.py`.
"""
from __future__ import annotations

import re
from typing import Sequence

from jax.sharding import PartitionSpec as P

from benchmarks.experts import RULES, leaf_spec

__all__ = ["KINDS", "RULES", "baseline_annotations"]

KINDS = ("data_parallel", "fsdp", "megatron", "megatron_2d")
_EXPERT = {"megatron_2d": "megatron_dp"}  # this module's names for experts.py's kinds


def baseline_annotations(kind: str, family: str, inputs: Sequence[tuple[str, tuple[int, ...]]],
                         mesh: dict[str, int]) -> list[tuple[str, P]] | None:
    """Exact-path annotations for every input (traced paths: 'state/...', 'batch/...') under
    pinned baseline `kind`; None where it does not apply to this mesh (2D needs two axes)."""
    if kind not in KINDS:
        raise ValueError(f"unknown baseline {kind!r}; known: {KINDS}")
    if kind == "megatron_2d" and sum(s > 1 for s in mesh.values()) < 2:
        return None
    return [(f"^{re.escape(path)}$",
             leaf_spec(_EXPERT.get(kind, kind), family, path, shape, path.startswith("batch/"),
                       mesh))
            for path, shape in inputs]
