"""What Mixture-of-Experts routing cost, per step and per request.

The model's `MoEStats` counts (token, expert) pairs per MoE layer, split by scheduled request;
the model executor hands them over in each step's `ModelOutput.moe`, and the engine turns them
into a `MoEStep` (what that step read) and adds each request's slice to its `MoEUsage`.
Definitions (docs/architecture.md, "MoE accounting"):

- experts touched: distinct experts that ran in a layer (for a step: for any of its tokens;
  for a request: for any of its tokens over its whole life).
- tokens per expert: (token, expert) pairs of a touched expert.
- active parameters per token: what one token computes with (`ModelConfig.num_active_params`,
  the model-card count).
- weights read per token: the weights a step streams from memory (every non-expert weight
  once, plus each touched expert once) divided by the tokens it ran. At batch 1 it equals the
  active weights; as a batch grows it falls, and slower for MoE than for a dense model, since
  more tokens touch more distinct experts. A request's figure is its share: each step's reads
  split by tokens, summed over the steps it ran in, over its tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from lifeline.engine.executor import MoECounts
from lifeline.model.config import ModelConfig


@dataclass(slots=True)
class MoEStep:
    tokens: int
    experts_touched: list[int]
    """Per MoE layer."""
    expert_params_read: int
    weights_read: int
    """Non-expert weights plus the touched experts' weights."""

    @property
    def experts_touched_mean(self) -> float:
        return sum(self.experts_touched) / max(len(self.experts_touched), 1)

    @property
    def tokens_per_expert_mean(self) -> float:
        """Mean (token, expert) pairs per touched expert."""
        touched = sum(self.experts_touched)
        pairs = self.tokens * len(self.experts_touched)
        return pairs / touched if touched else 0.0

    @property
    def weights_read_per_token(self) -> float:
        return self.weights_read / self.tokens if self.tokens else 0.0


class MoEUsage:
    """One request's routing over its life (recomputation after preemption included)."""

    __slots__ = ("config", "counts", "tokens", "weights_read")

    def __init__(self, config: ModelConfig, num_layers: int):
        self.config = config
        self.counts = torch.zeros(num_layers, config.num_experts, dtype=torch.long)
        self.weights_read = 0.0
        self.tokens = 0

    @classmethod
    def merged(cls, usages: list[MoEUsage]) -> MoEUsage:
        """Several engine requests served as one (`n` > 1)."""
        out = cls(usages[0].config, usages[0].counts.shape[0])
        for u in usages:
            out.add(u.counts, u.tokens, u.weights_read)
        return out

    def add(self, counts: torch.Tensor, tokens: int, weights_read: float) -> None:
        self.counts += counts
        self.tokens += tokens
        self.weights_read += weights_read

    def summary(self) -> dict[str, Any]:
        """The `moe` object of a request's timings."""
        config = self.config
        touched = (self.counts > 0).sum(dim=1)
        loads = self.counts[self.counts > 0]
        return {
            "tokens": self.tokens,
            "experts_touched_per_layer": touched.tolist(),
            "experts_touched_mean": float(touched.float().mean()) if touched.numel() else 0.0,
            "num_experts": config.num_experts,
            "top_k": config.num_experts_per_tok,
            "tokens_per_expert_mean": float(loads.float().mean()) if loads.numel() else 0.0,
            "tokens_per_expert_max": int(loads.max()) if loads.numel() else 0,
            "active_params_per_token": config.num_active_params(),
            "weights_read_per_token": self.weights_read / self.tokens if self.tokens else 0.0,
        }


class MoEAccounting:
    """Takes each step's routing counts (`ModelOutput.moe`); owned by the engine."""

    def __init__(self, config: ModelConfig):
        self.config = config
        self.static_params = config.static_params_read()
        self.layers = [i for i in range(config.num_layers) if config.is_moe_layer(i)]
        """Decoder layer index of each row of the counts (dense layers have none)."""
        num_layers = len(self.layers)
        self.totals = torch.zeros(num_layers, config.num_experts, dtype=torch.long)
        """Cumulative (token, expert) pairs per layer and expert; replaced, never changed in
        place, so another thread can read a consistent snapshot."""
        self.usage: dict[str, MoEUsage] = {}
        self.last_step: MoEStep | None = None
        self.recent: deque[MoEStep] = deque(maxlen=4096)
        """Steps not yet taken by a metrics reader (`popleft` is safe from another thread);
        the oldest are dropped past 4,096."""

    def end(self, moe: MoECounts) -> MoEStep:
        """Account the step just run: `moe.request_ids[i]` ran `moe.tokens[i]` tokens as
        segment i."""
        counts, request_ids, tokens = moe.counts, moe.request_ids, moe.tokens
        per_layer = counts.sum(dim=1)
        touched = (per_layer > 0).sum(dim=1).tolist()
        expert_read = sum(touched) * self.config.expert_params()
        step_tokens = sum(tokens)
        step = MoEStep(step_tokens, touched, expert_read, self.static_params + expert_read)
        self.totals = self.totals + per_layer
        share = step.weights_read / step_tokens if step_tokens else 0.0
        for i, (rid, n) in enumerate(zip(request_ids, tokens)):
            usage = self.usage.get(rid)
            if usage is None:
                usage = self.usage[rid] = MoEUsage(self.config, per_layer.shape[0])
            usage.add(counts[:, i], n, share * n)
        self.last_step = step
        self.recent.append(step)
        return step

    def finish(self, request_id: str) -> MoEUsage | None:
        return self.usage.pop(request_id, None)
