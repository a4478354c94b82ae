"""The Llama dense family: Llama 2/3, Mistral, Qwen2 (QKV bias), Qwen3 (QK-norm); GQA, SwiGLU."""
from __future__ import annotations

import torch
from torch import nn

from lifeline.model.config import ModelConfig
from lifeline.model.layers.attention import PagedAttention
from lifeline.model.layers.linear import GatedMLP, embedding, linear, project
from lifeline.model.layers.norm import RMSNorm
from lifeline.model.layers.rotary import RotaryEmbedding
from lifeline.model.registry import QKV


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias)
        self.k_proj = linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias)
        self.v_proj = linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias)
        self.o_proj = linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        window = cfg.sliding_window if cfg.layer_types[layer_idx] == "sliding" else None
        self.attn = PagedAttention(layer_idx, cfg.attn_scale, window)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = project(self, x, *QKV)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, k, rope)
        o = self.attn(q, k, v)
        return self.o_proj(o.reshape(n, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta,
                                      cfg.rope_scaling)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, self.rotary) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of `input_ids` (what an image's rows replace)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states of the step's tokens; the KV pools and the step's attention metadata
        come from the forward context (lifeline.model.context)."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary.step_rows(positions)
        for layer in self.layers:
            x = layer(x, rope)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
