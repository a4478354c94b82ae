"""One description of a model's shape, whatever file it came from (GGUF, HF config, preset)."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lifeline.model import registry


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """The vision side of a vision-language model: its tower (lifeline.model.vision), how an
    image's tokens look in the prompt, and how its language model attends over them."""

    family: str
    """'idefics3' (SmolVLM) or 'gemma3'."""
    vision: dict[str, Any]
    """The checkpoint's `vision_config`."""
    image_token_id: int
    """The token whose positions take the tower's rows."""
    marker: str
    """What marks an image in the rendered prompt (replaced by the family's placeholder)."""
    scale_factor: int = 2
    """Idefics3's pixel shuffle."""
    tokens_per_image: int = 256
    """Rows per frame (Gemma 3: `mm_tokens_per_image`; Idefics3: patches / scale_factor²)."""
    bidirectional: bool = False
    """An image's tokens attend to each other both ways in the language model (Gemma 3)."""
    processor: dict[str, Any] = field(default_factory=dict)
    """The image processor's settings, as the checkpoint saved them (`image_processor_settings`)."""


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
    """Width of one query/key head; for MLA, `qk_nope_head_dim + qk_rope_head_dim` (what the
    attention scale uses)."""
    intermediate_size: int
    """Hidden width of the dense MLP (of every layer that is not MoE)."""
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
    vision: VisionSpec | None = None
    """A vision-language model's vision side; None for a text model."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Hidden width of one routed expert (Mixtral: `intermediate_size`)."""
    shared_expert_intermediate_size: int = 0
    """Width of the always-on shared expert (Qwen2-MoE; DeepSeek: all its shared experts as
    one MLP); 0 for none."""
    shared_expert_gate: bool = True
    """The shared expert's output is scaled by a learned sigmoid gate (Qwen2-MoE: one
    `hidden_size` vector); DeepSeek adds it ungated."""
    norm_topk_prob: bool = False
    """Renormalize the top-k routing probabilities to sum to 1 (Mixtral, Qwen3-MoE checkpoints)."""
    decoder_sparse_step: int = 1
    """Every n-th layer is MoE (Qwen-MoE); the others, and `mlp_only_layers`, are dense."""
    mlp_only_layers: list[int] = field(default_factory=list)
    kv_lora_rank: int = 0
    """Multi-head latent attention (DeepSeek-V2/V3): the width of the compressed KV latent that
    the cache holds in place of K and V; 0 for ordinary attention."""
    q_lora_rank: int = 0
    """MLA: the width of the compressed query (q_a_proj, q_b_proj); 0: one q_proj."""
    qk_rope_head_dim: int = 0
    """MLA: the part of each query/key head that carries RoPE (its key part is shared by all
    heads and cached beside the latent)."""
    qk_nope_head_dim: int = 0
    """MLA: the part of each query/key head without position."""
    v_head_dim: int = 0
    """MLA: the width of each value head."""

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full"] * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ValueError("layer_types must name every layer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise ValueError("an MoE model needs 0 < num_experts_per_tok <= num_experts "
                             "and moe_intermediate_size > 0")
        mla = (self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim)
        if (any(mla) or self.q_lora_rank) and not all(d > 0 for d in mla):
            raise ValueError("an MLA model needs kv_lora_rank, qk_rope_head_dim, "
                             "qk_nope_head_dim and v_head_dim > 0")

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention: the cache holds one latent per token, not K and V."""
        return self.kv_lora_rank > 0

    @property
    def family(self) -> str:
        """The name of its model family (lifeline.model.registry)."""
        return registry.family(self.architecture).name

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def expert_params(self) -> int:
        """Weights of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def num_params(self) -> int:
        """Every weight the model holds, all experts included; a tied head counts once."""
        return self._count_params(self.num_experts)

    def num_active_params(self) -> int:
        """Weights one token's forward pass touches, counted as model cards count them
        (Mixtral 8x7B: 12.9B of 46.7B; Qwen3-30B-A3B: 3.3B of 30.5B): attention, norms, the
        router, the top-k routed experts and the shared expert of every layer, plus the whole
        embedding matrix and output head (a token reads only one embedding row, but cards count
        it all). Equals `num_params()` for a dense model."""
        return self._count_params(self.num_experts_per_tok)

    def static_params_read(self) -> int:
        """Weights every forward pass streams whatever the routing: all but the routed experts
        and, for an untied model, the input embedding table (a pass reads only its rows)."""
        num_moe = sum(self.is_moe_layer(i) for i in range(self.num_layers))
        experts = num_moe * self.num_experts * self.expert_params()
        embed = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_params() - experts - embed

    def _count_params(self, experts_per_layer: int) -> int:
        h = self.hidden_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        layers = sum(self._layer_params(i, experts_per_layer) for i in range(self.num_layers))
        return layers + embed + h

    def _layer_params(self, layer_idx: int, experts: int) -> int:
        h = self.hidden_size
        attn = self._mla_params() if self.is_mla else self._attention_params()
        norms = h * registry.family(self.architecture).norms_per_layer
        if not self.is_moe_layer(layer_idx):
            return attn + norms + 3 * h * self.intermediate_size
        shared = self.shared_expert_intermediate_size
        ffn = self.num_experts * h + experts * self.expert_params()
        ffn += (3 * h * shared + h * self.shared_expert_gate) if shared else 0
        return attn + norms + ffn

    def _attention_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attn = h * (q + 2 * kv) + q * h
        return attn + (q + 2 * kv) * self.attention_bias + 2 * d * self.qk_norm

    def _mla_params(self) -> int:
        """DeepSeek-V2/V3 attention: the query through q_proj, or q_a_proj, its norm and
        q_b_proj; kv_a_proj_with_mqa to the latent and the shared RoPE key, the latent's norm,
        kv_b_proj from the latent to every head's key (no RoPE part) and value; o_proj."""
        h, heads, rank, rope = (self.hidden_size, self.num_heads, self.kv_lora_rank,
                                self.qk_rope_head_dim)
        q_out = heads * (self.qk_nope_head_dim + rope)
        if self.q_lora_rank:
            q = (h + 1 + q_out) * self.q_lora_rank + self.q_lora_rank * self.attention_bias
        else:
            q = h * q_out
        kv = (h + self.attention_bias) * (rank + rope) + rank
        kv += rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        out = heads * self.v_head_dim * h + h * self.attention_bias
        return q + kv + out


def gemma3_layer_types(num_layers: int, pattern: int | None = None) -> list[str]:
    """Every `pattern`-th layer global, the others sliding (the Gemma 3 family's
    `global_every` unless given)."""
    pattern = pattern or registry.family("gemma3").global_every
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


def config_from_gguf_header(metadata: dict[str, Any],
                            tensor_shapes: Mapping[str, Sequence[int]]) -> ModelConfig:
    """`config_from_gguf` of a file's metadata and its tensor table (shapes in torch order):
    the table says whether the file has an output head of its own (else it is tied) and the
    vocabulary's size (the embedding's rows), which the metadata may not."""
    return config_from_gguf({**metadata, "_has_output_tensor": "output.weight" in tensor_shapes,
                             "_vocab_size": tensor_shapes["token_embd.weight"][0]})


def config_from_hf(path: str | Path) -> ModelConfig:
    """From a Hugging Face model directory, or its `config.json` file itself."""
    path = Path(path)
    file = path if path.is_file() else path / "config.json"
    top = raw = json.loads(file.read_text())
    if raw.get("model_type") in ("gemma3", "idefics3", "smolvlm"):
        raw = raw.get("text_config", raw)
        if raw is not top and raw.get("model_type") is None:
            raw = {**raw, "model_type": "llama"}
    arch = raw.get("model_type", "llama")
    num_heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    num_layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types") or []
    layer_types = ["sliding" if t == "sliding_attention" else "full" for t in layer_types]
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    found = registry.find(arch)
    if found and found.global_every and not layer_types:
        layer_types = gemma3_layer_types(num_layers,
                                         raw.get("sliding_window_pattern", found.global_every))
    if window is None or arch in ("qwen2", "qwen3") and not raw.get("use_sliding_window"):
        window, layer_types = None, []
    elif not layer_types:
        layer_types = ["sliding"] * num_layers  # Mistral: one window for every layer
    rope_params = raw.get("rope_parameters") or {}
    rope_scaling = raw.get("rope_scaling") or None
    cfg = ModelConfig(
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
        qk_norm=arch in ("gemma3_text", "qwen3", "qwen3_moe"),
        attention_bias=raw.get("attention_bias",
                               raw.get("qkv_bias", arch in ("qwen2", "qwen2_moe"))),
        name=file.parent.name if file.name == "config.json" else file.stem,
    )
    if top.get("vision_config"):
        cfg.vision = _vision_spec(top, file.parent)
    if raw.get("kv_lora_rank"):
        _set_mla_fields(cfg, raw)
    if found and found.routed_experts:
        _set_moe_fields(cfg, raw)
    return cfg


def _vision_spec(top: dict[str, Any], folder: Path) -> VisionSpec:
    """The vision side, its image processor's settings checked against the model (a checkpoint
    Lifeline would read other than transformers is refused here, at load)."""
    vision = dict(top["vision_config"])
    settings, processor = image_processor_settings(folder)
    if top["model_type"] == "gemma3":
        spec = VisionSpec("gemma3", vision, int(top.get("image_token_index", 262144)),
                          "<start_of_image>",
                          tokens_per_image=int(top.get("mm_tokens_per_image", 256)),
                          bidirectional=True, processor=settings)
    else:
        scale = int(top.get("scale_factor", 2))
        patches = (vision.get("image_size", 224) // vision.get("patch_size", 32)) ** 2
        spec = VisionSpec("idefics3", vision, int(top.get("image_token_id", 128257)), "<image>",
                          scale_factor=scale, tokens_per_image=patches // scale ** 2,
                          processor=settings)
    try:
        _check_image_processor(spec, processor)
    except ValueError as exc:
        raise ValueError(f"{folder}: {exc}") from None
    return spec


PROCESSOR_FILE, IMAGE_PROCESSOR_FILE = "processor_config.json", "preprocessor_config.json"


def image_processor_settings(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the image processor's settings, the processor's own) as transformers reads them:
    `image_processor` nested in processor_config.json (what transformers 5 saves), else the
    flat preprocessor_config.json (the older layout, beside a processor_config.json holding
    only the processor's own settings). Neither is an error: defaults would process images
    other than the checkpoint's processor does."""
    nested, flat = folder / PROCESSOR_FILE, folder / IMAGE_PROCESSOR_FILE
    processor = _json_object(nested) if nested.is_file() else {}
    if isinstance(processor.get("image_processor"), dict):
        return processor["image_processor"], processor
    if flat.is_file():
        settings = _json_object(flat)
        return settings, {**settings, **processor}
    raise ValueError(f"{folder}: a vision model needs its image processor's settings, in "
                     f"{PROCESSOR_FILE} (under 'image_processor', as transformers 5 saves "
                     f"them) or {IMAGE_PROCESSOR_FILE}; neither is there")


def _json_object(file: Path) -> dict[str, Any]:
    value = json.loads(file.read_text())
    if not isinstance(value, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return value


def _check_image_processor(spec: VisionSpec, processor: dict[str, Any]) -> None:
    """The settings parse (lifeline.media.processors refuses what it cannot follow), the
    encoder reads frames of the side they make, and the processor's image token count is
    the model's."""
    from lifeline.media.processors import Gemma3Processor, Idefics3Processor

    side = spec.vision.get("image_size", 224)
    if spec.family == "gemma3":
        made = Gemma3Processor.from_config({"size": {"height": side, "width": side},
                                            **spec.processor})
        count_key = "image_seq_length"
    else:
        made = Idefics3Processor.from_config({"max_image_size": {"longest_edge": side},
                                              **spec.processor},
                                             image_seq_len=spec.tokens_per_image)
        count_key = "image_seq_len"
    if made.side != side:
        raise ValueError(f"the image processor makes {made.side} px frames; the vision "
                         f"encoder reads {side} px")
    count = processor.get(count_key)
    if count is not None and count != spec.tokens_per_image:
        raise ValueError(f"the processor's {count_key} is {count}; the model gives each "
                         f"frame {spec.tokens_per_image} tokens")


def _set_moe_fields(cfg: ModelConfig, raw: dict[str, Any]) -> None:
    cfg.num_experts = (raw.get("num_experts") or raw.get("num_local_experts")
                       or raw["n_routed_experts"])
    cfg.num_experts_per_tok = raw["num_experts_per_tok"]
    cfg.moe_intermediate_size = raw.get("moe_intermediate_size") or raw["intermediate_size"]
    cfg.shared_expert_intermediate_size = raw.get("shared_expert_intermediate_size") or 0
    cfg.norm_topk_prob = cfg.architecture == "mixtral" or raw.get("norm_topk_prob", False)
    cfg.decoder_sparse_step = raw.get("decoder_sparse_step") or 1
    cfg.mlp_only_layers = list(raw.get("mlp_only_layers") or [])
    if raw.get("n_shared_experts"):
        # DeepSeek: its shared experts run as one ungated MLP of their summed width.
        cfg.shared_expert_intermediate_size = raw["n_shared_experts"] * cfg.moe_intermediate_size
        cfg.shared_expert_gate = False
    if "first_k_dense_replace" in raw:
        # DeepSeek: the first k layers are dense, then every moe_layer_freq-th is MoE.
        first, every = raw["first_k_dense_replace"], raw.get("moe_layer_freq") or 1
        cfg.mlp_only_layers = [i for i in range(cfg.num_layers) if i < first or i % every]
    cfg.__post_init__()


def _set_mla_fields(cfg: ModelConfig, raw: dict[str, Any]) -> None:
    """DeepSeek-V2/V3 multi-head latent attention. Its configs' `head_dim` is the RoPE part
    alone (transformers); ours is the whole query/key head."""
    cfg.kv_lora_rank = raw["kv_lora_rank"]
    cfg.q_lora_rank = raw.get("q_lora_rank") or 0
    cfg.qk_rope_head_dim = raw["qk_rope_head_dim"]
    cfg.qk_nope_head_dim = raw["qk_nope_head_dim"]
    cfg.v_head_dim = raw["v_head_dim"]
    cfg.head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    cfg.__post_init__()


def _rope_theta(raw: dict[str, Any], rope_params: dict[str, Any]) -> float:
    if "rope_theta" in raw:
        return raw["rope_theta"]
    full = rope_params.get("full_attention", rope_params)
    return full.get("rope_theta", 10000.0)


def _local_theta(rope_params: dict[str, Any]) -> float | None:
    local = rope_params.get("sliding_attention")
    return local.get("rope_theta") if local else None
