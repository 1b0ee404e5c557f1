"""The models the quality suite judges: realistic widths built from abstract inputs (compiled,
never run, nothing allocated at full size) and the small models of the tests (run too, so
their numerics can be checked).

Each case's setup returns `(step, state, batch)`; `family` picks the experts' rules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import architectures
import models


@dataclass(frozen=True)
class Case:
    """One model of the suite."""

    setup: Callable[[], tuple]  # () -> (step, state, batch)
    family: str  # rule family of experts.RULES
    realistic: bool  # abstract inputs at full width: compiled only, never run
    about: str


REALISTIC: dict[str, Case] = {
    "gpt-1024": Case(
        lambda: models.gpt_abstract(batch=32, seq=512, vocab=32768, d_model=1024, heads=16,
                                    layers=4),
        "transformer", True, "GPT, d_model 1024, 16 heads, 4 layers, seq 512, batch 32, vocab "
        "32,768 (84M parameters)"),
    "gpt-1024-scan": Case(
        lambda: models.gpt_abstract(batch=32, seq=512, vocab=32768, d_model=1024, heads=16,
                                    layers=4, scan=True),
        "transformer", True, "gpt-1024 with its blocks as one nn.scan over stacked "
        "parameters (a loop in the compiled program, as MaxText's scan_layers)"),
    "moe-8x1024": Case(
        lambda: architectures.moe_abstract(batch=16, seq=256, features=1024, d_model=1024,
                                           experts=8, hidden=4096, layers=2, out=1024),
        "moe", True, "2 top-2 MoE layers of 8 experts, d_model 1024, expert hidden 4096, "
        "4,096 tokens (136M parameters)"),
    "resnet50-width": Case(
        lambda: architectures.bottleneck_resnet_abstract(batch=32, size=56),
        "cnn", True, "ResNet-50's stage widths (256 to 2,048 channels), one bottleneck per "
        "stage, 56x56 input, batch 32, 1,000 classes"),
    "encdec-768": Case(
        lambda: architectures.encdec_abstract(batch=32, seq=256, vocab=32768, d_model=768,
                                              heads=12, layers=2),
        "transformer", True, "encoder-decoder, d_model 768, 12 heads, 2+2 layers, seq 256, "
        "batch 32, vocab 32,768"),
}

SMALL: dict[str, Case] = {
    "mlp-wide": Case(lambda: models.mlp_setup(batch=64, features=256, hidden=1024, out=256),
                     "mlp", False, "3-layer MLP, hidden 1024, batch 64"),
    "gpt-small": Case(lambda: models.gpt_setup(batch=16, seq=32, vocab=256, d_model=64,
                                               heads=4, layers=2),
                      "transformer", False, "GPT, d_model 64, 2 layers"),
    "gpt-medium": Case(lambda: models.gpt_setup(batch=16, seq=32, vocab=512, d_model=128,
                                                heads=8, layers=3),
                       "transformer", False, "GPT, d_model 128, 3 layers"),
    "moe": Case(lambda: architectures.moe_setup(batch=8, seq=16, experts=8, d_model=64),
                "moe", False, "2 MoE layers of 8 experts, d_model 64"),
    "resnet": Case(lambda: architectures.resnet_setup(batch=16, size=16, channels=(32, 64)),
                   "cnn", False, "2 residual blocks, 32 and 64 channels, 16x16"),
    "encoder-decoder": Case(lambda: architectures.encdec_setup(batch=8, seq=16, d_model=64),
                            "transformer", False, "encoder-decoder, d_model 64, 1+1 layers"),
}

ZOO: dict[str, Case] = {**REALISTIC, **SMALL}
