"""The gateway under pressure: keys, rate limits, a bounded queue, health while the engine is
saturated, and a client that hangs up mid-stream. Real servers on loopback, default model."""
import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from lifeline.engine.engine import EngineConfig
from lifeline.server.config import ServerConfig
from lifeline.server.testing import ServerThread

MODEL = "gemma-3-270m"
SMALL_KV = 128 << 20
LONG = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 400,
        "temperature": 0, "ignore_eos": True}


def _server(loaded, **kwargs) -> ServerThread:
    engine = kwargs.pop("engine", EngineConfig(kv_cache_memory_bytes=SMALL_KV))
    return ServerThread(loaded, ServerConfig(engine=engine, **kwargs))


def _kv_usage(metrics_text: str) -> float:
    match = re.search(r"^lifeline:kv_cache_usage_perc\{[^}]*\} (\S+)$", metrics_text, re.MULTILINE)
    assert match, "no kv usage gauge"
    return float(match.group(1))


def test_api_keys_guard_every_route_but_health_ready_and_metrics(loaded):
    with _server(loaded, api_keys=["key-one", "key-two"]) as srv:
        url = srv.base_url
        for key in ("key-one", "key-two"):
            client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
            assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=1).usage
        bad = openai.OpenAI(base_url=url + "/v1", api_key="key-three", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with httpx.Client(base_url=url, timeout=30) as http:
            r = http.post("/v1/chat/completions", json={"model": MODEL})
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
            r = http.post("/tokenize", json={"prompt": "x"},
                          headers={"Authorization": "Bearer key-one-and-more"})
            assert r.status_code == 401
            for path in ("/health", "/ready", "/metrics"):
                assert http.get(path).status_code == 200, path
            ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                           headers={"Authorization": "Bearer key-two"})
            assert ok.status_code == 200


def test_protect_metrics_requires_a_key_for_metrics(loaded):
    with _server(loaded, api_keys=["k"], protect_metrics=True) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=30) as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"Authorization": "Bearer k"}).status_code == 200
        assert http.get("/health").status_code == 200


def test_requests_per_minute_limit_gives_429_with_retry_after(loaded):
    with _server(loaded, api_keys=["a", "b"], rate_limit_rpm=2) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=60) as http:
            body = {"prompt": "Hi", "max_tokens": 1}
            auth = {"Authorization": "Bearer a"}
            assert http.post("/v1/completions", json=body, headers=auth).status_code == 200
            assert http.post("/v1/completions", json=body, headers=auth).status_code == 200
            r = http.post("/v1/completions", json=body, headers=auth)
            assert r.status_code == 429
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert 1 <= int(r.headers["retry-after"]) <= 60
            other = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer b"})
            assert other.status_code == 200, "limits are per key"
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="a", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)


def test_tokens_per_minute_limit_counts_prompt_and_completion_tokens(loaded):
    with _server(loaded, rate_limit_tpm=40) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=60) as http:
        first = http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 40,
                                                   "ignore_eos": True})
        assert first.status_code == 200, "admitted: its 3 prompt tokens fit"
        assert first.json()["usage"]["total_tokens"] == 43
        r = http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 1})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1


def test_full_waiting_queue_gives_503_with_retry_after_not_a_hang(loaded):
    engine = EngineConfig(kv_cache_memory_bytes=SMALL_KV, max_num_seqs=1)
    with _server(loaded, engine=engine, max_queued_requests=1) as srv:
        async def scenario():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as http, \
                    http.stream("POST", "/v1/completions",
                                json={**LONG, "stream": True}) as running:
                lines = running.aiter_lines()
                while not (await anext(lines)).startswith("data:"):
                    pass
                waiting = asyncio.create_task(http.post("/v1/completions", json=LONG))
                for _ in range(200):
                    if srv.state.admission.waiting >= 1:
                        break
                    await asyncio.sleep(0.02)
                assert srv.state.admission.waiting == 1
                start = time.perf_counter()
                refused = await http.post("/v1/completions",
                                          json={"prompt": "Hi", "max_tokens": 1})
                assert time.perf_counter() - start < 5
                waiting.cancel()
                return refused

        refused = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "queue_full"
        assert int(refused.headers["retry-after"]) >= 1
        _wait_for_idle(srv)
        with httpx.Client(base_url=srv.base_url, timeout=60) as http:
            assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}
                             ).status_code == 200


def _wait_for_idle(srv: ServerThread, timeout: float = 30) -> None:
    engine = srv.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not engine.has_unfinished_requests() and srv.state.admission.in_flight == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the engine did not go idle")


@pytest.mark.alone
def test_health_answers_within_two_seconds_while_sixteen_long_requests_run(loaded):
    engine = EngineConfig(kv_cache_memory_bytes=SMALL_KV, max_num_seqs=16)
    with _server(loaded, engine=engine) as srv:
        async def scenario():
            async with openai.AsyncOpenAI(base_url=srv.base_url + "/v1", api_key="x",
                                          max_retries=0, timeout=300) as client, \
                    httpx.AsyncClient(base_url=srv.base_url, timeout=10) as http:
                streams = [await client.completions.create(
                    model=MODEL, prompt=f"Story {i}: once upon a time", max_tokens=48,
                    temperature=0, stream=True, extra_body={"ignore_eos": True})
                    for i in range(16)]

                async def drain(stream):
                    return [c async for c in stream]

                tasks = [asyncio.create_task(drain(s)) for s in streams]
                for _ in range(100):
                    if srv.engine.scheduler.running:
                        break
                    await asyncio.sleep(0.05)
                latencies = []
                while not all(t.done() for t in tasks) or not latencies:
                    start = time.perf_counter()
                    r = await http.get("/health")
                    assert r.status_code == 200
                    latencies.append(time.perf_counter() - start)
                    await asyncio.sleep(0.2)
                busy = len(srv.engine.scheduler.running)
                await asyncio.gather(*tasks)
                return latencies, busy

        latencies, _ = asyncio.run(asyncio.wait_for(scenario(), 400))
        assert len(latencies) >= 3
        assert max(latencies) < 2.0, latencies


def test_client_disconnect_mid_stream_aborts_and_frees_kv_blocks(loaded):
    with _server(loaded) as srv:
        engine = srv.engine
        total = engine.block_manager.num_blocks
        with httpx.Client(base_url=srv.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                seen = 0
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        seen += 1
                    if seen == 3:
                        # checked before the break: leaving the loop closes the lines generator,
                        # and with it httpcore's stream and the connection (the disconnect)
                        assert engine.block_manager.num_free_blocks < total
                        assert _kv_usage(http.get("/metrics").text) > 0
                        break
                assert seen == 3
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if engine.block_manager.num_free_blocks == total and not engine.requests:
                    break
                time.sleep(0.05)
            assert engine.block_manager.num_free_blocks == total
            metrics = http.get("/metrics").text
            assert _kv_usage(metrics) == 0.0
            assert re.search(r'^lifeline:request_success_total\{[^}]*finished_reason="abort"'
                             r'[^}]*\} 1\.0$', metrics, re.MULTILINE), "the abort was accounted"
            assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}
                             ).status_code == 200


@pytest.mark.alone
def test_a_runaway_request_template_is_stopped_with_400_and_health_stays_fast(loaded):
    with _server(loaded, allow_request_chat_template=True) as srv:
        async def scenario():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=60) as http:
                runaway = asyncio.create_task(http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "chat_template": "{% for i in range(10**9) %}x{% endfor %}"}))
                latencies = []
                while not runaway.done():
                    start = time.perf_counter()
                    assert (await http.get("/health")).status_code == 200
                    latencies.append(time.perf_counter() - start)
                    await asyncio.sleep(0.05)
                return await runaway, latencies

        r, latencies = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
        assert not latencies or max(latencies) < 2.0
        own = httpx.post(srv.base_url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
        assert own.status_code == 200 and own.json()["usage"]["prompt_tokens"] >= 1


@pytest.mark.alone
def test_tokenizing_a_huge_prompt_does_not_stall_the_event_loop(loaded):
    with _server(loaded) as srv:
        async def scenario():
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as http:
                huge = asyncio.create_task(http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "The quick brown fox. " * 12000}],
                    "max_tokens": 1}))
                latencies = []
                while not huge.done():
                    start = time.perf_counter()
                    assert (await http.get("/health")).status_code == 200
                    latencies.append(time.perf_counter() - start)
                    await asyncio.sleep(0.02)
                return await huge, latencies

        r, latencies = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert r.status_code == 400 and "context" in r.json()["error"]["message"]
        assert len(latencies) >= 3, "the request took long enough to overlap health checks"
        assert max(latencies) < 0.5, latencies


def test_drain_past_the_shutdown_timeout_aborts_what_is_left_and_exits(loaded):
    srv = _server(loaded, shutdown_timeout=1.0).start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=30) as http, \
                http.stream("POST", "/v1/chat/completions", json={
                    **LONG, "messages": [{"role": "user", "content": "A story, please."}],
                    "n": 2, "stream": True, "stream_options": {"include_usage": True}}) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            start = time.monotonic()
            srv.sigterm()
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]", "400 tokens take far longer than 1 s: aborted"
        chunks = [json.loads(line[6:]) for line in rest[:-1]]
        finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
                    for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]}
        assert finishes == {0: "abort", 1: "abort"}
        assert 0 < chunks[-1]["usage"]["completion_tokens"] < 800
        assert chunks[-1]["timings"]["e2e_ms"] > 1000
        srv.thread.join(15)
        assert not srv.thread.is_alive() and time.monotonic() - start < 10
    finally:
        srv.stop()


def test_the_model_loads_and_every_step_runs_on_the_engine_thread(loaded):
    """PyTorch work stays on one thread (see lifeline.server.async_engine: a second thread with
    an OpenMP team made every parallel kernel pay a wake-up). With a loader, `/ready` is 503 and
    requests get 503 until the engine thread has loaded the model and built the engine."""
    import threading

    threads: dict[str, set[str]] = {"load": set(), "step": set()}
    release = threading.Event()

    def loader():
        threads["load"].add(threading.current_thread().name)
        release.wait(30)
        return loaded

    with ServerThread(loader, ServerConfig(engine=EngineConfig(
            kv_cache_memory_bytes=SMALL_KV))) as srv, httpx.Client(base_url=srv.base_url) as http:
        assert http.get("/ready").status_code == 503
        early = http.post("/v1/completions", json={**LONG, "max_tokens": 2})
        assert early.status_code == 503 and early.headers.get("retry-after")
        release.set()
        deadline = time.monotonic() + 60
        while http.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "the server never became ready"
            time.sleep(0.05)
        engine = srv.engine
        step = engine.step

        def recorded_step():
            threads["step"].add(threading.current_thread().name)
            return step()

        engine.step = recorded_step
        r = http.post("/v1/completions", json={**LONG, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert threads == {"load": {"lifeline-engine"}, "step": {"lifeline-engine"}}
