"""The model families Lifeline runs, each declaring its contract in one place: the names
checkpoints give it, the config fields its model reads, the projections a weight format may
fuse, whether its forward compiles, its norm offset, which of its layers slide and whether its
logits are its head's output alone.

Adding a family is its own file (the model) and one `register` entry here. The model class is
named, not imported: configs, presets and the planner read the registry without torch.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from lifeline.model.config import ModelConfig

QKV = ("qkv_proj", ("q_proj", "k_proj", "v_proj"))
GATE_UP = ("gate_up_proj", ("gate_proj", "up_proj"))
_DECODER = frozenset({
    "vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
    "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling", "sliding_window",
    "layer_types", "max_position", "query_pre_attn_scalar", "hidden_act"})
_MOE = frozenset({
    "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers"})
_MLA = frozenset({
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"})


@dataclass(frozen=True, slots=True)
class ModelFamily:
    name: str
    model_class: str
    """`module:Class`, imported on the first build; empty for a family Lifeline describes but
    cannot run (`buildable`)."""
    architectures: tuple[str, ...]
    """What checkpoints call it: Hugging Face `model_type`s and class names, GGUF
    `general.architecture`s."""
    reads: frozenset[str]
    """The `ModelConfig` fields its model is built from."""
    fused: tuple[tuple[str, tuple[str, ...]], ...] = (QKV, GATE_UP)
    """(fused name, parts): projections of one input that a weight format may run as one
    GEMM (`FusedProjections`); the model calls them through `project`."""
    compiles: bool = True
    """Whether its forward runs through `torch.compile` (lifeline.model.compiled)."""
    norm_offset: float = 0.0
    """Added to each norm weight of a Hugging Face checkpoint (we compute x * w)."""
    global_every: int = 0
    """Which layers slide where the config has a window: all but every `global_every`-th
    layer, which attends globally; 0: every layer."""
    norms_per_layer: int = 2
    """RMSNorm weights per decoder layer (parameter counts)."""
    gguf_ffn_norm: str = "post_attention_layernorm"
    """The module a GGUF file's `blk.N.ffn_norm` is."""
    routed_experts: bool = False
    """Sparse MoE blocks: the config carries the MoE fields."""
    plain_head: bool = True
    """Its `compute_logits` is `lm_head` alone (no soft-capping or scaling after it), so a
    weight format's head may return its argmax with the logits (the greedy shortlist)."""

    def __post_init__(self) -> None:
        if (self.model_class and ":" not in self.model_class) or not self.architectures:
            raise ValueError(f"{self.name}: give model_class as 'module:Class' (or '' for a "
                             "family with no model) and at least one architecture name")

    @property
    def buildable(self) -> bool:
        """Lifeline has a model for it; the others are shapes for the planner (their configs
        and parameter counts), which the engine cannot run."""
        return bool(self.model_class)

    def model(self) -> type[nn.Module]:
        if not self.buildable:
            raise ValueError(f"Lifeline has no model for the {self.name} family yet: its "
                             "configs are shapes for `lifeline plan`, not models to run")
        module, _, cls = self.model_class.partition(":")
        return getattr(importlib.import_module(module), cls)


_BY_ARCHITECTURE: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> None:
    for architecture in family.architectures:
        _BY_ARCHITECTURE[architecture] = family


def find(architecture: str) -> ModelFamily | None:
    return _BY_ARCHITECTURE.get(architecture)


def family(architecture: str) -> ModelFamily:
    found = _BY_ARCHITECTURE.get(architecture)
    if found is None:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {sorted(_BY_ARCHITECTURE)}")
    return found


def family_of(model: nn.Module) -> ModelFamily:
    return family(model.config.architecture)


def families() -> list[ModelFamily]:
    return list(dict.fromkeys(_BY_ARCHITECTURE.values()))


def build_model(cfg: ModelConfig) -> nn.Module:
    """The family's model for `cfg`, its weights on the meta device until loaded."""
    return family(cfg.architecture).model()(cfg)


register(ModelFamily(
    "gemma3", "lifeline.model.gemma3:Gemma3ForCausalLM",
    ("gemma3", "gemma3_text", "Gemma3ForCausalLM"),
    _DECODER | {"rope_local_theta"}, norm_offset=1.0, global_every=6, norms_per_layer=4,
    gguf_ffn_norm="pre_feedforward_layernorm"))
register(ModelFamily(
    "llama", "lifeline.model.llama:LlamaForCausalLM",
    ("llama", "LlamaForCausalLM", "qwen2", "Qwen2ForCausalLM", "qwen3", "Qwen3ForCausalLM",
     "mistral", "MistralForCausalLM"),
    _DECODER | {"num_layers", "qk_norm", "attention_bias"}))
register(ModelFamily(
    "moe", "lifeline.model.moe:MoEForCausalLM",
    ("qwen3_moe", "Qwen3MoeForCausalLM", "qwen2_moe", "Qwen2MoeForCausalLM", "mixtral",
     "MixtralForCausalLM"),
    _DECODER | {"num_layers", "qk_norm", "attention_bias"} | _MOE, routed_experts=True,
    compiles=False))  # routing gives each expert a data-dependent number of tokens
register(ModelFamily(
    # Multi-head latent attention and DeepSeekMoE (shared plus routed experts, the first layers
    # dense): presets and configs for the planner; no model yet.
    "deepseek", "", ("deepseek_v2", "DeepseekV2ForCausalLM", "deepseek_v3",
                     "DeepseekV3ForCausalLM"),
    _DECODER | {"num_layers", "shared_expert_gate"} | _MOE | _MLA, routed_experts=True,
    compiles=False))
