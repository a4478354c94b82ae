"""Pure ASGI middleware (no response buffering, so streams and disconnects pass through):
stamps arrival, checks the API key and the body size, and logs requests that no handler
accounted for."""
from __future__ import annotations

import time
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lifeline.observe import ServerStamps
from lifeline.server.errors import APIError
from lifeline.server.gateway import ADMIN_QUERY_KEY, is_admin_path
from lifeline.server.state import ServerState

QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""Not logged unless they fail; nor are the admin paths (`is_admin_path`): a dashboard polls."""


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        stamps = ServerStamps(arrival=time.perf_counter())
        scope_state = scope.setdefault("state", {})
        scope_state["stamps"] = stamps
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            scope_state["key"] = self._admit(scope)
        except APIError as exc:
            await exc.response()(scope, receive, send_wrapper)
            self._log(scope, stamps, exc.status)
            return
        try:
            await self.app(scope, _limit_body(receive, self.state.config.max_body_bytes),
                           send_wrapper)
        finally:
            if not scope_state.get("accounted"):
                self._log(scope, stamps, status)

    def _admit(self, scope: Scope) -> str:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        if _is_preflight(scope, headers):
            return "anonymous"  # a browser never sends a key on a preflight
        path = scope["path"]
        query_key = _query_admin_key(scope) if is_admin_path(path) else None
        key = self.state.auth.check(path, headers.get("authorization"), query_key)
        length = headers.get("content-length")
        if length and length.isdigit() and int(length) > self.state.config.max_body_bytes:
            raise APIError(413, f"the body is larger than {self.state.config.max_body_bytes} "
                           "bytes", None, "body_too_large")
        return key

    def _log(self, scope: Scope, stamps: ServerStamps, status: int) -> None:
        path = scope["path"]
        if (path in QUIET_PATHS or path.startswith(("/debug/", "/dashboard"))) and status < 400:
            return
        stamps.last_byte = time.perf_counter()
        self.state.log_plain(stamps, scope["path"], status)


def _query_admin_key(scope: Scope) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get(ADMIN_QUERY_KEY)
    return values[0] if values else None


def _is_preflight(scope: Scope, headers: dict[str, str]) -> bool:
    return (scope.get("method") == "OPTIONS" and "origin" in headers
            and "access-control-request-method" in headers)


def _limit_body(receive: Receive, limit: int) -> Receive:
    """Stops a chunked body that grows past `limit` (no Content-Length to check up front)."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise APIError(413, f"the body is larger than {limit} bytes", None,
                               "body_too_large")
        return message

    return wrapped
