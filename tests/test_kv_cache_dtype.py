"""A 16-bit KV cache (`--kv-cache-dtype fp16|bf16`): half the bytes of the float32 one, keys and
values rounded once as they are written. Held to llama.cpp's greedy text on SmolLM2 (its server
recorded the fixtures with its default f16 cache; tests/fixtures/smollm2_llamacpp.json) up to the
same near ties as the float32 cache, and to the float32 cache's perplexity on the long essay.
Measured figures: docs/performance.md ("KV cache by need")."""
from __future__ import annotations

import pytest
import torch

from lifeline import LLM, SamplingParams
from lifeline.model.default import SMOLLM2_MODEL_ID
from lifeline.model.loader import load_model
from tests.test_smollm2_reference import FIXTURES, LLAMACPP_TIE_MARGIN, LONG, PROMPTS


@pytest.fixture(scope="module")
def loaded():
    return load_model(SMOLLM2_MODEL_ID)


@pytest.fixture(scope="module")
def fp32(loaded):
    return LLM(loaded, max_num_batched_tokens=512)


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def half(loaded, request):
    llm = LLM(loaded, max_num_batched_tokens=512, kv_cache_dtype=request.param)
    pools = llm.engine.executor.runner.kv_caches
    assert {k.dtype for k, _ in pools} == {getattr(torch, {"fp16": "float16",
                                                          "bf16": "bfloat16"}[request.param])}
    return llm


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return float((-logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()).exp())


def test_16_bit_cache_keeps_the_long_essays_perplexity_within_half_a_percent(half, fp32):
    """The essay spans three 512-token chunks: the later chunks read the earlier ones' keys
    and values back from the rounded cache."""
    ids = LONG["prompt_ids"]
    exact, rounded = fp32.prompt_logits(ids), half.prompt_logits(ids)
    assert not torch.equal(exact, rounded)  # the rounding is there...
    ratio = _perplexity(rounded, ids) / _perplexity(exact, ids)
    assert abs(ratio - 1) < 0.005, ratio  # ...and costs less than half a percent
    agreement = float((exact.argmax(-1) == rounded.argmax(-1)).float().mean())
    assert agreement > 0.97, agreement


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_16_bit_cache_greedy_follows_llamacpp_up_to_ties(half, fp32, name):
    """Where the 16-bit cache's greedy text parts from llama.cpp's, the float32 engine's logits
    (held to transformers in test_smollm2_reference) prefer our pick by less than the tie margin,
    and llama.cpp ranked it in its top three."""
    prompt = PROMPTS[name]
    theirs = prompt["completion_ids"]
    n = FIXTURES["settings"]["max_new_tokens"]
    ours = half.generate({"prompt_token_ids": prompt["prompt_ids"]},
                         SamplingParams(max_tokens=n, temperature=0))[0].token_ids
    part = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if part is None:
        assert len(ours) == len(theirs) or ours[-1] in half.tokenizer.eos_token_ids
        return
    logits = fp32.prompt_logits(prompt["prompt_ids"] + ours[:part])[-1]
    preference = float(logits[ours[part]] - logits[theirs[part]])
    assert abs(preference) < LLAMACPP_TIE_MARGIN, f"parted at token {part} by {preference:.3f}"
    assert ours[part] in prompt["steps_top_ids"][part][:3]


def test_the_command_line_defaults_to_fp16_on_the_cpu_and_names_every_format():
    from lifeline import cli
    from lifeline.engine import engine
    from lifeline.gateway.config import parse_config

    assert set(cli.KV_CACHE_DTYPES) == set(engine.KV_CACHE_DTYPES)
    cpu = cli.serve_config(cli.build_parser().parse_args(["serve"])).engine
    assert (cpu.kv_cache_dtype, cpu.kv_dtype_bytes, cpu.kv_cache_memory_bytes) == ("fp16", 2, None)
    gpu = cli.serve_config(cli.build_parser().parse_args(["serve", "--device", "cuda"])).engine
    assert (gpu.kv_cache_dtype, gpu.kv_dtype_bytes) == ("auto", 2)
    exact = cli.serve_config(cli.build_parser().parse_args(
        ["serve", "--kv-cache-dtype", "float32"])).engine
    assert (exact.kv_cache_dtype, exact.kv_dtype_bytes) == ("fp32", 4)
    assert engine.EngineConfig().kv_cache_dtype == "auto"  # the Python API: float32 on the CPU
    with pytest.raises(ValueError, match="choose from"):
        engine.EngineConfig(kv_cache_dtype="q8_0")
    config = parse_config('[backends.a]\nmodel = "preset:gemma-3-270m"\n'
                          '[backends.b]\nmodel = "preset:gemma-3-270m"\n'
                          '[backends.b.engine]\nkv_cache_dtype = "bf16"\n'
                          '[models.m]\nbackends = ["a", "b"]\n', ".toml")
    dtypes = {name: b.engine.kv_cache_dtype for name, b in config.backends.items()}
    assert dtypes == {"a": "fp16", "b": "bf16"}


def test_a_server_on_an_fp16_cache_reports_its_halved_pool_and_answers(loaded):
    """A real server on loopback with the command line's default cache: /metrics gives the
    bytes a token and the pool at half of float32's, and the official client gets an answer."""
    import httpx
    import openai

    from lifeline.engine.engine import EngineConfig
    from lifeline.server.config import ServerConfig
    from lifeline.server.testing import ServerThread

    config = ServerConfig(served_model_name="smol",
                          engine=EngineConfig(kv_cache_dtype="fp16", max_model_len=2048))
    with ServerThread(loaded, config) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x")
        answer = client.completions.create(model="smol", prompt="The capital of France is",
                                           max_tokens=8, temperature=0)
        assert answer.usage.completion_tokens == 8
        metrics = httpx.get(f"{srv.base_url}/metrics").text
    per_token = 2 * loaded.config.num_kv_heads * loaded.config.head_dim * 2 * \
        loaded.config.num_layers  # K and V, 2 bytes each, every layer
    assert _metric(metrics, "lifeline:kv_cache_bytes_per_token") == per_token
    assert _metric(metrics, "lifeline:kv_cache_pool_bytes") == per_token * 2048


def _metric(text: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith(name + "{") or line.startswith(name + " "))
