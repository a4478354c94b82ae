"""One request through the gateway: try the decision's backends in order until one serves,
then relay its answer.

Nothing reaches the client before a backend has produced its first output token (or, without
streaming, its whole answer), so a failure up to then (connect error, 5xx, 429/503, no first
token within the route's limit, a stream that broke or reported an error) moves the request to
the next backend without the client ever seeing two answers. A stream that breaks after its
first token has been relayed ends with an OpenAI error event and no `data: [DONE]`. At most
`max_attempts` backends are tried."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from lifeline.gateway import record, sse
from lifeline.gateway.backends import Backend, BackendError, Exchange, close_soon, failure_kind
from lifeline.gateway.router import Decision, Route
from lifeline.observe import ServerStamps
from lifeline.server.errors import error_body

log = logging.getLogger("lifeline.gateway")
PASSED_HEADERS = ("content-type", "retry-after")


class Relay:
    def __init__(self, state: Any, stamps: ServerStamps, request_id: str, endpoint: str,
                 body: dict[str, Any], route: Route, decision: Decision):
        self.state, self.stamps, self.id = state, stamps, request_id
        self.endpoint, self.body, self.route, self.decision = endpoint, body, route, decision
        self.stream = body.get("stream") is True
        self.expected_choices = _choices(body)
        self.routed: float | None = None
        self.failed_s = 0.0
        self.marks: dict[str, float] = {}
        self.sent_at: float | None = None
        self.first_output: float | None = None
        self.backend: Backend | None = None
        self.reported: dict[str, Any] | None = None
        """The backend's own stage timings: `{"timings": ...}` or vLLM's `{"metrics": ...}`."""
        self.usage: dict[str, Any] | None = None
        self.status = 200
        self.verdict: bool | None = None
        self.accounted = False
        self.aborted = False
        self._exchange: Exchange | None = None
        self._bodies: dict[str, bytes] = {}
        self._seen: dict[str, Any] = {}
        """The stream's id, object, created and model (for a closing chunk of our own)."""
        self._finished: set[int] = set()
        self._ended = False

    @property
    def headers(self) -> dict[str, str]:
        return {"accept": "text/event-stream" if self.stream else "application/json",
                "x-request-id": self.id}

    # -- the attempts -------------------------------------------------------------------

    async def respond(self) -> Response:
        state = self.state
        state.admission.in_flight += 1
        state.generations.add(self)
        handed_off = False
        try:
            response = await self._attempts()
            handed_off = isinstance(response, StreamingResponse)
            return response
        except asyncio.CancelledError:
            self.status = 499
            raise
        finally:
            if not handed_off:
                self.finish()

    async def _attempts(self) -> Response:
        spec = self.route.spec
        tried = 0
        previous: Backend | None = None
        order = list(self.decision.order)
        while order:
            backend = order.pop(0)
            if tried >= spec.max_attempts or self.aborted:
                break
            if not backend.acquire():
                self.decision.attempts.append({"backend": backend.name, "outcome": "skipped",
                                               "note": backend.unavailable() or "busy"})
                continue
            tried += 1
            if previous is not None:
                self.state.metrics.fallbacks.labels(spec.name, previous.name).inc()
            started = time.perf_counter()
            self.routed = self.routed or started
            self.state.metrics.backend_requests.labels(backend.name).inc()
            try:
                return await self._attempt(backend, started)
            except BackendError as err:
                backend.release(None if self.aborted else backend.verdict_on(err))
                self._failed(backend, err, started)
                previous = backend
                if backend.retries_on(err):
                    order.insert(0, backend)
            except BaseException:
                backend.release(None)
                raise
        if self.aborted:
            self.status = 503
            return self._error(503, "the gateway is shutting down", "draining", 1.0)
        return self._exhausted(tried)

    async def _attempt(self, backend: Backend, started: float) -> Response:
        self.marks = marks = {}
        self.sent_at = started
        self._exchange = None
        limit = self.route.spec.first_token_timeout_s or backend.spec.first_token_timeout_s
        if not self.stream:
            limit = None
        try:
            async with asyncio.timeout(limit):
                exchange = await backend.open(self.endpoint, self._body_for(backend),
                                              self.headers, marks, self.decision.prefix)
                self._exchange = exchange
                try:
                    if exchange.status != 200:
                        return await self._refused(backend, exchange, started)
                    if not self.stream:
                        content = await exchange.aread()
                        close_soon(exchange)
                        return self._whole(backend, content)
                    stream = sse.events(exchange.aiter_bytes())
                    held = await self._until_output(stream)
                except BaseException:
                    close_soon(exchange)
                    raise
        except TimeoutError:
            raise BackendError("first_token_timeout",
                               f"no output token within {limit:g} s") from None
        return self._commit(backend, exchange, stream, held)

    def _body_for(self, backend: Backend) -> bytes:
        model = backend.model_for(self.route.spec.name)
        if model not in self._bodies:
            self._bodies[model] = json.dumps({**self.body, "model": model},
                                             ensure_ascii=False).encode()
        return self._bodies[model]

    async def _refused(self, backend: Backend, exchange: Exchange, started: float) -> Response:
        """A status other than 200: a failure to move on from, or the client's own error
        (4xx), passed on as the backend worded it."""
        kind = failure_kind(exchange.status)
        if kind is not None:
            close_soon(exchange)  # its body (a message we would not show) is not read
            raise BackendError(kind, f"answered HTTP {exchange.status}", exchange.status,
                               _retry_after(exchange.headers))
        content = await exchange.aread()
        close_soon(exchange)
        backend.release(True)  # it answered; the request was at fault
        self.backend, self.status = backend, exchange.status
        self.decision.attempts.append(self._attempt_entry(backend, "answered", started,
                                                          exchange.status))
        headers = {k: v for k, v in exchange.headers.items() if k in PASSED_HEADERS}
        return Response(content, exchange.status, headers={**headers, **self._own_headers()})

    async def _until_output(self, stream: AsyncIterator[sse.Event]) -> list[sse.Event]:
        """The events up to the first that carries output (or ends the stream)."""
        held: list[sse.Event] = []
        async for event in stream:
            held.append(event)
            if event.done:
                return held
            if event.error:
                raise BackendError("error_event", "the stream reported an error before any "
                                   "output")
            if event.data is not None and sse.has_output(event.data):
                self.first_output = time.perf_counter()
                return held
        raise BackendError("incomplete_stream", "the stream ended before any output")

    def _failed(self, backend: Backend, err: BackendError, started: float) -> None:
        now = time.perf_counter()
        self.failed_s += now - started
        self.state.metrics.backend_errors.labels(backend.name, err.kind).inc()
        entry = self._attempt_entry(backend, err.kind, started, err.status)
        entry["error"] = err.message
        entry.update(err.detail)
        self.decision.attempts.append(entry)
        log.info("%s: backend %s failed (%s: %s)", self.id, backend.name, err.kind,
                 err.message)

    def _attempt_entry(self, backend: Backend, outcome: str, started: float,
                       status: int | None = None) -> dict[str, Any]:
        entry = {"backend": backend.name, "outcome": outcome, "status": status,
                 "ms": record.ms(time.perf_counter() - started)}
        if outcome != "skipped" and self._exchange is not None:
            entry.update(getattr(self._exchange, "detail", None) or {})
        return entry

    def _exhausted(self, tried: int) -> Response:
        name = self.route.spec.name
        if tried == 0:
            notes = "; ".join(f"{b.name}: {b.unavailable() or 'not tried'}"
                              for b in self.route.members())
            waits = [b.breaker.retry_in() for b in self.route.members()
                     if b.breaker.retry_in() > 0]
            self.status = 503
            return self._error(503, f"no backend of {name!r} can take a request now "
                               f"({notes})", "no_backend_available",
                               min(waits) if waits else 1.0)
        failures = [a for a in self.decision.attempts if a["outcome"] not in ("skipped",)]
        summary = "; ".join(f"{a['backend']}: {a['outcome']}" for a in failures)
        limited = all(a["status"] == 429 for a in failures)
        self.status = 429 if limited else 503
        return self._error(self.status, f"every backend tried for {name!r} failed "
                           f"({summary})", "rate_limit_exceeded" if limited else
                           "backends_failed", 1.0)

    def _error(self, status: int, message: str, code: str, retry_after: float) -> Response:
        body = error_body(status, message, None, code)
        body["routing"] = self.decision.to_dict()
        headers = {"Retry-After": str(max(1, round(retry_after))), **self._own_headers()}
        return JSONResponse(body, status, headers)

    # -- a backend serves ----------------------------------------------------------------

    def _whole(self, backend: Backend, content: bytes) -> Response:
        try:
            data = json.loads(content)
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except ValueError:
            raise BackendError("bad_response", "the answer is not a JSON object") from None
        backend.release(True)
        self.backend = backend
        self._observe(data)
        self.decision.attempts.append(self._attempt_entry(backend, "served", self.sent_at,
                                                          200))
        self.stamps.mark("last_byte")
        timings = self.timings()
        data["timings"] = timings
        data["routing"] = self.decision_dict()
        self.verdict = True
        return JSONResponse(data, headers={"Server-Timing": record.server_timing(timings),
                                           **self._own_headers()})

    def _commit(self, backend: Backend, exchange: Exchange,
                stream: AsyncIterator[sse.Event], held: list[sse.Event]) -> Response:
        self.backend = backend
        self.decision.attempts.append(self._attempt_entry(backend, "served", self.sent_at,
                                                          200))
        if self.first_output is not None:
            self.state.metrics.ttft.labels(backend.name).observe(
                self.first_output - self.sent_at)
        return _RelayResponse(self, self._pump(stream, held), media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", **self._own_headers()})

    async def _pump(self, stream: AsyncIterator[sse.Event], held: list[sse.Event]
                    ) -> AsyncIterator[bytes]:
        try:
            async for piece in self._pieces(stream, held):
                with self.stamps.writing():
                    yield piece
        except (asyncio.CancelledError, GeneratorExit):
            self.status, self.verdict = 499, None
            raise
        finally:
            self.end()

    def end(self) -> None:
        """The relayed stream is over (or never began: the client left first). Once."""
        if self._ended:
            return
        self._ended = True
        if self._exchange is not None:
            close_soon(self._exchange)
        if self.backend is not None:
            self.backend.release(self.verdict)
        self.finish()

    async def _pieces(self, stream: AsyncIterator[sse.Event], held: list[sse.Event]
                      ) -> AsyncIterator[bytes]:
        tail: list[sse.Event] = []
        """Events from the first that ends the answer on: held until `[DONE]`, so the last
        of them can carry the gateway's timings."""
        for event in held:
            if event.done:
                break
            piece = self._pass(event, tail)
            if piece:
                yield piece
        if not (held and held[-1].done):
            try:
                async for piece in self._rest(stream, tail):
                    yield piece
            except BackendError as err:
                for piece in self._broken(err, tail):
                    yield piece
                return
            if self.verdict is False:
                return
        self.verdict = True
        self.stamps.mark("last_byte")
        for piece in self._closing(tail):
            yield piece
        yield b"data: [DONE]\n\n"

    async def _rest(self, stream: AsyncIterator[sse.Event], tail: list[sse.Event]
                    ) -> AsyncIterator[bytes]:
        """The stream after the held events, up to `[DONE]` or the backend's error event
        (passed on as it came; the stream then ends)."""
        while True:
            event = await anext(stream, None)
            if event is None:
                raise BackendError("incomplete_stream", "the backend ended the stream without "
                                   "[DONE]")
            if event.done:
                return
            if event.error:
                self.verdict, self.status = False, 502
                self.state.metrics.backend_errors.labels(self.backend.name, "error_event").inc()
                for e in [*tail, event]:
                    yield e.raw
                return
            piece = self._pass(event, tail)
            if piece:
                yield piece

    def _broken(self, err: BackendError, tail: list[sse.Event]) -> list[bytes]:
        """The end of a stream whose backend failed after the answer began: what was held, then
        an error event (never a silent end, never `[DONE]`)."""
        pieces = [e.raw for e in tail]
        if self.aborted:
            self.verdict, self.status = None, 503
            return pieces + [sse.encode(error_body(
                503, "the gateway is shutting down; the answer is incomplete", None,
                "draining"))]
        self.verdict, self.status = False, 502
        self.state.metrics.backend_errors.labels(self.backend.name, err.kind).inc()
        return pieces + [sse.encode({"error": {
            "message": f"the backend {self.backend.name!r} failed after the answer began "
                       f"({err.message}); the answer is incomplete", "type": "server_error",
            "param": None, "code": "backend_failed_mid_stream"}})]

    def _pass(self, event: sse.Event, tail: list[sse.Event]) -> bytes | None:
        """Note what the event says; its bytes to send now, or None when it joins the tail."""
        data = event.data
        if data is not None:
            self._observe(data)
            for choice in data.get("choices") or ():
                if isinstance(choice, dict) and choice.get("finish_reason"):
                    self._finished.add(choice.get("index", 0))
            ends = len(self._finished) >= self.expected_choices or (
                not data.get("choices") and any(k in data for k in ("usage", "timings",
                                                                      "metrics")))
            if tail or ends:
                tail.append(event)
                return None
        elif tail:
            tail.append(event)
            return None
        return event.raw

    def _closing(self, tail: list[sse.Event]) -> list[bytes]:
        """The held tail, its last JSON event carrying the gateway's timings (the backend's
        nested in them) and the routing decision; a chunk of its own when there is none."""
        timings, routing = self.timings(), self.decision_dict()
        last = next((i for i in range(len(tail) - 1, -1, -1) if tail[i].data is not None),
                    None)
        pieces = [e.raw for e in tail]
        if last is None:
            chunk = {"id": self._seen.get("id", self.id), "object": self._seen.get(
                "object", "chat.completion.chunk"), "created": self._seen.get(
                "created", int(time.time())), "model": self._seen.get("model"),
                "choices": [], "timings": timings, "routing": routing}
            return pieces + [sse.encode(chunk)]
        data = dict(tail[last].data)
        data["timings"], data["routing"] = timings, routing
        pieces[last] = sse.encode(data)
        return pieces

    def _observe(self, data: dict[str, Any]) -> None:
        for key in ("id", "object", "created", "model"):
            if key in data and key not in self._seen:
                self._seen[key] = data[key]
        if isinstance(data.get("timings"), dict):
            self.reported = {"timings": data["timings"]}
        elif isinstance(data.get("metrics"), dict):
            self.reported = {"metrics": data["metrics"]}
        if isinstance(data.get("usage"), dict):
            self.usage = data["usage"]

    # -- what happened ------------------------------------------------------------------

    def timings(self) -> dict[str, Any]:
        return record.timings(self)

    def decision_dict(self) -> dict[str, Any]:
        self.decision.outcome = record.outcome(self)
        return self.decision.to_dict()

    def finish(self) -> None:
        """Account the request once: Prometheus, the decision log, the access log."""
        if self.accounted:
            return
        self.accounted = True
        self.state.admission.in_flight -= 1
        self.state.generations.discard(self)
        if self.stamps.last_byte is None:
            self.stamps.mark("last_byte")
        record.account(self, self.decision_dict(), self.timings())

    def abort(self) -> None:
        """A shutdown that ran out of time: end the relay (the client gets an error event)."""
        self.aborted = True
        if self._exchange is not None:
            close_soon(self._exchange)

    def _own_headers(self) -> dict[str, str]:
        headers = {"X-Request-Id": self.id}
        if self.backend is not None:
            headers["X-Lifeline-Backend"] = self.backend.name
            replica = (getattr(self._exchange, "detail", None) or {}).get("replica")
            if replica:
                headers["X-Lifeline-Replica"] = replica
        return headers


class _RelayResponse(StreamingResponse):
    """Ends its relay however the response ends: a client gone before the first byte never
    starts the body's generator, whose own cleanup would then never run."""

    def __init__(self, relay: Relay, content: AsyncIterator[bytes], **kwargs: Any):
        super().__init__(content, **kwargs)
        self.relay = relay

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.relay._ended:
                self.relay.status, self.relay.verdict = 499, None
                self.relay.end()


def _choices(body: dict[str, Any]) -> int:
    """Choices a complete answer has: `n` per prompt."""
    n = body.get("n") if isinstance(body.get("n"), int) and body.get("n") > 0 else 1
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return n * len(prompt)
    return n


def _retry_after(headers: dict[str, str]) -> float | None:
    try:
        return float(headers["retry-after"])
    except (KeyError, ValueError):
        return None
