"""Rotary position embedding, NEOX layout (rotate halves), as HF and llama.cpp's NEOX type."""
from __future__ import annotations

import functools
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
    """cos and sin of position x inverse frequency, as rows a step needs (`rows`): on the CPU
    computed for the step's positions, by the very ATen kernels a table of every position
    would have been built with (so the same bits; compiled code calls them through
    `lifeline_ext::rope_rows`, where Inductor's own cos and sin differ in the last bit); on a
    GPU, or compiled where that operator is not built, looked up in tables of every position
    (`build_tables`: Gemma 3's two are 64 MiB at 32,768 positions, which the CPU no longer
    holds)."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None):
        super().__init__()
        self.max_position = max_position
        self.register_buffer("inv_freq", _inv_freq(head_dim, theta, scaling), persistent=False)
        self.register_buffer("cos", None, persistent=False)  # `build_tables`
        self.register_buffer("sin", None, persistent=False)

    def build_tables(self) -> None:
        """The tables of every position (computed on the CPU, placed where `inv_freq` is)."""
        if self.cos is not None:
            return
        if self.inv_freq.is_meta:  # a model of shapes only
            shape = (self.max_position, self.inv_freq.shape[0])
            self.cos = torch.empty(shape, device="meta")
            self.sin = torch.empty(shape, device="meta")
            return
        t = torch.arange(self.max_position, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.cpu())
        device = self.inv_freq.device
        self.cos, self.sin = freqs.cos().to(device), freqs.sin().to(device)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, head_dim / 2] of `positions` [N]."""
        if self.cos is not None:
            return self.cos[positions], self.sin[positions]
        if torch.compiler.is_compiling():
            return torch.ops.lifeline_ext.rope_rows(positions, self.inv_freq)
        freqs = torch.outer(positions.float(), self.inv_freq)
        return freqs.cos(), freqs.sin()

    def step_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, 1, head_dim / 2] of a step's `positions` [N], computed once a step
        by the model and handed to every layer: compiled code does not merge the layers' calls
        of `lifeline_ext::rope_rows` (docs/performance.md)."""
        cos, sin = self.rows(positions)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [N, H, D], k: [N, KVH, D] rotated by the step's `rows` (`step_rows`)."""
        cos, sin = rows
        # float32 rows: bf16 activations rotate in float32, rounded once (a no-op in float32)
        return _rotate(q, cos, sin).to(q.dtype), _rotate(k, cos, sin).to(k.dtype)


def build_tables(model: nn.Module) -> None:
    """Every rotary embedding of `model` with its tables (`RotaryEmbedding.build_tables`)."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_tables()


@functools.cache
def native_rows() -> bool:
    """Whether `lifeline_ext::rope_rows` (lifeline/csrc/cpu_ops.cpp) is built, its shapes
    registered for the compiler; compiled code without it looks rows up in tables."""
    from lifeline.model.native import native_ops

    if not native_ops() or not hasattr(torch.ops.lifeline_ext, "rope_rows"):
        return False

    @torch.library.register_fake("lifeline_ext::rope_rows")
    def _(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (positions.shape[0], inv_freq.shape[0])
        return inv_freq.new_empty(shape), inv_freq.new_empty(shape)

    return True


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Written as the reference writes it: int8-all's perplexity moved from 20.504 to 20.556 when
    # this became roll + addcmul (1-ulp differences, amplified by activation quantization),
    # for no measurable speed (docs/performance.md).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
