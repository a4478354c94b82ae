"""One HTTP exchange with an ASGI application in this process, the response streamed as the
application sends it (httpx's `ASGITransport` collects the whole body first, which would hide
every token until the last). Closing the exchange early tells the application the client went
away, as a closed socket would: a local engine then aborts the request and frees its blocks."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import ASGIApp, Message

_END = {"type": "lifeline.bridge.end"}
"""Put on the queue when the application returns (or raises)."""
SPEC = {"version": "3.0", "spec_version": "2.3"}
"""2.3: Starlette's streaming responses then watch `receive` for the disconnect."""


class BridgeError(RuntimeError):
    """The application failed before it finished its response."""


class AppExchange:
    """`exchange = await AppExchange.open(app, "POST", path, body, headers)`: status and
    headers are known on return; `aiter_bytes` yields the body as it is sent."""

    def __init__(self, app: ASGIApp, scope: dict[str, Any], body: bytes):
        self._queue: asyncio.Queue[Message] = asyncio.Queue()
        self._gone = asyncio.Event()
        self._body: bytes | None = body
        self._ended = False
        self.status = 0
        self.headers: dict[str, str] = {}
        self._task = asyncio.create_task(app(scope, self._receive, self._send))
        self._task.add_done_callback(lambda _: self._queue.put_nowait(_END))

    @classmethod
    async def open(cls, app: ASGIApp, method: str, path: str, body: bytes,
                   headers: dict[str, str]) -> AppExchange:
        scope = {"type": "http", "asgi": SPEC, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
                 "headers": [(k.lower().encode("latin-1"), v.encode("latin-1"))
                             for k, v in headers.items()]}
        exchange = cls(app, scope, body)
        message = await exchange._queue.get()
        if message is _END:
            exchange._raise_failure("before its response")
        exchange.status = message["status"]
        exchange.headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                            for k, v in message.get("headers", ())}
        return exchange

    async def _receive(self) -> Message:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        if not self._gone.is_set():
            self._queue.put_nowait(message)

    def _raise_failure(self, when: str) -> None:
        exc = self._task.exception() if self._task.done() and not self._task.cancelled() \
            else None
        raise BridgeError(f"the local server stopped {when}"
                          + (f": {type(exc).__name__}" if exc else "")) from exc

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        while not self._ended:
            message = await self._queue.get()
            if message is _END:
                self._raise_failure("in the middle of its response")
            if message["type"] != "http.response.body":
                continue
            self._ended = not message.get("more_body", False)
            if message.get("body"):
                yield message["body"]

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def aclose(self) -> None:
        """Hang up: the application sees `http.disconnect` (and is cancelled if it does not
        return by itself soon after)."""
        self._gone.set()
        if self._task.done():
            return
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(asyncio.shield(self._task), 1.0)
        if not self._task.done():
            self._task.cancel()
