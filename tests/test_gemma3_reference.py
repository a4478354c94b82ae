"""The default model (Gemma 3 270M, Q4_K_M) against two independent references:
transformers' Gemma3ForCausalLM in float32 on tensors dequantized by the `gguf` package, and
llama.cpp's greedy continuations on the same file (fixtures made by
scripts/make_llamacpp_fixtures.py with llama-cpp-python)."""
import json
from pathlib import Path

import pytest

from lifeline import LLM, SamplingParams
from tests.reference.gemma3_hf import assert_logits_agree, reference_greedy, reference_logits

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "gemma3_llamacpp.json").read_text())
PROMPTS = {p["name"]: p for p in FIXTURES["prompts"]}
LONG = max(PROMPTS.values(), key=lambda p: len(p["prompt_ids"]))

LOGIT_ATOL = 2e-3
"""Both sides are float32 on the same dequantized weights; only summation order differs."""
LLAMACPP_TIE_MARGIN = 0.4
"""llama.cpp quantizes activations to 8 bits; where its greedy text parts from ours, the fp32
reference may prefer our pick over llama.cpp's by less than this many logits. Measured with
scripts/check_reference.py: partings at reference preferences of 0.005 to 0.277."""


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(default_model, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def reference(gemma3_reference):
    return gemma3_reference


def test_long_prompt_exercises_window_global_layers_and_chunks():
    assert len(LONG["prompt_ids"]) > 1100


def test_logits_match_transformers_over_long_chunked_prompt(llm, reference):
    ids = LONG["prompt_ids"]
    assert_logits_agree(llm.prompt_logits(ids), reference_logits(reference, ids), LOGIT_ATOL)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_tokenizer_matches_llamacpp(llm, name):
    prompt = PROMPTS[name]
    assert llm.tokenizer.encode(prompt["text"]) == prompt["prompt_ids"]


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_matches_transformers_and_llamacpp_up_to_ties(llm, reference, name):
    prompt = PROMPTS[name]
    n = len(prompt["completion_ids"])
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    ours = llm.generate({"prompt_token_ids": prompt["prompt_ids"]}, params)[0].token_ids
    ref_ids, ref_logits = reference_greedy(reference, prompt["prompt_ids"], n)
    assert ours == ref_ids
    theirs = prompt["completion_ids"]
    part = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if part is not None:
        preference = float(ref_logits[part][ours[part]] - ref_logits[part][theirs[part]])
        assert preference < LLAMACPP_TIE_MARGIN, f"parted at token {part} by {preference:.3f}"
        assert ours[part] in prompt["steps_top_ids"][part][:3]


def test_default_model_facts(llm):
    tok = llm.tokenizer
    assert tok.bos_token_id == 2 and tok.add_bos
    assert {1, 106} <= set(tok.eos_token_ids)
    assert tok.encode("Hi")[0] == 2
    cfg = llm.loaded.config
    assert cfg.layer_types.count("full") == 3 and cfg.layer_types[5] == "full"
    assert cfg.rope_local_theta == 10000.0 and cfg.sliding_window == 512
    model = llm.loaded.model
    assert model.lm_head.weight is model.embed_tokens.weight
