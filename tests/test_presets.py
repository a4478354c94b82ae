"""Presets of real architectures: full-size shapes cost no memory and count the published
parameters; the scaled dense-vs-MoE trio has the intended sizes and runs."""
import pytest
import torch

from lifeline import LLM, SamplingParams
from lifeline.engine.kv_layout import kv_bytes_per_token, plan_kv
from lifeline.model import registry
from lifeline.model.config import config_from_hf
from lifeline.model.loader import load_model
from lifeline.model.presets import FULL, SCALED, preset_config, shape_model

CARDS = {  # total and active parameters (billions) as the model cards state them
    "llama-2-7b": (6.74, 6.74), "llama-2-13b": (13.0, 13.0), "llama-3.1-8b": (8.03, 8.03),
    "llama-3.1-70b": (70.6, 70.6), "mistral-7b-v0.1": (7.24, 7.24), "qwen3-8b": (8.2, 8.2),
    "qwen3-32b": (32.8, 32.8), "gemma-3-1b": (1.0, 1.0), "mixtral-8x7b": (46.7, 12.9),
    "qwen3-30b-a3b": (30.5, 3.3), "qwen1.5-moe-a2.7b": (14.3, 2.7),
    "qwen3-235b-a22b": (235, 22), "deepseek-v2-lite": (15.7, 2.4),
    # The main model: the card's 685B adds the 14B multi-token-prediction module.
    "deepseek-v3": (671, 37),
}
WHOLE_BILLIONS = {"qwen3-235b-a22b", "deepseek-v3"}
"""Cards that round to whole billions: within half of one."""
ACTIVE_WITHOUT_INPUT_EMBEDDING = {"deepseek-v2-lite", "deepseek-v3"}
"""DeepSeek's cards leave the input embedding table (a token reads one row of it) out of the
activated count (V2-Lite: 2.45B so, 2.66B with it; V3: 36.6B, 37.6B); the others count it."""
BUILDABLE = sorted(n for n in FULL if registry.family(FULL[n]["architecture"]).buildable)


def test_every_full_size_preset_is_checked_against_a_card():
    assert set(CARDS) | {"gemma-3-270m", "gemma-3-27b"} == set(FULL)


@pytest.mark.parametrize("name", sorted(CARDS))
def test_full_size_presets_count_the_published_parameters(name):
    total, active = CARDS[name]
    tolerance = 0.5 if name in WHOLE_BILLIONS else 0.06
    cfg = preset_config(name)
    counted_active = cfg.num_active_params()
    if name in ACTIVE_WITHOUT_INPUT_EMBEDDING:
        counted_active -= cfg.vocab_size * cfg.hidden_size
    assert cfg.num_params() / 1e9 == pytest.approx(total, abs=tolerance)
    assert counted_active / 1e9 == pytest.approx(active, abs=tolerance)


def test_gemma_3_270m_preset_equals_the_shipped_gguf():
    # The default model's GGUF holds exactly this many weights (docs/serve.md, /v1/models).
    assert preset_config("gemma-3-270m").num_params() == 268_098_176


@pytest.mark.parametrize("name", BUILDABLE)
def test_full_size_models_build_with_shapes_only(name):
    model = shape_model(name)
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    assert sum(p.numel() for p in params) == preset_config(name).num_params()


def test_mla_presets_are_shapes_for_the_planner_that_no_model_builds():
    assert set(FULL) - set(BUILDABLE) == {"deepseek-v3", "deepseek-v2-lite"}
    cfg = preset_config("deepseek-v3")
    assert cfg.is_mla and cfg.family == "deepseek" and not preset_config("llama-3.1-8b").is_mla
    with pytest.raises(ValueError, match="no model for the deepseek family"):
        shape_model("deepseek-v3")


def _deepseek_configs():
    from transformers import DeepseekV2Config, DeepseekV3Config

    v2_lite = DeepseekV2Config(  # deepseek-ai/DeepSeek-V2-Lite's config.json: no q compression
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, moe_intermediate_size=1408,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, max_position_embeddings=163840)
    # transformers' defaults are deepseek-ai/DeepSeek-V3's config.json but for the context
    # (4,096 before YaRN's factor of 40).
    v3 = DeepseekV3Config(max_position_embeddings=163840)
    return {"deepseek-v3": v3, "deepseek-v2-lite": v2_lite}


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v2-lite"])
def test_mla_configs_and_counts_equal_transformers(name, tmp_path):
    """The HF config.json transformers writes reads back as the preset, and both count exactly
    the parameters transformers' own DeepSeek model holds (built on the meta device)."""
    from transformers import AutoModelForCausalLM

    hf_config = _deepseek_configs()[name]
    hf_config.save_pretrained(tmp_path)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(hf_config)
    expected = sum(p.numel() for p in reference.parameters())
    cfg, preset = config_from_hf(tmp_path / "config.json"), preset_config(name)
    shape = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads",
             "num_kv_heads", "head_dim", "intermediate_size", "num_experts",
             "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
             "shared_expert_gate", "mlp_only_layers", "kv_lora_rank", "q_lora_rank",
             "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "tie_word_embeddings",
             "max_position")
    assert {f: getattr(cfg, f) for f in shape} == {f: getattr(preset, f) for f in shape}
    assert cfg.num_params() == preset.num_params() == expected


def test_mla_caches_one_latent_and_the_rope_key_per_token_and_layer():
    cfg = preset_config("deepseek-v3")
    for dtype_bytes in (1, 2, 4):
        assert kv_bytes_per_token(cfg, dtype_bytes, cfg.num_layers) == (512 + 64) * 61 * dtype_bytes
    # Not 2 x 128 heads x 192 dims: MLA's cache is 1/85 of what MHA of these heads would hold.
    mha = 2 * cfg.num_kv_heads * cfg.head_dim * 2 * 61
    assert mha // kv_bytes_per_token(cfg, 2, 61) == 85
    layout = plan_kv(cfg, 16, memory_bytes=10 * 2**30, dtype_bytes=2)
    assert layout.groups[0].bytes_per_block == 16 * (512 + 64) * 2 * 61


def test_scaled_trio_pairs_by_total_and_by_active_weights():
    moe, total, active = (preset_config(n) for n in (
        "scaled-moe", "scaled-dense-same-total", "scaled-dense-same-active"))
    router = moe.num_layers * moe.num_experts * moe.hidden_size
    assert total.num_params() == moe.num_params() - router
    assert active.num_params() == moe.num_active_params() - router
    assert moe.num_active_params() < moe.num_params() / 4
    for cfg in (moe, total, active):
        assert cfg.num_active_params() * 4 > 300e6  # > 300 MB of fp32 weights each step reads


def test_scaled_preset_loads_with_random_weights_and_generates():
    llm = LLM(load_model("preset:scaled-dense-same-active"), num_kv_blocks=16)
    assert llm.loaded.tokenizer is None and set(SCALED) >= {"scaled-moe"}
    out = llm.generate({"prompt_token_ids": [1, 2, 3, 4]},
                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    weights = sum(p.numel() for p in llm.loaded.model.parameters())
    assert weights == llm.loaded.config.num_params()
    assert not any(p.is_meta or not torch.isfinite(p).all() for p in llm.loaded.model.parameters())


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        preset_config("nope")
