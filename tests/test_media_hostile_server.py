"""Hostile image hosts against a real vision server on loopback (issue 27, property 1): while
image URLs are read from hosts that trickle their headers a byte at a time, send `100 Continue`
forever or trickle a TLS handshake, `/health` answers as fast as it does when the server is
idle (measured from another process, against an idle control in the same test), a text
request is answered while the fetches still wait, and each image request ends at its fetch
deadline with an OpenAI-format 400. `/tokenize` and `/detokenize` are charged by the rate
limiter like completions. The model is a tiny random Idefics3 (tests.tenants.tiny_vlm); the
hosts are scripted sockets (tests.test_media_fetch.Hostile)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from lifeline.engine.engine import EngineConfig
from lifeline.model.loader import load_model
from lifeline.server.config import ServerConfig
from lifeline.server.testing import ServerThread
from tests.tenants import WORD_LIST, tiny_vlm
from tests.test_media_fetch import (
    Hostile,
    endless_continue,
    trickled_head,
    trickled_tls_handshake,
)

FETCH_TIMEOUT_S = 2.0
POLLER = r"""
import http.client, json, select, sys, time
conn = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=60)
latencies = []
print("ready", flush=True)
sys.stdin.readline()
while True:
    start = time.perf_counter()
    conn.request("GET", "/health")
    r = conn.getresponse()
    r.read()
    assert r.status == 200, r.status
    latencies.append(time.perf_counter() - start)
    if select.select([sys.stdin], [], [], 0.01)[0]:
        break
print(json.dumps(latencies), flush=True)
"""


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return tiny_vlm(tmp_path_factory.mktemp("vlm"))


def _server(path, **options) -> ServerThread:
    config = ServerConfig(served_model_name="vlm", chat_template=path / "template.jinja",
                          engine=EngineConfig(kv_cache_memory_bytes=16 << 20, block_size=4),
                          **options)
    return ServerThread(load_model(path), config)


class Poller:
    """`GET /health` every 10 ms from another process (so that the probe does not share the
    server's GIL), from `start()` to `stop()`: each one's latency in milliseconds."""

    def __init__(self, port: int):
        self.proc = subprocess.Popen([sys.executable, "-c", POLLER, "127.0.0.1", str(port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def start(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stop(self) -> list[float]:
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        latencies = json.loads(self.proc.stdout.readline())
        self.proc.wait(30)
        return sorted(x * 1e3 for x in latencies)


def _idle_latencies(port: int, seconds: float) -> list[float]:
    poller = Poller(port)
    poller.start()
    threading.Event().wait(seconds)
    return poller.stop()


def _p(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _image_chat(url: str) -> dict:
    return {"model": "vlm", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": WORD_LIST[5]}, {"type": "image_url", "image_url": {"url": url}}]}]}


@pytest.mark.alone
def test_health_stays_fast_while_hostile_image_hosts_are_read(vlm_path):
    hosts = [(Hostile(trickled_head), "http"), (Hostile(endless_continue), "http"),
             (Hostile(trickled_tls_handshake), "https")]
    srv = _server(vlm_path, allowed_media_domains=["127.0.0.1"],
                  media_fetch_timeout_s=FETCH_TIMEOUT_S)
    try:
        with srv, httpx.Client(base_url=srv.base_url, timeout=60) as http:
            chat = srv.state.chat
            chat.fetch_policy = dataclasses.replace(chat.fetch_policy,
                                                    allow_private_addresses=True)
            text = {"model": "vlm", "max_tokens": 2, "messages": [
                {"role": "user", "content": WORD_LIST[7]}]}
            assert http.post("/v1/chat/completions", json=text).status_code == 200  # warm
            _idle_latencies(srv.config.port, 1.0)  # warm: imports and caches
            idle = _idle_latencies(srv.config.port, 3.0)
            answers: dict[str, httpx.Response] = {}

            def ask(host: Hostile, scheme: str) -> None:
                with httpx.Client(base_url=srv.base_url, timeout=60) as own:
                    answers[scheme + str(host.port)] = own.post(
                        "/v1/chat/completions", json=_image_chat(host.url(scheme)))

            senders = [threading.Thread(target=ask, args=h) for h in hosts]
            poller = Poller(srv.config.port)
            poller.start()
            for t in senders:
                t.start()
            end = time.monotonic() + 30  # a loop held by a fetch takes the others late
            while sum(host.open for host, _ in hosts) < len(hosts) and time.monotonic() < end:
                threading.Event().wait(0.02)
            served = http.post("/v1/chat/completions", json=text)
            still_read = sum(host.open for host, _ in hosts)
            for t in senders:
                t.join(60)
            loaded = poller.stop()
    finally:
        for host, _ in hosts:
            host.close()
    assert served.status_code == 200 and still_read == len(hosts), (served.text, still_read)
    assert len(answers) == len(hosts)
    for r in answers.values():
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "image_fetch_failed" and "timed out" in error["message"]
        assert error["param"].endswith("image_url.url")
    for host, _ in hosts:
        assert host.wait_for(1) == ["client left"]
    report = (f"idle p50 {_p(idle, .5):.1f} p99 {_p(idle, .99):.1f} max {idle[-1]:.1f} ms; "
              f"loaded p50 {_p(loaded, .5):.1f} p99 {_p(loaded, .99):.1f} max "
              f"{loaded[-1]:.1f} ms over {len(loaded)} probes")
    print(report)
    assert len(loaded) >= 50, report
    assert _p(loaded, .5) <= _p(idle, .5) + 5, report
    assert _p(loaded, .99) <= _p(idle, .99) + 20, report
    assert loaded[-1] <= _p(idle, .99) + 50, report


def _refused(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error


def test_tokenize_and_detokenize_are_charged_by_the_rate_limiter(vlm_path):
    """Requests per minute: each call counts, the one past the limit is a 429 with Retry-After.
    Tokens per minute: what /tokenize counted and what /detokenize is given are charged, a call
    that could never fit is a 400 naming its field."""
    words = " ".join(WORD_LIST[10:20])
    with _server(vlm_path, rate_limit_rpm=3) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=60) as http:
        assert http.post("/tokenize", json={"model": "vlm", "prompt": words}).status_code == 200
        assert http.post("/detokenize", json={"model": "vlm", "tokens": [5, 6]}
                         ).status_code == 200
        assert http.post("/tokenize", json={"model": "vlm", "messages": [
            {"role": "user", "content": words}]}).status_code == 200
        for path, body in (("/tokenize", {"model": "vlm", "prompt": words}),
                           ("/detokenize", {"model": "vlm", "tokens": [5]})):
            r = http.post(path, json=body)
            _refused(r, 429, "rate_limit_exceeded")
            assert float(r.headers["retry-after"]) > 0
    with _server(vlm_path, rate_limit_tpm=25) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=60) as http:
        counted = http.post("/tokenize", json={"model": "vlm", "prompt": words}).json()
        assert counted["count"] == 10
        assert http.post("/detokenize", json={"model": "vlm", "tokens": counted["tokens"]}
                         ).status_code == 200
        _refused(http.post("/detokenize", json={"model": "vlm", "tokens": counted["tokens"]}),
                 429, "rate_limit_exceeded")
        _refused(http.post("/tokenize", json={"model": "vlm", "prompt": words}), 429,
                 "rate_limit_exceeded")
        r = http.post("/detokenize", json={"model": "vlm", "tokens": [5] * 26})
        _refused(r, 400, "request_too_large")
        assert r.json()["error"]["param"] == "tokens"
