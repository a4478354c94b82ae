"""The bench client and load shapes against a scripted OpenAI-compatible server on loopback
(uvicorn in a thread): what the client records from multi-token chunks, reasoning deltas,
refusals and errors mid-stream; that a closed loop keeps exactly N requests in flight, counts
warm-up apart and stops at its bound; exact prompt lengths through `/tokenize`."""
import asyncio
import json
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from lifeline.bench.client import BenchClient, BenchRequest
from lifeline.bench.load import LoadPlan, interarrival_times, run_load
from lifeline.bench.metrics import request_metrics
from lifeline.bench.workloads import (
    Lengths,
    ServerTokenizer,
    cycle,
    jsonl_requests,
    random_requests,
)
from lifeline.server.testing import free_port

TOKEN_DELAY_S = 0.002


def _scripted_app() -> FastAPI:
    app = FastAPI()
    app.state.in_flight = app.state.max_in_flight = app.state.served = 0
    app.state.chat_bodies = []

    def sse(obj) -> str:
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"

    async def completion_events(body):
        n = body["max_tokens"]
        if body["prompt"] == "midway":
            yield sse({"choices": [{"index": 0, "text": "a", "finish_reason": None}]})
            yield sse({"error": {"message": "engine died", "type": "server_error"}})
            return
        sent = 0
        while sent < n:
            k = min(2, n - sent)  # two tokens an event, as a server with stream intervals
            await asyncio.sleep(TOKEN_DELAY_S)
            yield sse({"choices": [{"index": 0, "text": " x" * k, "finish_reason": None,
                                    "logprobs": {"tokens": [" x"] * k}}]})
            sent += k
        prompt_n = len(body["prompt"]) if isinstance(body["prompt"], list) else 3
        yield sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        yield sse({"choices": [], "usage": {"prompt_tokens": prompt_n, "completion_tokens": n},
                   "timings": {"prompt_n": prompt_n, "prompt_ms": 1.5, "predicted_n": n,
                               "predicted_ms": 9.0}})
        yield sse("[DONE]")

    async def chat_events(body):
        yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for delta in ({"reasoning_content": "hm"}, {"reasoning_content": " ok"},
                      {"content": "Yes"}, {"content": "."}):
            await asyncio.sleep(TOKEN_DELAY_S)
            yield sse({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
        yield sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}})
        yield sse("[DONE]")

    def counted(events):
        async def wrapped():
            app.state.in_flight += 1
            app.state.served += 1
            app.state.max_in_flight = max(app.state.max_in_flight, app.state.in_flight)
            try:
                async for e in events:
                    yield e
            finally:
                app.state.in_flight -= 1
        return StreamingResponse(wrapped(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        if body["prompt"] == "refuse":
            return JSONResponse({"error": {"message": "queue full"}}, status_code=503)
        return counted(completion_events(body))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        app.state.chat_bodies.append(body)
        return counted(chat_events(body))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        words = (await request.json())["prompt"].split()
        return {"tokens": [sum(map(ord, w)) % 997 for w in words]}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return {"prompt": " ".join(f"w{t}" for t in (await request.json())["tokens"])}

    return app


@pytest.fixture(scope="module")
def scripted():
    app, port = _scripted_app(), free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield app, f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(5)


def _send(url, req, endpoint="completions"):
    async def go():
        async with BenchClient(url, "m", endpoint=endpoint) as c:
            return await c.send(req)
    return asyncio.run(go())


def test_multi_token_events_are_counted_from_logprobs_with_llama_cpp_timings(scripted):
    _, url = scripted
    trace = _send(url, BenchRequest([1, 2, 3, 4], max_tokens=5))
    assert [c.tokens for c in trace.chunks] == [2, 2, 1]
    assert trace.output_tokens == 5 and trace.prompt_tokens == 4
    assert trace.server_timings["source"] == "llama.cpp"
    assert trace.server_timings["prefill_ms"] == 1.5
    m = request_metrics(trace)
    assert m.ok and len(m.tbt_ms) == 4 and len(m.itl_ms) == 2
    assert 0 < m.ttft_ms < m.e2e_ms


def test_chat_reasoning_deltas_come_before_the_first_answer(scripted):
    _, url = scripted
    m = request_metrics(_send(url, BenchRequest("hi", max_tokens=4), endpoint="chat"))
    assert m.ok and m.output_tokens == 4
    assert m.ttft_ms < m.ttfat_ms < m.e2e_ms


def test_a_refusal_and_an_error_mid_stream_are_failures_by_kind(scripted):
    _, url = scripted
    refused = _send(url, BenchRequest("refuse", max_tokens=2))
    assert refused.error == "http_503" and "queue full" in refused.error_message
    broken = _send(url, BenchRequest("midway", max_tokens=2))
    assert broken.error == "stream_error" and len(broken.chunks) == 1
    assert not request_metrics(broken).ok


def test_closed_loop_keeps_n_users_in_flight_and_leaves_warmup_out(scripted):
    app, url = scripted
    app.state.max_in_flight = 0
    before = app.state.served

    async def go():
        async with BenchClient(url, "m") as c:
            work = cycle([BenchRequest([1, 2], max_tokens=8)])
            return await run_load(c, work, LoadPlan(concurrency=4, requests=20, warmup=3))

    result = asyncio.run(go())
    assert len(result.sent) == 20 and app.state.served - before == 23
    assert app.state.max_in_flight == 4
    assert all(s.trace.error is None for s in result.sent)
    assert result.duration_s > 0
    assert min(s.trace.sent for s in result.sent) >= result.start


def test_a_ramp_up_starts_the_users_evenly_over_its_seconds(scripted):
    """4 users over 0.4 s: each user's first request (each lasts longer than the ramp) leaves
    0.1 s after the one before, and not before; the users go on after the ramp."""
    _, url = scripted

    async def go():
        async with BenchClient(url, "m") as c:
            work = cycle([BenchRequest([1, 2], max_tokens=600)])
            return await run_load(c, work, LoadPlan(concurrency=4, requests=8, ramp_up_s=0.4))

    result = asyncio.run(go())
    first = sorted(s.trace.sent for s in result.sent)[:4]
    offsets = [t - result.start for t in first]
    assert offsets[0] < 0.05
    for i, offset in enumerate(offsets):
        assert i * 0.1 <= offset + 1e-3 < i * 0.1 + 0.08, offsets
    assert len(result.sent) == 8
    with pytest.raises(ValueError, match="ramp-up"):
        LoadPlan(rate=5.0, requests=4, ramp_up_s=1.0)
    with pytest.raises(ValueError, match="ramp-up"):
        LoadPlan(concurrency=2, requests=4, ramp_up_s=-1.0)


def test_sessions_send_their_growing_history_with_the_servers_answers(scripted):
    app, url = scripted
    app.state.chat_bodies.clear()

    async def go():
        async with BenchClient(url, "m", endpoint="chat") as c:
            work = cycle([BenchRequest(f"q{i}", max_tokens=4) for i in range(6)])
            return await run_load(c, work, LoadPlan(concurrency=1, requests=6, turns=3))

    result = asyncio.run(go())
    assert [s.turn for s in result.sent] == [0, 1, 2, 0, 1, 2]
    bodies = app.state.chat_bodies
    assert [len(b["messages"]) for b in bodies] == [1, 3, 5, 1, 3, 5]
    assert bodies[2]["messages"] == [
        {"role": "user", "content": "q0"}, {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "q2"}]
    assert bodies[3]["messages"] == [{"role": "user", "content": "q3"}]


def test_a_duration_bound_stops_starting_requests(scripted):
    _, url = scripted

    async def go():
        async with BenchClient(url, "m") as c:
            work = cycle([BenchRequest([1], max_tokens=4)])
            return await run_load(c, work, LoadPlan(concurrency=2, duration_s=0.2))

    result = asyncio.run(go())
    assert result.sent and max(s.trace.sent for s in result.sent) < result.start + 0.2


def test_open_loop_sends_at_scheduled_times(scripted):
    _, url = scripted

    async def go():
        async with BenchClient(url, "m") as c:
            work = cycle([BenchRequest([1], max_tokens=2)])
            return await run_load(c, work, LoadPlan(rate=200.0, requests=15, concurrency=0))

    result = asyncio.run(go())
    scheduled = sorted(s.scheduled for s in result.sent)
    assert len(result.sent) == 15 and scheduled[0] >= result.start
    assert all(s.trace.sent >= s.scheduled - 1e-3 for s in result.sent)


def test_interarrival_times_have_mean_one_over_rate_and_burstiness_raises_variance():
    poisson = interarrival_times(10.0, 1.0, 20000, seed=1)
    bursty = interarrival_times(10.0, 0.25, 20000, seed=1)
    mean = sum(poisson) / len(poisson)
    assert mean == pytest.approx(0.1, rel=0.03)
    assert sum(bursty) / len(bursty) == pytest.approx(0.1, rel=0.06)

    def cv2(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / len(xs) / m ** 2
    assert cv2(poisson) == pytest.approx(1.0, rel=0.1)  # exponential
    assert cv2(bursty) == pytest.approx(4.0, rel=0.15)  # gamma: 1 / shape


def test_workload_lengths_are_exact_and_prefix_groups_share_their_prefix(scripted):
    _, url = scripted

    async def go():
        async with BenchClient(url, "m") as c:
            return await random_requests(ServerTokenizer(c), Lengths(32, 8, "uniform", 0.5), 12,
                                         chat=False, prefix_groups=2, prefix_tokens=10)

    reqs = asyncio.run(go())
    assert all(len(r.prompt) == r.prompt_tokens for r in reqs)
    assert all(16 <= r.prompt_tokens <= 48 and 4 <= r.max_tokens <= 12 for r in reqs)
    assert reqs[0].prompt[:10] == reqs[2].prompt[:10] != reqs[1].prompt[:10]
    assert len({tuple(r.prompt) for r in reqs}) == 12


def test_jsonl_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a b"}\n\n{"messages": [{"role": "user", "content": "c"}], '
                    '"max_tokens": 3}\n')
    reqs = jsonl_requests(path, 16)
    assert reqs[0].prompt == "a b" and reqs[0].max_tokens == 16
    assert reqs[1].extra["messages"][0]["content"] == "c" and reqs[1].max_tokens == 3


def test_client_capacity_measure_against_the_trivial_server():
    from lifeline.bench.client_capacity import measure, trivial_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(trivial_app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        out = asyncio.run(measure(f"http://127.0.0.1:{port}/v1", 40, 8, 4))
    finally:
        server.should_exit = True
        thread.join(5)
    assert out["ok"] == 40 and out["requests_per_s"] > 0
    assert out["events_per_s"] == pytest.approx(4 * out["requests_per_s"])


def test_find_max_rate_runs_open_loop_trials_up_to_the_limit(scripted, tmp_path):
    from lifeline.cli import main

    _, url = scripted
    out = tmp_path / "rate.json"
    rc = main(["bench", "--url", url, "--model", "m", "--find-max-users", "--rate", "50",
               "--max-users", "200", "--requests", "10", "--warmup", "0", "--input-tokens", "8",
               "--output-tokens", "4", "--slo", "e2e=30s", "--json", str(out), "--quiet"])
    assert rc == 0
    results = json.loads(out.read_text())
    search = results["search"]
    assert search["metric"] == "rate" and search["max_rate_rps"] == 200
    assert [t["rate"] for t in search["trials"]] == [50, 100, 200]
    assert results["settings"]["rate"] == 200 and results["summary"]["requests"] == 10


def test_sweep_runs_each_load_and_lists_them(scripted, tmp_path):
    from lifeline.cli import main

    _, url = scripted
    out = tmp_path / "sweep.json"
    rc = main(["bench", "--url", url, "--model", "m", "--sweep", "1,2", "--requests", "4",
               "--warmup", "0", "--input-tokens", "8", "--output-tokens", "4",
               "--json", str(out), "--quiet"])
    assert rc == 0
    results = json.loads(out.read_text())
    rows = results["sweep"]["trials"]
    assert results["sweep"]["metric"] == "concurrency"
    assert [r["concurrency"] for r in rows] == [1, 2] and all(r["met"] is None for r in rows)
    assert all(r["output_throughput_tok_s"] > 0 for r in rows)
    assert results["settings"]["concurrency"] == 2 and results["summary"]["requests"] == 8


def test_conversation_lengths_come_in_pairs_from_a_trace_file(scripted, tmp_path):
    from lifeline.bench.conversation import load_pairs

    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "t0,374,44\nt1,1353,142\nt2,209,181\nt3,91,16\nt4,0,5\n")
    pairs = load_pairs(trace)
    assert pairs == ((374, 44), (1353, 142), (209, 181), (91, 16))
    _, url = scripted

    async def go():
        async with BenchClient(url, "m") as c:
            return await random_requests(ServerTokenizer(c),
                                         Lengths(1, 1, "conversation", pairs=pairs), 5,
                                         chat=False, seed=3)

    reqs = asyncio.run(go())
    assert all((len(r.prompt), r.max_tokens) in pairs for r in reqs)
    assert len({(len(r.prompt), r.max_tokens) for r in reqs}) > 1


def test_an_unreachable_server_is_a_message_not_a_traceback(capsys):
    from lifeline.cli import main

    url = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["bench", "--url", url, "--model", "m", "--requests", "2", "--quiet"]) == 1
    assert f"cannot reach {url}" in capsys.readouterr().err
    assert main(["bench", "--url", url, "--turns", "2"]) == 2  # sessions need chat
