"""One description of a model's shape, whatever file it came from (GGUF, HF config, preset)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FAMILIES = {
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "Gemma3ForCausalLM": "gemma3",
    "llama": "llama",
    "LlamaForCausalLM": "llama",
    "qwen2": "llama",
    "Qwen2ForCausalLM": "llama",
    "qwen3": "llama",
    "Qwen3ForCausalLM": "llama",
    "mistral": "llama",
    "MistralForCausalLM": "llama",
}


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    """As the source names it: 'gemma3', 'llama', 'qwen2', 'qwen3', ..."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_local_theta: float | None = None
    """RoPE base of sliding-window layers when it differs (Gemma 3: 10,000)."""
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    """'full' or 'sliding' per layer."""
    max_position: int = 8192
    tie_word_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "silu"
    qk_norm: bool = False
    attention_bias: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full"] * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ValueError("layer_types must name every layer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def family(self) -> str:
        try:
            return FAMILIES[self.architecture]
        except KeyError:
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"supported: {sorted(set(FAMILIES))}") from None

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def num_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * h * self.intermediate_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp) + embed

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> list[str]:
    return ["full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers)]


def config_from_gguf(meta: dict[str, Any]) -> ModelConfig:
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    num_layers = get("block_count")
    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    head_dim = get("attention.key_length", hidden // num_heads)
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", [])) or meta.get(
        "_vocab_size")
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        intermediate_size=get("feed_forward_length"),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=get("rope.freq_base", 10000.0),
        max_position=get("context_length", 8192),
        name=meta.get("general.name", arch),
        qk_norm=arch in ("gemma3", "qwen3"),
        attention_bias=arch == "qwen2",
        tie_word_embeddings=not meta.get("_has_output_tensor", False),
    )
    if arch == "gemma3":
        # Not in the metadata: llama.cpp hard-codes these for Gemma 3.
        cfg.sliding_window = get("attention.sliding_window", 512)
        cfg.layer_types = gemma3_layer_types(num_layers)
        cfg.rope_local_theta = 10000.0
        cfg.query_pre_attn_scalar = head_dim
        cfg.hidden_act = "gelu_pytorch_tanh"
        cfg.tie_word_embeddings = True
    return cfg


def config_from_hf(path: str | Path) -> ModelConfig:
    raw = json.loads((Path(path) / "config.json").read_text())
    raw = raw.get("text_config", raw) if raw.get("model_type") == "gemma3" else raw
    arch = raw.get("model_type", "llama")
    num_heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    num_layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types") or []
    layer_types = ["sliding" if t == "sliding_attention" else "full" for t in layer_types]
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    if arch == "gemma3_text" and not layer_types:
        layer_types = gemma3_layer_types(num_layers, raw.get("sliding_window_pattern", 6))
    if window is None or arch in ("qwen2", "qwen3") and not raw.get("use_sliding_window"):
        window, layer_types = None, []
    rope_params = raw.get("rope_parameters") or {}
    rope_scaling = raw.get("rope_scaling") or None
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads") or num_heads,
        head_dim=raw.get("head_dim") or hidden // num_heads,
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(raw, rope_params),
        rope_local_theta=raw.get("rope_local_base_freq") or _local_theta(rope_params),
        rope_scaling=rope_scaling,
        sliding_window=window,
        layer_types=layer_types,
        max_position=raw.get("max_position_embeddings", 8192),
        tie_word_embeddings=raw.get("tie_word_embeddings", arch == "gemma3_text"),
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act", "silu"),
        qk_norm=arch in ("gemma3_text", "qwen3"),
        attention_bias=raw.get("attention_bias", arch == "qwen2"),
        name=Path(path).name,
    )


def _rope_theta(raw: dict[str, Any], rope_params: dict[str, Any]) -> float:
    if "rope_theta" in raw:
        return raw["rope_theta"]
    full = rope_params.get("full_attention", rope_params)
    return full.get("rope_theta", 10000.0)


def _local_theta(rope_params: dict[str, Any]) -> float | None:
    local = rope_params.get("sliding_attention")
    return local.get("rope_theta") if local else None
