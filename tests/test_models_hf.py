"""Tiny random Llama, Qwen2, Qwen3 and Gemma 3 models made with transformers: our engine must
give the same logits and the same greedy continuations as transformers' own implementation."""
import os

import pytest
import torch
import transformers

from lifeline import LLM, SamplingParams
from tests.reference.tiny_hf import hf_greedy, random_prompt

DEVICE = os.environ.get("LIFELINE_TEST_DEVICE", "cpu")
"""A GPU check runs this file with LIFELINE_TEST_DEVICE=cuda; CI runs it on the CPU."""
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
        "max_position_embeddings": 512, "head_dim": 32}


def _config(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(**TINY, rope_theta=10000.0)
    if kind == "qwen2":
        return transformers.Qwen2Config(**TINY)
    if kind == "qwen3":
        return transformers.Qwen3Config(**TINY)
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            **TINY, sliding_window=8, layer_types=["sliding_attention", "sliding_attention",
                                                    "full_attention"],
            query_pre_attn_scalar=32)
    raise ValueError(kind)


def tiny_model(kind: str, tmp_path_factory) -> tuple:
    """(kind, transformers model, saved directory) of a tiny random model of `kind`."""
    torch.manual_seed(0)
    cfg = _config(kind)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.float().eval()
    if kind == "qwen2":
        for layer in model.model.layers:  # random biases, so the bias path is exercised
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if kind == "gemma3":
        for name, p in model.named_parameters():
            if "norm" in name:
                torch.nn.init.normal_(p, std=0.3)
    path = tmp_path_factory.mktemp(kind)
    model.save_pretrained(path)
    return kind, model, path


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def tiny(request, tmp_path_factory):
    return tiny_model(request.param, tmp_path_factory)


def _prompt(n: int, seed: int) -> list[int]:
    return random_prompt(n, seed, TINY["vocab_size"])


def test_logits_match_transformers_with_chunked_prefill(tiny):
    _, model, path = tiny
    llm = LLM(path, max_num_batched_tokens=16, block_size=4, device=DEVICE)
    ids = _prompt(45, seed=1)
    ours = llm.prompt_logits(ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_greedy_continuations_identical_batched_and_alone(tiny):
    kind, model, path = tiny
    llm = LLM(path, max_num_batched_tokens=24, block_size=4, device=DEVICE)
    prompts = [_prompt(n, seed=n) for n in (3, 17, 30, 9)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, result in zip(prompts, batched):
        assert result.token_ids == hf_greedy(model, p, 12), kind
        alone = llm.generate({"prompt_token_ids": p}, params)[0]
        assert alone.token_ids == result.token_ids
