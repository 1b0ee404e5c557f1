"""XLA's GPU compiler: the work it hands to cuBLAS and cuDNN, which its cost analysis leaves out,
and its buffers (`GPU`).

XLA GPU rewrites dots into `__cublas$lt$matmul` / `__cublas$gemm` custom calls and
convolutions into `__cudnn$conv...` ones, and `cost_analysis()` counts no flops for a custom
call, nor any bytes, so a roofline read from it judges the matrix work free (seen with jax
0.11.2 on an H200: benchmarks/results/device.md; docs/decisions.md, "One real GPU").
`library_work` reads those calls' flops and bytes from the optimised HLO text: 2 x output
elements x contraction length for a GEMM; 2 x forward-output elements x filter elements per
output feature for a convolution, whichever of forward, backward-input or backward-filter the
call computes. As cost_analysis does, a call in a loop body counts once here
(autopar.cost.loop_work adds the other trips).
"""
from __future__ import annotations

import json
import math
import re

from autopar.cost.hlo import array_bytes, array_dims, definitions, operand_shape
from autopar.cost.model import fused_values as ideal_fused_values
from autopar.cost.xla.cpu import CpuBuffers, value_buffers as cpu_value_buffers
from autopar.cost.xla.generic import ConservativeBuffers
from autopar.cost.xla.tpu import TpuBuffers

_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]+)"')
_DIM_LABELS = re.compile(r"dim_labels=(?P<lhs>\w+)_(?P<rhs>\w+)->(?P<out>\w+)")
_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[(?P<dims>[^\]]*)\]')
GEMMS = ("__cublas$lt$matmul", "__cublas$gemm")
# target -> (where the forward output is, where the filter is): "result" or an operand index
CONVOLUTIONS = {"__cudnn$convForward": ("result", 1),
                "__cudnn$convBiasActivationForward": ("result", 1),
                "__cudnn$convBackwardInput": (0, 1),
                "__cudnn$convBackwardFilter": (1, "result")}


def call_flops(shape: str, operands: list[list[int]], rest: str) -> float:
    """Flops of a cuBLAS or cuDNN custom call (0 for any other custom call)."""
    target = _TARGET.search(rest)
    target = target.group("target") if target else ""
    result = array_dims(shape)
    if target in GEMMS and operands:
        config = _CONTRACTING.search(rest)
        dims = json.loads(f"[{config.group('dims')}]") if config else []
        return 2.0 * math.prod(result) * math.prod(operands[0][int(d)] for d in dims)
    if target in CONVOLUTIONS:
        out_at, filter_at = CONVOLUTIONS[target]
        return convolution_flops(result if out_at == "result" else operands[out_at],
                                 result if filter_at == "result" else operands[filter_at], rest)
    return 0.0


def convolution_flops(out: list[int], kernel: list[int], rest: str) -> float:
    """A convolution's flops from its forward output's and filter's dimensions: a multiply and
    an add per output element and filter element of its output feature (`dim_labels` in the
    instruction's text says which filter dimension is that feature)."""
    labels = _DIM_LABELS.search(rest)
    if not labels or not kernel:
        return 0.0
    return 2.0 * math.prod(out) * math.prod(kernel) / kernel[labels["rhs"].index("o")]


def library_work(hlo_text: str) -> tuple[float, float]:
    """(flops, bytes accessed) of the cuBLAS and cuDNN calls in an optimised HLO module (0 for
    other platforms): each reads its operands and writes its result (not its scratch space,
    the result tuple's last element)."""
    if "custom_call_target=\"__cu" not in hlo_text:
        return 0.0, 0.0
    found = definitions(hlo_text.splitlines())
    shapes = {d["name"]: d["shape"] for d in found}
    flops = accessed = 0.0
    for d in found:
        target = _TARGET.search(d["rest"]) if d["op"] == "custom-call" else None
        if not target or not target["target"].startswith("__cu"):
            continue
        operands = [operand_shape(a, shapes) for a in d["args"].split(",") if a.strip()]
        flops += call_flops(d["shape"], [array_dims(o) for o in operands], d["rest"])
        accessed += array_bytes(d["shape"])[0] + sum(sum(array_bytes(o)) for o in operands)
    return flops, accessed


class GpuBuffers(TpuBuffers):
    """XLA's GPU compiler as the memory estimate asks for it, not calibrated: what its loops do
    is the TPU compiler's (a loop body's buffers reused, its weight-gradient dots run last, a
    stacked input converted once), the values it writes are XLA CPU's (a chain is written
    where a dot reads it: cuBLAS takes no fused operand), nothing more is written in loop
    bodies, steps run in program order (XLA CPU's schedule read estimates within 2% of these,
    for more planning time), and times charge an ideal fuser's traffic, as the conservative
    model's do (so a GPU plan's time is what it was before this model; its memory is not).

    Read against XLA GPU's compiled peaks (jax 0.11.2 on an H200; docs/decisions.md, "One
    node of 8 GPUs, compiled by XLA GPU"): the gpu suite's three plans 0.935 to 1.015x, the
    one-chip steps of benchmarks/results/device.md 1.004 to 1.404x (the unscanned steps over:
    XLA GPU fuses more outside loops than XLA CPU), where the conservative model read 1.087 to
    1.529x. The TPU compiler's own fusion rules read the one-chip float32 steps as low as
    0.546x."""

    name = "xla-gpu"
    values = staticmethod(cpu_value_buffers)
    fused_values = staticmethod(ideal_fused_values)
    body_buffers = staticmethod(CpuBuffers.body_buffers)  # nothing more written in bodies
    schedule = staticmethod(ConservativeBuffers.schedule)  # program order


GPU = GpuBuffers()
