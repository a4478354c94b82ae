"""Presets of real architectures: full-size shapes cost no memory and count the published
parameters; the scaled dense-vs-MoE trio has the intended sizes and runs."""
import pytest
import torch

from lifeline import LLM, SamplingParams
from lifeline.model.loader import load_model
from lifeline.model.presets import FULL, SCALED, preset_config, shape_model

CARDS = {  # total and active parameters (billions) as the model cards state them
    "llama-2-7b": (6.74, 6.74), "llama-3.1-8b": (8.03, 8.03), "mistral-7b-v0.1": (7.24, 7.24),
    "qwen3-8b": (8.2, 8.2), "qwen3-32b": (32.8, 32.8), "gemma-3-1b": (1.0, 1.0),
    "mixtral-8x7b": (46.7, 12.9), "qwen3-30b-a3b": (30.5, 3.3), "qwen1.5-moe-a2.7b": (14.3, 2.7),
}


def test_every_full_size_preset_is_checked_against_a_card():
    assert set(CARDS) | {"gemma-3-270m", "gemma-3-27b"} == set(FULL)


@pytest.mark.parametrize("name", sorted(CARDS))
def test_full_size_presets_count_the_published_parameters(name):
    total, active = CARDS[name]
    cfg = preset_config(name)
    assert cfg.num_params() / 1e9 == pytest.approx(total, abs=0.06)
    assert cfg.num_active_params() / 1e9 == pytest.approx(active, abs=0.06)


def test_gemma_3_270m_preset_equals_the_shipped_gguf():
    # The default model's GGUF holds exactly this many weights (docs/serve.md, /v1/models).
    assert preset_config("gemma-3-270m").num_params() == 268_098_176


@pytest.mark.parametrize("name", sorted(FULL))
def test_full_size_models_build_with_shapes_only(name):
    model = shape_model(name)
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    assert sum(p.numel() for p in params) == preset_config(name).num_params()


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
