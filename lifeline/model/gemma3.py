"""Gemma 3 text model: hybrid sliding-window/global attention, QK-norm, sandwich norms, GeGLU."""
from __future__ import annotations

import torch
from torch import nn

from lifeline.model.config import ModelConfig
from lifeline.model.layers.attention import PagedAttention
from lifeline.model.layers.linear import GatedMLP, embedding, linear, project
from lifeline.model.layers.norm import RMSNorm
from lifeline.model.layers.rotary import RotaryEmbedding
from lifeline.model.registry import QKV


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
        self.k_proj = linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
        self.v_proj = linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
        self.o_proj = linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        window = cfg.sliding_window if cfg.layer_types[layer_idx] == "sliding" else None
        self.attn = PagedAttention(layer_idx, cfg.attn_scale, window)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = project(self, x, *QKV)
        q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(q, k, rope)
        o = self.attn(q, k, v)
        return self.o_proj(o.reshape(n, -1))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Gemma3Attention(cfg, layer_idx, rotary)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(nn.Module):
    """HF checkpoints store Gemma norm weights as w for x*(1+w); we compute x*w like llama.cpp
    (the family's `norm_offset`, lifeline.model.registry)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        local_theta = cfg.rope_local_theta or cfg.rope_theta
        self.rotary_global = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta,
                                             cfg.rope_scaling)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position, local_theta)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, self.rotary_local if t == "sliding" else self.rotary_global)
            for i, t in enumerate(cfg.layer_types))
        self.sliding = tuple(t == "sliding" for t in cfg.layer_types)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size)
        self.embed_scale = cfg.hidden_size ** 0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of `input_ids` (what an image's rows replace)."""
        return self.embed_tokens(input_ids) * self.embed_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states of the step's tokens; the KV pools and the step's attention metadata
        come from the forward context (lifeline.model.context)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = (self.rotary_global.step_rows(positions), self.rotary_local.step_rows(positions))
        for layer, sliding in zip(self.layers, self.sliding):
            x = layer(x, rope[sliding])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
