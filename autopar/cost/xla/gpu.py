"""XLA's GPU compiler: the work it hands to cuBLAS and cuDNN, which its cost analysis leaves out.

XLA GPU rewrites dots into `__cublas$lt$matmul` / `__cublas$gemm` custom calls and
convolutions into `__cudnn$conv...` ones, and `cost_analysis()` counts no flops for a custom
call. Seen with jax 0.11.2 on an H200 (benchmarks/results/device.md): the 4-layer d_model-1024
GPT's step reported 0.23 TFLOP where the same program compiled for the CPU (dots kept as dots)
counts 8.68, so a roofline read from it judged the matrix work free. `library_flops` reads those
calls' flops from the optimised HLO text: 2 x output elements x contraction length for a GEMM;
2 x forward-output elements x filter elements per output feature for a convolution, whichever
of forward, backward-input or backward-filter the call computes. As cost_analysis does, a call
in a loop body counts once.
"""
from __future__ import annotations

import json
import math
import re

_DEFINITION = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\([^)]*\)|[a-z][a-z0-9]*\[[0-9,]*\]"
    r"(?:\{[^}]*\})?)\s+(?P<op>[\w\-]+)\((?P<args>[^)]*)\)(?P<rest>.*)$")
_ARRAY = re.compile(r"[a-z][a-z0-9]*\[([0-9,]*)\]")
_OPERAND = re.compile(r"%(?P<name>[\w.\-]+)\s*$")
_TARGET = re.compile(r'custom_call_target="(?P<target>[^"]+)"')
_DIM_LABELS = re.compile(r"dim_labels=(?P<lhs>\w+)_(?P<rhs>\w+)->(?P<out>\w+)")
_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[(?P<dims>[^\]]*)\]')
GEMMS = ("__cublas$lt$matmul", "__cublas$gemm")
# target -> (where the forward output is, where the filter is): "result" or an operand index
CONVOLUTIONS = {"__cudnn$convForward": ("result", 1),
                "__cudnn$convBiasActivationForward": ("result", 1),
                "__cudnn$convBackwardInput": (0, 1),
                "__cudnn$convBackwardFilter": (1, "result")}


def _dims(shape: str) -> list[int]:
    """The first array's dimensions in an HLO shape (a tuple's first element)."""
    found = _ARRAY.search(shape)
    return [int(d) for d in found.group(1).split(",") if d] if found else []


def library_flops(hlo_text: str) -> float:
    """Flops of the cuBLAS and cuDNN calls in an optimised HLO module (0 for other platforms)."""
    if "custom_call_target=\"__cu" not in hlo_text:
        return 0.0
    shapes: dict[str, list[int]] = {}
    calls = []
    for line in hlo_text.splitlines():
        found = _DEFINITION.match(line)
        if not found:
            continue
        shapes[found.group("name")] = _dims(found.group("shape"))
        target = _TARGET.search(found.group("rest"))
        if found.group("op") == "custom-call" and target:
            calls.append((target.group("target"), found))
    total = 0.0
    for target, call in calls:
        operands = [_operand_dims(a, shapes) for a in call.group("args").split(",")]
        result = _dims(call.group("shape"))
        if target in GEMMS:
            config = _CONTRACTING.search(call.group("rest"))
            dims = json.loads(f"[{config.group('dims')}]") if config else []
            total += 2.0 * math.prod(result) * math.prod(operands[0][int(d)] for d in dims)
        elif target in CONVOLUTIONS:
            labels = _DIM_LABELS.search(call.group("rest"))
            out_at, filter_at = CONVOLUTIONS[target]
            out = result if out_at == "result" else operands[out_at]
            kernel = result if filter_at == "result" else operands[filter_at]
            if labels and kernel:
                per_output = math.prod(kernel) / kernel[labels.group("rhs").index("o")]
                total += 2.0 * math.prod(out) * per_output
    return total


def _operand_dims(argument: str, shapes: dict[str, list[int]]) -> list[int]:
    """An operand's dimensions: written beside it (`f32[2,3]{1,0} %x`) or defined earlier."""
    if "[" in argument:
        return _dims(argument)
    found = _OPERAND.search(argument.strip())
    return shapes.get(found.group("name"), []) if found else []
