"""`lifeline serve` on the default model, driven over loopback by the official `openai` client
(and raw `httpx` where a client would refuse to send the request): what a user of an
OpenAI-compatible server observes, plus the timings that say where each millisecond went."""
import asyncio
import json
import math
import time

import openai
import pytest

from lifeline import LLM, SamplingParams
from lifeline.engine.engine import EngineConfig
from lifeline.observe import STAGES
from lifeline.server.config import ServerConfig
from lifeline.server.testing import ServerThread

MODEL = "gemma-3-270m"
STAGE_KEYS = [f"{s}_ms" for s in STAGES]
TIMING_KEYS = STAGE_KEYS + ["prefill_chunks", "ttft_ms", "ttfat_ms", "tbt_p50_ms", "tbt_p90_ms",
                            "tbt_max_ms", "e2e_ms", "prompt_tokens", "cached_tokens",
                            "completion_tokens", "prefill_tok_s", "decode_tok_s", "preemptions",
                            "prompt_anatomy"]
SUM_TOLERANCE_MS = 0.01
"""The stages telescope from arrival to last byte, so they add up to e2e up to float rounding."""
LONG_PROMPT = ("You are a careful assistant who answers questions about geography, history and "
               "science. Always answer briefly, in one sentence, and say so when you do not know. ")


@pytest.fixture(scope="module")
def server(loaded):
    config = ServerConfig(engine=EngineConfig(kv_cache_memory_bytes=256 << 20))
    with ServerThread(loaded, config) as srv:
        yield srv


def _extra(obj, name):
    return (obj.model_extra or {}).get(name)


def _check_timings(timings: dict, client_e2e_s: float, completion_tokens: int) -> None:
    assert set(TIMING_KEYS) <= set(timings), set(TIMING_KEYS) - set(timings)
    stages = sum(timings[k] for k in STAGE_KEYS)
    assert all(timings[k] >= 0 for k in STAGE_KEYS), timings
    assert math.isclose(stages, timings["e2e_ms"], abs_tol=SUM_TOLERANCE_MS), timings
    assert timings["e2e_ms"] <= client_e2e_s * 1e3
    assert 0 < timings["ttft_ms"] <= timings["e2e_ms"]
    assert timings["completion_tokens"] == completion_tokens
    assert timings["prefill_chunks"] >= 1


def test_completion_matches_the_offline_engine(loaded, client):
    prompt = "The capital of France is"
    expected = LLM(loaded, kv_cache_memory_bytes=64 << 20).generate(
        prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    start = time.perf_counter()
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    e2e = time.perf_counter() - start
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == 12
    _check_timings(_extra(out, "timings"), e2e, 12)


def test_streamed_completion_equals_the_whole_one_and_ends_with_usage_and_timings(client):
    kwargs = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kwargs)
    start = time.perf_counter()
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    e2e = time.perf_counter() - start
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    _check_timings(_extra(last, "timings"), e2e, 10)
    assert all(_extra(c, "timings") is None for c in chunks[:-1])


def test_streaming_without_usage_puts_timings_in_the_last_chunk(client):
    chunks = list(client.completions.create(model=MODEL, prompt="One, two, three,",
                                            max_tokens=4, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason is not None
    assert _extra(chunks[-1], "timings")["completion_tokens"] == 4
    assert all(c.usage is None for c in chunks)


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = LONG_PROMPT + "What is the capital of Italy?"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens >= 32
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    assert _extra(second, "timings")["cached_tokens"] == cached


def test_non_streaming_response_sends_server_timing(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200
    header = r.headers["server-timing"]
    names = [entry.split(";")[0].strip() for entry in header.split(",")]
    assert names[:len(STAGES)] == list(STAGES) and "e2e" in names
    e2e = float(header.split("e2e;dur=")[1])
    assert math.isclose(e2e, r.json()["timings"]["e2e_ms"], rel_tol=1e-3)


def test_n_choices_stop_seed_and_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="Colors: red, green,", max_tokens=8,
                                    n=3, temperature=1.0, seed=7, logprobs=2)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)
    for c in out.choices:
        top, token = c.logprobs.top_logprobs[0], c.logprobs.tokens[0]
        assert len(top) in (2, 3) and top[token] == c.logprobs.token_logprobs[0]  # top 2 + own
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
    again = client.completions.create(model=MODEL, prompt="Colors: red, green,", max_tokens=8,
                                      n=1, temperature=1.0, seed=7)
    assert again.choices[0].text == client.completions.create(
        model=MODEL, prompt="Colors: red, green,", max_tokens=8, temperature=1.0,
        seed=7).choices[0].text
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=20,
                                        temperature=0, stop=[" 7"])
    assert stopped.choices[0].finish_reason == "stop" and " 7" not in stopped.choices[0].text


def test_models_tokenize_and_detokenize(loaded, client, http):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = http.get("/v1/models").json()["data"][0]
    assert card["architecture"] == "gemma3" and card["context_length"] == 32768
    assert card["parameters"]["total"] == card["parameters"]["active"] == \
        loaded.config.num_params()
    assert card["weight_format"].startswith("gguf:")
    ids = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert ids["tokens"] == loaded.tokenizer.encode("Hello world") and ids["count"] == 3
    text = http.post("/detokenize", json={"tokens": ids["tokens"][1:]}).json()["prompt"]
    assert text == "Hello world"


def test_health_ready_and_metrics(http):
    assert http.get("/health").status_code == 200
    ready = http.get("/ready").json()
    assert ready["status"] == "ready"
    # a server given a loaded model reports its start too, the load before it included
    phases = ready["startup_seconds"]
    assert "compile_warmup" in phases and phases["read_weights"] > 0
    assert sum(s for p, s in phases.items() if p != "ready") == pytest.approx(phases["ready"])
    metrics = http.get("/metrics").text
    for name in ("lifeline:time_to_first_token_seconds_bucket", "lifeline:kv_cache_usage_perc",
                 "lifeline:request_queue_time_seconds_bucket", "lifeline:prompt_tokens_total"):
        assert name in metrics


BAD_REQUESTS = [
    ("invalid JSON", b'{"prompt": "x",', 400, None),
    ("non-object body", b"[1, 2]", 400, None),
    ("negative max_tokens", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("zero max_tokens", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("unknown model", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("NaN temperature", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("temperature too high", {"prompt": "x", "temperature": 5}, 400, "temperature"),
    ("top_p zero", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("n too large", {"prompt": "x", "n": 1000}, 400, "n"),
    ("n zero", {"prompt": "x", "n": 0}, 400, "n"),
    ("logprobs too many", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("stream_options without stream", {"prompt": "x", "stream_options": {"include_usage": True}},
     400, None),
    ("token id out of vocabulary", {"prompt": [2, 999999999]}, 400, "prompt"),
    ("negative token id", {"prompt": [2, -5]}, 400, "prompt"),
    ("unpaired surrogate", b'{"prompt": "abc \\ud800 def"}', 400, None),
    ("deep nesting", b'{"prompt": "x", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    ("prompt longer than the context", {"prompt": [2] + [107] * 33000, "max_tokens": 1}, 400,
     "prompt"),
    ("wrong type", {"prompt": {"a": 1}}, 400, "prompt"),
    ("logit_bias outside vocabulary", {"prompt": "x", "logit_bias": {"99999999": 1}}, 400,
     "logit_bias"),
    ("stop_token_ids outside vocabulary", {"prompt": "x", "stream": True,
                                           "stop_token_ids": [-1]}, 400, "stop_token_ids"),
]


@pytest.mark.parametrize("name,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_completion_requests_get_openai_errors_and_the_server_stays_up(http, name, body,
                                                                          status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post("/v1/completions", content=content,
                  headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200


def test_too_large_body_is_413(http):
    r = http.post("/v1/completions", content=b'{"prompt": "' + b"a" * (9 << 20) + b'"}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["message"]
    assert http.get("/health").status_code == 200


def test_unknown_route_is_an_openai_404(http):
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_openai_client_raises_on_bad_input(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


def test_thirty_two_concurrent_streams_complete_with_consistent_usage_and_timings(server):
    async def one(client: openai.AsyncOpenAI, i: int):
        start = time.perf_counter()
        stream = await client.completions.create(
            model=MODEL, prompt=f"Item {i}: the number {i} is", max_tokens=6 + i % 3,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return chunks, time.perf_counter() - start, 6 + i % 3

    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x",
                                      timeout=240, max_retries=0) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))),
                                          300)

    results = asyncio.run(run())
    for chunks, e2e, wanted in results:
        text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
        assert 1 <= len(text_chunks) <= wanted
        last = chunks[-1]
        assert last.usage.completion_tokens == wanted
        _check_timings(_extra(last, "timings"), e2e, wanted)


CHAT = [{"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"}]


def test_chat_completion_and_its_stream_agree_and_report_prompt_anatomy(client):
    kwargs = {"model": MODEL, "messages": CHAT, "max_completion_tokens": 8, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    start = time.perf_counter()
    whole = client.chat.completions.create(**kwargs)
    e2e = time.perf_counter() - start
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    assert whole.choices[0].finish_reason == "length"
    timings = _extra(whole, "timings")
    _check_timings(timings, e2e, 8)
    anatomy = timings["prompt_anatomy"]
    assert anatomy["total"] == whole.usage.prompt_tokens == timings["prompt_tokens"]
    assert sum(v for k, v in anatomy.items() if k != "total") == anatomy["total"]
    assert anatomy["system"] > 0 and anatomy["latest_user"] > 0 and anatomy["template"] > 0
    assert timings["template_ms"] > 0 and timings["ttfat_ms"] == timings["ttft_ms"]
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == message.content
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0, "same prompt again"
    assert _extra(chunks[-1], "timings")["prompt_anatomy"] == anatomy


def test_chat_logprobs_n_and_async_client(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x",
                                      max_retries=0, timeout=120) as client:
            return await client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=4, n=2, temperature=0.7, seed=3,
                logprobs=True, top_logprobs=3)

    out = asyncio.run(asyncio.wait_for(run(), 120))
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        entries = c.logprobs.content
        assert len(entries) == 4 and all(len(e.top_logprobs) == 3 for e in entries)
        assert all(e.logprob <= 0 and bytes(e.bytes).decode("utf-8", "replace") == e.token
                   for e in entries)
    assert out.usage.completion_tokens == 8


BAD_CHATS = [
    ("empty messages", {"messages": []}, 400, "messages"),
    ("messages not a list", {"messages": "hi"}, 400, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("tool_choice without tools", {"messages": CHAT, "tool_choice": "auto"}, 400, "tool_choice"),
    ("top_logprobs above the limit", {"messages": CHAT, "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    ("request template not allowed", {"messages": CHAT, "chat_template": "{{ 'x' }}"}, 400,
     "chat_template"),
    ("max_completion_tokens zero", {"messages": CHAT, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("negative frequency penalty out of range", {"messages": CHAT, "frequency_penalty": -3},
     400, "frequency_penalty"),
    ("infinite top_p", b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
     400, None),
    ("unknown model", {"model": "llama-9000", "messages": CHAT}, 404, "model"),
    ("prompt longer than the context", {"messages": [{"role": "user", "content":
                                                      "hello " * 33000}]}, 400, "messages"),
]


@pytest.mark.parametrize("name,body,status,param", BAD_CHATS, ids=[b[0] for b in BAD_CHATS])
def test_bad_chat_requests_get_openai_errors_and_the_server_stays_up(http, name, body, status,
                                                                    param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post("/v1/chat/completions", content=content,
                  headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert (error["param"] or "").startswith(param), error
    ok = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
    assert ok.status_code == 200


def _access_lines(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "lifeline.access"]


def test_one_access_log_line_one_trace_and_metrics_per_request(server, client, caplog):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from lifeline.observe import Tracer

    exporter = InMemorySpanExporter()
    previous, server.state.tracer = server.state.tracer, Tracer(exporter)
    try:
        with caplog.at_level("INFO", logger="lifeline.access"):
            out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
            with pytest.raises(openai.BadRequestError):
                client.completions.create(model=MODEL, prompt="Hello", max_tokens=-1)
            # the line is written after the response's last byte, so it can trail the client
            deadline = time.monotonic() + 5
            while len(_access_lines(caplog)) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        server.state.tracer = previous
    lines = _access_lines(caplog)
    assert [(line["endpoint"], line["status"]) for line in lines] == [
        ("/v1/completions", 200), ("/v1/completions", 400)]
    assert lines[0]["request_id"] == out.id
    assert lines[0]["timings"]["e2e_ms"] == _extra(out, "timings")["e2e_ms"]
    spans = exporter.get_finished_spans()
    parent = next(s for s in spans if s.name == "request")
    assert parent.attributes["lifeline.request_id"] == out.id
    children = [s.name for s in spans if s.parent is not None and
                s.parent.span_id == parent.context.span_id]
    assert children == list(STAGES)



def test_streamed_n_choices_interleave_and_each_finishes(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, n=3, max_tokens=5, temperature=0.8, seed=1, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 15
    assert _extra(chunks[-1], "timings")["completion_tokens"] == 15


def test_a_list_of_prompts_times_n_gives_indexed_choices(client):
    out = client.completions.create(model=MODEL, prompt=["Red,", "One,"], n=2, max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in out.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3], "greedy choices agree"
    single = client.completions.create(model=MODEL, prompt="One,", max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_index[2] == single.choices[0].text
    assert out.usage.prompt_tokens == 2 * single.usage.prompt_tokens
    assert out.usage.completion_tokens == 12


def test_serve_flags_become_the_server_config():
    from lifeline.cli import build_parser, serve_config

    args = build_parser().parse_args([
        "serve", "--model", "/models/qwen3-0.6b.gguf", "--port", "9001", "--api-key", "a",
        "--api-key", "b", "--rate-limit-rpm", "5", "--max-queued-requests", "3",
        "--shutdown-timeout", "7", "--reasoning-parser", "think", "--tool-call-parser", "hermes",
        "--max-num-seqs", "8", "--no-prefix-caching", "--no-compile",
        "--sampling-defaults", '{"temperature": 0.2, "top_p": 0.9}'])
    config = serve_config(args)
    assert config.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}
    assert config.served_model_name == "qwen3-0.6b" and config.port == 9001
    assert config.api_keys == ["a", "b"] and config.rate_limit_rpm == 5
    assert config.max_queued_requests == 3 and config.shutdown_timeout == 7
    assert config.reasoning_parser == "think" and config.tool_call_parser == "hermes"
    assert config.engine.max_num_seqs == 8 and not config.engine.enable_prefix_caching
    assert not config.engine.compile
    default = serve_config(build_parser().parse_args(["serve"]))
    assert default.served_model_name is None
    assert default.engine.weights == "gguf-int8"  # the fastest within 2% perplexity
    assert default.engine.compile


def test_wrong_method_is_an_openai_405(http):
    r = http.get("/v1/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_n_choices_share_their_prompt_through_the_prefix_cache(server, client):
    prompt = "Request 8127. " + LONG_PROMPT + "Name three rivers."
    stats = server.engine.block_manager.stats
    before = stats.hits
    out = client.completions.create(model=MODEL, prompt=prompt, n=4, max_tokens=3,
                                    temperature=0.8, seed=5)
    full_blocks = (out.usage.prompt_tokens - 1) // 16  # one prompt token is always computed
    assert full_blocks >= 2 and len(out.choices) == 4
    assert stats.hits - before >= 3 * full_blocks * 16, "choices 1-3 reuse choice 0's blocks"
    assert out.usage.prompt_tokens_details.cached_tokens == 0, "choice 0 computed the prompt"


def test_sampling_defaults_fill_only_the_fields_a_request_leaves_out(loaded):
    config = ServerConfig(engine=EngineConfig(kv_cache_memory_bytes=64 << 20),
                          sampling_defaults={"temperature": 0.0})
    with ServerThread(loaded, config) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)

        def text(**fields) -> str:
            return client.completions.create(model=MODEL, prompt="Once upon a time",
                                             max_tokens=16, **fields).choices[0].text

        greedy = text(temperature=0)
        assert text(seed=1) == text(seed=2) == greedy  # the default: temperature 0
        # a field the request sends is its own, even at the OpenAI default
        assert text(temperature=1.0, seed=1) != text(temperature=1.0, seed=2)
    for bad, where in [({"temperature": 5}, "sampling_defaults.temperature"),
                       ({"seed": 1}, "unknown field 'seed'")]:
        with pytest.raises(ValueError, match=where):
            ServerConfig(sampling_defaults=bad)
