"""Dense MLPs and the vocabulary layers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def linear(in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=bias, device="meta")
    return layer


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU for Llama/Qwen, GeGLU for Gemma."""

    def __init__(self, hidden: int, intermediate: int, act: str):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}")
        self.gate_proj = linear(hidden, intermediate)
        self.up_proj = linear(hidden, intermediate)
        self.down_proj = linear(intermediate, hidden)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
