"""Reasoning and tool calls through the whole server and the real engine. No available model
writes `<think>` or `<tool_call>` by itself, so the test builds one: a one-layer Llama whose
layers add nothing and whose head maps each token to a chosen successor, over a vocabulary
built here in which every piece of the answer is one token. Greedy decoding then walks a fixed
chain; `logit_bias` (a real sampling feature) switches it to another chain."""
import json

import httpx
import pytest
import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from lifeline.engine.engine import EngineConfig
from lifeline.model.config import ModelConfig
from lifeline.model.loader import LoadedModel, build_model, load_weights
from lifeline.server.config import ServerConfig
from lifeline.server.testing import ServerThread
from lifeline.tokenizer import HFTokenizer

ASSISTANT, EOS = "<|assistant|>", "</s>"
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
REASONING_CHAIN = ["<think>", "Let me check.", "</think>", "<tool_call>", CALL, "</tool_call>",
                   EOS]
PLAIN_CHAIN = ["Sunny", " today.", EOS]
TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
            f"{{% if add_generation_prompt %}}{ASSISTANT}{{% endif %}}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "weather in Paris"}]


def _tokenizer(path) -> HFTokenizer:
    backend = Backend(models.WordLevel({"[UNK]": 0, "weather": 1, "in": 2, "Paris": 3},
                                       unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.Fuse()
    pieces = [ASSISTANT, *REASONING_CHAIN[:-1], *PLAIN_CHAIN[:-1]]
    backend.add_tokens([AddedToken(p, special=False, normalized=False) for p in pieces])
    backend.add_special_tokens([EOS])
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    return HFTokenizer(path)


def _successor_model(tokenizer: HFTokenizer, source: str) -> LoadedModel:
    vocab = tokenizer.vocab_size
    hidden = 32
    cfg = ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=hidden, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=32,
                      max_position=256, name="successor")
    model = build_model(cfg)
    tensors = {name: (torch.ones if name.endswith("norm.weight") else torch.zeros)(p.shape)
               for name, p in model.named_parameters()}
    tensors["embed_tokens.weight"] = torch.eye(vocab, hidden)
    head = tensors["lm_head.weight"]
    ids = tokenizer._tk.token_to_id

    def link(chain, strength):
        for a, b in zip([ASSISTANT, *chain], chain):
            head[ids(b), ids(a)] = strength

    link(REASONING_CHAIN, 10.0)
    link(PLAIN_CHAIN, 9.0)
    load_weights(model, tensors.items())
    return LoadedModel(model.eval(), cfg, tokenizer, source, "f32")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("successor")
    tokenizer = _tokenizer(path)
    (path / "template.jinja").write_text(TEMPLATE)
    return _successor_model(tokenizer, str(path)), path


def _config(path) -> ServerConfig:
    return ServerConfig(served_model_name="tiny", chat_template=path / "template.jinja",
                        reasoning_parser="think", tool_call_parser="hermes",
                        engine=EngineConfig(num_kv_blocks=64))


@pytest.fixture(scope="module")
def server(tiny):
    loaded, path = tiny
    tokenizer = loaded.tokenizer
    with ServerThread(loaded, _config(path)) as srv:
        srv.token_id = tokenizer._tk.token_to_id
        yield srv


def test_reasoning_and_a_tool_call_in_one_response(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                         temperature=0, max_tokens=20)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.model_extra["reasoning_content"] == "Let me check."
    assert not message.content
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert out.usage.completion_tokens == len(REASONING_CHAIN)
    assert out.usage.completion_tokens_details.reasoning_tokens == 3
    timings = out.model_extra["timings"]
    assert timings["ttfat_ms"] > timings["ttft_ms"]


def test_streamed_reasoning_and_tool_call(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=20,
        stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == "Let me check."
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 3
    timings = chunks[-1].model_extra["timings"]
    assert timings["ttfat_ms"] > timings["ttft_ms"]


def test_logit_bias_steers_to_a_plain_answer(client, server):
    bias = {str(server.token_id("Sunny")): 8}
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                         max_tokens=20, logit_bias=bias)
    assert out.choices[0].message.content == "Sunny today."
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens_details.reasoning_tokens == 0
    timings = out.model_extra["timings"]
    assert timings["ttfat_ms"] == timings["ttft_ms"]


def test_without_tools_or_with_tool_choice_none_the_call_stays_text(client):
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                             max_tokens=20, **extra)
        assert out.choices[0].finish_reason == "stop"
        assert out.choices[0].message.content == f"<tool_call>{CALL}</tool_call>"
        assert out.choices[0].message.tool_calls is None


def test_tokenize_reports_the_prompt_anatomy(server):
    r = httpx.post(server.base_url + "/tokenize", timeout=30,
                   json={"messages": MESSAGES, "tools": TOOLS})
    body = r.json()
    assert r.status_code == 200 and body["tokens"][-1] == server.token_id(ASSISTANT)
    anatomy = body["prompt_anatomy"]
    assert anatomy["total"] == body["count"] == sum(
        v for k, v in anatomy.items() if k != "total")


def test_a_dead_engine_fails_requests_cleanly_and_health_says_so(tiny):
    loaded, path = tiny
    with ServerThread(loaded, _config(path)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=30) as http:
        def broken_step():
            raise RuntimeError("simulated device failure")

        srv.engine.step = broken_step
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3})
        error = r.json()["error"]
        assert r.status_code == 500 and error["code"] == "internal_error"
        # the client learns an error id, the server log the exception (it may hold internals)
        assert "error id err-" in error["message"]
        assert "simulated device failure" not in error["message"]
        assert http.get("/health").status_code == 503
        assert http.get("/ready").status_code == 503
        again = http.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert again.status_code == 503 and again.json()["error"]["code"] == "engine_dead"
