"""Small real servers on loopback for the gateway's tests: an OpenAI-shaped upstream whose
behaviour a test switches (answer, fail with a status, hold requests until released, replay a
stream captured from a real peer), and a socket that accepts connections and never answers.
They stand where the model does not matter (the router's choices, its fallbacks); the tests
that need a model use real `lifeline serve` processes."""
from __future__ import annotations

import asyncio
import json
import socket
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
        body = await request.json()
        self.requests.append({"path": request.url.path, "body": body,
                              "headers": dict(request.headers)})
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
