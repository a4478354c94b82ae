"""Tenants are isolated in the prefix cache: `cache_salt` (vLLM's field) and the server option
that salts every request by its API key decide which requests may share KV blocks, so one
tenant's `cached_tokens` never reveals another's prompts. And `n` seeded choices differ from
each other yet come back the same on every run, offline as on the server."""
import httpx
import openai
import pytest

from lifeline import LLM, SamplingParams
from lifeline.engine.engine import EngineConfig
from lifeline.server.config import ServerConfig
from lifeline.server.protocol import MAX_CACHE_SALT_CHARS
from lifeline.server.testing import ServerThread

MODEL = "gemma-3-270m"
SYSTEM = ("You are a careful assistant who answers questions about geography, history and "
          "science. Always answer briefly, in one sentence, and say so when you do not know. ")


def _engine() -> EngineConfig:
    return EngineConfig(kv_cache_memory_bytes=256 << 20)


@pytest.fixture(scope="module")
def server(loaded):
    with ServerThread(loaded, ServerConfig(engine=_engine())) as srv:
        yield srv


def _cached(client: openai.OpenAI, prompt: str, **extra) -> int:
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                    extra_body=extra or None)
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert out.model_extra["timings"]["cached_tokens"] == cached
    return cached


def test_cache_salt_decides_which_requests_share_blocks(client):
    prompt = "Ticket 4471. " + SYSTEM + "Name a river."
    assert _cached(client, prompt, cache_salt="alpha") == 0
    assert _cached(client, prompt, cache_salt="beta") == 0, "another salt reads alpha's blocks"
    assert _cached(client, prompt) == 0, "no salt reads alpha's blocks"
    assert _cached(client, prompt, cache_salt="alpha") >= 32
    assert _cached(client, prompt, cache_salt="beta") >= 32
    assert _cached(client, prompt) >= 32


def test_chat_takes_cache_salt_too(client):
    messages = [{"role": "system", "content": "Ticket 9120. " + SYSTEM},
                {"role": "user", "content": "Name a mountain."}]

    def cached(salt: str) -> int:
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                             temperature=0, extra_body={"cache_salt": salt})
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("one") == 0
    assert cached("two") == 0
    assert cached("one") >= 32


@pytest.mark.parametrize("salt", ["", "x" * (MAX_CACHE_SALT_CHARS + 1), 7, ["a"]])
def test_a_bad_cache_salt_is_an_openai_400(server, salt):
    r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "cache_salt": salt})
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "cache_salt"
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def test_salt_cache_by_api_key_keeps_each_tenant_to_its_own_blocks(loaded):
    config = ServerConfig(engine=_engine(), api_keys=["key-a", "key-b"],
                          salt_cache_by_api_key=True)
    prompt = "Ticket 3318. " + SYSTEM + "Name a lake."
    with ServerThread(loaded, config) as srv:
        a, b = (openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, timeout=120,
                              max_retries=0) for key in ("key-a", "key-b"))
        assert _cached(a, prompt) == 0
        assert _cached(b, prompt) == 0, "tenant b learned that tenant a sent this prompt"
        assert _cached(b, prompt, cache_salt="guess") == 0
        assert _cached(a, prompt) >= 32, "tenant a still hits its own blocks"
        assert _cached(b, prompt) >= 32
        assert _cached(a, prompt, cache_salt="s") == 0, "a salt splits a tenant's cache too"
        assert _cached(a, prompt, cache_salt="s") >= 32


def test_offline_prompts_take_cache_salt_like_vllm(loaded):
    llm = LLM(loaded, kv_cache_memory_bytes=64 << 20)
    prompt = "Ticket 5150. " + SYSTEM + "Name a desert."
    params = SamplingParams(max_tokens=1, temperature=0)
    runs = [{"prompt": prompt, "cache_salt": "x"}, {"prompt": prompt, "cache_salt": "y"},
            {"prompt": prompt, "cache_salt": "x"}, prompt]
    cached = [llm.generate(p, params)[0].num_cached_tokens for p in runs]
    assert cached[0] == cached[1] == cached[3] == 0 and cached[2] >= 32
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt": prompt, "cache_salt": ""}, params)


def test_seeded_n_choices_differ_and_repeat(client):
    def texts() -> list[str]:
        out = client.completions.create(model=MODEL, prompt="Here is a random list of words:",
                                        n=3, seed=7, temperature=1.0, max_tokens=16,
                                        extra_body={"ignore_eos": True})
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = texts()
    assert len(set(first)) == 3, first
    assert texts() == first


def test_seeded_n_chat_choices_differ_and_repeat(client):
    def texts() -> list[str]:
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Write a short poem."}], n=3,
            seed=7, temperature=1.0, max_tokens=16, extra_body={"ignore_eos": True})
        return [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]

    first = texts()
    assert len(set(first)) == 3, first
    assert texts() == first


def test_offline_n_samples_are_the_servers_n_choices(client, loaded):
    prompt = "Here is a random list of colours:"
    out = client.completions.create(model=MODEL, prompt=prompt, n=3, seed=7, temperature=1.0,
                                    max_tokens=8, extra_body={"ignore_eos": True})
    served = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    llm = LLM(loaded, kv_cache_memory_bytes=64 << 20)
    offline = llm.generate(prompt, SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=8,
                                                  ignore_eos=True))
    assert [r.text for r in offline] == served
