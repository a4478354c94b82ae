"""Rotary position embedding, NEOX layout (rotate halves), as HF and llama.cpp's NEOX type."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        return _llama3_scaling(inv_freq, scaling).float()
    raise ValueError(f"unsupported rope scaling {kind!r}")


def _llama3_scaling(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(mid, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None):
        super().__init__()
        inv_freq = _inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self._positions: torch.Tensor | None = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] = ()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [N, H, D], k: [N, KVH, D], positions: [N]."""
        if torch.compiler.is_compiling():  # the compiler shares the lookup across layers
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        else:
            if positions is not self._positions:  # every layer of a step passes this tensor
                self._positions = positions
                self._cos_sin = (self.cos[positions].unsqueeze(1),
                                 self.sin[positions].unsqueeze(1))
            cos, sin = self._cos_sin
        # float32 tables: bf16 activations rotate in float32, rounded once (a no-op in float32)
        return _rotate(q, cos, sin).to(q.dtype), _rotate(k, cos, sin).to(k.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Written as the reference writes it: int8-all's perplexity moved from 20.504 to 20.556 when
    # this became roll + addcmul (1-ulp differences, amplified by activation quantization),
    # for no measurable speed (docs/performance.md).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
