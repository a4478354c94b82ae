"""Dense MLPs and the vocabulary layers."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lifeline.model.registry import GATE_UP

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def linear(in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
    layer = nn.Linear(in_features, out_features, bias=bias, device="meta")
    return layer


def embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """On the meta device until loaded, like `linear`, and without drawing its initial values:
    `normal_` on a meta tensor is a Python decomposition whose first call imports Dynamo
    (seconds of a server's start, before any weight is read)."""
    return nn.Embedding(num_embeddings, embedding_dim,
                        _weight=torch.empty(num_embeddings, embedding_dim, device="meta"))


class FusedProjections(nn.Module):
    """Projections of the same input run as one GEMM over their stacked weights (q/k/v,
    gate/up): one call instead of several, for weight formats whose calls cost more than their
    bytes (`lifeline.model.weight_format`). Returns the parts, split."""

    def __init__(self, linear: nn.Module, sizes: list[int]):
        super().__init__()
        self.linear, self.sizes = linear, sizes

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)


def project(module: nn.Module, x: torch.Tensor, fused: str, names: tuple[str, ...]
            ) -> tuple[torch.Tensor, ...]:
    """`module`'s projections `names` of `x`, through `module.<fused>` when a weight format
    has stacked them into one `FusedProjections` (the family's `fused` projections,
    lifeline.model.registry)."""
    stacked = getattr(module, fused, None)
    if stacked is not None:
        return stacked(x)
    return tuple(getattr(module, name)(x) for name in names)


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
        gate, up = project(self, x, *GATE_UP)
        return self.down_proj(self.act(gate) * up)
