"""A hostile or broken upstream costs the gateway bounded work (issue 27, property 4, and the
gateway's half of property 1), seen from outside: a real gateway on loopback in front of
scripted upstreams (`tests/upstreams.py`) that answer with bad JSON, wrong types, non-finite
numbers, oversized fields, an event without end, a body that never ends, a stream cut
mid-answer, or connections closed before or after reading the request.

What each test shows: a malformed answer is a `bad_response` that falls back, is recorded, and
releases its backend once (the load, read at `/gateway/backends` and `/metrics`, is never
negative and returns to exactly 0); the parse work per chunk does not grow with the buffer;
a relayed request ends at its deadline; a POST is resent only when the upstream read none of
it, and the resend is in the record; a client's 4xx is no success for the circuit breaker; a
stream cut mid-answer is recorded as the failure it was, its error event carrying `routing` and
`timings`; and re-serialising a large body leaves `/health` as fast as it is idle."""
from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lifeline.gateway import sse
from lifeline.gateway.config import parse_config
from lifeline.gateway.testing import GatewayThread
from lifeline.server.testing import free_port
from tests.upstreams import BAD_ANSWERS, RawUpstream, Upstream

ERRORS = "lifeline:gateway_backend_errors_total"


def _gateway(text: str) -> GatewayThread:
    return GatewayThread(parse_config(text, ".toml"))


def _metric(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _ask(gw: GatewayThread, stream: bool, timeout: float = 30, **extra) -> httpx.Response:
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": stream, **extra}
    return httpx.post(gw.base_url + "/v1/completions", json=body, timeout=timeout)


def _routing(r: httpx.Response) -> dict:
    if r.headers["content-type"].startswith("text/event-stream"):
        return _events(r.text)[-1]["routing"]
    return r.json()["routing"]


def _text(r: httpx.Response) -> str:
    if r.headers["content-type"].startswith("text/event-stream"):
        return "".join(c.get("text") or "" for e in _events(r.text) for c in e.get("choices", ()))
    return r.json()["choices"][0]["text"]


def _loads(gw: GatewayThread) -> dict[str, tuple[int, int]]:
    """Each backend's load and refused releases, as `/gateway/backends` shows them."""
    status = httpx.get(gw.base_url + "/gateway/backends", timeout=10).json()
    return {name: (s["outstanding"], s["unmatched_releases"]) for name, s in status.items()}


def _settled(gw: GatewayThread, timeout: float = 10) -> dict[str, tuple[int, int]]:
    """The loads once every attempt has ended (a relay closes its exchange from a task)."""
    deadline = time.monotonic() + timeout
    while True:
        loads = _loads(gw)
        if all(v == (0, 0) for v in loads.values()) or time.monotonic() > deadline:
            return loads
        time.sleep(0.02)


# -- malformed answers ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def broken():
    """One gateway: route `m` tries `bad` (whose script each test sets), then `good`. The
    breaker never opens here: every case reaches `bad`."""
    with Upstream("bad") as bad, Upstream("good") as good:
        config = f"""
            [health]
            interval_s = 60
            [circuit_breaker]
            failures = 100000
            [backends.bad]
            base_url = "{bad.base_url}"
            max_response_bytes = "256KiB"
            [backends.good]
            base_url = "{good.base_url}"
            [models.m]
            backends = ["bad"]
            fallbacks = ["good"]
            """
        with _gateway(config) as gw:
            yield gw, bad, good


MALFORMED = [*BAD_ANSWERS, "gzip"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("script", MALFORMED)
def test_a_malformed_answer_is_a_bad_response_that_falls_back_and_releases_once(
        broken, script, stream):
    gw, bad, _ = broken
    bad.script = script
    before = httpx.get(gw.base_url + "/metrics").text
    consecutive = httpx.get(gw.base_url + "/gateway/backends").json()["bad"][
        "consecutive_failures"]
    r = _ask(gw, stream)
    assert r.status_code == 200, r.text
    assert _text(r) == "answer from good"
    if stream:
        assert r.text.endswith("data: [DONE]\n\n")
        assert len({e["id"] for e in _events(r.text)}) == 1  # one backend's answer
    routing = _routing(r)
    attempts = [(a["backend"], a["outcome"]) for a in routing["attempts"]]
    assert attempts == [("bad", "bad_response"), ("good", "served")], routing["attempts"]
    assert "malformed" in routing["attempts"][0]["error"] or "compressed" in \
        routing["attempts"][0]["error"]
    assert _settled(gw) == {"bad": (0, 0), "good": (0, 0)}
    after = httpx.get(gw.base_url + "/metrics").text
    assert _metric(after, ERRORS, backend="bad", kind="bad_response") == \
        _metric(before, ERRORS, backend="bad", kind="bad_response") + 1
    assert httpx.get(gw.base_url + "/gateway/backends").json()["bad"][
        "consecutive_failures"] == consecutive + 1  # a failure for its breaker


def test_the_load_is_never_negative_and_every_attempt_is_released_once(broken):
    """Every hostile script at once, from 8 clients, while a reader watches the gateway's own
    view of each backend's load: never below zero, no release refused, and exactly 0 after."""
    gw, bad, _ = broken
    seen: list[tuple[int, int]] = []
    gauges: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen.extend(_loads(gw).values())
            metrics = httpx.get(gw.base_url + "/metrics").text
            gauges.extend(_metric(metrics, "lifeline:gateway_backend_outstanding", backend=b)
                          for b in ("bad", "good"))

    def one(case: tuple[str, bool]) -> int:
        bad.script = case[0]  # shared: each request meets whichever script is set now
        return _ask(gw, case[1]).status_code

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    cases = [(s, stream) for s in MALFORMED for stream in (False, True)] * 2
    with cf.ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(one, cases))
    stop.set()
    watcher.join(10)
    assert set(statuses) == {200}
    assert seen and min(load for load, _ in seen) >= 0
    assert max(refused for _, refused in seen) == 0
    assert gauges and min(gauges) >= 0
    assert _settled(gw) == {"bad": (0, 0), "good": (0, 0)}


def test_a_huge_event_without_a_line_end_is_capped_and_each_chunk_parsed_once(
        broken, monkeypatch):
    """A first event that never ends: the gateway stops at `max_event_bytes` (1 MiB), having
    searched each byte once (the work per chunk is the chunk's, whatever the buffer holds), and
    falls back."""
    gw, bad, _ = broken
    feeds: list[tuple[int, int, int]] = []
    feed = sse.EventSplitter.feed

    def counted(self, chunk):
        scanned, held = self.scanned, len(self.buffer)
        try:
            return feed(self, chunk)
        finally:
            feeds.append((len(chunk), self.scanned - scanned, held))

    monkeypatch.setattr(sse.EventSplitter, "feed", counted)
    bad.script, bad.piece_bytes, bad.total_bytes = "huge_event", 4 << 10, 64 << 20
    r = _ask(gw, True)
    assert r.status_code == 200 and _text(r) == "answer from good"
    failed = _routing(r)["attempts"][0]
    assert (failed["backend"], failed["outcome"]) == ("bad", "bad_response")
    assert "an event of more than 1048576 bytes" in failed["error"]
    huge = [f for f in feeds if f[2] > 0 or f[0] > 100]
    assert len(huge) >= 32 and max(held for _, _, held in huge) > 900 << 10
    assert all(scanned <= size + 2 for size, scanned, _ in feeds), feeds[-5:]
    assert sum(size for size, _, _ in feeds) < (1 << 20) + (256 << 10)  # read to its cap
    assert _settled(gw) == {"bad": (0, 0), "good": (0, 0)}


def test_a_giant_whole_answer_is_capped(broken):
    gw, bad, _ = broken
    bad.script, bad.piece_bytes, bad.total_bytes = "trickle", 16 << 10, 64 << 20
    r = _ask(gw, False)
    assert r.status_code == 200 and _text(r) == "answer from good"
    failed = _routing(r)["attempts"][0]
    assert failed["outcome"] == "bad_response"
    assert "an answer of more than 262144 bytes" in failed["error"]
    assert _settled(gw) == {"bad": (0, 0), "good": (0, 0)}


# -- the deadline -----------------------------------------------------------------------------

def test_a_relayed_request_ends_at_its_total_deadline():
    """`deadline_s = 1`: a whole answer trickled without end, a stream that never reaches its
    first token, and one that streams without end are each over by the deadline, recorded, with
    no further attempt (the fallback is never asked), their backend released."""
    with Upstream("slow") as slow, Upstream("good") as good:
        config = f"""
            [health]
            interval_s = 60
            [circuit_breaker]
            failures = 100
            [backends.slow]
            base_url = "{slow.base_url}"
            [backends.good]
            base_url = "{good.base_url}"
            [models.m]
            backends = ["slow"]
            fallbacks = ["good"]
            deadline_s = 1.0
            """
        with _gateway(config) as gw:
            slow.piece_bytes, slow.piece_every_s, slow.total_bytes = 32, 0.05, 1 << 30
            for script, stream in (("trickle", False), ("huge_event", True)):
                slow.script = script
                start = time.monotonic()
                r = _ask(gw, stream)
                took = time.monotonic() - start
                assert 1.0 <= took < 3.0, took
                assert r.status_code == 504, r.text
                body = r.json()
                assert body["error"]["code"] == "deadline_exceeded"
                assert [(a["backend"], a["outcome"]) for a in body["routing"]["attempts"]] == [
                    ("slow", "deadline")]
                assert body["timings"]["e2e_ms"] >= 1000

            slow.script = "slow_tokens"
            start = time.monotonic()
            r = _ask(gw, True)
            took = time.monotonic() - start
            assert 1.0 <= took < 3.0, took
            assert r.status_code == 200  # the answer had begun
            events = _events(r.text)
            assert "data: [DONE]" not in r.text
            assert "".join(c["text"] for e in events[:-1] for c in e["choices"]).startswith(
                "answer from slow")
            last = events[-1]
            assert last["error"]["code"] == "deadline_exceeded"
            assert [(a["backend"], a["outcome"], a.get("after_output"))
                    for a in last["routing"]["attempts"]] == [("slow", "deadline", True)]
            assert last["routing"]["outcome"]["status"] == 504
            assert last["timings"]["e2e_ms"] >= 1000 and last["timings"]["ttft_ms"] > 0
            assert good.served() == 0
            assert _settled(gw) == {"slow": (0, 0), "good": (0, 0)}
            metrics = httpx.get(gw.base_url + "/metrics").text
    assert _metric(metrics, "lifeline:gateway_requests_total", model_name="m",
                   status="504") == 3


# -- resends ----------------------------------------------------------------------------------

def test_a_post_is_resent_only_when_the_upstream_provably_read_none_of_it(monkeypatch):
    with RawUpstream("raw") as raw, Upstream("good") as good:
        config = f"""
            [health]
            interval_s = 60
            [circuit_breaker]
            failures = 100
            [backends.raw]
            base_url = "{raw.base_url}"
            [backends.good]
            base_url = "{good.base_url}"
            [models.m]
            backends = ["raw"]
            fallbacks = ["good"]
            """
        with _gateway(config) as gw:
            def attempts(r: httpx.Response) -> list:
                return [(a["backend"], a["outcome"], a.get("resent"))
                        for a in r.json()["routing"]["attempts"]]

            first = _ask(gw, False)
            assert attempts(first) == [("raw", "served", None)]  # its connection is kept

            # Read whole, then closed without an answer, on the kept-alive connection: the
            # upstream may have acted on it, so it is not sent there again.
            raw.mode = "read_then_close"
            r = _ask(gw, False, prompt="read then closed")
            assert attempts(r) == [("raw", "disconnected", None), ("good", "served", None)]
            assert [q["prompt"] for q in raw.requests] == ["hi", "read then closed"]

            # Closed on a new connection before reading: nothing was read, but a new connection
            # is never resent (the upstream closes them all): the fallback answers.
            # (The reset can reach the gateway while its connection is still being set up: then
            # the attempt is a `connect` failure, as a refused one is; either way not resent.)
            raw.mode = "close_before_reading"
            r = _ask(gw, False, prompt="never read")
            (backend, outcome, resent), *rest = attempts(r)
            assert (backend, resent) == ("raw", None) and outcome in ("disconnected", "connect")
            assert rest == [("good", "served", None)]
            assert len(raw.requests) == 2

            # A kept-alive connection the upstream closed while it was idle: httpcore's pool
            # usually sees that before it hands the connection out; here its check is made to
            # miss it (as when the close lands just after the check), and the gateway's own
            # check at the write finds it: not one byte was sent, so it is sent once more, on
            # a new connection, and the record says so.
            raw.mode = "close_idle"
            assert attempts(_ask(gw, False, prompt="kept")) == [("raw", "served", None)]
            time.sleep(0.3)  # the upstream has closed the idle connection
            from httpcore._async.http11 import AsyncHTTP11Connection
            monkeypatch.setattr(AsyncHTTP11Connection, "has_expired", lambda self: False)
            r = _ask(gw, False, prompt="resent")
            (backend, outcome, resent), = attempts(r)
            assert (backend, outcome) == ("raw", "served")
            assert len(resent) == 1 and "before the request was sent" in resent[0]["reason"]
            assert [q["prompt"] for q in raw.requests][2:] == ["kept", "resent"]  # read once
            assert _settled(gw) == {"raw": (0, 0), "good": (0, 0)}
            metrics = httpx.get(gw.base_url + "/metrics").text
    assert _metric(metrics, "lifeline:gateway_backend_resends_total", backend="raw") == 1


# -- the circuit breaker ----------------------------------------------------------------------

def test_a_clients_own_4xx_is_no_success_for_the_circuit_breaker():
    with Upstream("flaky") as flaky, Upstream("steady") as steady:
        config = f"""
            [health]
            interval_s = 60
            [circuit_breaker]
            failures = 2
            cooldown_s = 0.5
            [backends.flaky]
            base_url = "{flaky.base_url}"
            [backends.steady]
            base_url = "{steady.base_url}"
            [models.m]
            backends = ["flaky"]
            fallbacks = ["steady"]
            """
        with _gateway(config) as gw:
            def state() -> tuple[str, int]:
                s = httpx.get(gw.base_url + "/gateway/backends").json()["flaky"]
                return s["circuit"], s["consecutive_failures"]

            flaky.mode, flaky.fail_status = "fail", 500
            assert _text(_ask(gw, False)) == "answer from steady"
            assert state() == ("closed", 1)
            flaky.mode, flaky.script = "ok", "client_error"
            refused = _ask(gw, False)
            assert refused.status_code == 400  # the client's error, passed on once
            assert state() == ("closed", 1)  # not reset by the client's own error
            flaky.mode, flaky.script = "fail", None
            assert _text(_ask(gw, False)) == "answer from steady"
            assert state() == ("open", 2)

            deadline = time.monotonic() + 10
            while state()[0] != "half_open":
                assert time.monotonic() < deadline
                time.sleep(0.05)
            flaky.mode, flaky.script = "ok", "client_error"
            assert _ask(gw, False).status_code == 400  # the probe met the client's error
            assert state() == ("half_open", 2)  # no verdict: still probing, not closed
            flaky.script = None
            assert _text(_ask(gw, False)) == "answer from flaky"
            assert state() == ("closed", 0)
            assert _settled(gw) == {"flaky": (0, 0), "steady": (0, 0)}


# -- a stream cut mid-answer -----------------------------------------------------------------

CUTS = [("cut", "disconnected"), ("no_done", "incomplete_stream"),
        ("error_after_output", "error_event"), ("bad_after_output", "bad_response")]


@pytest.mark.parametrize("script,kind", CUTS)
def test_a_stream_cut_mid_answer_is_recorded_as_what_it_was(script, kind, caplog):
    caplog.set_level(logging.INFO, logger="lifeline.access")
    with Upstream("up") as up, Upstream("spare") as spare:
        config = f"""
            [health]
            interval_s = 60
            [backends.up]
            base_url = "{up.base_url}"
            [backends.spare]
            base_url = "{spare.base_url}"
            [models.m]
            backends = ["up"]
            fallbacks = ["spare"]
            """
        with _gateway(config) as gw:
            up.script = script
            r = _ask(gw, True)
            assert r.status_code == 200  # the answer had begun when it broke
            assert "data: [DONE]" not in r.text
            events = _events(r.text)
            text = "".join(c["text"] for e in events[:-1] for c in e["choices"])
            assert text == "answer from up"  # relayed once, from one backend
            last = events[-1]
            assert set(last) >= {"error", "routing", "timings"}
            if script == "error_after_output":
                assert last["error"]["message"] == "out of memory"  # the upstream's own
            else:
                assert last["error"]["code"] == "backend_failed_mid_stream"
            attempts = last["routing"]["attempts"]
            assert [(a["backend"], a["outcome"], a["after_output"]) for a in attempts] == [
                ("up", kind, True)]
            assert last["routing"]["outcome"]["status"] == 502
            assert last["timings"]["ttft_ms"] > 0 and last["timings"]["e2e_ms"] > 0
            assert last["timings"]["retries"] == 0
            assert spare.served() == 0  # never two answers
            assert _settled(gw) == {"up": (0, 0), "spare": (0, 0)}
            status = httpx.get(gw.base_url + "/gateway/backends").json()["up"]
            assert status["consecutive_failures"] == 1  # the attempt failed
            metrics = httpx.get(gw.base_url + "/metrics").text
    assert _metric(metrics, ERRORS, backend="up", kind=kind) == 1
    assert _metric(metrics, "lifeline:gateway_requests_total", model_name="m",
                   status="502") == 1
    logged = [json.loads(rec.getMessage()) for rec in caplog.records
              if rec.name == "lifeline.access"]
    assert [(line["status"], line["routing"]["attempts"][0]["outcome"]) for line in logged] == [
        (502, kind)]


# -- the event loop while a large body is written again ----------------------------------------

def _health_latencies(base: str, seconds: float, busy: threading.Event | None = None
                      ) -> list[float]:
    """`GET /health` every 10 ms for `seconds` (or while `busy` is set), each one's latency."""
    out: list[float] = []
    with httpx.Client(base_url=base, timeout=30) as http:
        http.get("/health")
        end = time.monotonic() + seconds
        while (busy.is_set() if busy is not None else time.monotonic() < end):
            start = time.perf_counter()
            assert http.get("/health").status_code == 200
            out.append(time.perf_counter() - start)
            time.sleep(0.01)
    return out


@pytest.mark.alone
def test_writing_a_large_body_again_leaves_health_as_fast_as_when_idle(tmp_path):
    """A gateway process in front of an upstream that answers with 16 MB of small values; the
    requests, 16 MB of small values too, name the route, so the gateway writes each one again
    with the backend's `model`, and reads and writes each answer again with its `timings` and
    `routing`. The C codec would hold the GIL for ~150 ms a body and every `/health` with it;
    off the loop, `/health` stays within a few milliseconds of its idle latency."""
    items = 1_000_000
    request = json.dumps({"model": "m", "prompt": "p", "max_tokens": 1,
                          "logit_bias": {}, "extra": list(range(items))},
                         separators=(",", ":")).encode()
    answer = json.dumps({"id": "big", "object": "text_completion", "created": 1, "model": "u",
                         "choices": [{"index": 0, "text": "big", "finish_reason": "stop",
                                      "logprobs": {"token_logprobs": [-0.5] * items}}]}
                        ).encode()
    assert len(request) > 5 << 20 and len(answer) > 5 << 20
    with Upstream("u") as up:
        up.script, up.answer = "fixed", answer
        path = tmp_path / "gw.toml"
        port = free_port()
        path.write_text(f"""
[server]
max_body_bytes = "64MiB"
[health]
interval_s = 60
[backends.u]
base_url = "{up.base_url}"
model = "upstream-name"
max_response_bytes = "64MiB"
[models.m]
backends = ["u"]
""")
        log = (tmp_path / "gw.log").open("w")
        proc = subprocess.Popen([sys.executable, "-m", "lifeline.cli", "serve", "--config",
                                 str(path), "--no-huge-pages", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None, (tmp_path / "gw.log").read_text()[-2000:]
                try:
                    if httpx.get(base + "/ready", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.2)
            _health_latencies(base, 1.0)  # warm: the first probes pay for imports and caches
            idle = _health_latencies(base, 4.0)
            busy = threading.Event()
            busy.set()
            answers: list[httpx.Response] = []

            def send() -> None:
                try:
                    with httpx.Client(base_url=base, timeout=300) as http:
                        for _ in range(3):
                            answers.append(http.post(
                                "/v1/completions", content=request,
                                headers={"content-type": "application/json"}))
                finally:
                    busy.clear()

            sender = threading.Thread(target=send)
            sender.start()
            loaded = _health_latencies(base, 0, busy)
            sender.join()
        finally:
            proc.terminate()
            proc.wait(30)
    assert [r.status_code for r in answers] == [200, 200, 200], answers[-1].text[:500]
    idle_ms = sorted(x * 1e3 for x in idle)
    loaded_ms = sorted(x * 1e3 for x in loaded)

    def p(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    report = (f"idle p50 {p(idle_ms, .5):.1f} p99 {p(idle_ms, .99):.1f} max {idle_ms[-1]:.1f}"
              f" ms; loaded p50 {p(loaded_ms, .5):.1f} p99 {p(loaded_ms, .99):.1f} max "
              f"{loaded_ms[-1]:.1f} ms over {len(loaded_ms)} probes")
    print(report)
    assert len(loaded_ms) >= 50, report
    assert p(loaded_ms, .5) <= p(idle_ms, .5) + 5, report
    assert p(loaded_ms, .99) <= p(idle_ms, .99) + 20, report
    assert loaded_ms[-1] <= p(idle_ms, .99) + 50, report
    got = json.loads(answers[-1].content)
    assert got["choices"][0]["logprobs"]["token_logprobs"] == [-0.5] * items
    assert got["routing"]["attempts"][0]["outcome"] == "served"
    assert up.requests[-1]["body"]["bytes"] == len(request) + len("upstream-name") - len("m")
