"""Mixture-of-Experts feed-forward: a top-k softmax router, experts run grouped by expert, and the
routing counts of every step.

Execution: the step's (token, expert) pairs are sorted by expert; each expert that received
tokens runs one gate/up and one down matmul over its rows, and the weighted results are added
back to their tokens with one `index_add_`. Experts that received no token are never read, so
a decode step reads only the experts its tokens chose. Knowing each expert's row count needs one
device-to-host copy per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lifeline.model.config import ModelConfig
from lifeline.model.layers.linear import ACTIVATIONS, GatedMLP, linear


@dataclass(slots=True)
class MoEStats:
    """Expert routing of every forward pass since the last `reset()`, split by segment (the
    engine makes each scheduled request one segment). The caller resets it once per step, runs
    the step, then reads it; recording costs one `bincount` per MoE layer."""

    counts: torch.Tensor
    """`[num_moe_layers, num_segments, num_experts]` (token, expert) pairs routed to each
    expert by each segment's tokens."""
    layers: list[int]
    """Decoder layer index of each row (dense layers have none)."""
    top_k: int
    expert_params: int
    """Weights of one routed expert."""
    segments: torch.Tensor | None = None
    """Segment of each token of the next forward passes; None: all one segment."""

    @classmethod
    def for_config(cls, cfg: ModelConfig) -> MoEStats:
        layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
        counts = torch.zeros(len(layers), 1, cfg.num_experts, dtype=torch.long)
        return cls(counts, layers, cfg.num_experts_per_tok, cfg.expert_params())

    def reset(self, segments: torch.Tensor | None = None, num_segments: int = 1) -> None:
        """Zero the counts; `segments` `[N]` (values < `num_segments`) labels the tokens of the
        forward passes that follow."""
        # A fresh tensor rather than zero_(): the old one may be an inference-mode tensor.
        layers, _, experts = self.counts.shape
        self.counts = torch.zeros(layers, num_segments, experts, dtype=torch.long,
                                  device=self.counts.device)
        self.segments = segments

    def record(self, row: int, experts: torch.Tensor) -> torch.Tensor:
        """Count one layer's routing (`experts` `[N, k]`); returns pairs per expert `[E]`."""
        num_segments, num_experts = self.counts.shape[1:]
        flat = experts.flatten()
        if self.segments is not None and num_segments > 1:
            seg = self.segments.to(flat.device).repeat_interleave(experts.shape[1])
            flat = seg * num_experts + flat
        per_segment = torch.bincount(flat, minlength=num_segments * num_experts)
        per_segment = per_segment.view(num_segments, num_experts)
        if self.counts.device != per_segment.device:
            self.counts = self.counts.to(per_segment.device)
        self.counts[row] += per_segment
        return per_segment.sum(dim=0)

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """`[num_moe_layers, num_experts]`; each row sums to tokens × top-k."""
        return self.counts.sum(dim=1)

    def num_tokens(self) -> int:
        """Tokens that went through the MoE layers since the reset."""
        if not self.layers:
            return 0
        return int(self.counts[0].sum()) // self.top_k

    def experts_touched(self) -> list[int]:
        """Distinct experts that ran, per MoE layer."""
        return (self.tokens_per_expert > 0).sum(dim=1).tolist()

    def expert_params_read(self) -> int:
        """Routed-expert weights read since the reset: what an MoE step costs in memory traffic
        beyond the dense part, growing with the number of distinct experts a batch touches."""
        return sum(self.experts_touched()) * self.expert_params


def route(logits: torch.Tensor, top_k: int, normalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, the top k, optionally renormalized to sum to 1 (which equals
    Mixtral's softmax over the top-k logits). Returns (weights, experts), both `[N, k]`."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


class Experts(nn.Module):
    """All routed experts of one layer as two 3-D weights, transformers 5's fused layout:
    `gate_up_proj [E, 2I, H]` (gate rows first) and `down_proj [E, H, I]`."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str):
        super().__init__()
        self.gate_up_proj = _meta_param(num_experts, 2 * intermediate, hidden)
        self.down_proj = _meta_param(num_experts, hidden, intermediate)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
        """x `[N, H]`; weights, experts `[N, k]`; counts `[E]` pairs per expert."""
        order = experts.flatten().argsort(stable=True)
        token = order // experts.shape[1]
        xs = x.index_select(0, token)
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                rows = slice(start, start + n)
                gate, up = F.linear(xs[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
                ys[rows] = F.linear(self.act(gate) * up, self.down_proj[e])
                start += n
        ys *= weights.flatten()[order].unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, token, ys)


class SparseMoeBlock(nn.Module):
    """Replaces the MLP of an MoE layer; weight names follow transformers (`gate` is the router)."""

    def __init__(self, cfg: ModelConfig, stats: MoEStats, row: int):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.normalize = cfg.norm_topk_prob
        self.gate = linear(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                               cfg.hidden_act)
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size,
                                          cfg.hidden_act)
            self.shared_expert_gate = linear(cfg.hidden_size, 1)
        self.stats, self.row = stats, row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.top_k, self.normalize)
        counts = self.stats.record(self.row, experts)
        out = self.experts(x, weights, experts, counts)
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def _meta_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta"), requires_grad=False)
