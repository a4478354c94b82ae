"""The engine on a GPU (`--device cuda`, `LLM(device="cuda")`): every weight and the KV cache in
bfloat16. Its arithmetic runs on the CPU too (`ModelExecutor(dtype=torch.bfloat16)`), so CI
checks it there against float32: logits of tiny models of each family, and SmolLM2's greedy
text up to ties (tests/reference/agreement.py). The tests that need a GPU are skipped without
one; benchmarks/gpu.py runs the same checks on an H200 (docs/performance.md)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lifeline import LLM, SamplingParams
from lifeline.cli import build_parser, main, serve_config
from lifeline.engine.engine import EngineConfig, LLMEngine
from lifeline.engine.model_executor import ModelExecutor
from lifeline.model.config import ModelConfig, gemma3_layer_types
from lifeline.model.default import smollm2_model_path
from lifeline.model.device import parameter_bytes, place_model
from lifeline.model.loader import (
    LoadedModel,
    attach_tokenizer,
    build_model,
    init_dummy_weights,
    load_model,
)
from lifeline.model.presets import preset_config, shape_model
from tests.reference.agreement import compare

CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU (CI has none; benchmarks/gpu.py runs these "
                                 "checks on an H200)")
SMOLLM2 = json.loads((Path(__file__).parent / "fixtures" / "smollm2_llamacpp.json").read_text())
BF16_LOGITS_RTOL = 3e-2
"""‖bf16 − fp32‖ / ‖fp32‖ over a prompt's logits: bfloat16 keeps 8 bits of mantissa (2^-9
relative rounding per value), compounded over a few layers."""


def test_engine_config_takes_the_devices_defaults():
    assert (EngineConfig().weights, EngineConfig().kv_dtype_bytes) == ("fp32", 4)
    gpu = EngineConfig(device="cuda")
    assert (gpu.weights, gpu.kv_dtype_bytes) == ("bf16", 2)
    assert EngineConfig(device="cuda:1", weights="fp32").kv_dtype_bytes == 4
    assert EngineConfig(weights="bf16").kv_dtype_bytes == 4  # the CPU's bf16 is the head alone
    with pytest.raises(ValueError, match="CPU only"):
        EngineConfig(device="cuda", weights="int8-all")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        EngineConfig(device="mps")


def test_serve_flags_choose_the_weights_by_device():
    cpu = serve_config(build_parser().parse_args(["serve"])).engine
    assert (cpu.device, cpu.weights) == ("cpu", "gguf-int8")
    gpu = serve_config(build_parser().parse_args(["serve", "--device", "cuda"])).engine
    assert (gpu.device, gpu.weights, gpu.kv_dtype_bytes) == ("cuda", "bf16", 2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_serve_on_cuda_without_a_gpu_says_so(capsys):
    assert main(["serve", "--device", "cuda", "--no-huge-pages"]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err


def test_llama_8b_placed_in_bf16_is_16_gb():
    """Shapes only (the meta device): the weights `lifeline serve --device cuda --model
    preset:llama-3.1-8b` puts on the GPU, against the published 8.03B parameters."""
    model = shape_model("llama-3.1-8b")
    place_model(model, "meta", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert 2 * 8.02e9 < parameter_bytes(model) < 2 * 8.04e9
    assert parameter_bytes(model) == 2 * preset_config("llama-3.1-8b").num_params()


def test_a_preset_takes_a_tokenizer_that_covers_its_vocabulary():
    """`lifeline serve --model preset:NAME --tokenizer PATH` (how benchmarks/gpu.py gives the
    random 8B model text output for `lifeline bench`)."""
    smollm2 = smollm2_model_path()
    small = LoadedModel(None, preset_config("scaled-dense-same-active"), None, "preset", "dummy")
    attach_tokenizer(small, smollm2)
    assert small.tokenizer.decode(small.tokenizer.encode("Hello there")) == "Hello there"
    big = LoadedModel(None, preset_config("llama-3.1-8b"), None, "preset", "dummy")
    with pytest.raises(ValueError, match="fewer than the model's 128256"):
        attach_tokenizer(big, smollm2)


def _tiny(architecture: str) -> LoadedModel:
    common = {"vocab_size": 512, "hidden_size": 64, "num_layers": 4, "num_heads": 4,
              "num_kv_heads": 2, "head_dim": 16, "intermediate_size": 128, "max_position": 512}
    if architecture == "gemma3":
        cfg = ModelConfig("gemma3", **common, sliding_window=8, rope_local_theta=1e4,
                          layer_types=gemma3_layer_types(4, 2), query_pre_attn_scalar=16,
                          hidden_act="gelu_pytorch_tanh", qk_norm=True, tie_word_embeddings=True)
    elif architecture == "qwen3_moe":
        cfg = ModelConfig("qwen3_moe", **common, qk_norm=True, num_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    else:
        cfg = ModelConfig("llama", **common)
    model = build_model(cfg)
    init_dummy_weights(model, seed=3)
    with torch.no_grad():  # std 0.1: attention far from uniform, so its errors show
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(5)
    return LoadedModel(model.eval(), cfg, None, "tiny", "dummy-f32")


def _bf16_engine(loaded: LoadedModel, config: EngineConfig) -> LLMEngine:
    return LLMEngine(loaded, config, executor=lambda layout: ModelExecutor(
        loaded, config, layout, dtype=torch.bfloat16))


@pytest.mark.parametrize("architecture", ["llama", "gemma3", "qwen3_moe"])
def test_bf16_logits_match_float32_over_chunks_and_windows(architecture):
    """Chunks of 16 over a 40-token prompt (later chunks read earlier ones from the bf16 pool),
    and for Gemma 3 a window of 8: the sliding layers' second pool and masks."""
    ids = [(i * 37) % 500 + 3 for i in range(40)]
    config = {"num_kv_blocks": 64, "block_size": 4, "max_num_batched_tokens": 16}
    ref = LLMEngine(_tiny(architecture), EngineConfig(**config)).prompt_logits(ids)
    loaded = _tiny(architecture)
    engine = _bf16_engine(loaded, EngineConfig(**config, kv_dtype_bytes=2))
    runner = engine.executor.runner
    assert {k.dtype for pair in runner.kv_caches for k in pair} == {torch.bfloat16}
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    if loaded.config.tie_word_embeddings:
        assert loaded.model.lm_head.weight is loaded.model.embed_tokens.weight
    got = engine.prompt_logits(ids)
    error = float((got - ref).norm() / ref.norm())
    assert 0 < error < BF16_LOGITS_RTOL


@pytest.fixture(scope="module")
def smollm2_reference():
    """SmolLM2 in float32 on the CPU: each fixture prompt's greedy tokens and top logprobs."""
    llm = LLM(load_model("smollm2-135m-instruct"), max_num_batched_tokens=512,
              kv_cache_memory_bytes=64 << 20)
    return {p["name"]: _greedy(llm, p) for p in _smollm2_prompts()}


def _smollm2_prompts() -> list[dict]:
    return [p for p in SMOLLM2["prompts"] if p["name"] in ("facts", "chat_capital")]


def _greedy(llm: LLM, prompt: dict, max_tokens: int = 16) -> tuple[list[int], list]:
    out = llm.generate({"prompt_token_ids": prompt["prompt_ids"]},
                       SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=5))[0]
    return out.token_ids, [lp.top for lp in out.logprobs]


def _agrees_up_to_ties(llm: LLM, reference: dict) -> None:
    """Greedy on every reference prompt, held to the CPU's float32 text up to ties."""
    for name, (ref, top) in reference.items():
        prompt = next(p for p in _smollm2_prompts() if p["name"] == name)
        ours, _ = _greedy(llm, prompt)
        agreement = compare(ours, ref, top)
        assert agreement.ok, (name, agreement)


def test_bf16_greedy_matches_float32_up_to_ties_on_the_cpu(smollm2_reference):
    """Decode steps too: the bf16 pool read back through the decode path, with SmolLM2's real
    weights (random ones leave every logit a near tie)."""
    loaded = load_model("smollm2-135m-instruct")
    config = EngineConfig(max_num_batched_tokens=512, kv_dtype_bytes=2,
                          kv_cache_memory_bytes=64 << 20)
    llm = LLM(loaded, kv_cache_memory_bytes=1 << 20)
    llm.engine = _bf16_engine(loaded, config)
    _agrees_up_to_ties(llm, smollm2_reference)


@CUDA
def test_cuda_greedy_matches_the_cpu_up_to_ties(smollm2_reference):
    llm = LLM(load_model("smollm2-135m-instruct"), device="cuda", max_num_batched_tokens=512)
    runner = llm.engine.executor.runner
    assert runner.kv_caches[0][0].device.type == "cuda"
    assert runner.kv_caches[0][0].dtype == torch.bfloat16
    _agrees_up_to_ties(llm, smollm2_reference)


@CUDA
def test_dummy_weights_are_drawn_on_the_gpu():
    llm = LLM("preset:llama-3.1-8b", device="cuda", num_kv_blocks=64)
    params = list(llm.loaded.model.parameters())
    assert {(p.device.type, p.dtype) for p in params} == {("cuda", torch.bfloat16)}
    out = llm.generate({"prompt_token_ids": list(range(10, 40))},
                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
