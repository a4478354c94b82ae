"""Tiny random Qwen3-MoE, Mixtral and Qwen2-MoE models made with transformers: our engine must
give the same logits and greedy continuations, count the same parameters, and report routing."""
import json
import os

import pytest
import torch
import transformers

from lifeline import LLM, SamplingParams
from lifeline.model.config import config_from_hf
from tests.reference.tiny_hf import hf_greedy, random_prompt

DEVICE = os.environ.get("LIFELINE_TEST_DEVICE", "cpu")
TINY = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 512,
        "head_dim": 16, "num_experts_per_tok": 2, "initializer_range": 0.1}
KINDS = ["qwen3_moe", "mixtral", "qwen2_moe"]


def _config(kind: str):
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**TINY, num_experts=8, moe_intermediate_size=32,
                                           intermediate_size=96, norm_topk_prob=True,
                                           mlp_only_layers=[1])
    if kind == "mixtral":
        return transformers.MixtralConfig(**TINY, num_local_experts=4, intermediate_size=48,
                                          tie_word_embeddings=True)
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**TINY, num_experts=8, moe_intermediate_size=32,
                                           intermediate_size=96,
                                           shared_expert_intermediate_size=80)
    raise ValueError(kind)


@pytest.fixture(scope="module", params=KINDS)
def tiny(request, tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(request.param),
                                                          attn_implementation="eager")
    model = model.float().eval()
    for name, p in model.named_parameters():
        if "bias" in name:
            torch.nn.init.normal_(p, std=0.5)  # exercise the QKV bias
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def _prompt(n: int, seed: int) -> list[int]:
    return random_prompt(n, seed, TINY["vocab_size"])


def test_logits_match_transformers_with_chunked_prefill(tiny):
    _, model, path = tiny
    llm = LLM(path, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64,
              device=DEVICE)
    ids = _prompt(45, seed=1)
    ours = llm.prompt_logits(ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_greedy_continuations_identical_batched_and_alone(tiny):
    kind, model, path = tiny
    llm = LLM(path, max_num_batched_tokens=24, block_size=4, num_kv_blocks=64,
              device=DEVICE)
    prompts = [_prompt(n, seed=n) for n in (3, 17, 30, 9)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for p, result in zip(prompts, batched):
        assert result.token_ids == hf_greedy(model, p, 10), kind
        alone = llm.generate({"prompt_token_ids": p}, params)[0]
        assert alone.token_ids == result.token_ids


def test_parameter_counts_total_and_active(tiny):
    kind, model, path = tiny
    cfg = config_from_hf(path)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    hf = model.config
    moe_layers = [i for i, layer in enumerate(model.model.layers)
                  if hasattr(layer.mlp, "experts")]
    idle_experts = hf.num_experts - hf.num_experts_per_tok if kind != "mixtral" else (
        hf.num_local_experts - hf.num_experts_per_tok)
    expert = sum(p.numel() for p in model.model.layers[moe_layers[0]].mlp.experts.parameters())
    expert //= hf.num_local_experts if kind == "mixtral" else hf.num_experts
    hand = sum(p.numel() for p in model.parameters()) - len(moe_layers) * idle_experts * expert
    assert cfg.num_active_params() == hand < cfg.num_params()


def test_routing_stats_count_every_token_top_k_times(tiny):
    _, _, path = tiny
    llm = LLM(path, max_num_batched_tokens=64, block_size=4, num_kv_blocks=64,
              device=DEVICE)
    stats = llm.loaded.model.moe_stats
    cfg = llm.loaded.config
    stats.reset()
    llm.prompt_logits(_prompt(20, seed=2))
    assert stats.layers == [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    assert stats.num_tokens() == 20
    assert stats.tokens_per_expert.sum(dim=1).tolist() == [20 * cfg.num_experts_per_tok] * len(
        stats.layers)
    touched = stats.experts_touched()
    assert all(cfg.num_experts_per_tok <= t <= cfg.num_experts for t in touched), touched
    assert stats.expert_params_read() == sum(touched) * cfg.expert_params()
    stats.reset()
    assert stats.num_tokens() == 0 and stats.experts_touched() == [0] * len(stats.layers)


CARDS = {  # published total and activated parameters, in billions, from each model card
    "Qwen3-30B-A3B": (30.5, 3.3, {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "intermediate_size": 6144, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 768}),
    "Mixtral-8x7B": (46.7, 12.9, {
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2}),
    "Qwen1.5-MoE-A2.7B": (14.3, 2.7, {
        "model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048,
        "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
        "intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632}),
}


@pytest.mark.parametrize("name", sorted(CARDS))
def test_total_and_active_parameters_match_model_cards(name, tmp_path):
    total, active, raw = CARDS[name]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = config_from_hf(tmp_path)
    # Cards state one decimal, rounded or cut (Qwen3-30B-A3B's 3.35B is "3.3B").
    assert cfg.num_params() / 1e9 == pytest.approx(total, abs=0.06)
    assert cfg.num_active_params() / 1e9 == pytest.approx(active, abs=0.06)


def _hf_routing(model, ids: list[int], top_k: int) -> torch.Tensor:
    """(token, expert) pairs per MoE layer and expert, from transformers' own router logits."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), output_router_logits=True).router_logits
    return torch.stack([torch.bincount(layer.topk(top_k, dim=-1).indices.flatten(),
                                       minlength=layer.shape[-1]) for layer in logits])


def test_per_request_routing_matches_the_transformers_router(tiny):
    kind, model, path = tiny
    llm = LLM(path, max_num_batched_tokens=24, block_size=4, num_kv_blocks=64, device=DEVICE)
    cfg = llm.loaded.config
    prompts = [_prompt(n, seed=100 + n) for n in (5, 21, 12)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    steps = list(llm.engine.moe.recent)
    total_read = 0.0
    for p, result in zip(prompts, results):
        usage = result.timeline.moe
        ran = p + result.token_ids[:-1]  # the last token is sampled, never fed back
        assert usage.tokens == len(ran)
        assert torch.equal(usage.counts, _hf_routing(model, ran, cfg.num_experts_per_tok)), kind
        summary = usage.summary()
        touched = (usage.counts > 0).sum(dim=1).tolist()
        assert summary["experts_touched_per_layer"] == touched
        assert summary["tokens_per_expert_max"] == int(usage.counts.max())
        assert summary["active_params_per_token"] == cfg.num_active_params()
        total_read += usage.weights_read
    # Every step's reads are shared out over its requests, nothing lost or counted twice.
    assert total_read == pytest.approx(sum(s.weights_read for s in steps))
    assert sum(s.tokens for s in steps) == sum(r.timeline.moe.tokens for r in results)
    assert llm.engine.moe.usage == {}  # finished requests leave nothing behind


def test_a_lone_decode_step_reads_exactly_the_active_weights(tiny):
    _, _, path = tiny
    llm = LLM(path, num_kv_blocks=64, block_size=4, device=DEVICE)
    cfg = llm.loaded.config
    llm.generate({"prompt_token_ids": _prompt(7, seed=3)},
                 SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    step = llm.engine.moe.last_step  # one request decoding: one token
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert step.tokens == 1 and step.experts_touched == [cfg.num_experts_per_tok] * moe_layers
    assert step.weights_read == (cfg.static_params_read()
                                 + moe_layers * cfg.num_experts_per_tok * cfg.expert_params())
    # Whatever is not read by one token is exactly the idle experts (and an untied embedding).
    idle = moe_layers * (cfg.num_experts - cfg.num_experts_per_tok) * cfg.expert_params()
    embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    assert cfg.num_params() - step.weights_read == idle + embed
