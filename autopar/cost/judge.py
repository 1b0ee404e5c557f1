"""Judging a compiled program: its step time on a hardware profile, from XLA's output alone.

`evaluate(compiled, mesh, hardware=None)` (`autopar.evaluate`) takes any jax `Compiled` or
`Lowered`, autopar's or one sharded by hand, the mesh it was compiled over, and a profile (a
name or a `Hardware`; default: jax's first device's). It returns an `Evaluation` per device
and step: flops and bytes accessed (cuBLAS and cuDNN calls and every loop trip included), their
roofline time, each collective as a `JudgedCollective` priced by `bus_time` (nccl-tests' bus
bandwidth, plus the link's latency), and the compiled memory. `step_s` adds compute and
collectives: they are taken not to overlap.
It raises an AutoparError for an unknown profile, or a program naming a device the mesh lacks.

Design and rationale: docs/internals-steps.md, "autopar/cost/judge.py".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.cost.hardware import Hardware, Link, get_profile, group_link
from autopar.cost.hlo import collectives, compiled_memory_bytes
from autopar.cost.loop_work import extra_trips_work
from autopar.cost.xla.gpu import library_work
from autopar.errors import AutoparError
from autopar.mesh import MeshShape, mesh_shape


# nccl-tests' bus-bandwidth factor per byte of the operation's size S (for n devices; the
# rest (n-1)/n), and S per byte of the result on one device: a reduce-scatter's S is its
# input, n results.
BUS_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "collective-permute": lambda n: 1.0}
SIZE_PER_RESULT = {"reduce-scatter": lambda n: n}


def bus_time(kind: str, result_bytes: float, n: int, link: Link) -> float:
    """Seconds of one collective of `kind` over `n` devices on `link` (bandwidth, latency),
    from the bytes of its result on one device, by nccl-tests' definitions
    (docs/internals-steps.md)."""
    if n <= 1:
        return 0.0
    size = SIZE_PER_RESULT.get(kind, lambda k: 1)(n) * result_bytes
    factor = BUS_FACTOR.get(kind, lambda k: (k - 1) / k)(n)
    return link.latency + size * factor / link.bandwidth


@dataclass(frozen=True)
class JudgedCollective:
    """One collective instruction, judged."""

    kind: str
    result_bytes: int  # its result on one device, one execution
    axes: tuple[str, ...]  # the mesh axes its groups span
    devices: int  # devices per group
    executions: int  # per step
    seconds: float  # all its executions, on the link of `axes`


@dataclass(frozen=True)
class Evaluation:
    """A compiled step judged on a hardware profile (per device, per step)."""

    hardware: str
    flops: float
    bytes_accessed: float
    compute_s: float  # roofline: max(flops / peak, bytes accessed / memory bandwidth)
    communication_s: float  # every collective, one after another
    memory_bytes: int  # arguments, outputs and temporaries, less donated aliases
    collectives: tuple[JudgedCollective, ...]

    @property
    def step_s(self) -> float:
        return self.compute_s + self.communication_s

    def collective_bytes(self) -> dict[str, float]:
        """Result bytes on one device per step, by kind (the planner's units)."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.kind] = out.get(c.kind, 0.0) + c.result_bytes * c.executions
        return out

    def summary(self) -> str:
        lines = [f"judged on {self.hardware}: {self.step_s * 1e3:.3f} ms per step "
                 f"(compute {self.compute_s * 1e3:.3f} ms, collectives "
                 f"{self.communication_s * 1e3:.3f} ms), {self.flops / 1e9:.2f} GFLOP and "
                 f"{self.memory_bytes / 2**20:.1f} MiB per device"]
        by_key: dict[tuple, list[JudgedCollective]] = {}
        for c in self.collectives:
            by_key.setdefault((c.kind, c.axes), []).append(c)
        for (kind, axes), group in sorted(by_key.items(), key=lambda kv: -sum(
                c.seconds for c in kv[1])):
            moved = sum(c.result_bytes * c.executions for c in group)
            lines.append(f"  {kind} over {'/'.join(axes) or '-'}: {len(group)} instruction(s), "
                         f"{moved / 2**20:.2f} MiB, {sum(c.seconds for c in group) * 1e3:.3f} ms")
        return "\n".join(lines)


def group_axes(groups: tuple[tuple[int, ...], ...] | None, mesh: MeshShape
               ) -> tuple[tuple[str, ...], int]:
    """The mesh axes along which a collective's device groups vary, and the devices per
    group. Device ids are positions in the mesh's device order (the executable's device
    assignment)."""
    if groups is None:
        return tuple(n for n, s in zip(mesh.names, mesh.sizes) if s > 1), mesh.size
    varying: set[int] = set()
    for group in groups:
        if any(i >= mesh.size for i in group):
            raise AutoparError(
                f"the compiled program names device {max(group)} but mesh {mesh} has "
                f"{mesh.size} devices. Fix: pass the mesh the program was compiled for.")
        coords = np.array(np.unravel_index(list(group), mesh.sizes)).T
        varying |= {k for k in range(len(mesh.sizes)) if len(set(coords[:, k])) > 1}
    return (tuple(mesh.names[k] for k in sorted(varying)),
            max(len(set(g)) for g in groups) if groups else 1)


def evaluate(compiled: Any, mesh: Any, hardware: str | Hardware | None = None) -> Evaluation:
    """Judge `compiled` (a jax `Compiled`, or a `Lowered`, compiled here) for `mesh` (the mesh
    it was compiled over: a jax Mesh, an AbstractMesh or a dict of axis sizes) on `hardware`
    (a profile name or an autopar.Hardware; default: the one matching jax's first device).

    Works for any program: `evaluate(jax.jit(step, in_shardings=...).lower(*args).compile(),
    mesh, "h100")` judges an expert's sharding the way `evaluate(train_step.lower(...)
    .compile(), ...)` judges autopar's."""
    if hasattr(compiled, "compile") and not hasattr(compiled, "memory_analysis"):
        compiled = compiled.compile()
    hw, shape = get_profile(hardware), mesh_shape(mesh)
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    text = compiled.as_text()
    # What cost_analysis leaves out: XLA GPU's cuBLAS and cuDNN calls, a loop's later trips.
    for more_flops, more_bytes in (library_work(text), extra_trips_work(text)):
        flops, accessed = flops + more_flops, accessed + more_bytes
    judged = []
    for c in collectives(text):
        axes, n = group_axes(c.groups, shape)
        if c.kind == "collective-permute":
            n = 2 if axes else 1  # a pair: one hop on its link
        one = bus_time(c.kind, c.result_bytes, n, group_link(hw, shape, axes))
        judged.append(JudgedCollective(c.kind, c.result_bytes, axes, n, c.executions,
                                       one * c.executions))
    return Evaluation(hw.name, flops, accessed,
                      max(flops / hw.flops, accessed / hw.memory_bandwidth),
                      sum(c.seconds for c in judged), compiled_memory_bytes(compiled),
                      tuple(judged))
