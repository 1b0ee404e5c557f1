"""What XLA's compilers do to a step's buffers, per platform: the `BufferModel` seam
(buffers.py), XLA's CPU compiler (cpu.py), the TPU compiler (tpu.py) and a conservative model
for the others (generic.py)."""
from autopar.cost.xla.buffers import BufferModel, ValueBuffers
from autopar.cost.xla.cpu import CPU
from autopar.cost.xla.generic import CONSERVATIVE
from autopar.cost.xla.tpu import TPU

__all__ = ["BufferModel", "ValueBuffers", "CPU", "TPU", "CONSERVATIVE", "buffer_model"]


def buffer_model(platform: str) -> BufferModel:
    """The calibrated model of `platform` ('cpu', 'gpu', 'tpu', ...), else the conservative
    one."""
    return {"cpu": CPU, "tpu": TPU}.get(platform, CONSERVATIVE)
