"""Small real servers on loopback for the gateway's tests: an OpenAI-shaped upstream whose
behaviour a test switches (answer, fail with a status, hold requests until released, replay a
stream captured from a real peer, or answer in one of the hostile or broken ways of
`Upstream.script`), a bare HTTP/1.1 server whose connections close where a test says
(`RawUpstream`), and a socket that accepts connections and never answers. They stand where the
model does not matter (the router's choices, its fallbacks); the tests that need a model use
real `lifeline serve` processes."""
from __future__ import annotations

import asyncio
import gzip
import json
import re
import socket
import struct
import threading
import time
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lifeline.server.testing import free_port


class Upstream:
    """`with Upstream("a") as up:` an OpenAI-compatible server at `up.base_url` (with `/v1`)
    that answers "answer from a"."""

    def __init__(self, name: str):
        self.name = name
        self.mode = "ok"
        """'ok', 'fail' (`fail_status`), 'hold' (answer once `release()` is called)."""
        self.fail_status = 503
        self.healthy = True
        self.replay: dict[str, Any] | None = None
        """A capture from `scripts/capture_peer_streams.py`, replayed as recorded."""
        self.script: str | None = None
        """A broken or hostile answer, one of SCRIPTS (None: answer well)."""
        self.piece_bytes = 16 << 10
        """How a script that sends much sends it: pieces of this size ..."""
        self.piece_every_s = 0.0
        """... this far apart ..."""
        self.total_bytes = 4 << 20
        """... up to this many bytes in all."""
        self.sent_bytes = 0
        """Bytes a script's answer had sent when the gateway stopped reading (or it ended)."""
        self.answer: bytes | None = None
        """With script 'fixed': the whole answer's bytes, sent as they are."""
        self.requests: list[dict[str, Any]] = []
        self.health_hits = 0
        self._released = threading.Event()
        self.port = free_port()
        app = Starlette(routes=[
            Route("/v1/chat/completions", self._generate, methods=["POST"]),
            Route("/v1/completions", self._generate, methods=["POST"]),
            Route("/health", self._health)])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def hold(self) -> None:
        self._released.clear()
        self.mode = "hold"

    def release(self) -> None:
        self.mode = "ok"
        self._released.set()

    def served(self, model: str | None = None) -> int:
        return sum(1 for r in self.requests if model is None or r["body"].get("model") == model)

    async def _health(self, request: Request) -> Response:
        self.health_hits += 1
        return JSONResponse({"status": "ok" if self.healthy else "down"},
                            200 if self.healthy else 503)

    async def _generate(self, request: Request) -> Response:
        raw = await request.body()
        # a large body is not parsed: this server shares the process (and the GIL) with the
        # gateway of a test that measures the gateway's event loop
        body = json.loads(raw) if len(raw) <= 1 << 20 else {"bytes": len(raw)}
        self.requests.append({"path": request.url.path, "body": body,
                              "headers": dict(request.headers)})
        if self.script is not None:
            return self._scripted(request.url.path.endswith("chat/completions"),
                                  body.get("stream") is True)
        if self.mode == "fail":
            return JSONResponse({"error": {"message": "overloaded", "type": "server_error",
                                           "param": None, "code": None}}, self.fail_status,
                                {"Retry-After": "2"})
        while self.mode == "hold" and not self._released.is_set():
            await asyncio.sleep(0.01)
        if self.replay is not None:
            return self._replayed()
        n = len(self.requests)
        chat = request.url.path.endswith("chat/completions")
        words = ["answer", " from", f" {self.name}"]
        if body.get("stream"):
            return StreamingResponse(self._chunks(n, chat, words, body),
                                     media_type="text/event-stream")
        message = ({"message": {"role": "assistant", "content": "".join(words)}} if chat
                   else {"text": "".join(words)})
        return JSONResponse({"id": f"{self.name}-{n}", "object": "chat.completion" if chat
                             else "text_completion", "created": int(time.time()),
                             "model": body.get("model"), "choices": [
                                 {"index": 0, **message, "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 5, "completion_tokens": 3,
                                       "total_tokens": 8}})

    async def _chunks(self, n: int, chat: bool, words: list[str], body: dict[str, Any]):
        base = {"id": f"{self.name}-{n}", "object": "chat.completion.chunk" if chat else
                "text_completion", "created": int(time.time()), "model": body.get("model")}

        def chunk(piece: str | None, finish: str | None = None) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if piece is None else (
                    {"content": piece} if piece else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": finish}
            return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"

        if chat:
            yield chunk(None)
        for word in words:
            await asyncio.sleep(0.002)
            yield chunk(word)
        yield chunk("", "stop")
        yield "data: [DONE]\n\n"

    def _scripted(self, chat: bool, stream: bool) -> Response:
        """The answer `script` names (SCRIPTS says what each sends)."""
        script = self.script
        base = {"id": f"{self.name}-s", "object": "chat.completion.chunk" if stream else
                "chat.completion", "created": int(time.time()), "model": "m"}
        if script == "fixed":
            return Response(self.answer, media_type="application/json")
        if script == "client_error":
            return JSONResponse({"error": {"message": "max_tokens must be positive",
                                           "type": "invalid_request_error",
                                           "param": "max_tokens", "code": None}}, 400)
        if script == "gzip":
            answer = json.dumps({**base, "choices": [_choice(chat, False, "zipped", "stop")]})
            return Response(gzip.compress(answer.encode()), media_type="application/json",
                            headers={"content-encoding": "gzip"})
        if script in ("huge_event", "trickle"):
            head = f"data: {json.dumps(base)[:-1]}, \"choices\": [{{\"index\": 0, " \
                   "\"delta\": {\"content\": \"" if stream else \
                f"{json.dumps(base)[:-1]}, \"choices\": [{{\"index\": 0, \"text\": \""
            return StreamingResponse(self._much(head.encode()), media_type=(
                "text/event-stream" if stream else "application/json"))
        if script in ("cut", "no_done", "slow_tokens", "error_after_output",
                      "bad_after_output"):
            return StreamingResponse(self._broken_stream(chat, base), media_type=(
                "text/event-stream"))
        bad = BAD_ANSWERS[script]
        if not stream:
            if isinstance(bad, str):
                return Response(bad.encode(), media_type="application/json")
            return Response(json.dumps({**base, **bad}).encode(),
                            media_type="application/json")

        async def events():
            yield f"data: {json.dumps({**base, 'choices': [_choice(chat, True, '', None)]})}" \
                  "\n\n"
            text = bad if isinstance(bad, str) else json.dumps({**base, **bad})
            yield f"data: {text}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def _much(self, head: bytes):
        """`head`, then `x` in pieces, never a line's end, up to `total_bytes`."""
        self.sent_bytes = len(head)
        yield head
        piece = b"x" * self.piece_bytes
        while self.sent_bytes < self.total_bytes:
            if self.piece_every_s:
                await asyncio.sleep(self.piece_every_s)
            self.sent_bytes += len(piece)
            yield piece

    async def _broken_stream(self, chat: bool, base: dict[str, Any]):
        """Output, then: the connection cut ('cut'), the stream ended without `[DONE]`
        ('no_done'), an error event ('error_after_output'), an event that is not JSON
        ('bad_after_output'), or a token every `piece_every_s` without end ('slow_tokens')."""
        for word in ("answer", " from", f" {self.name}"):
            yield f"data: {json.dumps({**base, 'choices': [_choice(chat, True, word, None)]})}" \
                  "\n\n"
            await asyncio.sleep(0.01)
        if self.script == "cut":
            raise ConnectionResetError("the upstream dies mid-answer (scripted)")
        if self.script == "bad_after_output":
            yield 'data: {"choices": [{"index": 0, "delta": {"content": "unterminated\n\n'
        if self.script == "error_after_output":
            yield 'data: {"error": {"message": "out of memory", "type": "server_error", ' \
                  '"param": null, "code": null}}\n\n'
        while self.script == "slow_tokens":
            await asyncio.sleep(self.piece_every_s)
            yield f"data: {json.dumps({**base, 'choices': [_choice(chat, True, '.', None)]})}" \
                  "\n\n"

    def _replayed(self) -> Response:
        doc = self.replay
        headers = {k: v for k, v in doc["headers"].items()
                   if k not in ("transfer-encoding", "connection", "content-length")}

        async def lines():
            for _, line in doc["lines"]:
                yield line.encode()
        return StreamingResponse(lines(), doc["status"], headers=headers)

    def start(self) -> Upstream:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError(f"upstream {self.name} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._released.set()
        self.server.should_exit = True
        self.thread.join(10)

    def __enter__(self) -> Upstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _choice(chat: bool, stream: bool, text: str, finish: str | None) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": text, "finish_reason": finish}
    return {"index": 0, ("delta" if stream else "message"): {"role": "assistant",
                                                             "content": text},
            "finish_reason": finish}


_GOOD = [{"index": 0, "text": "fine", "message": {"role": "assistant", "content": "fine"},
          "finish_reason": "stop"}]
BAD_ANSWERS: dict[str, Any] = {
    "bad_json": '{"choices": [{"index": 0, "text": "unterminated',
    "not_an_object": "[1, 2, 3]",
    "wrong_choices": {"choices": 5},
    "wrong_content": {"choices": [{"index": 0, "text": 7, "message": {"content": 7},
                                   "delta": {"content": 7}, "finish_reason": "stop"}]},
    "wrong_index": {"choices": [{**_GOOD[0], "index": 9}]},
    "wrong_usage": {"choices": _GOOD, "usage": {"prompt_tokens": "five",
                                                "prompt_tokens_details": "many"}},
    "wrong_timings": {"choices": _GOOD, "timings": {"gateway_ms": "slow", "cache_n": []}},
    "nan": '{"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}], '
           '"timings": {"prompt_ms": NaN}}',
    "infinity": '{"choices": [{"index": 0, "text": "x", "finish_reason": "stop"}], '
                '"usage": {"prompt_tokens": 1, "total_tokens": 1}, "created": 1e999}',
    "oversized_id": {"id": "i" * (64 << 10), "choices": _GOOD},
    "oversized_model": {"model": "m" * 5000, "choices": _GOOD},
    "surrogate": '{"choices": [{"index": 0, "text": "\\ud800", "finish_reason": "stop"}]}',
    "deep": '{"choices": [{"index": 0, "text": "x", "finish_reason": "stop", "logprobs": '
            + "[" * 200 + "]" * 200 + "}]}",
}
"""Malformed answers (a whole answer's body, or one event of a stream): bad JSON, wrong types,
non-finite numbers, oversized fields."""
SCRIPTS = (*BAD_ANSWERS, "huge_event", "trickle", "cut", "no_done", "slow_tokens",
           "error_after_output", "bad_after_output", "client_error", "gzip", "fixed")
"""`Upstream.script`: besides BAD_ANSWERS, 'huge_event' (a stream whose first event never
ends: `total_bytes` without a line's end), 'trickle' (a whole answer that never ends, in
`piece_bytes` pieces `piece_every_s` apart), 'cut' (output, then the connection dies), 'no_done'
(output, then the stream ends without `[DONE]`), 'slow_tokens' (output without end),
'error_after_output' (output, then an error event), 'bad_after_output' (output, then an
event that is not JSON), 'client_error' (400, the client's fault),
'gzip' (a compressed answer), 'fixed' (`answer` as it is)."""


class RawUpstream:
    """`with RawUpstream("r") as up:` a bare HTTP/1.1 server (kept-alive connections) whose
    connections do what `mode` says: 'ok' answers each request with a small completion;
    'read_then_close' reads a request whole, then closes without a word; 'close_before_reading'
    closes each new connection at once, reading nothing; 'close_idle' answers, then closes the
    connection `idle_close_s` later while it is idle. `requests` holds every request body read
    whole; `GET /health` always answers."""

    def __init__(self, name: str):
        self.name = name
        self.mode = "ok"
        self.idle_close_s = 0.05
        self.requests: list[dict[str, Any]] = []
        self.connections = 0
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._connection, "127.0.0.1", self.port))
        self._started.set()
        self.loop.run_forever()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            if self.mode == "close_before_reading":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?i)content-length: *(\d+)", head)
                body = await reader.readexactly(int(length.group(1))) if length else b""
                if head.startswith(b"GET"):
                    answer = b'{"status":"ok"}'
                else:
                    self.requests.append(json.loads(body))
                    if self.mode == "read_then_close":
                        return
                    answer = json.dumps({
                        "id": f"{self.name}-{len(self.requests)}", "object": "text_completion",
                        "created": int(time.time()), "model": "m", "choices": [
                            {"index": 0, "text": f"answer from {self.name}",
                             "finish_reason": "stop"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n" % len(answer) + answer)
                await writer.drain()
                if self.mode == "close_idle" and not head.startswith(b"GET"):
                    await asyncio.sleep(self.idle_close_s)
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def __enter__(self) -> RawUpstream:
        self.thread.start()
        self._started.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            self.server.close()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Stalled:
    """Accepts connections, reads what is sent, never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.conns: list[socket.socket] = []
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            conn.setblocking(False)
            self.conns.append(conn)

    def __enter__(self) -> Stalled:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self.thread.join(5)
        for conn in self.conns:
            conn.close()
        self.sock.close()
