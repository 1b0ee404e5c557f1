"""What XLA's compilers do to a step's buffers, per platform: the `BufferModel` seam
(buffers.py), XLA's CPU compiler (cpu.py), the TPU compiler (tpu.py), XLA's GPU compiler
(gpu.py) and a conservative model for the others (generic.py)."""
from autopar.cost.xla.buffers import BufferModel, ValueBuffers
from autopar.cost.xla.cpu import CPU
from autopar.cost.xla.generic import CONSERVATIVE
from autopar.cost.xla.gpu import GPU
from autopar.cost.xla.tpu import TPU

__all__ = ["BufferModel", "ValueBuffers", "CPU", "TPU", "GPU", "CONSERVATIVE", "buffer_model",
           "reassociates_sums"]


def buffer_model(platform: str) -> BufferModel:
    """The model of `platform` ('cpu', 'gpu', 'tpu'), else the conservative one."""
    return {"cpu": CPU, "tpu": TPU, "gpu": GPU}.get(platform, CONSERVATIVE)


def reassociates_sums(platform: str) -> bool:
    """Whether `platform`'s compiler adds partial sums before the collective that reduces
    them: the sum of two all-reduced results becomes one all-reduce of their sum (XLA's
    AllReduceReassociate). The TPU compiler does (libtpu 0.0.42.1: three partial products
    added compile to one all-reduce of their sum; tests/test_tpu.py); XLA CPU (jax 0.10.2)
    combines them into one all-reduce of a tuple, every product's bytes moved."""
    return platform == "tpu"
