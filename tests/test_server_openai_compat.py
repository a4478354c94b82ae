"""OpenAI compatibility where Lifeline once answered wrongly: refused `response_format`,
legacy logprobs (the sampled token among the top), `echo` with prompt logprobs, `/tokenize`'s
chat options, continuous usage in streams, `context_length_exceeded`, CORS, and a bounded
schemathesis run over the served OpenAPI schema. A real server on loopback, the official
`openai` client, raw `httpx` where the client would not send the request."""
import contextlib
import copy
import json

import httpx
import openai
import pytest

from lifeline import LLM, SamplingParams
from lifeline.engine.engine import EngineConfig
from lifeline.server.config import ServerConfig
from lifeline.server.protocol import ChatCompletionRequest
from lifeline.server.testing import ServerThread

MODEL = "gemma-3-270m"
KV = 256 << 20
LOGPROB_TOLERANCE = 2e-3
"""Prefill and decode compute the same logits through different kernels (batched chunk vs one
row), so their logprobs agree to float32 rounding, not bit for bit."""
GOOD = "http://good.example"
BAD = "http://evil.example"
KEY = "sk-compat"
SMALL_CONTEXT = 128
START_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def server(loaded):
    with _serve(loaded, ServerConfig(engine=EngineConfig(kv_cache_memory_bytes=KV))) as srv:
        yield srv


@pytest.fixture(scope="module")
def small_server(loaded):
    """A context of SMALL_CONTEXT tokens: prompts that reach it are cheap to send and serve."""
    config = ServerConfig(engine=EngineConfig(kv_cache_memory_bytes=64 << 20,
                                              max_model_len=SMALL_CONTEXT))
    with _serve(loaded, config) as srv:
        yield srv


@pytest.fixture(scope="module")
def small(small_server):
    with httpx.Client(base_url=small_server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline(loaded):
    return LLM(loaded, kv_cache_memory_bytes=64 << 20)


@contextlib.contextmanager
def _serve(loaded, config: ServerConfig):
    """A server whose start may take long on a machine whose cores are all busy."""
    srv = ServerThread(loaded, config).start(timeout=START_TIMEOUT_S)
    try:
        yield srv
    finally:
        srv.stop()


def _error(response: httpx.Response, status: int, param: str | None,
           code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


# response_format -------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    {"type": "regex"}, "json", {"type": "text", "strict": True},
])
@pytest.mark.parametrize("endpoint,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_response_format_other_than_text_is_refused(http, endpoint, body, fmt):
    r = http.post(endpoint, json={**body, "max_tokens": 1, "response_format": fmt})
    error = _error(r, 400, "response_format")
    assert "constrained decoding" in error["message"]


def test_response_format_text_is_accepted(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=1, response_format={"type": "text"})
    assert out.choices[0].finish_reason in ("length", "stop")


def test_the_client_sees_the_refusal(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=1,
                                       messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "json_object"})
    assert info.value.body["param"] == "response_format"


# legacy logprobs --------------------------------------------------------------------------------

def test_logprobs_zero_gives_the_sampled_token_alone(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4,
                                    temperature=1.0, seed=7, logprobs=0,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value is not None and value <= 0
        assert top == {token: value}


def test_logprobs_n_adds_the_sampled_token_when_it_is_not_among_the_top(client, loaded):
    # A bias forces an unlikely token; logprobs describe the raw model, so that token is not
    # the most likely one and comes as the (N+1)-th entry.
    forced = loaded.tokenizer.encode(" zebra", add_special_tokens=False)[0]
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2,
                                    temperature=0, logprobs=1, logit_bias={str(forced): 100},
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    forced_text = loaded.tokenizer.token_to_bytes(forced).decode()
    assert lp.tokens == [forced_text, forced_text]
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and top[forced_text] == value
        assert max(top.values()) > value


def test_logprobs_n_when_the_sampled_token_is_the_top_one(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3,
                                    temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and top[token] == value == max(top.values())


# echo -------------------------------------------------------------------------------------------

def test_echo_prepends_the_prompt(client, loaded):
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    echoed = client.completions.create(model=MODEL, prompt=[prompt, "Two plus two is"],
                                       max_tokens=3, temperature=0, echo=True, n=2,
                                       extra_body={"ignore_eos": True})
    assert len(echoed.choices) == 4
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert echoed.choices[1].text == prompt + plain.choices[0].text
    assert all(c.text.startswith("Two plus two is") for c in echoed.choices[2:])
    assert echoed.usage.completion_tokens == 12
    ids = loaded.tokenizer.encode(prompt)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0,
                                       echo=True, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == prompt + plain.choices[0].text


def test_echo_streams_the_prompt_first(client):
    prompt = "Once upon a time"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3,
                                            temperature=0, echo=True, stream=True, logprobs=1,
                                            extra_body={"ignore_eos": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0].startswith(prompt)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                      echo=True, logprobs=1, extra_body={"ignore_eos": True})
    assert "".join(texts) == whole.choices[0].text
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.tokens]
    assert streamed == whole.choices[0].logprobs.tokens
    assert len(streamed) == whole.usage.prompt_tokens + 3


def test_echo_logprobs_match_the_offline_prompt_logits(client, loaded, offline):
    prompt = "The quick brown fox jumps over the lazy"
    ids = loaded.tokenizer.encode(prompt)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                    echo=True, logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    n = len(ids)
    assert out.usage.prompt_tokens == n and len(lp.tokens) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    reference = offline.prompt_logits(ids).log_softmax(dim=-1)
    text = [loaded.tokenizer.token_to_bytes(t).decode("utf-8", "replace") for t in ids]
    assert lp.tokens[:n] == ["", *text[1:]]  # the BOS, as skip_special_tokens decodes it
    for i in range(1, n):
        expected = reference[i - 1, ids[i]].item()
        assert lp.token_logprobs[i] == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
        top = reference[i - 1].topk(2)
        names = {text_of(loaded, t) for t in top.indices.tolist()} | {text[i]}
        assert set(lp.top_logprobs[i]) == names
        assert len(lp.top_logprobs[i]) <= 3
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(prompt)


ECHO_PROMPTS = {
    "text": "The capital of France is",
    "text with a special token": "<start_of_turn>user\nHi<end_of_turn>",
    "non-ASCII text": "Na\u00efve caf\u00e9 \u65e5\u672c \U0001f999 ok",
    "token ids": "ids:<start_of_turn>user\nCaf\u00e9 \U0001f999<end_of_turn>",
}


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("name", sorted(ECHO_PROMPTS))
def test_echo_text_and_its_token_offsets_agree(client, loaded, name, skip_special_tokens):
    """The echoed prompt is its ids decoded; each token in `logprobs.tokens` is the text it
    adds, at its `text_offset` in the returned text, offsets never decreasing; the same
    streamed."""
    prompt = ECHO_PROMPTS[name]
    ids = loaded.tokenizer.encode(prompt.removeprefix("ids:"))
    sent = ids if prompt.startswith("ids:") else prompt
    expected = loaded.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    args = dict(model=MODEL, prompt=sent, max_tokens=2, temperature=0, echo=True, logprobs=1,
                extra_body={"ignore_eos": True, "skip_special_tokens": skip_special_tokens})
    whole = client.completions.create(**args).choices[0]
    streamed = [c.choices[0] for c in client.completions.create(**args, stream=True)
                if c.choices]
    assert whole.text.startswith(expected)
    assert "".join(c.text for c in streamed) == whole.text
    lp = whole.logprobs
    assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == lp.tokens
    assert [o for c in streamed if c.logprobs for o in c.logprobs.text_offset] == \
        lp.text_offset
    n = len(ids)
    assert len(lp.tokens) == len(lp.text_offset) == n + 2
    assert "".join(lp.tokens[:n]) == expected and lp.text_offset[n] == len(expected)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, offset in zip(lp.tokens[:n], lp.text_offset, strict=False):
        assert whole.text[offset:offset + len(token)] == token
    specials = [loaded.tokenizer.decode([t], skip_special_tokens=skip_special_tokens)
                for t in ids if t in loaded.tokenizer.special_token_ids]
    assert [lp.tokens[i] for i, t in enumerate(ids)
            if t in loaded.tokenizer.special_token_ids] == specials


def text_of(loaded, token_id: int) -> str:
    return loaded.tokenizer.token_to_bytes(token_id).decode("utf-8", "replace")


def test_echo_logprob_of_a_greedy_token_equals_its_generated_logprob(client, loaded, offline):
    """The prompt logprob (prefill) of a token the model chose greedily equals the logprob it
    had when it was generated (decode): two paths through the server to one number."""
    ids = loaded.tokenizer.encode("Water boils at a temperature of")
    generated = offline.generate({"prompt_token_ids": ids},
                                 SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    made = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0,
                                     logprobs=0, extra_body={"ignore_eos": True})
    assert made.choices[0].text == generated.text
    scored = client.completions.create(model=MODEL, prompt=ids + generated.token_ids,
                                       max_tokens=1, temperature=0, echo=True, logprobs=0,
                                       extra_body={"ignore_eos": True})
    echoed = scored.choices[0].logprobs.token_logprobs[len(ids):len(ids) + 3]
    assert echoed == pytest.approx(made.choices[0].logprobs.token_logprobs,
                                   abs=LOGPROB_TOLERANCE)


# system messages with the built-in Gemma template ------------------------------------------------

LATER_SYSTEM = [{"role": "user", "content": "Hi"},
                {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "What is the capital of Italy?"}]


def test_a_later_system_message_is_accepted_and_rendered_as_google_renders_it(client, http,
                                                                              loaded):
    from tests.test_chat_templates import google_render

    out = client.chat.completions.create(model=MODEL, messages=LATER_SYSTEM, max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop")
    reference = loaded.tokenizer.encode(google_render(LATER_SYSTEM), add_special_tokens=False)
    assert out.usage.prompt_tokens == len(reference)
    r = http.post("/tokenize", json={"messages": LATER_SYSTEM})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == reference
    in_user_place = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                     {"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Bye"}]
    out = client.chat.completions.create(model=MODEL, messages=in_user_place, max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop")


# /tokenize ---------------------------------------------------------------------------------------

PARTIAL = [{"role": "user", "content": "Name a colour."},
           {"role": "assistant", "content": "The colour I pick is"}]


@pytest.mark.parametrize("options", [
    {},
    {"add_generation_prompt": False},
    {"add_generation_prompt": False, "continue_final_message": True},
])
def test_tokenize_counts_what_chat_prompts(server, client, http, options):
    r = http.post("/tokenize", json={"messages": PARTIAL, **options})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    chat = client.chat.completions.create(model=MODEL, messages=PARTIAL, max_tokens=1,
                                          extra_body=options)
    assert chat.usage.prompt_tokens == len(ids)
    state = server.state
    body = ChatCompletionRequest(messages=PARTIAL, **options)
    assert ids == state.chat.encode(state.chat.render(body))


def test_tokenize_options_change_the_prompt(http, loaded):
    counts = {}
    for name, options in {"generation": {}, "plain": {"add_generation_prompt": False},
                          "continue": {"add_generation_prompt": False,
                                       "continue_final_message": True}}.items():
        r = http.post("/tokenize", json={"messages": PARTIAL, **options})
        counts[name] = r.json()["tokens"]
    assert counts["generation"] != counts["plain"] != counts["continue"]
    assert loaded.tokenizer.decode(counts["continue"]).endswith("The colour I pick is")


def test_tokenize_refuses_both_options(http):
    r = http.post("/tokenize", json={"messages": PARTIAL, "continue_final_message": True})
    _error(r, 400, "continue_final_message")


# continuous usage ------------------------------------------------------------------------------

def test_continuous_usage_on_every_chunk(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to five."}], max_tokens=5,
        stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert len(chunks) >= 6
    assert all(c.usage is not None for c in chunks)
    completion = [c.usage.completion_tokens for c in chunks]
    assert completion == sorted(completion) and completion[0] == 0 and completion[-1] == 5
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
    assert chunks[-1].choices == []


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream_options", [
    None, {"include_usage": False}, {"continuous_usage_stats": True},
    {"include_usage": False, "continuous_usage_stats": True}])
def test_no_usage_in_a_stream_unless_include_usage(server, client, endpoint, stream_options):
    """As OpenAI and vLLM: usage only where `include_usage` asks for it; without it,
    `continuous_usage_stats` adds none (raw events, so a field the client would drop shows)."""
    extra = {} if stream_options is None else {"stream_options": stream_options}
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}
    else:
        path, body = "/v1/completions", {"prompt": "Hello"}
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        with http.stream("POST", path, json={**body, "max_tokens": 3, "stream": True,
                                             "ignore_eos": True, **extra}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(events) >= 3
    assert [e for e in events if "usage" in e] == []
    assert all(e["choices"] for e in events[:-1])
    parsed = client.chat.completions.create if endpoint == "chat" else client.completions.create
    chunks = list(parsed(model=MODEL, **body, max_tokens=3, stream=True,
                         extra_body={"ignore_eos": True, **extra}))
    assert all(c.usage is None for c in chunks)


def test_usage_in_a_final_chunk_with_empty_choices(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_usage_only_at_the_end_without_continuous(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]


# null is a field left out ------------------------------------------------------------------------

NULLABLE = ("stream", "n", "temperature", "top_p", "presence_penalty", "frequency_penalty",
            "logprobs", "stop", "seed", "user", "stream_options", "max_tokens")
"""Fields OpenAI's published schema marks nullable (found by benchmarks/fuzz_api.py: a null
`stream`, `n` or `temperature` got 400 `invalid_value` here, a null `max_tokens` a 400 whose
message was a Python TypeError's)."""


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_null_is_the_field_left_out(client, http, small, endpoint):
    """The official client sends `None` as JSON null; OpenAI takes it as the default: one
    choice, not streamed. A null `max_tokens` is none sent (the output is capped by
    `max_completion_tokens` in chat, by `--default-max-tokens` in completions)."""
    nulls = {k: None for k in NULLABLE if endpoint == "chat" or k != "logprobs"}
    if endpoint == "chat":
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4}
        r = client.chat.completions.create(model=MODEL, **body, **nulls)
        path = "/v1/chat/completions"
    else:
        body = {"prompt": "Hello", "echo": None, "stop": ["\n"]}
        r = client.completions.create(model=MODEL, **{**nulls, **body, "max_tokens": 4})
        path = "/v1/completions"
    assert len(r.choices) == 1 and r.usage.completion_tokens >= 1
    raw = http.post(path, json={"model": MODEL, **nulls, **body, "stop": None,
                                **({} if endpoint == "chat" else {"max_tokens": 4})})
    assert raw.status_code == 200, raw.text
    assert raw.headers["content-type"].startswith("application/json")
    assert raw.json()["usage"]["completion_tokens"] >= 1
    if endpoint == "chat":  # max_tokens null, nothing else: the server's default applies,
        # clamped to the room left in the context (a small one: the base model may not stop)
        raw = small.post(path, json={"model": MODEL, "messages": body["messages"],
                                     "max_tokens": None, "stop": ["."], "temperature": 0})
        assert raw.status_code == 200, raw.text
        usage = raw.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= SMALL_CONTEXT


# context_length_exceeded ------------------------------------------------------------------------

def test_context_length_exceeded(small):
    http = small
    limit = http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert limit == SMALL_CONTEXT
    r = http.post("/v1/completions", json={"prompt": [2] + [107] * limit, "max_tokens": 1})
    _error(r, 400, "prompt", "context_length_exceeded")
    r = http.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "hello " * limit}]})
    _error(r, 400, "messages", "context_length_exceeded")
    r = http.post("/v1/completions", json={"prompt": [2] + [107] * (limit - 10),
                                           "max_tokens": 20})
    error = _error(r, 400, "prompt", "context_length_exceeded")
    assert str(limit) in error["message"]
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                "max_completion_tokens": limit})
    _error(r, 400, "messages", "context_length_exceeded")


def test_a_default_max_tokens_is_clamped_not_refused(small):
    r = small.post("/v1/completions", json={"prompt": [2] + [107] * (SMALL_CONTEXT - 5),
                                            "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["finish_reason"] == "length"


# CORS ---------------------------------------------------------------------------------------------

def _preflight(http: httpx.Client, origin: str, path: str = "/v1/chat/completions"
               ) -> httpx.Response:
    return http.options(path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                       "Access-Control-Request-Headers": "authorization,"
                                                                         "content-type"})


@pytest.fixture(scope="module")
def cors_server(loaded):
    config = ServerConfig(api_keys=[KEY], allowed_origins=[GOOD], rate_limit_rpm=1,
                          engine=EngineConfig(kv_cache_memory_bytes=64 << 20))
    with _serve(loaded, config) as srv, httpx.Client(base_url=srv.base_url,
                                                           timeout=60) as c:
        yield c


def test_cors_is_off_by_default(http):
    r = _preflight(http, GOOD, "/v1/models")
    assert "access-control-allow-origin" not in r.headers
    r = http.get("/v1/models", headers={"Origin": GOOD})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_preflight_needs_no_key(cors_server):
    r = _preflight(cors_server, GOOD)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == GOOD
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()


def test_preflight_from_a_disallowed_origin(cors_server):
    r = _preflight(cors_server, BAD)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_preflight_needs_no_key_with_cors_off(loaded):
    config = ServerConfig(api_keys=[KEY], engine=EngineConfig(kv_cache_memory_bytes=64 << 20))
    with _serve(loaded, config) as srv, httpx.Client(base_url=srv.base_url) as c:
        r = _preflight(c, GOOD)
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
        assert c.options("/v1/models").status_code == 401  # not a preflight: the key counts
        assert c.get("/v1/models", headers={"Origin": GOOD}).status_code == 401


def test_cors_headers_on_answers_and_errors(cors_server):
    auth = {"Authorization": f"Bearer {KEY}"}
    r = cors_server.get("/v1/models", headers={"Origin": GOOD, **auth})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD
    r = cors_server.get("/v1/models", headers={"Origin": BAD, **auth})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = cors_server.get("/v1/models", headers={"Origin": GOOD})
    _error(r, 401, None, "invalid_api_key")
    assert r.headers["access-control-allow-origin"] == GOOD
    body = {"prompt": "hi", "max_tokens": 1}
    first = cors_server.post("/v1/completions", json=body, headers={"Origin": GOOD, **auth})
    assert first.status_code == 200 and first.headers["access-control-allow-origin"] == GOOD
    r = cors_server.post("/v1/completions", json=body, headers={"Origin": GOOD, **auth})
    assert r.status_code == 429 and r.headers["access-control-allow-origin"] == GOOD


# schemathesis ------------------------------------------------------------------------------------

FUZZ_TIMEOUT_S = 300
"""A hang fails the run; a slow answer on a machine whose cores are all busy does not."""
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2, "min_tokens": 4}
"""Schema maxima for the fuzzing run: generation stays short on a CPU."""


def _capped(node):
    """A copy of a JSON schema whose integer fields in CAPS get those maxima, and whose `model`
    is the served one (a random name is a 404 before anything else is looked at)."""
    if isinstance(node, list):
        return [_capped(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _capped(v) for k, v in node.items()}
    if "model" in out.get("properties", {}):
        out["properties"]["model"] = {"anyOf": [{"enum": [MODEL]}, {"type": "null"}]}
    for name, props in ((k, v) for k, v in out.get("properties", {}).items() if k in CAPS):
        for sub in props.get("anyOf", [props]):
            if sub.get("type") == "integer":
                sub["maximum"] = CAPS[name]
    return out


def test_schemathesis_finds_no_server_error(small_server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode

    with httpx.Client(base_url=small_server.base_url, timeout=30) as c:
        raw = c.get("/openapi.json").json()
    bodies = raw["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "TokenizeRequest"):
        assert bodies[name]["properties"], name
    assert raw["paths"]["/v1/completions"]["post"]["requestBody"]["required"]
    schema = schemathesis.openapi.from_dict(_capped(copy.deepcopy(raw)))
    calls = {"count": 0, "statuses": set()}

    for result in schema.get_all_operations():
        operation = result.ok()
        modes = [(GenerationMode.POSITIVE, 15)]
        if operation.method.upper() == "POST":  # nothing to get wrong in a bare GET
            modes.append((GenerationMode.NEGATIVE, 6))
        for mode, examples in modes:
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, database=None,
                      phases=[Phase.explicit, Phase.generate, Phase.shrink],
                      suppress_health_check=list(HealthCheck))
            def check(case):
                response = case.call_and_validate(base_url=small_server.base_url,
                                                  checks=[not_a_server_error],
                                                  timeout=FUZZ_TIMEOUT_S)
                calls["count"] += 1
                calls["statuses"].add(response.status_code)

            check()
    assert calls["count"] > 40
    assert 200 in calls["statuses"] and 400 in calls["statuses"]
    assert json.loads(httpx.get(small_server.base_url + "/health").text)["status"] == "ok"


def test_prompt_logprobs_in_pieces_equal_one_pass():
    import torch

    from lifeline.engine.prompt_logprobs import ROWS_AT_ONCE, gather_prompt_logprobs

    torch.manual_seed(0)
    rows, vocab, start = ROWS_AT_ONCE * 2 + 5, 50, 3
    logits = torch.randn(rows, vocab) * 4
    prompt = torch.randint(0, vocab, (start + rows,)).tolist()  # the last row scores nothing
    got = gather_prompt_logprobs(logits, start, prompt, 3)
    full = logits.log_softmax(dim=-1)
    assert [pos for pos, _ in got] == list(range(start + 1, start + rows))
    for pos, lp in got:
        row = full[pos - start - 1]
        assert lp.token_id == prompt[pos]
        assert lp.logprob == pytest.approx(row[prompt[pos]].item(), abs=1e-5)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
    assert gather_prompt_logprobs(logits[:1], len(prompt) - 1, prompt, 0) == []
