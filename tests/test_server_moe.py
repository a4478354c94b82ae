"""An MoE model behind the real server: routing in each response's `timings`, the load of every
expert in `/metrics`, total vs active parameters in `/v1/models`."""
import re

import httpx
import pytest
import torch
import transformers

from lifeline.engine.engine import EngineConfig
from lifeline.model.loader import load_hf
from lifeline.server.config import ServerConfig
from lifeline.server.testing import ServerThread
from tests.reference.tiny_hf import random_prompt
from tests.test_observe import documented_metric_names, moe_metric_names

CONFIG = transformers.Qwen3MoeConfig(
    hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=300, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    intermediate_size=96, norm_topk_prob=True, mlp_only_layers=[1], initializer_range=0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3moe")
    transformers.AutoModelForCausalLM.from_config(CONFIG).save_pretrained(path)
    config = ServerConfig(served_model_name="moe", engine=EngineConfig(num_kv_blocks=64))
    with ServerThread(load_hf(path), config) as srv:
        yield srv


def _complete(server, prompt: list[int], max_tokens: int) -> dict:
    r = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
        "model": "moe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def _expert_pairs(server) -> dict[tuple[str, str], float]:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    pattern = r'lifeline:moe_expert_tokens_total\{expert="(\d+)",layer="(\d+)",model_name="moe"\}'
    return {(layer, expert): float(v) for expert, layer, v in
            re.findall(pattern + r" (\S+)", text)}


def test_timings_and_metrics_account_every_routed_token(server):
    before = sum(_expert_pairs(server).values())
    bodies = [_complete(server, random_prompt(n, n, 300), 5) for n in (9, 30)]
    total_tokens = 0
    for body in bodies:
        moe = body["timings"]["moe"]
        ran = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] - 1
        assert moe["tokens"] == ran
        assert moe["num_experts"] == 8 and moe["top_k"] == 2
        assert len(moe["experts_touched_per_layer"]) == 2  # layer 1 is dense
        assert all(2 <= t <= 8 for t in moe["experts_touched_per_layer"])
        assert moe["tokens_per_expert_max"] <= ran
        assert 0 < moe["weights_read_per_token"] <= moe["active_params_per_token"]
        total_tokens += ran
    after = _expert_pairs(server)
    assert {layer for layer, _ in after} == {"0", "2"}
    # Two MoE layers, two experts per token.
    assert sum(after.values()) - before == total_tokens * 2 * 2
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    steps = re.search(r'lifeline:moe_experts_touched_per_layer_count\{model_name="moe"\} (\S+)',
                      text)
    assert steps and float(steps[1]) >= 2
    assert 'lifeline:model_parameters{kind="active",model_name="moe"}' in text
    families = set(re.findall(r"^# TYPE (lifeline:\S+)", text, re.MULTILINE))
    families = {f.removesuffix("_total") for f in families if not f.endswith("_created")}
    moe = moe_metric_names(documented_metric_names())
    assert {n.removesuffix("_total") for n in moe} <= families  # every documented MoE series


def test_models_reports_total_and_active_parameters(server):
    card = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]
    params = card["parameters"]
    assert params["active"] < params["total"]
