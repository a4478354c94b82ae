"""Shapes of real architectures, for dummy-weight performance work and the planner.

Two kinds:

- Full size (`FULL`): the published configuration of a real model, shapes only. `shape_model`
  builds it on the meta device, so a 46.7B Mixtral costs no memory; parameter counts match the
  model cards (tests/test_presets.py). DeepSeek's (multi-head latent attention) are shapes for
  the planner only: no Lifeline model builds them (`registry.ModelFamily.buildable`).
- Scaled (`SCALED`): the dense-vs-MoE experiment at a size this machine runs. Three models that
  differ only in the feed-forward block, each with more than 300 MB of fp32 weights so decode
  streams weights from memory rather than cache:
  `scaled-moe` (Qwen3-MoE layout: 64 experts, top-4), `scaled-dense-same-total` (its dense twin
  with the same total weights: one MLP as wide as all experts) and `scaled-dense-same-active`
  (the dense twin with the same active weights: an MLP as wide as the top-4 experts).

`load_model("preset:NAME")` builds a preset with random weights (no tokenizer: prompts are
token ids). Configs need no torch (the planner reads them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lifeline.model.config import ModelConfig, VisionSpec, gemma3_layer_types
from lifeline.model.registry import build_model

if TYPE_CHECKING:
    from torch import nn

_QWEN3 = {"vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
          "qk_norm": True, "head_dim": 128, "max_position": 40960}
_LLAMA2 = {"vocab_size": 32000, "rms_norm_eps": 1e-5, "head_dim": 128, "max_position": 4096}
_LLAMA3 = {"architecture": "llama", "vocab_size": 128256, "num_kv_heads": 8, "head_dim": 128,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position": 131072}
# DeepSeek-V2/V3: multi-head latent attention (a 512-wide KV latent plus a 64-wide RoPE key
# cached per token; 128 + 64 query/key and 128 value dims per head), the first layers dense,
# then shared plus routed experts, untied head. `head_dim` is the query/key head (nope + rope).
_DEEPSEEK = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position": 163840,
             "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
             "v_head_dim": 128, "head_dim": 192, "shared_expert_gate": False}


def _gemma3(hidden: int, layers: int, heads: int, kv: int, head_dim: int, inter: int,
            window: int, vocab: int, max_position: int) -> dict[str, Any]:
    return {"architecture": "gemma3_text", "vocab_size": vocab, "hidden_size": hidden,
            "num_layers": layers, "num_heads": heads, "num_kv_heads": kv, "head_dim": head_dim,
            "intermediate_size": inter, "sliding_window": window,
            "layer_types": gemma3_layer_types(layers), "rope_theta": 1_000_000.0,
            "rope_local_theta": 10_000.0, "query_pre_attn_scalar": head_dim,
            "hidden_act": "gelu_pytorch_tanh", "qk_norm": True, "tie_word_embeddings": True,
            "max_position": max_position}


FULL: dict[str, dict[str, Any]] = {
    # Dense, MHA
    "llama-2-7b": {**_LLAMA2, "architecture": "llama", "hidden_size": 4096, "num_layers": 32,
                   "num_heads": 32, "num_kv_heads": 32, "intermediate_size": 11008},
    "llama-2-13b": {**_LLAMA2, "architecture": "llama", "hidden_size": 5120, "num_layers": 40,
                    "num_heads": 40, "num_kv_heads": 40, "intermediate_size": 13824},
    # Dense, GQA
    "llama-3.1-8b": {**_LLAMA3, "hidden_size": 4096, "num_layers": 32, "num_heads": 32,
                     "intermediate_size": 14336},
    "llama-3.1-70b": {**_LLAMA3, "hidden_size": 8192, "num_layers": 80, "num_heads": 64,
                      "intermediate_size": 28672},
    "mistral-7b-v0.1": {**_LLAMA2, "architecture": "mistral", "hidden_size": 4096,
                        "num_layers": 32, "num_heads": 32, "num_kv_heads": 8,
                        "intermediate_size": 14336, "max_position": 32768,
                        "sliding_window": 4096, "layer_types": ["sliding"] * 32},
    "qwen3-8b": {**_QWEN3, "architecture": "qwen3", "hidden_size": 4096, "num_layers": 36,
                 "num_heads": 32, "num_kv_heads": 8, "intermediate_size": 12288},
    "qwen3-32b": {**_QWEN3, "architecture": "qwen3", "hidden_size": 5120, "num_layers": 64,
                  "num_heads": 64, "num_kv_heads": 8, "intermediate_size": 25600},
    # Hybrid sliding-window / global attention (5:1), MQA at the small sizes
    "gemma-3-270m": _gemma3(640, 18, 4, 1, 256, 2048, 512, 262144, 32768),
    "gemma-3-1b": _gemma3(1152, 26, 4, 1, 256, 6912, 512, 262144, 32768),
    "gemma-3-27b": _gemma3(5376, 62, 32, 16, 128, 21504, 1024, 262208, 131072),
    # MoE
    "mixtral-8x7b": {"architecture": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
                     "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
                     "intermediate_size": 14336, "rms_norm_eps": 1e-5,
                     "rope_theta": 1_000_000.0, "max_position": 32768, "num_experts": 8,
                     "num_experts_per_tok": 2, "moe_intermediate_size": 14336,
                     "norm_topk_prob": True},
    "qwen3-30b-a3b": {**_QWEN3, "architecture": "qwen3_moe", "hidden_size": 2048,
                      "num_layers": 48, "num_heads": 32, "num_kv_heads": 4,
                      "intermediate_size": 6144, "num_experts": 128, "num_experts_per_tok": 8,
                      "moe_intermediate_size": 768, "norm_topk_prob": True},
    "qwen1.5-moe-a2.7b": {"architecture": "qwen2_moe", "vocab_size": 151936,
                          "hidden_size": 2048, "num_layers": 24, "num_heads": 16,
                          "num_kv_heads": 16, "head_dim": 128, "intermediate_size": 5632,
                          "attention_bias": True, "max_position": 8192, "num_experts": 60,
                          "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                          "shared_expert_intermediate_size": 5632},
    "qwen3-235b-a22b": {**_QWEN3, "architecture": "qwen3_moe", "hidden_size": 4096,
                        "num_layers": 94, "num_heads": 64, "num_kv_heads": 4,
                        "intermediate_size": 12288, "num_experts": 128,
                        "num_experts_per_tok": 8, "moe_intermediate_size": 1536,
                        "norm_topk_prob": True},
    # MoE with multi-head latent attention: shapes for the planner (no model runs them)
    "deepseek-v3": {**_DEEPSEEK, "architecture": "deepseek_v3", "vocab_size": 129280,
                    "hidden_size": 7168, "num_layers": 61, "num_heads": 128,
                    "num_kv_heads": 128, "intermediate_size": 18432, "q_lora_rank": 1536,
                    "num_experts": 256, "num_experts_per_tok": 8,
                    "moe_intermediate_size": 2048, "shared_expert_intermediate_size": 2048,
                    "norm_topk_prob": True, "mlp_only_layers": [0, 1, 2]},
    "deepseek-v2-lite": {**_DEEPSEEK, "architecture": "deepseek_v2", "vocab_size": 102400,
                         "hidden_size": 2048, "num_layers": 27, "num_heads": 16,
                         "num_kv_heads": 16, "intermediate_size": 10944, "num_experts": 64,
                         "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
                         "shared_expert_intermediate_size": 2 * 1408, "mlp_only_layers": [0]},
}

_SCALED_BASE = {"vocab_size": 32000, "hidden_size": 768, "num_layers": 8, "num_heads": 12,
                "num_kv_heads": 4, "head_dim": 64, "rms_norm_eps": 1e-6,
                "rope_theta": 1_000_000.0, "qk_norm": True, "max_position": 4096}
_EXPERTS, _TOP_K, _EXPERT_WIDTH = 64, 4, 256

SCALED: dict[str, dict[str, Any]] = {
    "scaled-moe": {**_SCALED_BASE, "architecture": "qwen3_moe",
                   "intermediate_size": _TOP_K * _EXPERT_WIDTH, "num_experts": _EXPERTS,
                   "num_experts_per_tok": _TOP_K, "moe_intermediate_size": _EXPERT_WIDTH,
                   "norm_topk_prob": True},
    "scaled-dense-same-total": {**_SCALED_BASE, "architecture": "qwen3",
                                "intermediate_size": _EXPERTS * _EXPERT_WIDTH},
    "scaled-dense-same-active": {**_SCALED_BASE, "architecture": "qwen3",
                                 "intermediate_size": _TOP_K * _EXPERT_WIDTH},
}

_SIGLIP_512 = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
               "num_attention_heads": 12, "image_size": 512, "patch_size": 16,
               "layer_norm_eps": 1e-6}
_SIGLIP_SO400M = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                  "num_attention_heads": 16, "image_size": 896, "patch_size": 14,
                  "layer_norm_eps": 1e-6}
VISION: dict[str, dict[str, Any]] = {
    # Vision-language: the published configurations (HuggingFaceTB/SmolVLM-256M-Instruct, a
    # SmolLM2-135M decoder; google/gemma-3-4b-it), for dummy-weight studies of the encoder.
    "smolvlm-256m": {
        "architecture": "llama", "vocab_size": 49280, "hidden_size": 576, "num_layers": 30,
        "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "intermediate_size": 1536,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position": 8192,
        "tie_word_embeddings": True,
        "vision": VisionSpec("idefics3", _SIGLIP_512, 49190, "<image>", scale_factor=4,
                             tokens_per_image=64,
                             processor={"size": {"longest_edge": 2048},
                                        "max_image_size": {"longest_edge": 512},
                                        "resample": 1})},
    "gemma-3-4b": {
        **_gemma3(2560, 34, 8, 4, 256, 10240, 1024, 262208, 131072),
        "vision": VisionSpec("gemma3", _SIGLIP_SO400M, 262144, "<start_of_image>",
                             tokens_per_image=256, bidirectional=True,
                             processor={"size": {"height": 896, "width": 896},
                                        "resample": 2})},
}

PRESETS = {**FULL, **SCALED, **VISION}


def preset_config(name: str) -> ModelConfig:
    try:
        fields = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}") from None
    return ModelConfig(name=name, **fields)


def shape_model(name_or_config: str | ModelConfig) -> nn.Module:
    """The model with every tensor on the meta device: shapes, no memory."""
    import torch  # here, not above: configs need no torch

    cfg = (preset_config(name_or_config) if isinstance(name_or_config, str)
           else name_or_config)
    with torch.device("meta"):
        model = build_model(cfg)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model
