"""The debug endpoints and the dashboard stream of a real server on loopback (a tiny random-weight
Llama behind a word-level tokenizer): the step log names requests by the ids their responses
carry and agrees with their timings; finished and in-flight requests are listed by stage; the
event stream carries a request sent while it is open and leaves no task behind when its client
goes; with keys configured only the admin key opens these paths; no prompt or output text is
ever shown; bad parameters get OpenAI-format 400s."""
import asyncio
import concurrent.futures
import contextlib
import importlib.util
import json
import threading

import httpx
import openai
import pytest

from lifeline.bench.workloads import WORDS
from lifeline.engine.engine import EngineConfig
from lifeline.server.config import ServerConfig
from lifeline.server.debug import DASHBOARD_DIR
from lifeline.server.testing import ServerThread
from tests.word_models import tiny_llama, word_tokenizer

SECRET = "zyzzyva"
"""A word only the test's prompts hold: it must never appear in a debug answer."""
BUDGET = 16


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = tmp_path_factory.mktemp("words")
    return tiny_llama(word_tokenizer(path, [SECRET, *WORDS]), path)


def _config(**kwargs) -> ServerConfig:
    engine = kwargs.pop("engine", EngineConfig(  # no prefix cache: every prompt is computed
        num_kv_blocks=256, max_num_batched_tokens=BUDGET, block_size=4,
        enable_prefix_caching=False))
    return ServerConfig(served_model_name="tiny", engine=engine, **kwargs)


@pytest.fixture(scope="module")
def server(loaded):
    with ServerThread(loaded, _config()) as srv:
        yield srv


def _prompt(words: int) -> str:
    return " ".join([SECRET, *WORDS[:words - 1]])


def _complete(client: openai.OpenAI, prompt: str, max_tokens: int = 5, **extra):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body={"ignore_eos": True, **extra})


def _timings(out) -> dict:
    return out.model_extra["timings"]


def _no_text(body: str, *texts: str) -> None:
    assert SECRET not in body
    for text in texts:
        assert text.strip() not in body


def test_the_step_log_names_the_response_and_agrees_with_its_timings(client, http):
    out = _complete(client, _prompt(40), max_tokens=6)
    timings = _timings(out)
    assert timings["prompt_tokens"] == 40
    body = http.get("/debug/steps", params={"limit": 4096})
    assert body.status_code == 200
    page = body.json()
    assert page["object"] == "list" and page["dropped"] == 0
    assert page["config"]["max_num_batched_tokens"] == BUDGET
    assert page["next"] == page["data"][-1]["step"] == page["latest"]
    rows = [(rec, row) for rec in page["data"] for row in rec["requests"] if row["id"] == out.id]
    prefill = [(rec["step"], row["tokens"], row["context"]) for rec, row in rows
               if row["kind"] == "prefill"]
    assert [p[1] for p in prefill] == [16, 16, 8]
    assert [r[:3] for r in timings["steps"]["prefill"]] == [list(p) for p in prefill]
    assert timings["prefill_chunks"] == 3
    decodes = [row["context"] for _, row in rows if row["kind"] == "decode"]
    assert decodes == [41, 42, 43, 44, 45]
    steps = timings["steps"]
    assert steps["decode_steps"] == 5
    assert steps["decode_context"] == {"first": 41, "last": 45}
    assert timings["kv_bytes_read_per_token"] == pytest.approx(
        sum(rec["kv_bytes_read"] for rec, row in rows if row["kind"] == "decode") / 5)
    assert timings["queue"]["max_num_seqs"] == 64 and timings["recomputed_tokens"] == 0
    assert timings["reasoning_tokens"] == 0
    _no_text(body.text, out.choices[0].text)
    later = http.get("/debug/steps", params={"since": page["next"]}).json()
    assert later["data"] == [] and later["next"] == page["next"]


def test_each_choice_of_a_response_is_named_in_the_step_log(client, http):
    since = http.get("/debug/steps", params={"limit": 1}).json()["latest"]
    out = client.completions.create(model="tiny", prompt=_prompt(6), max_tokens=3, n=2,
                                    temperature=1, seed=1, extra_body={"ignore_eos": True})
    data = http.get("/debug/steps", params={"since": since}).json()["data"]
    rows = [row for rec in data for row in rec["requests"] if row["id"] == out.id]
    assert {row["choice"] for row in rows} == {0, 1}
    assert sum(row["kind"] == "decode" for row in rows) == 2 * 2


def test_finished_requests_are_listed_with_their_timings_newest_first(client, http):
    first, second = (_complete(client, _prompt(8), max_tokens=2) for _ in range(2))
    listed = http.get("/debug/requests").json()
    assert listed["object"] == "list"
    finished = [row for row in listed["data"] if row["state"] == "finished"]
    ids = [row["id"] for row in finished]
    assert ids.index(second.id) < ids.index(first.id)
    row = http.get(f"/debug/requests/{second.id}").json()
    assert row["timings"] == _timings(second)
    assert row["model"] == "tiny" and row["status"] == 200 and row["finish_reason"] == "length"
    assert [r["id"] for r in http.get("/debug/requests", params={"limit": 1}).json()["data"]
            if r["state"] == "finished"] == [second.id]
    _no_text(json.dumps(listed), first.choices[0].text, second.choices[0].text)
    missing = http.get("/debug/requests/cmpl-nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"


class Gate:
    """Holds the engine thread before the first step that `when` picks, until `release`: the
    requests in flight then stay where they are while the test looks at them."""

    def __init__(self, engine, when):
        self.executor, self.inner, self.when = engine.executor, engine.executor.execute, when
        self.reached, self.opened = threading.Event(), threading.Event()

    def __enter__(self):
        self.executor.execute = self
        return self

    def __call__(self, out):
        if not self.opened.is_set() and self.when(out):
            self.reached.set()
            self.opened.wait(60)
        return self.inner(out)

    def release(self) -> None:
        self.opened.set()

    def __exit__(self, *exc) -> None:
        self.release()
        del self.executor.execute


def _in_flight(http) -> dict:
    return {r["id"]: r for r in http.get("/debug/requests").json()["data"]
            if r["state"] != "finished"}


def test_requests_in_flight_are_listed_by_their_stage(server, http):
    def in_decode(out):
        return any(s.request.num_output_tokens for s in out.scheduled)

    with Gate(server.engine, in_decode) as gate, _stream_completion(server, 50) as response:
        assert gate.reached.wait(60)
        events = _events(response)  # one iterator: a dropped one would close the stream
        first = next(events)
        row = http.get(f"/debug/requests/{first['id']}").json()
        assert (row["state"], row["completion_tokens"], row["prompt_tokens"]) == ("decode", 1, 8)
        assert row["ttft_ms"] > 0 and row["elapsed_ms"] >= row["ttft_ms"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            queued = pool.submit(httpx.post, server.base_url + "/v1/completions", timeout=120,
                                 json={"model": "tiny", "prompt": _prompt(4), "max_tokens": 1})
            _wait_until(lambda: len(_in_flight(http)) == 2)
            rows = _in_flight(http)
            assert rows[first["id"]]["state"] == "decode"
            [other] = [r for i, r in rows.items() if i != first["id"]]
            assert (other["state"], other["completion_tokens"]) == ("queued", 0)
            diagnosis = http.get(f"/debug/requests/{first['id']}/diagnosis")
            assert diagnosis.status_code in (409, 501)
            gate.release()
            assert queued.result(60).status_code == 200
        assert len(list(events)) > 1
    assert _in_flight(http) == {}


def test_a_prompt_being_computed_is_listed_in_prefill(server, http):
    def second_chunk(out):
        return any(s.start == BUDGET and not s.request.num_output_tokens
                   for s in out.scheduled)

    with Gate(server.engine, second_chunk) as gate, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        done = pool.submit(httpx.post, server.base_url + "/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": _prompt(40), "max_tokens": 1})
        assert gate.reached.wait(60)
        [row] = _in_flight(http).values()
        assert (row["state"], row["computed_tokens"], row["prompt_tokens"]) == (
            "prefill", BUDGET, 40)
        gate.release()
        assert done.result(60).status_code == 200


def _stream_completion(server, max_tokens: int):
    body = {"model": "tiny", "prompt": _prompt(8), "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    return httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120)


@pytest.mark.parametrize(("path", "params", "param"), [
    ("/debug/steps", {"limit": 0}, "limit"), ("/debug/steps", {"limit": 4097}, "limit"),
    ("/debug/steps", {"since": -1}, "since"), ("/debug/steps", {"since": "x"}, "since"),
    ("/debug/requests", {"limit": "1.5"}, "limit"), ("/debug/requests", {"limit": 513}, "limit")])
def test_bad_parameters_get_an_openai_error(http, path, params, param):
    response = http.get(path, params=params)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_the_diagnosis_route_answers_with_the_diagnosis_or_says_there_is_none(client, http):
    out = _complete(client, _prompt(10), max_tokens=3)
    response = http.get(f"/debug/requests/{out.id}/diagnosis")
    if importlib.util.find_spec("lifeline.bench.diagnose") is None:
        assert response.status_code == 501
        assert response.json()["error"]["code"] == "diagnosis_unavailable"
    else:
        assert response.status_code == 200, response.text


def test_a_single_server_lists_itself_as_its_only_backend(http):
    assert http.get("/debug/backends").json()["data"] == [
        {"name": "tiny", "model": "tiny", "local": True, "default": True, "routes": ["tiny"]}]


def test_the_dashboard_page_is_served_when_installed(http):
    response = http.get("/dashboard")
    page = DASHBOARD_DIR / "index.html"
    if page.is_file():
        assert response.status_code == 200 and response.text == page.read_text()
        assert response.headers["content-type"].startswith("text/html")
    else:
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "dashboard_not_installed"
    assert http.get("/dashboard/static/..%2Fdebug.py").status_code == 404
    assert http.get("/dashboard/static/nothing.js").status_code == 404


def _events(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def _loop_tasks(server) -> int:
    loop = server.server._loop

    async def count() -> int:
        return len(asyncio.all_tasks())

    return asyncio.run_coroutine_threadsafe(count(), loop).result(10)


def test_the_event_stream_carries_a_request_sent_while_it_is_open(server, client, http):
    tasks, threads = _loop_tasks(server), _threads()
    with httpx.stream("GET", server.base_url + "/dashboard/events", timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
        opening = next(events)
        assert set(opening) >= {"now", "engine", "steps", "requests", "histograms"}
        assert opening["engine"]["kv_blocks_total"] == 256
        assert len(server.state.viewers) == 1
        out = _complete(client, _prompt(12), max_tokens=4)
        seen_steps, seen_finished, received = set(), None, []
        for _, event in zip(range(120), events):
            received.append(json.dumps(event))
            seen_steps |= {row["id"] for rec in event["steps"] for row in rec["requests"]}
            seen_finished = next((r for r in event["requests"] if r["id"] == out.id
                                  and r["state"] == "finished"), None)
            if seen_finished and out.id in seen_steps:
                break
        assert seen_finished is not None and out.id in seen_steps
        assert seen_finished["timings"] == _timings(out)
        histograms = event["histograms"]
        assert sum(count for _, count in histograms["ttft_ms"]) >= 1
        assert histograms["ttft_ms"][-1][0] is None
        _no_text("".join(received), out.choices[0].text)
    _wait_until(lambda: not server.state.viewers)
    _wait_until(lambda: _loop_tasks(server) <= tasks)
    assert _threads() <= threads


def _threads() -> int:
    """Threads but the server's idle workers (anyio keeps them a while after any use)."""
    return sum(not t.name.startswith("AnyIO worker") for t in threading.enumerate())


def _wait_until(condition, tries: int = 200) -> None:
    """Poll (a condition, not a duration: no figure is asserted)."""
    import time

    for _ in range(tries):
        if condition():
            return
        time.sleep(0.05)
    assert condition()


def test_with_api_keys_only_the_admin_key_opens_the_debug_paths(loaded):
    config = _config(api_keys=["tenant"], admin_key="boss")
    with ServerThread(loaded, config) as srv:
        base = srv.base_url
        tenant, boss = ({"Authorization": f"Bearer {k}"} for k in ("tenant", "boss"))
        for page in ("/dashboard", "/dashboard/static/dashboard.js"):
            assert httpx.get(base + page, timeout=30).status_code == 200, "code, no data: open"
        for path in ("/debug/steps", "/debug/requests", "/dashboard/events",
                     "/debug/requests/x/diagnosis"):
            for headers in ({}, tenant, {"Authorization": "Bearer wrong"}):
                response = httpx.get(base + path, headers=headers, timeout=30)
                assert response.status_code == 403, (path, headers)
                assert response.json()["error"]["code"] == "admin_key_required"
        assert httpx.get(base + "/debug/steps", headers=boss, timeout=30).status_code == 200
        page = httpx.get(base + "/dashboard", timeout=30)  # the page holds no data
        assert page.status_code == (200 if (DASHBOARD_DIR / "index.html").is_file() else 404)
        query = httpx.get(base + "/debug/requests", params={"admin_key": "boss"}, timeout=30)
        assert query.status_code == 200
        with httpx.stream("GET", base + "/dashboard/events", params={"admin_key": "boss"},
                          timeout=30) as response:
            assert response.status_code == 200 and "engine" in next(_events(response))
        assert httpx.post(base + "/v1/completions", headers=boss, timeout=30, json={
            "model": "tiny", "prompt": "a", "max_tokens": 1}).status_code == 401


def test_with_api_keys_and_no_admin_key_the_debug_paths_are_closed(loaded):
    config = _config(api_keys=["tenant"],
                     engine=EngineConfig(num_kv_blocks=64, step_log_size=0))
    with ServerThread(loaded, config) as srv:
        response = httpx.get(srv.base_url + "/debug/requests", timeout=30,
                             headers={"Authorization": "Bearer tenant"})
        assert response.status_code == 403
        assert "no admin key" in response.json()["error"]["message"]


def test_an_admin_key_alone_protects_the_debug_paths_and_a_log_off_says_so(loaded):
    config = _config(admin_key="boss", engine=EngineConfig(num_kv_blocks=64, step_log_size=0))
    with ServerThread(loaded, config) as srv:
        base = srv.base_url
        assert httpx.get(base + "/debug/steps", timeout=30).status_code == 403
        off = httpx.get(base + "/debug/steps", headers={"Authorization": "Bearer boss"},
                        timeout=30)
        assert off.status_code == 404 and off.json()["error"]["code"] == "step_log_disabled"
        done = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": _prompt(5), "max_tokens": 2}).json()
        assert done["timings"]["steps"]["prefill"][0][1] == 5


def test_the_command_line_sets_the_admin_key_and_the_step_log_size():
    from lifeline.cli import build_parser, serve_config

    config = serve_config(build_parser().parse_args(
        ["serve", "--admin-key", "boss", "--step-log-size", "0", "--api-key", "t"]))
    assert config.admin_key == "boss" and config.engine.step_log_size == 0
    default = serve_config(build_parser().parse_args(["serve"]))
    assert default.admin_key is None and default.engine.step_log_size == 4096
    with pytest.raises(ValueError):
        EngineConfig(step_log_size=-1)


def test_a_dashboard_that_takes_no_events_is_dropped_and_others_go_on(server, client, http,
                                                                       monkeypatch, caplog):
    """A client that opens the stream and never reads: once the socket's buffers are full the
    server's send blocks, and after SEND_TIMEOUT_S the stream ends (events come every
    millisecond here so the buffers fill at once; the timeout is cut to one second)."""
    import socket

    from lifeline.server import debug

    monkeypatch.setattr(debug, "EVENT_INTERVAL_S", 0.001)
    monkeypatch.setattr(debug, "SEND_TIMEOUT_S", 1.0)
    tasks = _loop_tasks(server)
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", server.config.port))
    stalled.sendall(b"GET /dashboard/events HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        _wait_until(lambda: len(server.state.viewers) == 1)
        with caplog.at_level("WARNING", logger="lifeline.server"):
            _wait_until(lambda: not server.state.viewers, tries=600)  # 30 s at most
        assert any("dropped" in r.getMessage() for r in caplog.records)
        out = _complete(client, _prompt(8), max_tokens=3)  # the server goes on
        assert out.choices[0].finish_reason == "length"
        with httpx.stream("GET", server.base_url + "/dashboard/events",
                          timeout=30) as response:
            assert response.status_code == 200 and "engine" in next(_events(response))
    finally:
        stalled.close()
    _wait_until(lambda: not server.state.viewers)
    _wait_until(lambda: _loop_tasks(server) <= tasks)


def test_more_dashboards_than_the_limit_get_503_with_retry_after(server):
    from lifeline.server.debug import MAX_VIEWERS

    with contextlib.ExitStack() as stack:
        streams = []  # kept: a closed event generator closes its connection
        for _ in range(MAX_VIEWERS):
            streams.append(_events(stack.enter_context(httpx.stream(
                "GET", server.base_url + "/dashboard/events", timeout=30))))
            next(streams[-1])
        assert len(server.state.viewers) == MAX_VIEWERS
        extra = httpx.get(server.base_url + "/dashboard/events", timeout=30)
        assert extra.status_code == 503 and extra.headers["retry-after"]
        assert extra.json()["error"]["code"] == "too_many_viewers"
    _wait_until(lambda: not server.state.viewers)


GATEWAY = """
[server]
api_keys = ["tenant"]
admin_key = "boss"
default_model = "tiny-a"

[backends.a]
model = "tiny-a"
[backends.a.engine]
num_kv_blocks = 128
block_size = 4

[backends.b]
model = "tiny-b"
[backends.b.engine]
num_kv_blocks = 128
block_size = 4

[backends.far]
base_url = "http://127.0.0.1:9"

[models.tiny-a]
backends = ["a"]
[models.tiny-b]
backends = ["b"]
[models.far]
backends = ["far"]
"""


@pytest.fixture(scope="module")
def gateway(loaded):
    from lifeline.gateway.config import parse_config
    from lifeline.gateway.testing import GatewayThread

    with GatewayThread(parse_config(GATEWAY, ".toml"), {"a": loaded, "b": loaded}) as gw:
        yield gw


def test_the_gateway_serves_each_local_backends_debug_paths_to_the_admin_key(gateway):
    base = gateway.base_url
    boss = httpx.Client(base_url=base, timeout=60, headers={"Authorization": "Bearer boss"})
    tenant = openai.OpenAI(base_url=base + "/v1", api_key="tenant")
    out = tenant.completions.create(model="tiny-b", prompt=_prompt(9), max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    for path in ("/debug/steps", "/debug/requests", "/debug/backends", "/dashboard/events",
                 f"/debug/requests/{out.id}"):
        response = httpx.get(base + path, headers={"Authorization": "Bearer tenant"}, timeout=30)
        assert response.status_code == 403, path
    assert httpx.get(base + "/dashboard", timeout=30).status_code in (200, 404)

    def ids(params: dict) -> set:
        data = boss.get("/debug/steps", params={"limit": 4096, **params}).json()["data"]
        return {row["id"] for rec in data for row in rec["requests"]}

    assert out.id in ids({"model": "tiny-b"}) and out.id in ids({"backend": "b"})
    assert out.id not in ids({}), "the default is the default model's backend, a"
    assert out.id not in ids({"backend": "a"})
    row = boss.get(f"/debug/requests/{out.id}")  # found in whichever backend holds it
    assert row.status_code == 200 and row.json()["timings"]["prompt_tokens"] == 9
    if importlib.util.find_spec("lifeline.bench.diagnose") is not None:
        assert boss.get(f"/debug/requests/{out.id}/diagnosis").status_code == 200
    listed = boss.get("/debug/requests", params={"backend": "b"})
    assert out.id in {r["id"] for r in listed.json()["data"]}
    _no_text(listed.text + row.text, out.choices[0].text)
    backends = {b["name"]: b for b in boss.get("/debug/backends").json()["data"]}
    assert {n: (b["local"], b["default"], b["routes"]) for n, b in backends.items()} == {
        "a": (True, True, ["tiny-a"]), "b": (True, False, ["tiny-b"]),
        "far": (False, False, ["far"])}
    for params, status, code, param in (
            ({"backend": "nope"}, 404, "backend_not_found", "backend"),
            ({"backend": "x" * 5000}, 404, "backend_not_found", "backend"),
            ({"backend": "far"}, 404, "backend_not_local", "backend"),
            ({"model": "far"}, 404, "backend_not_local", "model"),
            ({"model": "nope"}, 404, "model_not_found", "model"),
            ({"backend": "b", "limit": "0"}, 400, "invalid_value", "limit")):
        response = boss.get("/debug/steps", params=params)
        assert response.status_code == status, (params, response.text)
        error = response.json()["error"]
        assert error["code"] == code and error["param"] == param, error
        assert len(error["message"]) < 400, "a hostile name is not echoed whole"
    assert boss.get("/debug/requests/nope").status_code == 404


def test_the_gateway_streams_a_backends_dashboard_events(gateway):
    base = gateway.base_url
    tenant = openai.OpenAI(base_url=base + "/v1", api_key="tenant")
    with httpx.stream("GET", base + "/dashboard/events", timeout=60,
                      params={"backend": "b", "admin_key": "boss"}) as response:
        assert response.status_code == 200
        events = _events(response)
        assert next(events)["engine"]["kv_blocks_total"] == 128
        out = tenant.completions.create(model="tiny-b", prompt=_prompt(7), max_tokens=2,
                                        temperature=0, extra_body={"ignore_eos": True})
        for _, event in zip(range(120), events):
            if any(r["id"] == out.id and r["state"] == "finished" for r in event["requests"]):
                break
        else:
            raise AssertionError("the request never reached the stream")
    b = gateway.app.state.lifeline.local()["b"]
    _wait_until(lambda: not b.viewers)
