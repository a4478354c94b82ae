"""SmolLM2-135M-Instruct (Llama, Q4_1) against two independent references: llama.cpp's own
server (tokens, detokenized text, chat template and greedy continuations recorded by
scripts/make_smollm2_fixtures.py in tests/fixtures/smollm2_llamacpp.json) and transformers'
LlamaForCausalLM in float32 on tensors dequantized by the `gguf` package. The model is loaded
once for the module; the offline LLM and a loopback server share its weights."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifeline import LLM, SamplingParams
from lifeline.chat.builtin import builtin_family
from lifeline.chat.templates import resolve_template, special_token_texts
from lifeline.engine.engine import EngineConfig
from lifeline.model.default import SMOLLM2_MODEL_ID, smollm2_model_path
from lifeline.model.gguf_file import GGUFFile
from lifeline.model.loader import load_model
from lifeline.server.config import ServerConfig
from lifeline.server.testing import ServerThread
from tests.reference.gemma3_hf import assert_logits_agree, reference_logits
from tests.reference.llama_hf import build_reference_llama, reference_tokenizer

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "smollm2_llamacpp.json").read_text())
PROMPTS = {p["name"]: p for p in FIXTURES["prompts"]}
TEXTS = {f"{t['name']}-{'special' if t['parse_special'] else 'plain'}": t
         for t in FIXTURES["tokenizer"]}
CHATS = {c["name"]: c for c in FIXTURES["chats"]}
LONG = PROMPTS["long_essay"]

LOGIT_ATOL = 2e-3
"""Both sides are float32 on the same dequantized weights; only summation order differs."""
PIECES = ["the", " The", " quick", "I'm", "'s", "'LL", " 42", "3.14", "١٢٣", "²", " ", "  ", "\t",
          "\n", "\n\n", "\r\n", "\u00a0", "\u3000", "北京", "的", "東京タワー", "한국어", "😀", "👍🏽",
          "👨‍👩‍👧", "é", "e\u0301", "Straße", "ελληνικά", "{\"k\": [1]}", "->", "...", "$", "#!",
          "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|", "<file_sep>", "\x00",
          "\ufffd"]
"""Text pieces whose joins the property test draws: letters, numbers, whitespace runs, scripts,
emoji sequences, combining marks, contractions, special tokens and near misses."""
NO_TOKEN_BYTES = "\x04\x06\x13\x14\x16\x1d"
"""Control characters whose byte has no token in the vocabulary: `tokenizers` then merges the
bytes on either side as if it were absent, llama.cpp does not (fixture text 'no_byte_token')."""
ASSIGNED = st.characters(exclude_categories=("Cs", "Cn"), exclude_characters=NO_TOKEN_BYTES)
"""Characters Python's Unicode database knows (bpe.py classifies by it; a newer one may call a
character a letter that it does not know)."""
LLAMACPP_TIE_MARGIN = 0.4
"""The Gemma 3 test's margin (tests/test_gemma3_reference.py): where our greedy text parts from
llama.cpp's, each side may prefer its own pick by less than this many logits."""


def assert_follows_llamacpp_greedy(llm) -> None:
    """`llm`'s greedy text on the fixture prompts is llama-server's on the same file, but where
    llama.cpp's own top choices are a near tie (`LLAMACPP_TIE_MARGIN`) at the first parting."""
    n = FIXTURES["settings"]["max_new_tokens"]
    for name, prompt in sorted(PROMPTS.items()):
        ours = llm.generate({"prompt_token_ids": prompt["prompt_ids"]},
                            SamplingParams(max_tokens=n, temperature=0))[0].token_ids
        theirs = prompt["completion_ids"]
        part = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if part is None:
            continue
        top, logprobs = prompt["steps_top_ids"][part], prompt["steps_top_logprobs"][part]
        assert ours[part] in top[:3], (name, part)
        assert logprobs[0] - logprobs[top.index(ours[part])] < LLAMACPP_TIE_MARGIN, (name, part)


@pytest.fixture(scope="module")
def loaded():
    return load_model(SMOLLM2_MODEL_ID)


@pytest.fixture(scope="module")
def llm(loaded):
    return LLM(loaded, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def reference():
    return build_reference_llama(smollm2_model_path())


@pytest.fixture(scope="module")
def server(loaded):
    config = ServerConfig(served_model_name=SMOLLM2_MODEL_ID,
                          engine=EngineConfig(kv_cache_memory_bytes=64 << 20))
    with ServerThread(loaded, config) as srv:
        yield srv


@pytest.fixture(scope="module")
def template(loaded):
    tokenizer = loaded.tokenizer
    source = GGUFFile(loaded.source).metadata["tokenizer.chat_template"]
    return resolve_template(gguf_template=source, family=builtin_family("llama"),
                            escape=tokenizer.escape_specials, **special_token_texts(tokenizer))


def test_fixtures_are_for_the_installed_file(loaded):
    digest = hashlib.sha256(Path(loaded.source).read_bytes()).hexdigest()
    assert Path(loaded.source).name == FIXTURES["model"]["file"]
    assert digest == FIXTURES["model"]["sha256"]


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_tokenizer_matches_llamacpp(llm, hf_tokenizer, name):
    case = TEXTS[name]
    tokenizer = llm.tokenizer
    assert tokenizer.encode(case["text"], parse_special=case["parse_special"]) == case["ids"]
    assert tokenizer.decode(case["ids"]) == case["detokenized"]
    if case["parse_special"] and not set(NO_TOKEN_BYTES) & set(case["text"]):
        # the reference of the property test below agrees too
        assert hf_tokenizer.encode(case["text"], add_special_tokens=False).ids == case["ids"]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return reference_tokenizer(smollm2_model_path())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES) | st.text(ASSIGNED, max_size=4), max_size=12))
def test_tokenizer_matches_hugging_face_tokenizers_on_mixed_text(llm, hf_tokenizer, parts):
    """Beyond the fixtures: the same vocabulary and merges run by `tokenizers` with SmolLM2's
    pre-tokenizer (which llama.cpp's 'smollm' pre-tokenizer follows; it agrees with llama.cpp on
    every fixture text)."""
    text = "".join(parts)
    assert llm.tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("name", sorted(CHATS))
def test_chat_template_renders_as_llamacpp(template, name):
    chat = CHATS[name]
    assert template.render(chat["messages"]) == chat["prompt"]


def test_long_prompt_spans_chunks():
    assert len(LONG["prompt_ids"]) > 1000


def test_logits_match_transformers_over_long_chunked_prompt(llm, reference):
    ids = LONG["prompt_ids"]
    assert_logits_agree(llm.prompt_logits(ids), reference_logits(reference, ids), LOGIT_ATOL)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_matches_transformers_and_llamacpp_up_to_ties(llm, reference, name):
    """Greedy until an end-of-generation token, as llama-server ran it. transformers, run once
    over the prompt and our tokens, must pick each of our tokens (so its own greedy text is ours);
    where llama.cpp's text parts from ours, each side may prefer its pick only by a near tie."""
    prompt = PROMPTS[name]
    theirs = prompt["completion_ids"]
    n = FIXTURES["settings"]["max_new_tokens"]
    ours = llm.generate({"prompt_token_ids": prompt["prompt_ids"]},
                        SamplingParams(max_tokens=n, temperature=0))[0].token_ids
    assert len(ours) == n or ours[-1] in llm.tokenizer.eos_token_ids
    ref_logits = reference_logits(reference, prompt["prompt_ids"] + ours[:-1], len(ours))
    assert ref_logits.argmax(-1).tolist() == ours
    part = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if part is None:
        assert len(ours) == len(theirs)
        return
    preference = float(ref_logits[part][ours[part]] - ref_logits[part][theirs[part]])
    assert preference < LLAMACPP_TIE_MARGIN, f"parted at token {part} by {preference:.3f}"
    top, logprobs = prompt["steps_top_ids"][part], prompt["steps_top_logprobs"][part]
    assert ours[part] in top[:3]
    assert logprobs[0] - logprobs[top.index(ours[part])] < LLAMACPP_TIE_MARGIN


def test_chat_answer_names_paris_and_stops_at_im_end(client):
    """An instruction-tuned model through the server, with the template from its GGUF file."""
    response = client.chat.completions.create(
        model=SMOLLM2_MODEL_ID, temperature=0, max_tokens=48,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    choice = response.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert "<|im_end|>" not in choice.message.content
    assert response.usage.prompt_tokens == len(PROMPTS["chat_capital"]["prompt_ids"])


def test_model_facts(llm):
    tok = llm.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos) == (1, 2, False)
    assert tok.encode("<|im_end|>") == [2] and 2 in tok.eos_token_ids
    assert tok.encode("Hi")[0] != tok.bos_token_id
    cfg = llm.loaded.config
    assert (cfg.architecture, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        "llama", 30, 9, 3, 64)
    assert set(cfg.layer_types) == {"full"} and cfg.rope_theta == 100000.0
    assert llm.loaded.weight_format == "gguf:F32+Q4_1+Q8_0"
    model = llm.loaded.model
    assert model.lm_head.weight is model.embed_tokens.weight
