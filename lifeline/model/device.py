"""A loaded model on the device it runs on: on a GPU every weight in one dtype (bfloat16 by
default, dequantized from GGUF on the CPU first), the KV pools in the same dtype. The CPU keeps
float32 and its weight formats (lifeline.model.weight_format)."""
from __future__ import annotations

import torch
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def runs_on_gpu(device: str | torch.device) -> bool:
    return torch.device(device).type != "cpu"


def gpu_dtype(weights: str) -> torch.dtype:
    """The dtype of a model whose weight format on a GPU is `weights` ('bf16', 'fp32')."""
    try:
        return DTYPES[weights]
    except KeyError:
        raise ValueError(f"weights {weights!r} do not run on a GPU; there: "
                         f"{', '.join(DTYPES)}") from None


def place_model(model: nn.Module, device: str | torch.device,
                dtype: torch.dtype | None = None) -> None:
    """Moves `model` to `device` in place, its floating-point parameters converted to `dtype`
    one at a time (a tied head stays tied, and the device never holds a float32 copy of the
    whole model). Buffers keep their dtype: the rotary tables (built here) stay float32, and
    a rotation's result is rounded once, to the activations' dtype."""
    from lifeline.model.layers.rotary import build_tables

    build_tables(model)  # the rows are computed for each step on the CPU only
    for param in model.parameters():
        target = dtype if dtype is not None and param.is_floating_point() else param.dtype
        param.data = param.data.to(device, target)
    model.to(device)


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (each tied one once), as placed."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
