"""Tenants are isolated in the prefix cache: `cache_salt` (vLLM's field) and the server option
that salts every request by its API key decide which requests may share KV blocks, so one
tenant's `cached_tokens` never reveals another's prompts; behind the gateway too, whose
backends (an upstream `lifeline serve`, an engine in its process; a Ray replica in
tests/test_scale_out_ray.py) see a keyed digest of the caller, never its key, and whose
records show each tenant only its own requests. And `n` seeded choices differ from each other
yet come back the same on every run, offline as on the server."""
import json
import sys
import time

import httpx
import openai
import pytest

from lifeline import LLM, SamplingParams
from lifeline.cli import main
from lifeline.engine.engine import EngineConfig
from lifeline.gateway.config import ConfigError, load_config, parse_config
from lifeline.gateway.testing import GatewayThread
from lifeline.server.config import ServerConfig
from lifeline.server.protocol import MAX_CACHE_SALT_CHARS
from lifeline.server.testing import ServerThread
from tests.tenants import ADMIN, KEYS, TENANT_OPTIONS, check_tenants_and_options, tiny_vlm
from tests.test_gateway_routing import SERVE, Served
from tests.upstreams import Upstream

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


# -- behind the gateway --------------------------------------------------------------------

def _via_gateway(client: openai.OpenAI, model: str, prompt: str, **extra) -> int:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                    extra_body=extra or None)
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert out.model_extra["routing"]["outcome"]["cached_tokens"] == cached
    return cached


def test_tenants_stay_apart_behind_the_gateway_in_front_of_lifeline_serve(loaded, tmp_path):
    """Two tenants (two API keys) through the gateway: to a real `lifeline serve` upstream,
    and to an engine in the gateway's process. Tenant b sending tenant a's prompt hits nothing;
    each tenant's repeat hits its own blocks. Each sees only its own routing decisions, and
    neither the debug views."""
    upstream = Served("upstream", tmp_path / "upstream.log", *SERVE)
    try:
        upstream.wait_ready()
        config = parse_config(f"""
[server]
api_keys = ["key-a", "key-b"]
admin_key = "boss"
salt_cache_by_api_key = true
[backends.up]
base_url = "{upstream.v1}"
model = "{MODEL}"
honours_cache_salt = true
[backends.here]
[backends.here.engine]
weights = "fp32"
compile = false
kv_cache_memory_bytes = "128MiB"
[models.up]
backends = ["up"]
[models.here]
backends = ["here"]
""", ".toml")
        with GatewayThread(config, {"here": loaded}) as gw:
            _ready(gw.base_url)
            a, b = (openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, timeout=120,
                                  max_retries=0) for key in ("key-a", "key-b"))
            for model, ticket in (("up", 7001), ("here", 7002)):
                prompt = f"Ticket {ticket}. " + SYSTEM + "Name a city."
                assert _via_gateway(a, model, prompt) == 0
                assert _via_gateway(b, model, prompt) == 0, f"{model}: b learned a's prompt"
                assert _via_gateway(b, model, prompt, cache_salt="guess") == 0
                assert _via_gateway(a, model, prompt) >= 32, f"{model}: a's own blocks"
                assert _via_gateway(b, model, prompt) >= 32, f"{model}: b's own blocks"

            def decisions(key: str) -> list:
                return httpx.get(gw.base_url + "/gateway/decisions?limit=256", timeout=30,
                                 headers={"authorization": f"Bearer {key}"}).json()["data"]

            assert [d["model"] for d in decisions("key-a")] == ["up", "up", "here", "here"]
            assert [d["model"] for d in decisions("key-b")] == ["up"] * 3 + ["here"] * 3
            assert len(decisions("boss")) == 10
            for key, status in (("key-b", 403), ("boss", 200)):
                r = httpx.get(gw.base_url + "/debug/requests", timeout=30,
                              headers={"authorization": f"Bearer {key}"})
                assert r.status_code == status
    finally:
        upstream.stop()


def _ready(base: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(base + "/ready", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the gateway's backends did not become ready"
        time.sleep(0.2)


def test_the_gateway_sends_a_keyed_digest_never_a_key_and_its_hashes_differ_by_process(
        tmp_path, capsys):
    """What leaves the gateway for a tenant is a digest keyed per process: the upstream sees
    neither key, one salt per tenant (and per salt of its own); the routing record's session
    and prefix hashes repeat within a gateway and differ in another gateway process. Where the
    gateway cannot keep tenants apart, it does not start."""
    text = """
[server]
api_keys = ["key-a", "key-b"]
salt_cache_by_api_key = true
[health]
interval_s = 0.5
[backends.u]
base_url = "{url}"
honours_cache_salt = true
[models.m]
backends = ["u"]
policy = "prefix_affinity"
sticky = "user"
"""
    with Upstream("u") as up:
        path = tmp_path / "gw.toml"
        path.write_text(text.format(url=up.base_url))
        other = Served("gateway", tmp_path / "gw.log", sys.executable, "-m", "lifeline.cli",
                       "serve", "--config", str(path), "--no-huge-pages")
        try:
            with GatewayThread(load_config(path)) as gw:
                _ready(gw.base_url, 60)
                other.wait_ready(180)

                def ask(base: str, key: str, **extra) -> tuple[dict, str]:
                    r = httpx.post(base + "/v1/chat/completions", timeout=60, headers={
                        "authorization": f"Bearer {key}"}, json={
                        "model": "m", "user": "alice@example.com", "max_tokens": 2,
                        "messages": [{"role": "user", "content": "Where is my parcel?"}],
                        **extra})
                    assert r.status_code == 200, r.text
                    return r.json()["routing"], up.requests[-1]["body"]["cache_salt"]

                here = [ask(gw.base_url, "key-a"), ask(gw.base_url, "key-a"),
                        ask(gw.base_url, "key-b"), ask(gw.base_url, "key-a", cache_salt="s")]
                there = ask(other.root, "key-a")
                bad = httpx.post(gw.base_url + "/v1/completions", timeout=60, json={
                    "model": "m", "prompt": "x", "cache_salt": ""},
                    headers={"authorization": "Bearer key-a"})
        finally:
            other.stop()
    salts = [salt for _, salt in here]
    assert salts[0] == salts[1] and len(set(salts)) == 3 and there[1] != salts[0]
    assert all(s.startswith("tenant:") and len(s) <= 72 for s in [*salts, there[1]])
    for request in up.requests:
        assert "key-a" not in json.dumps(request) and "key-b" not in json.dumps(request)
    hashes = [(r["split"]["sticky"]["hash"], r["prefix_hash"]) for r, _ in [*here, there]]
    assert len(set(hashes[:4])) == 1, "the same user and prompt: the same hashes"
    assert hashes[4][0] != hashes[0][0] and hashes[4][1] != hashes[0][1], \
        "another gateway process keys its hashes with another secret"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"

    refusals = {
        text.replace("honours_cache_salt = true\n", ""): "backend 'u' is an upstream server",
        text.replace('api_keys = ["key-a", "key-b"]\n', ""): "needs API keys",
    }
    for config, message in refusals.items():
        bad_path = tmp_path / "refused.toml"
        bad_path.write_text(config.format(url="http://127.0.0.1:9/v1"))
        with pytest.raises(ConfigError, match=message):
            GatewayThread(load_config(bad_path))
        assert main(["serve", "--config", str(bad_path), "--no-huge-pages"]) == 2
        assert "server.salt_cache_by_api_key: " + message in capsys.readouterr().err


def test_a_local_backend_behind_the_gateway_keeps_tenants_apart_and_takes_its_options(
        tmp_path):
    """A vision model's engine in the gateway's process, the server options in its `server`
    table: tenants share neither prefix-cache blocks nor image embeddings, and every option
    given (image limits, media domains, default max_tokens; the gateway's key limit) holds.
    tests/test_scale_out_ray.py holds a Ray replica given the same as flags to the same."""
    path = tiny_vlm(tmp_path / "vlm")
    o = TENANT_OPTIONS
    config = parse_config(f"""
[server]
api_keys = {json.dumps(list(KEYS.values()))}
admin_key = "{ADMIN}"
salt_cache_by_api_key = true
rate_limit_rpm = {o["rate_limit_rpm"]}
[backends.vlm]
model = "{path}"
served_model_name = "vlm"
[backends.vlm.engine]
weights = "fp32"
compile = false
kv_cache_memory_bytes = "16MiB"
[backends.vlm.server]
chat_template = "{path / "template.jinja"}"
max_images = {o["max_images"]}
max_image_pixels = {o["max_image_pixels"]}
allowed_media_domains = {json.dumps(o["allowed_media_domains"])}
default_max_tokens = {o["default_max_tokens"]}
[models.vlm]
backends = ["vlm"]
""", ".toml")
    with GatewayThread(config) as gw:
        _ready(gw.base_url, 300)
        check_tenants_and_options(gw.base_url, "vlm", path)
