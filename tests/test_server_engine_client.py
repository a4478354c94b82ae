"""The seam between the HTTP layer and the engine: the handlers know an engine only as an
`EngineClient`, and what a stream reads from an output never changes as the engine goes on.
A stand-in engine (no model) keeps stepping while the reader is slow."""
import ast
import asyncio
import threading
import time
from pathlib import Path

import pytest

from lifeline.engine.engine import RequestOutput
from lifeline.engine.request import FinishReason, Request, RequestStatus
from lifeline.engine.sampling_params import SamplingParams
from lifeline.server.async_engine import AsyncEngine
from lifeline.server.engine_client import GenerationOutput
from lifeline.server.errors import APIError

SERVER = Path(__file__).resolve().parents[1] / "lifeline" / "server"


class StandInEngine:
    """Gives every request one token a step (its id is the step number), as `LLMEngine` does:
    each output holds the live request."""

    def __init__(self, tokens: int, step_s: float = 0.005):
        self.tokens = tokens
        self.step_s = step_s
        self.requests: dict[str, Request] = {}
        self.stepped = threading.Event()

    def add_request(self, prompt, params, request_id, arrival, *, cache_salt=None, deadline=None,
                    fault=None, client_id=None, choice_index=None):
        if not prompt:
            raise ValueError("the prompt is empty")
        req = Request(request_id, list(prompt), params)
        req.timeline.arrival = arrival
        self.requests[request_id] = req

    def abort_request(self, request_id):
        req = self.requests.pop(request_id, None)
        if req is not None:
            req.status = RequestStatus.FINISHED

    def has_unfinished_requests(self):
        return bool(self.requests)

    def close(self):
        """`LLMEngine.close`, which the engine loop calls as it ends: nothing to release."""

    def step(self):
        time.sleep(self.step_s)
        outputs = []
        for req in list(self.requests.values()):
            token = len(req.output_token_ids)
            req.output_token_ids.append(token)
            req.timeline.token_times.append(time.perf_counter())
            if req.timeline.first_token is None:
                req.timeline.first_token = req.timeline.token_times[-1]
            done = len(req.output_token_ids) == self.tokens
            if done:
                req.status, req.finish_reason = RequestStatus.FINISHED, FinishReason.LENGTH
                del self.requests[req.request_id]
            outputs.append(RequestOutput(req.request_id, [token], f"<{token}>",
                                         "".join(f"<{t}>" for t in req.output_token_ids)
                                         if done else "", done, req))
        self.stepped.set()
        return outputs


@pytest.fixture
def client():
    engine = StandInEngine(tokens=8)
    client = AsyncEngine(lambda: engine)
    client.start()
    client.wait_started()
    yield client
    client.stop()


def test_outputs_are_snapshots_a_slow_reader_never_sees_later_tokens(client):
    async def read_slowly():
        outs = []
        async for out in client.generate([1, 2, 3], SamplingParams(), "r1",
                                         arrival=time.perf_counter()):
            outs.append(out)
            await asyncio.sleep(0.03)  # the engine steps several times meanwhile
        return outs

    outs = asyncio.run(read_slowly())
    assert all(isinstance(o, GenerationOutput) for o in outs)
    assert [o.new_token_ids for o in outs] == [(i,) for i in range(8)]
    first, last = outs[0], outs[-1]
    assert first.timeline.token_times == [first.token_time], "no later token's time"
    assert first.timeline.first_token == first.token_time and not first.finished
    assert all(o.timeline is None for o in outs[1:-1])
    assert last.finished and last.finish_reason == "length"
    assert last.timeline.token_times == [o.token_time for o in outs]
    assert last.text == "".join(o.new_text for o in outs)
    with pytest.raises(AttributeError):
        first.new_text = "changed"


def test_a_refused_request_raises_and_a_closed_stream_aborts(client):
    async def scenario():
        with pytest.raises(ValueError, match="empty"):
            async for _ in client.generate([], SamplingParams(), "bad", arrival=0.0):
                pass
        stream = client.generate([1], SamplingParams(), "r2", arrival=time.perf_counter())
        await anext(stream)
        await stream.aclose()
        deadline = time.monotonic() + 5
        while client.engine.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not client.engine.requests, "closing the stream aborted the request"

    asyncio.run(scenario())


def test_a_reader_whose_loop_closed_does_not_stop_the_engine(client):
    async def leave_early():
        stream = client.generate([1], SamplingParams(), "r4", arrival=time.perf_counter())
        await anext(stream)  # the loop closes with the request still running

    asyncio.run(leave_early())
    deadline = time.monotonic() + 5
    while client.engine.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not client.engine.requests and client.dead_error is None


def test_a_request_the_engine_ended_without_an_answer_raises_its_api_error(client):
    from lifeline.engine.request import RequestError

    def failing_step():
        outputs = []
        for req in list(client.engine.requests.values()):
            req.status, req.error = RequestStatus.FINISHED, RequestError.TIMEOUT
            del client.engine.requests[req.request_id]
            outputs.append(RequestOutput(req.request_id, [], "", "", True, req))
        return outputs

    client.engine.step = failing_step

    async def scenario():
        async for _ in client.generate([1], SamplingParams(), "r3", arrival=0.0):
            pass

    with pytest.raises(APIError) as failure:
        asyncio.run(scenario())
    assert failure.value.status == 503 and failure.value.code == "request_timeout"
    timeline = failure.value.timeline  # the engine's last word, for the request's record
    assert timeline is not None and timeline.arrival == 0.0


def test_an_add_still_queued_when_the_engine_loop_dies_is_refused_not_left_waiting(client):
    """The loop dies in a step while a second request's add waits in its command queue: that
    request gets `EngineDeadError` at once (the engine's deadline cannot end it: the engine is
    gone)."""
    from lifeline.server.engine_client import EngineDeadError

    in_step, queued = threading.Event(), threading.Event()

    def dying_step():
        in_step.set()
        queued.wait(10)
        time.sleep(0.05)  # the second add is in the queue behind the step
        raise SystemExit("the loop itself dies")

    client.engine.step = dying_step

    async def scenario():
        async def first():
            async for _ in client.generate([1], SamplingParams(), "a", arrival=0.0):
                pass

        async def second():
            while not in_step.is_set():
                await asyncio.sleep(0.005)
            stream = client.generate([1], SamplingParams(), "b", arrival=0.0)
            pending = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.01)  # the add is queued now
            queued.set()
            return await asyncio.wait_for(pending, timeout=10)

        results = await asyncio.gather(first(), second(), return_exceptions=True)
        return results

    results = asyncio.run(scenario())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert client.dead_error is not None


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def test_only_the_in_process_client_and_its_factory_know_the_engine():
    """The handlers, streams and state see an `EngineClient`: no `LLMEngine`, no live
    `Request`, no scheduler. `async_engine.py` is the in-process client; `app.py` builds it."""
    for path in SERVER.glob("*.py"):
        names = _imports(path)
        if path.name not in ("async_engine.py", "app.py"):
            assert "lifeline.engine.engine.LLMEngine" not in names, path.name
        for live in ("lifeline.engine.engine.RequestOutput", "lifeline.engine.request.Request"):
            assert path.name == "async_engine.py" or live not in names, path.name
        text = path.read_text()
        for internal in ("state.engine", ".scheduler", "block_manager"):
            assert internal not in text, f"{path.name} reads {internal}"
