"""The MoE family: Qwen3-MoE, Qwen2-MoE (shared expert behind a sigmoid gate, QKV bias) and
Mixtral. Each is the Llama decoder with a sparse MoE block in place of the MLP of its MoE layers;
the families differ only in config (renormalized top-k, shared expert, QK-norm, bias)."""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from lifeline.model.config import ModelConfig
from lifeline.model.layers.moe import MoEStats, SparseMoeBlock
from lifeline.model.llama import LlamaForCausalLM

_EXPERT_WEIGHT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
_MIXTRAL_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class MoEForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.moe_stats = MoEStats.for_config(cfg)
        """Routing counts since the caller last reset them (see `MoEStats`)."""
        for row, layer_idx in enumerate(self.moe_stats.layers):
            self.layers[layer_idx].mlp = SparseMoeBlock(cfg, self.moe_stats, row)

    def convert_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoints store one tensor per expert and projection (`experts.3.gate_proj`;
        Mixtral: `block_sparse_moe.experts.3.w1`); stack each layer's experts into the fused
        `experts.gate_up_proj` and `experts.down_proj` once all of them have arrived. Fused
        tensors pass through."""
        num_experts = self.config.num_experts
        pending: dict[int, dict[str, dict[int, torch.Tensor]]] = {}
        for name, tensor in weights:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            m = _EXPERT_WEIGHT.fullmatch(name)
            if not m:
                yield name, tensor
                continue
            layer, expert, proj = int(m[1]), int(m[2]), _MIXTRAL_NAMES.get(m[3], m[3])
            parts = pending.setdefault(layer, {p: {} for p in _PROJECTIONS})
            parts[proj][expert] = tensor
            if all(len(parts[p]) == num_experts for p in _PROJECTIONS):
                del pending[layer]
                yield from _fuse(layer, parts, num_experts)
        if pending:
            raise ValueError(f"checkpoint is missing experts in layers {sorted(pending)}")


def _fuse(layer: int, parts: dict[str, dict[int, torch.Tensor]], num_experts: int
          ) -> Iterator[tuple[str, torch.Tensor]]:
    experts = range(num_experts)
    gate_up = torch.stack([torch.cat([parts["gate_proj"][e], parts["up_proj"][e]]) for e in experts])
    down = torch.stack([parts["down_proj"][e] for e in experts])
    yield f"layers.{layer}.mlp.experts.gate_up_proj", gate_up
    yield f"layers.{layer}.mlp.experts.down_proj", down
