"""Meshes: the real one used for lowering and the plain description used for planning."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from autopar.errors import AutoparError


@dataclass(frozen=True)
class MeshShape:
    """Axis names and sizes: all that planning needs to know about a mesh."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    def axis_size(self, name: str) -> int:
        return self._size_of[name]

    @functools.cached_property
    def _size_of(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes))

    def as_dict(self) -> dict[str, int]:
        return dict(self._size_of)

    # The cost model's caches key on the mesh millions of times per plan: hash it once.
    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.names, self.sizes))

    def __getstate__(self) -> dict:  # a string's hash differs between processes: not pickled
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def __str__(self) -> str:
        return "{" + ", ".join(f"{n!r}: {s}" for n, s in zip(self.names, self.sizes)) + "}"


def make_mesh(axes: Mapping[str, int], devices: Any = None) -> Mesh:
    """A jax Mesh with `AxisType.Auto` axes over `devices` (default: all of `jax.devices()`).

    Auto axes leave XLA's sharding propagation in charge between our constraints, which is what
    constraint-based lowering needs (jax.make_mesh defaults to Explicit axes).
    """
    names, sizes = _checked_axes(axes)
    devices = list(jax.devices() if devices is None else devices)
    needed = math.prod(sizes)
    if needed > len(devices):
        raise AutoparError(
            f"mesh {dict(axes)} needs {needed} devices but {len(devices)} are available. Fix: use a "
            f"smaller mesh, or on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={needed} "
            "before importing jax; to plan without the devices pass the mesh as a dict to autopar.plan."
        )
    grid = np.array(devices[:needed], dtype=object).reshape(sizes)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def _checked_axes(axes: Any) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A mesh's axis names and sizes, or an AutoparError naming what is wrong with them."""
    example = "Fix: autopar.make_mesh({'data': 2, 'model': 4}): axis names to sizes >= 1."
    if not isinstance(axes, Mapping) or not axes:
        raise AutoparError(f"make_mesh takes a dict of axis names to sizes, got {axes!r}. "
                           f"{example}")
    for name, size in axes.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise AutoparError(f"mesh axis name {name!r} (in {dict(axes)}) is not a name. "
                               f"{example}")
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
            raise AutoparError(f"mesh axis {name!r} has size {size!r} (in {dict(axes)}). "
                               f"{example}")
    return tuple(axes), tuple(int(s) for s in axes.values())


def auto_axes(mesh: Mesh) -> Mesh:
    """`mesh` with every axis `AxisType.Auto`: the same devices in the same order.

    jax.make_mesh gives Explicit axes (JAX's default since 0.9), under which a sharding is part
    of an array's type and may change only through `jax.sharding.reshard`; the lowering instead
    pins the plan GSPMD-style, with in/out shardings and `with_sharding_constraint` between
    equations, which JAX allows on Auto axes only. Planning needs only the axis names and
    sizes, and a NamedSharding over either mesh puts every shard on the same device, so
    converting is the simplest correct choice: the caller's arrays on their Explicit mesh are
    relabelled, not moved, and the step's results come back on the Auto mesh.
    """
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return mesh.update(axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def mesh_shape(mesh: Any) -> MeshShape:
    """The MeshShape of a Mesh, an AbstractMesh or a dict of axis sizes."""
    if isinstance(mesh, MeshShape):
        return mesh
    if isinstance(mesh, Mapping):
        return MeshShape(tuple(mesh), tuple(int(s) for s in mesh.values()))
    if isinstance(mesh, (Mesh, AbstractMesh)):
        return MeshShape(tuple(mesh.axis_names), tuple(int(s) for s in mesh.axis_sizes))
    raise AutoparError(
        f"mesh must be a jax Mesh, an AbstractMesh or a dict of axis sizes, got {type(mesh).__name__}. "
        "Fix: autopar.make_mesh({'data': 2, 'model': 4})."
    )


def mesh_or_count(mesh: Any) -> MeshShape | int:
    """A mesh's shape, or a device count (an int, or "auto": all of jax.devices())."""
    if isinstance(mesh, str):
        if mesh != "auto":
            raise AutoparError(f"mesh={mesh!r} is not understood. Fix: pass a Mesh, a dict of "
                               "axis sizes, a device count or 'auto'.")
        return len(jax.devices())
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        return mesh
    return mesh_shape(mesh)
