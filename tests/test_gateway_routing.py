"""The gateway of `lifeline serve --config FILE`, seen from outside: real servers on loopback
only. Two real `lifeline serve` processes (the default model) stand behind it where the model
matters (answers checked against the backend asked directly, prefix-cache hits, a backend
killed mid-stream and mid-queue); small real HTTP servers (`tests/upstreams.py`) stand where
only the router's choices matter (fallback chains, circuit breakers, health checks, the canary
split over 1,000 requests, balancing decisions, captured llama.cpp and vLLM streams)."""
import concurrent.futures as cf
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lifeline.bench.stages import normalize
from lifeline.gateway.config import ConfigError, load_config, parse_config
from lifeline.gateway.testing import GatewayThread
from lifeline.server.testing import free_port
from tests.upstreams import Stalled, Upstream

MODEL = "gemma-3-270m"
REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "peer_streams"
SERVE = [sys.executable, "-m", "lifeline.cli", "serve", "--no-compile", "--no-huge-pages",
         "--weights", "fp32", "--kv-cache-memory-bytes", "128MiB", "--default-max-tokens", "16"]
"""The backends: fp32 weights load fastest, and the tests ask for a few tokens each."""


class Served:
    """A `lifeline serve` subprocess: `command` and its flags, then `--port`."""

    def __init__(self, name: str, log: Path, *command: str):
        self.name, self.log, self.port = name, log, free_port()
        self.proc = subprocess.Popen([*command, "--port", str(self.port)],
                                     stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def v1(self) -> str:
        return self.root + "/v1"

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.root + "/ready", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(20)


@pytest.fixture(scope="module", autouse=True)
def _spawned(request, tmp_path_factory):
    """Both model servers start loading before the first test, so the tests that need no model
    run while they load (when a selected test needs them at all). A answers several requests
    at once; B one at a time (a second request waits in its queue, which the kill test
    needs)."""
    if not any("engines" in item.fixturenames for item in request.session.items
               if item.module is request.module):
        yield {}
        return
    logs = tmp_path_factory.mktemp("engines")
    servers = {"a": Served("a", logs / "a.log", *SERVE, "--max-num-seqs", "4"),
               "b": Served("b", logs / "b.log", *SERVE, "--max-num-seqs", "1")}
    servers["gateway"] = _serve_config(logs, servers["a"], servers["b"])
    yield servers
    for s in servers.values():
        s.stop()


def _serve_config(where: Path, a: Served, b: Served) -> Served:
    """`lifeline serve --config` in front of A and B, as a user runs it (YAML this time); it
    starts beside them and answers `/ready` once both are up."""
    path = where / "gateway.yaml"
    path.write_text(f"""
server:
  api_keys: [gw-key]
health: {{interval_s: 0.5}}
backends:
  a: {{base_url: "{a.v1}", model: {MODEL}}}
  b: {{base_url: "{b.v1}", model: {MODEL}}}
models:
  gemma:
    aliases: [chat, gpt-4o-mini]
    backends: [a]
  gemma-b:
    backends: [b]
""")
    return Served("gateway", where / "gateway.log", sys.executable, "-m", "lifeline.cli",
                  "serve", "--config", str(path), "--no-huge-pages")


@pytest.fixture(scope="module")
def engines(_spawned):
    for s in _spawned.values():
        s.wait_ready()
    return _spawned


def _gateway(text: str, **preloaded) -> GatewayThread:
    return GatewayThread(parse_config(text, ".toml"), preloaded or None)


def _upstreams(*served: Served) -> str:
    """Backend tables for real `lifeline serve` processes, named as they are."""
    return "".join(f'[backends.{s.name}]\nbase_url = "{s.v1}"\nmodel = "{MODEL}"\n'
                   for s in served)


def _chat(prompt: str = "Name a colour.", **extra) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": 6,
            "temperature": 0, **extra}


def _events(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _metric(text: str, name: str, **labels) -> float:
    """The value of one series in a Prometheus exposition (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def _wait_for(check, timeout: float = 30.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# -- the configuration --------------------------------------------------------------------

BAD_CONFIGS = [
    ('[backends.a]\nbase_url = "http://h/v1"\ntimeout = 3\n[models.m]\nbackends = ["a"]\n',
     ".toml", "backends.a.timeout: unknown key"),
    ('[backends.a]\nbase_url = "http://h/v1"\n[models.m]\nbackends = ["z"]\n', ".toml",
     "models.m.backends[0]: no backend named 'z'"),
    ('[backends.a]\nbase_url = "http://h/v1"\n[models.m]\nbackends = ["a"]\n'
     'max_attempts = "3"\n', ".toml", "models.m.max_attempts: expected an integer"),
    ('[backends.a]\nbase_url = "http://h/v1"\n[models.m]\npools = [{backends = ["a"]}, '
     '{backends = ["a"], weight = -1}]\n', ".toml",
     "models.m.pools[1].weight: must be a positive number"),
    ('[backends.a]\nbase_url = "http://h/v1"\n[models.m]\nbackends = ["a"]\n[models.n]\n'
     'backends = ["a"]\naliases = ["m"]\n', ".toml",
     "models.n.aliases[0]: 'm' is already a name of models.m"),
    ('[backends.a]\nbase_url = "ftp://h"\n[models.m]\nbackends = ["a"]\n', ".toml",
     "backends.a.base_url: expected an http:// or https:// URL"),
    ('[backends.a]\nkind = "upstream"\n[models.m]\nbackends = ["a"]\n', ".toml",
     "backends.a.base_url: required for an upstream backend"),
    ('[backends.a]\nbase_url = "http://h/v1"\n[models.m]\nbackends = ["a"]\n'
     'pools = [{backends = ["a"]}]\n', ".toml", "give either `backends` (one pool) or `pools`"),
    ("backends:\n  l:\n    engine: {kv_cache: 1}\nmodels:\n  m: {backends: [l]}\n", ".yaml",
     "backends.l.engine.kv_cache: unknown key"),
    ("backends:\n  l:\n    engine: {kv_cache_memory_bytes: lots}\nmodels:\n  m: {backends: [l]}\n",
     ".yaml", "backends.l.engine.kv_cache_memory_bytes: 'lots' is not a size"),
    ("backends:\n  a: {base_url: 'http://h/v1'}\nmodels:\n  m: {backends: [a], policy: best}\n",
     ".yml", "models.m.policy: expected one of least_outstanding"),
    ("backends: [a\n", ".yaml", "not valid YAML"),
    ("[server]\nport = 8000\n", ".toml", "backends: required"),
    ('[backends.l]\n[backends.l.server]\nsampling_defaults = { seed = 1 }\n[models.m]\n'
     'backends = ["l"]\n', ".toml", "backends.l.server.sampling_defaults: sampling_defaults: "
     "unknown field 'seed'"),
]


@pytest.mark.parametrize("text,suffix,message", BAD_CONFIGS)
def test_a_bad_config_is_refused_with_the_key_at_fault(text, suffix, message):
    with pytest.raises(ConfigError) as info:
        parse_config(text, suffix, "gw" + suffix)
    assert message in str(info.value)
    assert str(info.value).startswith(f"gw{suffix}: ")


def test_make_serve_answers_chat_with_smollm2_and_lists_both_models(default_model):
    """`make serve` runs configs/serve.toml: both PyPI models, SmolLM2-135M-Instruct the one a
    request that names no model gets, with its model card's sampling; uncompiled here only to
    save the test its compile time."""
    config = load_config(REPO / "configs" / "serve.toml")
    assert config.default_model == "smollm2-135m-instruct"
    for name, spec in config.backends.items():
        # the shared session model stays fp32: an engine converts its weights in place
        weights = "fp32" if name == "gemma" else spec.engine.weights
        object.__setattr__(spec, "engine", dataclasses.replace(
            spec.engine, compile=False, kv_cache_memory_bytes=64 << 20, weights=weights))
    with GatewayThread(config, {"gemma": default_model}) as gw:
        _wait_for(lambda: _ok(gw.base_url + "/ready"), 300, "both models")
        client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="none", max_retries=0)
        assert {"smollm2-135m-instruct", "gemma-3-270m"} <= {m.id for m in client.models.list()}
        answer = client.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=24, seed=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in answer.choices[0].message.content
        # /tokenize and /detokenize go to the model named: two tokenizers, two answers
        said = {}
        for model in ("smollm2", "gemma-3-270m"):
            ids = httpx.post(gw.base_url + "/tokenize", timeout=60, json={
                "model": model, "prompt": "Hello world", "add_special_tokens": False}).json()
            said[model] = ids["tokens"]
            back = httpx.post(gw.base_url + "/detokenize", timeout=60,
                              json={"model": model, "tokens": ids["tokens"]})
            assert back.json()["prompt"] == "Hello world"
        assert said["smollm2"] != said["gemma-3-270m"]
        missing = httpx.post(gw.base_url + "/tokenize", json={"model": "nope", "prompt": "x"})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"
        unnamed = httpx.post(gw.base_url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert unnamed.json()["model"] == "smollm2-135m-instruct"


def test_serve_with_a_bad_config_or_a_stray_flag_exits_2_and_says_why(tmp_path):
    bad = tmp_path / "gw.toml"
    bad.write_text(BAD_CONFIGS[0][0])
    good = tmp_path / "ok.yaml"
    good.write_text("backends:\n  a: {base_url: 'http://127.0.0.1:9/v1'}\n"
                    "models:\n  m: {backends: [a]}\n")
    for args, message in ([["--config", str(bad)], "backends.a.timeout: unknown key"],
                          [["--config", str(good), "--model", "x.gguf"],
                           "--model cannot be combined with --config"]):
        done = subprocess.run([sys.executable, "-m", "lifeline.cli", "serve", "--no-huge-pages",
                               *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr


# -- fallback, circuit breakers, health checks ---------------------------------------------

def test_a_request_falls_back_past_refused_503_and_stalled_backends_and_is_answered_once():
    refused = free_port()  # nothing listens there
    with Upstream("busy") as busy, Upstream("good") as good, Stalled() as stalled:
        busy.mode = "fail"
        config = f"""
            [health]
            interval_s = 60
            [backends.dead]
            base_url = "http://127.0.0.1:{refused}/v1"
            [backends.busy]
            base_url = "{busy.base_url}"
            [backends.stalled]
            base_url = "{stalled.base_url}"
            first_token_timeout_s = 0.5
            read_timeout_s = 0.5
            [backends.good]
            base_url = "{good.base_url}"
            [models.chain]
            backends = ["dead"]
            fallbacks = ["busy", "stalled", "good"]
            max_attempts = 4
            [models.only-busy]
            backends = ["busy"]
            """
        with _gateway(config) as gw:
            client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="x", max_retries=0)
            stream = client.chat.completions.create(model="chain", stream=True, **_chat())
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == "answer from good"
            assert {c.id for c in chunks} == {chunks[0].id}  # one backend's answer, once
            routing = chunks[-1].model_extra["routing"]
            assert [a["outcome"] for a in routing["attempts"]] == [
                "connect", "http_503", "first_token_timeout", "served"]
            assert chunks[-1].model_extra["timings"]["retries"] == 3

            plain = httpx.post(gw.base_url + "/v1/chat/completions",
                               json={"model": "chain", **_chat()}, timeout=30)
            assert plain.status_code == 200
            assert plain.json()["choices"][0]["message"]["content"] == "answer from good"
            assert [a["outcome"] for a in plain.json()["routing"]["attempts"]] == [
                "connect", "http_503", "read_timeout", "served"]

            # A third failure each opens three circuits; the fourth request goes straight on.
            list(client.chat.completions.create(model="chain", stream=True, **_chat()))
            fourth = httpx.post(gw.base_url + "/v1/chat/completions",
                                json={"model": "chain", **_chat()}, timeout=30).json()
            assert [a["backend"] for a in fourth["routing"]["attempts"]] == ["good"]
            notes = {c["backend"]: c["note"] for c in fourth["routing"]["candidates"]}
            assert notes["dead"] == notes["busy"] == notes["stalled"] == "circuit open"
            assert busy.served() == 3 and good.served() == 4

            status = httpx.get(gw.base_url + "/gateway/backends").json()
            assert {n: s["circuit"] for n, s in status.items()} == {
                "dead": "open", "busy": "open", "stalled": "open", "good": "closed"}
            refused_all = httpx.post(gw.base_url + "/v1/chat/completions",
                                     json={"model": "only-busy", **_chat()}, timeout=30)
            assert refused_all.status_code == 503
            assert refused_all.json()["error"]["code"] == "no_backend_available"
            assert int(refused_all.headers["Retry-After"]) >= 1
            assert busy.served() == 3  # an open circuit sends nothing

            metrics = httpx.get(gw.base_url + "/metrics").text
    errors = "lifeline:gateway_backend_errors_total"
    assert _metric(metrics, errors, backend="dead", kind="connect") == 3
    assert _metric(metrics, errors, backend="busy", kind="http_503") == 3
    assert _metric(metrics, errors, backend="stalled", kind="first_token_timeout") == 2
    assert _metric(metrics, errors, backend="stalled", kind="read_timeout") == 1
    assert _metric(metrics, "lifeline:gateway_fallbacks_total", model_name="chain",
                   backend="dead") == 3
    assert _metric(metrics, "lifeline:gateway_circuit_state", backend="busy") == 2
    assert _metric(metrics, "lifeline:gateway_backend_requests_total", backend="good") == 4


def test_a_circuit_half_opens_for_one_probe_and_health_checks_take_a_backend_out():
    with Upstream("flaky") as flaky, Upstream("steady") as steady:
        config = f"""
            [health]
            interval_s = 0.05
            unhealthy_after = 2
            [circuit_breaker]
            failures = 2
            cooldown_s = 1.5
            [backends.flaky]
            base_url = "{flaky.base_url}"
            [backends.steady]
            base_url = "{steady.base_url}"
            [models.m]
            backends = ["flaky"]
            fallbacks = ["steady"]
            """
        with _gateway(config) as gw:
            def ask() -> dict:
                r = httpx.post(gw.base_url + "/v1/completions",
                               json={"model": "m", "prompt": "hi"}, timeout=30)
                assert r.status_code == 200
                return r.json()

            def circuit() -> str:
                return httpx.get(gw.base_url + "/gateway/backends").json()["flaky"]["circuit"]

            flaky.mode, flaky.fail_status = "fail", 500
            for _ in range(2):
                assert ask()["choices"][0]["text"] == "answer from steady"
            assert circuit() == "open"
            assert [a["backend"] for a in ask()["routing"]["attempts"]] == ["steady"]
            assert flaky.served() == 2

            _wait_for(lambda: circuit() == "half_open", what="the half-open circuit")
            probe = ask()  # the probe fails: open again
            assert [a["outcome"] for a in probe["routing"]["attempts"]] == ["http_5xx", "served"]
            assert circuit() == "open"
            assert httpx.get(gw.base_url + "/gateway/backends").json()["flaky"][
                "circuit_opened"] == 2

            _wait_for(lambda: circuit() == "half_open", what="the half-open circuit")
            flaky.mode = "ok"
            assert ask()["choices"][0]["text"] == "answer from flaky"
            assert circuit() == "closed"

            flaky.healthy = False
            _wait_for(lambda: not httpx.get(gw.base_url + "/gateway/backends").json()[
                "flaky"]["healthy"], what="the failed health checks")
            answer = ask()
            assert answer["choices"][0]["text"] == "answer from steady"
            flaky_note = next(c for c in answer["routing"]["candidates"]
                              if c["backend"] == "flaky")["note"]
            assert flaky_note == "unhealthy (/health answered 503)"
            metrics = httpx.get(gw.base_url + "/metrics").text
            assert _metric(metrics, "lifeline:gateway_backend_healthy", backend="flaky") == 0
            flaky.healthy = True
            _wait_for(lambda: ask()["choices"][0]["text"] == "answer from flaky",
                      what="the backend back in rotation")
            checker = gw.state.health
        time.sleep(0.1)  # a check sent just before the stop has arrived
        hits = flaky.health_hits
        time.sleep(0.3)  # six intervals
        assert flaky.health_hits == hits and not checker.running


def test_gateway_keys_stay_at_the_gateway_and_its_rate_limit_applies():
    with Upstream("up") as up:
        config = f"""
            [server]
            api_keys = ["gw-key"]
            rate_limit_rpm = 3
            [backends.up]
            base_url = "{up.base_url}"
            api_key = "upstream-key"
            model = "their-name"
            [models.ours]
            backends = ["up"]
            """
        with _gateway(config) as gw:
            client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="gw-key",
                                   max_retries=0)
            assert client.chat.completions.create(model="ours", **_chat()).model == "their-name"
            sent = up.requests[-1]
            assert sent["headers"]["authorization"] == "Bearer upstream-key"
            assert sent["body"]["model"] == "their-name"
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=gw.base_url + "/v1", api_key="wrong",
                              max_retries=0).models.list()
            with pytest.raises(openai.NotFoundError) as missing:
                client.chat.completions.create(model="theirs", **_chat())
            assert missing.value.body["code"] == "model_not_found"
            client.chat.completions.create(model="ours", **_chat())
            client.chat.completions.create(model="ours", **_chat())
            with pytest.raises(openai.RateLimitError) as limited:
                client.chat.completions.create(model="ours", **_chat())
            assert int(limited.value.response.headers["Retry-After"]) >= 1
            assert up.served() == 3


def test_sigterm_drains_the_gateway_requests_in_flight_finish_new_ones_get_503():
    with Upstream("slow") as slow:
        config = f"""
            [server]
            shutdown_timeout_s = 30
            [backends.slow]
            base_url = "{slow.base_url}"
            [models.m]
            backends = ["slow"]
            """
        gw = _gateway(config).start()
        try:
            slow.hold()
            with cf.ThreadPoolExecutor(1) as pool:
                held = pool.submit(httpx.post, gw.base_url + "/v1/completions",
                                   json={"model": "m", "prompt": "p"}, timeout=30)
                _wait_for(lambda: slow.served() == 1, what="the request in flight")
                gw.sigterm()
                refused = httpx.post(gw.base_url + "/v1/completions",
                                     json={"model": "m", "prompt": "p"}, timeout=30)
                assert refused.status_code == 503 and refused.json()["error"]["code"] == \
                    "draining"
                assert int(refused.headers["Retry-After"]) >= 1
                assert httpx.get(gw.base_url + "/ready").json()["status"] == "draining"
                slow.release()
                assert held.result().status_code == 200
                assert held.result().json()["choices"][0]["text"] == "answer from slow"
            gw.thread.join(20)
            assert not gw.thread.is_alive()  # it stopped by itself once drained
        finally:
            gw.stop()
        assert slow.served() == 1


# -- the traffic split ----------------------------------------------------------------------

def test_each_request_leaves_one_access_log_line(caplog):
    caplog.set_level(logging.INFO, logger="lifeline.access")
    with Upstream("a") as up:
        config = f'[backends.a]\nbase_url = "{up.base_url}"\n[models.m]\nbackends = ["a"]\n'
        with _gateway(config) as gw:
            for stream in (False, True):
                r = httpx.post(gw.base_url + "/v1/chat/completions", timeout=30, json={
                    "model": "m", "stream": stream, **_chat()})
                assert r.status_code == 200
            assert httpx.post(gw.base_url + "/v1/completions", json={"model": "z"}).status_code \
                == 404
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "lifeline.access"]
    assert [(line["endpoint"], line["status"], "routing" in line) for line in lines] == [
        ("/v1/chat/completions", 200, True), ("/v1/chat/completions", 200, True),
        ("/v1/completions", 404, False)]


def test_hostile_bodies_at_the_gateway_get_openai_errors(tmp_path):
    """Every body the gateway parses itself (generation and /tokenize, /detokenize) is refused
    before any backend sees it when it is not an object, names a model of the wrong type, or is
    larger than the body limit; the backend is never asked."""
    with Upstream("a") as up:
        config = f'[backends.a]\nbase_url = "{up.base_url}"\n[models.m]\nbackends = ["a"]\n'
        with _gateway(config) as gw:
            cases = [(b"[1, 2]", 400, None), (b'"x"', 400, None),
                     (b'{"model": 123, "prompt": "x"}', 400, "model"),
                     (b'{"model": ["m"], "prompt": "x"}', 400, "model"),
                     (b'{"model": "m", "prompt": "' + b"a" * (9 << 20) + b'"}', 413, None)]
            for path in ("/v1/completions", "/tokenize", "/detokenize"):
                for body, status, param in cases:
                    r = httpx.post(gw.base_url + path, content=body, timeout=30,
                                   headers={"content-type": "application/json"})
                    assert r.status_code == status, (path, body[:40], r.text)
                    error = r.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"}
                    assert error["param"] == param
            assert up.requests == []
            assert httpx.get(gw.base_url + "/health").status_code == 200


def test_a_canary_split_holds_its_weights_over_1000_requests_and_sessions_stick():
    with Upstream("stable") as stable, Upstream("canary") as canary:
        config = f"""
            [backends.stable]
            base_url = "{stable.base_url}"
            [backends.canary]
            base_url = "{canary.base_url}"
            [models.m]
            pools = [{{name = "stable", backends = ["stable"], weight = 90}},
                     {{name = "canary", backends = ["canary"], weight = 10}}]
            [models.sticky]
            pools = [{{name = "stable", backends = ["stable"], weight = 90}},
                     {{name = "canary", backends = ["canary"], weight = 10}}]
            sticky = ["x-session-id", "user"]
            """
        with _gateway(config) as gw, httpx.Client(base_url=gw.base_url, timeout=30) as http, \
                cf.ThreadPoolExecutor(8) as pool:
            def ask(model: str, headers: dict | None = None, **body) -> str:
                r = http.post("/v1/completions", json={"model": model, "prompt": "p", **body},
                              headers=headers or {})
                assert r.status_code == 200
                return r.json()["routing"]["pool"]

            pools = list(pool.map(lambda _: ask("m"), range(1000)))
            assert abs(canary.served("m") / 1000 - 0.10) <= 0.03
            assert abs(stable.served("m") / 1000 - 0.90) <= 0.03
            assert pools.count("canary") == canary.served("m")

            users = list(pool.map(lambda i: ask("sticky", user=f"user-{i}"), range(1000)))
            assert abs(users.count("canary") / 1000 - 0.10) <= 0.03
            assert canary.served("sticky") == users.count("canary")
            for i in range(20):
                session = {"x-session-id": f"session-{i}"}
                seen = {ask("sticky", session, user=f"other-{j}") for j in range(5)}
                assert len(seen) == 1  # the header comes first and holds
            metrics = http.get("/metrics").text
    split = "lifeline:gateway_route_split_total"
    assert _metric(metrics, split, model_name="m", pool="canary") == pools.count("canary")
    assert _metric(metrics, split, model_name="m", pool="stable") == pools.count("stable")


# -- balancing and its decision record ---------------------------------------------------

def test_balancing_policies_choose_by_load_and_prefix_and_say_why(caplog):
    with Upstream("r1") as r1, Upstream("r2") as r2, Upstream("r3") as r3:
        replicas = '["r1", "r2", "r3"]'
        config = "\n".join(f'[backends.{u.name}]\nbase_url = "{u.base_url}"'
                           for u in (r1, r2, r3)) + f"""
            [models.least]
            backends = {replicas}
            [models.two]
            backends = {replicas}
            policy = "power_of_two"
            [models.prefix]
            backends = {replicas}
            policy = "prefix_affinity"
            """ + "".join(f'[models.only-{u.name}]\nbackends = ["{u.name}"]\n'
                          for u in (r1, r2, r3))
        with _gateway(config) as gw, cf.ThreadPoolExecutor(2) as pool, \
                caplog.at_level(logging.INFO, logger="lifeline.access"):
            def ask(model: str, prompt: str = "p") -> dict:
                r = httpx.post(gw.base_url + "/v1/completions",
                               json={"model": model, "prompt": prompt}, timeout=30)
                assert r.status_code == 200
                return r.json()

            def outstanding(name: str) -> int:
                return httpx.get(gw.base_url + "/gateway/backends").json()[name]["outstanding"]

            first = ask("least")["routing"]
            busy = next(u for u in (r1, r2, r3) if u.name == first["chosen"])
            busy.hold()
            held = pool.submit(ask, f"only-{busy.name}")
            _wait_for(lambda: outstanding(busy.name) == 1, what="the held request")
            routing = ask("least")["routing"]
            scores = {c["backend"]: c["score"] for c in routing["candidates"]}
            assert scores[busy.name] == 1 and routing["chosen"] != busy.name
            assert scores[routing["chosen"]] == 0
            assert routing["reason"].startswith("fewest requests in flight (0)")
            busy.release()
            assert held.result()["routing"]["chosen"] == busy.name

            two = ask("two")["routing"]
            drawn = [c for c in two["candidates"] if c["note"] == "drawn"]
            assert len(drawn) == 2 and two["chosen"] in {c["backend"] for c in drawn}
            assert two["reason"].startswith("less loaded of two drawn")

            prompt = "You are a helpful assistant for the harbour master. " * 8
            homes = [ask("prefix", prompt + f"question {i}")["routing"] for i in range(5)]
            owner = homes[0]["chosen"]
            assert {h["chosen"] for h in homes} == {owner}
            assert {h["prefix_hash"] for h in homes} == {homes[0]["prefix_hash"]}
            assert homes[0]["reason"].startswith("owns the prompt's prefix on the ring")
            owner_server = next(u for u in (r1, r2, r3) if u.name == owner)
            owner_server.hold()
            held = pool.submit(ask, "prefix", prompt + "held")
            _wait_for(lambda: outstanding(owner) == 1, what="the held request")
            spilled = ask("prefix", prompt + "spilled")
            routing = spilled["routing"]
            assert routing["load_bound"] == 1 and routing["chosen"] != owner
            assert f"the prefix's owner {owner} holds 1 (bound 1)" in routing["reason"]
            ring = [c["backend"] for c in sorted(
                (c for c in routing["candidates"] if c["score"] is not None),
                key=lambda c: c["score"])]
            assert ring[0] == owner and ring[1] == routing["chosen"]
            owner_server.release()
            held.result()

            recent = httpx.get(gw.base_url + "/gateway/decisions?limit=3").json()["data"]
            metrics = httpx.get(gw.base_url + "/metrics").text
    assert routing["reason"] in [d["reason"] for d in recent]
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == "lifeline.access"]
    line = next(entry for entry in logged
                if entry.get("routing", {}).get("reason") == routing["reason"])
    assert line["backend"] == routing["chosen"] and line["timings"]["backend"]["name"] == \
        routing["chosen"]
    assert _metric(metrics, "lifeline:gateway_routing_decisions_total", model_name="prefix",
                   policy="prefix_affinity", reason="spilled") == 1
    assert _metric(metrics, "lifeline:gateway_routing_decisions_total", model_name="prefix",
                   policy="prefix_affinity", reason="prefix_owner") == 6


# -- streams of other servers ------------------------------------------------------------

def _capture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_captured_llama_cpp_and_vllm_streams_pass_through_with_their_timings_nested():
    with Upstream("peer") as peer:
        config = f"""
            [backends.peer]
            base_url = "{peer.base_url}"
            [models.m]
            backends = ["peer"]
            """
        with _gateway(config) as gw:
            for capture, source in (("llamacpp_chat.json", "gateway/llama.cpp"),
                                    ("vllm_chat.json", "gateway")):
                doc = peer.replay = _capture(capture)
                r = httpx.post(gw.base_url + "/v1/chat/completions",
                               json={**doc["request"]["body"], "model": "m"}, timeout=30)
                sent = "".join(line for _, line in doc["lines"])
                got = r.text
                assert got.endswith("data: [DONE]\n\n")
                captured_events = [e for e in sent.split("\n\n") if e.startswith("data: {")]
                relayed_events = [e for e in got.split("\n\n") if e.startswith("data: {")]
                assert relayed_events[:-1] == captured_events[:-1]  # byte for byte
                last, theirs = json.loads(relayed_events[-1][6:]), json.loads(
                    captured_events[-1][6:])
                assert {k: v for k, v in last.items() if k not in ("timings", "routing")} == {
                    k: v for k, v in theirs.items() if k != "timings"}
                stages = normalize(last)
                assert stages["source"] == source
                if "timings" in theirs:
                    assert last["timings"]["backend"]["timings"] == theirs["timings"]
                    assert stages["prefill_ms"] == theirs["timings"]["prompt_ms"]
                    assert stages["cached_tokens"] == theirs["timings"]["cache_n"]
                assert last["routing"]["outcome"]["prompt_tokens"] == theirs["usage"][
                    "prompt_tokens"]
            doc = peer.replay = _capture("llamacpp_error_prompt_too_long.json")
            r = httpx.post(gw.base_url + "/v1/completions",
                           json={"model": "m", "prompt": [1, 2]}, timeout=30)
            assert r.status_code == 400 and r.text == doc["lines"][0][1]  # passed on, once
            assert peer.served() == 3


@pytest.mark.skipif(not shutil.which(os.environ.get("LLAMA_SERVER", "llama-server")),
                    reason="no llama-server binary (set LLAMA_SERVER to its path)")
def test_a_real_llama_server_behind_the_gateway(tmp_path):
    from lifeline.model.default import default_model_path

    port = free_port()
    proc = subprocess.Popen([shutil.which(os.environ.get("LLAMA_SERVER", "llama-server")),
                             "-m", str(default_model_path()), "-t", "2", "-c", "2048",
                             "--port", str(port)], stdout=(tmp_path / "llama.log").open("w"),
                            stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: _ok(f"http://127.0.0.1:{port}/health"), 120, "llama-server")
        config = f'[backends.llama]\nbase_url = "http://127.0.0.1:{port}/v1"\n' \
                 '[models.m]\nbackends = ["llama"]\n'
        with _gateway(config) as gw:
            r = httpx.post(gw.base_url + "/v1/chat/completions",
                           json={"model": "m", "stream": True, **_chat()}, timeout=60)
            last = _events(r.text)[-1]
            assert normalize(last)["source"] == "gateway/llama.cpp"
            assert "prompt_ms" in last["timings"]["backend"]["timings"]
            for _ in range(6):  # on kept-alive connections, which llama-server drops unsaid
                plain = httpx.post(gw.base_url + "/v1/chat/completions",
                                   json={"model": "m", **_chat()}, timeout=60)
                assert plain.status_code == 200
                assert [a["outcome"] for a in plain.json()["routing"]["attempts"]] == ["served"]
    finally:
        proc.kill()
        proc.wait(10)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


# -- real engines behind the gateway -----------------------------------------------------

def test_serve_config_serves_its_models_and_aliases_to_the_openai_client(engines):
    a, gateway = engines["a"], engines["gateway"]
    proc, log, base = gateway.proc, gateway.log, gateway.root
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="gw-key", max_retries=0)
        direct = openai.OpenAI(base_url=a.v1, api_key="none", max_retries=0)
        assert {m.id for m in client.models.list().data} == {
            "gemma", "chat", "gpt-4o-mini", "gemma-b"}
        assert client.models.retrieve("chat").model_extra["parent"] == "gemma"

        reference = direct.chat.completions.create(model=MODEL, **_chat())
        answer = client.chat.completions.create(model="chat", **_chat())
        assert answer.choices[0].message.content == reference.choices[0].message.content
        routing, timings = answer.model_extra["routing"], answer.model_extra["timings"]
        assert (routing["model"], routing["requested"], routing["chosen"]) == (
            "gemma", "chat", "a")
        assert timings["backend"]["name"] == "a"
        assert {"queue_ms", "prefill_ms", "decode_ms"} <= set(timings["backend"]["timings"])
        assert routing["outcome"]["backend_timings_source"] == "lifeline"
        assert routing["outcome"]["backend_ttft_ms"] == timings["backend"]["timings"]["ttft_ms"]
        assert answer.usage.prompt_tokens == reference.usage.prompt_tokens
        keyed = {"authorization": "Bearer gw-key"}
        chat_ids = httpx.post(base + "/tokenize", headers=keyed, timeout=60, json={
            "model": "chat", "messages": _chat()["messages"]}).json()
        assert chat_ids == httpx.post(a.root + "/tokenize", timeout=60, json={
            "model": MODEL, "messages": _chat()["messages"]}).json()
        assert chat_ids["count"] == reference.usage.prompt_tokens

        chunks = list(client.chat.completions.create(model="gemma-b", stream=True, **_chat()))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == reference.choices[0].message.content  # the same model, greedy
        last = chunks[-1].model_extra
        assert last["routing"]["chosen"] == "b" and last["timings"]["ttft_ms"] > 0
        assert normalize(last)["source"] == "gateway/lifeline"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0  # drained and stopped
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    lines = [json.loads(line) for line in log.read_text().splitlines()
             if line.startswith("{") and '"routing"' in line]
    streamed = next(entry for entry in lines if entry["stream"])
    assert streamed["backend"] == "b" and streamed["model"] == "gemma-b"
    assert streamed["routing"]["outcome"] == last["routing"]["outcome"]
    assert streamed["timings"]["backend"] == last["timings"]["backend"]


def test_a_local_engine_and_an_upstream_share_one_route(engines, default_model):
    """The local engine is today's single-model server in the gateway's process (its handlers,
    its engine client); both answer the same request as the upstream asked directly does."""
    a = engines["a"]
    config = f"""
        [backends.local]
        [backends.local.engine]
        weights = "fp32"
        compile = false
        kv_cache_memory_bytes = "128MiB"
        [backends.a]
        base_url = "{a.v1}"
        model = "{MODEL}"
        [models.gemma]
        pools = [{{name = "here", backends = ["local"]}}, {{name = "there", backends = ["a"]}}]
        [models.gemma-here]
        backends = ["local"]
        """
    reference = httpx.post(a.v1 + "/chat/completions", json={"model": MODEL, **_chat()},
                           timeout=120).json()["choices"][0]["message"]["content"]
    with _gateway(config, local=default_model) as gw:
        _wait_for(lambda: _ok(gw.base_url + "/ready"), 120, "the local engine")
        client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key="x", max_retries=0)
        answers = [client.chat.completions.create(model="gemma", **_chat()) for _ in range(2)]
        assert [r.model_extra["routing"]["pool"] for r in answers] == ["here", "there"]
        assert [r.choices[0].message.content for r in answers] == [reference, reference]
        assert {r.model for r in answers} == {MODEL}
        local = answers[0].model_extra["timings"]["backend"]
        assert local["name"] == "local" and local["timings"]["prompt_tokens"] > 0
        chunks = list(client.chat.completions.create(model="gemma", stream=True,
                                                     **_chat("Name a fruit.")))
        assert chunks[-1].model_extra["routing"]["chosen"] == "local"
        engine = gw.state.backends["local"].state.client
        with httpx.stream("POST", gw.base_url + "/v1/completions", json={
                "model": "gemma-here", "prompt": "Once upon a time", "max_tokens": 200,
                "ignore_eos": True, "stream": True}, timeout=120) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    break  # the client leaves mid-stream
        _wait_for(lambda: engine.stats().num_running == 0 and engine.stats().kv_usage == 0,
                  60, "the local engine to abort the request and free its blocks")
        assert gw.state.backends["local"].outstanding == 0
        metrics = httpx.get(gw.base_url + "/metrics").text
    assert _metric(metrics, "lifeline:time_to_first_token_seconds_count",
                   model_name=MODEL) == 3  # the local engine's own series, beside ours
    assert _metric(metrics, "lifeline:gateway_backend_requests_total", backend="local") == 3
    assert _metric(metrics, "lifeline:gateway_requests_total", model_name="gemma-here",
                   status="499") == 1


def test_prefix_affinity_keeps_a_shared_prefix_where_it_is_cached(engines):
    a, b = engines["a"], engines["b"]
    results = {}
    for policy in ("round_robin", "prefix_affinity"):
        config = _upstreams(a, b) + f'[models.m]\nbackends = ["a", "b"]\npolicy = "{policy}"\n'
        system = f"Conversation {uuid.uuid4()}. " + "You answer questions about ships. " * 12
        with _gateway(config) as gw:
            results[policy] = [httpx.post(gw.base_url + "/v1/chat/completions", json={
                "model": "m", "max_tokens": 2, "temperature": 0, "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Question {i}?"}]},
                timeout=120).json()["routing"] for i in range(3)]
    spread, kept = results["round_robin"], results["prefix_affinity"]
    assert len({r["chosen"] for r in spread}) == 2
    assert [r["outcome"]["cached_tokens"] > 0 for r in spread] == [False, False, True]
    assert len({r["chosen"] for r in kept}) == 1
    assert [r["outcome"]["cached_tokens"] > 0 for r in kept] == [False, True, True]
    assert kept[1]["outcome"]["cached_tokens"] >= 64  # the shared system prompt's blocks


def test_a_backend_killed_mid_stream_and_mid_queue(engines):
    """B serves one request at a time: one streams, three wait in its queue. Killing B ends the
    stream with an error event (its answer had begun) and moves the three waiting ones to A
    (nothing of theirs had reached a client): every request answered, none twice."""
    a, b = engines["a"], engines["b"]
    config = "[health]\ninterval_s = 0.2\n[circuit_breaker]\ncooldown_s = 600\n" + \
        _upstreams(a, b) + '[models.m]\nbackends = ["b"]\nfallbacks = ["a"]\n'
    prompt = {"prompt": "The history of the harbour", "temperature": 0}
    reference = httpx.post(a.v1 + "/completions", json={"model": MODEL, "max_tokens": 8,
                                                        **prompt}, timeout=120).json()
    with _gateway(config) as gw, cf.ThreadPoolExecutor(4) as pool:
        got_tokens = threading.Event()

        def long_stream() -> list:
            body = {"model": "m", "max_tokens": 400, "ignore_eos": True, "stream": True,
                    **prompt}
            events = []
            with httpx.stream("POST", gw.base_url + "/v1/completions", json=body,
                              timeout=120) as r:
                for line in r.iter_lines():
                    events.append(line)
                    if len(_events("\n".join(events))) >= 3:
                        got_tokens.set()
            return events

        def queued(stream: bool) -> httpx.Response:
            return httpx.post(gw.base_url + "/v1/completions", json={
                "model": "m", "max_tokens": 8, "stream": stream, **prompt}, timeout=120)

        running = pool.submit(long_stream)
        assert got_tokens.wait(120)
        waiting = [pool.submit(queued, s) for s in (True, True, False)]
        _wait_for(lambda: _metric(httpx.get(b.root + "/metrics").text,
                                  "lifeline:num_requests_waiting", model_name=MODEL) == 3,
                  60, "three requests in B's queue")
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait(20)

        cut = _events("\n".join(running.result()))
        assert "data: [DONE]" not in running.result()
        assert cut[-1]["error"]["code"] == "backend_failed_mid_stream"
        assert len({e["id"] for e in cut[:-1]}) == 1 and len(cut) > 3
        for future in waiting:
            r = future.result()
            assert r.status_code == 200
            if r.headers["content-type"].startswith("text/event-stream"):
                events = _events(r.text)
                assert r.text.endswith("data: [DONE]\n\n")
                assert len({e["id"] for e in events}) == 1  # one backend's answer
                assert [c["finish_reason"] for e in events for c in e["choices"]
                        if c["finish_reason"]] == ["length"]
                text = "".join(c["text"] for e in events for c in e["choices"])
                routing = events[-1]["routing"]
            else:
                text, routing = r.json()["choices"][0]["text"], r.json()["routing"]
            assert text == reference["choices"][0]["text"]
            assert [(x["backend"], x["outcome"]) for x in routing["attempts"]] == [
                ("b", "disconnected"), ("a", "served")]

        status = httpx.get(gw.base_url + "/gateway/backends").json()["b"]
        assert status["circuit"] == "open" and status["consecutive_failures"] == 4
        _wait_for(lambda: not httpx.get(gw.base_url + "/gateway/backends").json()["b"][
            "healthy"], 30, "the health checks to see B gone")
        after = httpx.post(gw.base_url + "/v1/completions",
                           json={"model": "m", "max_tokens": 2, **prompt}, timeout=120).json()
        assert [x["backend"] for x in after["routing"]["attempts"]] == ["a"]
        metrics = httpx.get(gw.base_url + "/metrics").text
    assert _metric(metrics, "lifeline:gateway_backend_errors_total", backend="b",
                   kind="disconnected") == 4
    assert _metric(metrics, "lifeline:gateway_fallbacks_total", model_name="m",
                   backend="b") == 3
    assert _metric(metrics, "lifeline:gateway_requests_total", model_name="m",
                   status="502") == 1
