"""What the devices at hand say: their compiler's platform, their kind and their memory.

In several processes (jax.distributed) a mesh holds every process's devices, and only a
process's own devices answer its questions (memory_stats), so the local ones are asked.
Compile-only devices (a TPU topology from `jax.experimental.topologies` on a machine without
one) have a platform and a kind but no runtime: their memory is the hardware profile's.
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from autopar.cost.hardware import Hardware, get_profile
from autopar.cost.memory import parse_bytes
from autopar.errors import AutoparError


def local_device(mesh: Any) -> Any:
    """One of this process's devices in `mesh` (a Mesh), or of jax's for a count or 'auto';
    None for a mesh of no devices (a dict of axis sizes, an AbstractMesh)."""
    if isinstance(mesh, Mesh):
        here = jax.process_index()
        return next((d for d in mesh.devices.flat if d.process_index == here), None)
    if isinstance(mesh, (str, int)) and not isinstance(mesh, bool):  # "auto" or a count
        return jax.local_devices()[0]
    return None


def resolve_memory_limit(memory_limit: int | str | None, hw: Hardware,
                         mesh: Any = None) -> int:
    """Bytes per device: the given limit, else the runtime's memory of the mesh's devices (the
    first one of this process), else the hardware profile's."""
    if memory_limit is not None:
        return parse_bytes(memory_limit)
    device = local_device(mesh)
    stats = device.memory_stats() if device is not None and runs_here(device) else None
    return int((stats or {}).get("bytes_limit") or hw.memory_bytes)


def runs_here(device: Any) -> bool:
    """Whether `device` can run programs in this process: not a compile-only device."""
    return device.local_hardware_id is not None


def check_runnable(mesh: Mesh) -> None:
    """An AutoparError where this process cannot run a step on `mesh` (compile-only devices)."""
    device = local_device(mesh)
    if device is None or not runs_here(device):
        raise AutoparError(
            f"the mesh {dict(mesh.shape)} is of compile-only devices "
            f"({mesh.devices.flat[0].device_kind}): the step can be planned and compiled for "
            "them, not run. Fix: use .plan(...), .lower(...).compile() or .input_shardings(...) "
            "here, and call the step on a mesh of the real devices.")


def mesh_profile(hardware: Any, mesh: Any) -> Hardware:
    """The hardware profile: the one named or given, else the one of the mesh's devices (a
    TPU topology's kind picks its generation), else of jax's first device."""
    return get_profile(hardware, local_device(mesh) if hardware is None else None)


def compiler_platform(mesh: Any, hw: Hardware) -> str:
    """The platform whose compiler will build the step: the mesh's devices' where it has
    devices (a Mesh; a count or 'auto': jax's devices), else the hardware profile's."""
    device = local_device(mesh)
    return device.platform if device is not None else hw.platform
