"""Weight formats a loaded model can run in: float32 as loaded, or an int8 LM head.

`int8` replaces the LM head by fbgemm's dynamically quantized linear: int8 weights with one
scale per output channel, activations quantized per call (one scale per row). On this kind of
CPU the 262,144 x 640 head runs ~5x faster at batch 1 and ~9x at batch 16 than float32.
Measured on the default model's 1,180-token essay (tests/test_weight_format.py): argmax agrees
with float32 at 88% of positions, perplexity 20.17 -> 20.80 (+3.1%). Quantizing every linear
the same way costs far more (57% agreement, perplexity 38), so the layers stay float32."""
from __future__ import annotations

import warnings

import torch
from torch import nn

WEIGHT_FORMATS = ("fp32", "int8")


def apply_weight_format(model: nn.Module, fmt: str) -> nn.Module:
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose from {WEIGHT_FORMATS}")
    if fmt == "fp32":
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        return quantize_dynamic(model, {"lm_head": per_channel_dynamic_qconfig},
                                dtype=torch.qint8, inplace=True)
