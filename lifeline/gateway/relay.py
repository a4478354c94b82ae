"""One request through the gateway: try the decision's backends in order until one serves,
then relay its answer.

Nothing reaches the client before a backend has produced its first output token (or, without
streaming, its whole answer), so a failure up to then (connect error, 5xx, 429/503, no first
token within the route's limit, a stream that broke, reported an error or was malformed) moves
the request to the next backend without the client ever seeing two answers. A stream that
breaks after its first token has been relayed ends with an OpenAI error event (carrying
`routing` and `timings`, the attempt recorded as failed with its kind) and no `data: [DONE]`.
At most `max_attempts` backends are tried, all within the route's `deadline_s`.

Each attempt holds a `Lease` on its backend, released exactly once however the attempt ends."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from lifeline.gateway import answers, bodies, record, sse
from lifeline.gateway.backends import (
    Backend,
    BackendError,
    Exchange,
    Lease,
    close_soon,
    failure_kind,
    read_capped,
)
from lifeline.gateway.router import Decision, Route
from lifeline.observe import ServerStamps
from lifeline.server.errors import error_body

log = logging.getLogger("lifeline.gateway")
PASSED_HEADERS = ("content-type", "retry-after")


class Relay:
    def __init__(self, state: Any, stamps: ServerStamps, request_id: str, endpoint: str,
                 body: dict[str, Any], route: Route, decision: Decision,
                 body_bytes: int | None = None):
        self.state, self.stamps, self.id = state, stamps, request_id
        self.endpoint, self.body, self.route, self.decision = endpoint, body, route, decision
        self.body_bytes = body_bytes
        """The size of the body the client sent (unknown: written off the loop)."""
        self.stream = body.get("stream") is True
        self.deadline_at = math.inf
        """When (the event loop's clock) the request must be over: arrival + `deadline_s`."""
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
        self._lease: Lease | None = None
        self._served: dict[str, Any] | None = None
        """The decision's entry for the attempt whose answer is relayed."""
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
        spent = time.perf_counter() - self.stamps.arrival
        self.deadline_at = asyncio.get_running_loop().time() + self.route.spec.deadline_s - spent
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

    def past_deadline(self) -> bool:
        return asyncio.get_running_loop().time() >= self.deadline_at

    async def _attempts(self) -> Response:
        spec = self.route.spec
        tried = 0
        previous: Backend | None = None
        order = list(self.decision.order)
        late = False
        while order:
            backend = order.pop(0)
            if tried >= spec.max_attempts or self.aborted:
                break
            if self.past_deadline():
                late = True
                break
            lease = backend.lease()
            if lease is None:
                self.decision.attempts.append({"backend": backend.name, "outcome": "skipped",
                                               "note": backend.unavailable() or "busy"})
                continue
            self._lease = lease
            tried += 1
            if previous is not None:
                self.state.metrics.fallbacks.labels(spec.name, previous.name).inc()
            started = time.perf_counter()
            self.routed = self.routed or started
            self.state.metrics.backend_requests.labels(backend.name).inc()
            try:
                return await self._attempt(backend, lease, started)
            except BackendError as err:
                lease.release(None if self.aborted else backend.verdict_on(err))
                self._failed(backend, err, started)
                previous = backend
                if err.kind == "deadline":
                    late = True
                    break
                if backend.retries_on(err):
                    order.insert(0, backend)
            except BaseException:
                lease.release(None)
                raise
        if self.aborted:
            self.status = 503
            return self._error(503, "the gateway is shutting down", "draining", 1.0)
        if late:
            self.status = 504
            return self._error(504, f"the request's deadline ({spec.deadline_s:g} s) passed "
                               "before a backend answered", "deadline_exceeded", 1.0)
        return self._exhausted(tried)

    async def _attempt(self, backend: Backend, lease: Lease, started: float) -> Response:
        self.marks = marks = {}
        self.sent_at = started
        self._exchange = None
        loop = asyncio.get_running_loop()
        limit = self.route.spec.first_token_timeout_s or backend.spec.first_token_timeout_s
        first_by = loop.time() + limit if self.stream and limit else math.inf
        try:
            async with asyncio.timeout_at(min(first_by, self.deadline_at)):
                body = await self._body_for(backend)
                exchange = await backend.open(self.endpoint, body, self.headers, marks,
                                              self.decision.prefix)
                self._exchange = exchange
                self._count_resends(backend, getattr(exchange, "detail", None))
                try:
                    if exchange.status != 200:
                        return await self._refused(backend, lease, exchange, started)
                    if not self.stream:
                        content = await read_capped(exchange, backend.spec.max_response_bytes)
                        close_soon(exchange)
                        data = await self._read_whole(content)
                    else:
                        stream = self._events(exchange, backend)
                        held = await self._until_output(stream, backend.spec.max_event_bytes)
                except BaseException:
                    close_soon(exchange)
                    raise
        except TimeoutError:
            if self.deadline_at <= first_by:
                raise self._deadline() from None
            raise BackendError("first_token_timeout",
                               f"no output token within {limit:g} s") from None
        if not self.stream:
            return await self._whole(backend, lease, data, len(content))
        return self._commit(backend, exchange, stream, held)

    def _deadline(self) -> BackendError:
        return BackendError("deadline", f"the request's deadline ({self.route.spec.deadline_s:g}"
                            " s) passed")

    async def _body_for(self, backend: Backend) -> bytes:
        """The body to send `backend`, `model` its name for the route: written once per name,
        off the event loop when the client's body was large."""
        model = backend.model_for(self.route.spec.name)
        if model not in self._bodies:
            size = self.body_bytes if self.body_bytes is not None else bodies.INLINE_BYTES + 1
            self._bodies[model] = await bodies.encode({**self.body, "model": model}, size)
        return self._bodies[model]

    async def _refused(self, backend: Backend, lease: Lease, exchange: Exchange,
                       started: float) -> Response:
        """A status other than 200: a failure to move on from, or the client's own error
        (4xx), passed on as the backend worded it."""
        kind = failure_kind(exchange.status)
        if kind is not None:
            close_soon(exchange)  # its body (a message we would not show) is not read
            raise BackendError(kind, f"answered HTTP {exchange.status}", exchange.status,
                               _retry_after(exchange.headers))
        content = await read_capped(exchange, backend.spec.max_response_bytes)
        close_soon(exchange)
        # It answered, but the request was at fault: that says nothing of the backend's health
        # (a backend that fails every other request must not look well by refusing bad ones).
        lease.release(None)
        self.backend, self.status = backend, exchange.status
        self.decision.attempts.append(self._attempt_entry(backend, "answered", started,
                                                          exchange.status))
        headers = {k: v for k, v in exchange.headers.items() if k in PASSED_HEADERS}
        return Response(content, exchange.status, headers={**headers, **self._own_headers()})

    async def _events(self, exchange: Exchange, backend: Backend) -> AsyncIterator[sse.Event]:
        """The stream's events, each checked: a malformed one is a `bad_response`."""
        try:
            async for event in sse.events(exchange.aiter_bytes(), backend.spec.max_event_bytes):
                if event.data is not None and not event.error:
                    answers.check_chunk(event.data, self.expected_choices)
                yield event
        except (sse.BadStream, answers.BadAnswer) as exc:
            raise BackendError("bad_response", f"the stream is malformed: {exc}") from None

    async def _until_output(self, stream: AsyncIterator[sse.Event], cap: int
                            ) -> list[sse.Event]:
        """The events up to the first that carries output (or ends the stream): at most
        `cap` bytes of them."""
        held: list[sse.Event] = []
        size = 0
        async for event in stream:
            held.append(event)
            size += len(event.raw)
            if event.done:
                return held
            if event.error:
                raise BackendError("error_event", "the stream reported an error before any "
                                   "output")
            if event.data is not None and sse.has_output(event.data):
                self.first_output = time.perf_counter()
                return held
            if size > cap:
                raise BackendError("bad_response", f"more than {cap} bytes of events before "
                                   "any output")
        raise BackendError("incomplete_stream", "the stream ended before any output")

    def _count_resends(self, backend: Backend, detail: dict[str, Any] | None) -> None:
        resent = (detail or {}).get("resent")
        if resent:
            self.state.metrics.resends.labels(backend.name).inc(len(resent))

    def _failed(self, backend: Backend, err: BackendError, started: float) -> None:
        if self._exchange is None:  # open() failed: its resends are in the error's detail
            self._count_resends(backend, err.detail)
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
        body["timings"] = self.timings()
        headers = {"Retry-After": str(max(1, round(retry_after))), **self._own_headers()}
        return JSONResponse(body, status, headers)

    # -- a backend serves ----------------------------------------------------------------

    async def _read_whole(self, content: bytes) -> dict[str, Any]:
        """A whole answer's JSON, checked (read off the event loop when large)."""
        try:
            data = await bodies.decode(content)
            answers.check_whole(data, self.expected_choices,
                                self.endpoint.endswith("/chat/completions"))
        except (bodies.BadJSON, answers.BadAnswer) as exc:
            raise BackendError("bad_response", f"the answer is malformed: {exc}") from None
        return data

    async def _whole(self, backend: Backend, lease: Lease, data: dict[str, Any],
                     size: int) -> Response:
        lease.release(True)
        self.backend = backend
        self._observe(data)
        self.decision.attempts.append(self._attempt_entry(backend, "served", self.sent_at,
                                                          200))
        self.stamps.mark("last_byte")
        timings = self.timings()
        data["timings"] = timings
        data["routing"] = self.decision_dict()
        self.verdict = True
        return Response(await bodies.encode(data, size), media_type="application/json",
                        headers={"Server-Timing": record.server_timing(timings),
                                 **self._own_headers()})

    def _commit(self, backend: Backend, exchange: Exchange,
                stream: AsyncIterator[sse.Event], held: list[sse.Event]) -> Response:
        self.backend = backend
        self._served = self._attempt_entry(backend, "served", self.sent_at, 200)
        self.decision.attempts.append(self._served)
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
        if self._lease is not None:
            self._lease.release(self.verdict)
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
        for piece in await self._closing(tail):
            yield piece
        yield b"data: [DONE]\n\n"

    async def _rest(self, stream: AsyncIterator[sse.Event], tail: list[sse.Event]
                    ) -> AsyncIterator[bytes]:
        """The stream after the held events, up to `[DONE]` or the backend's error event
        (passed on with the record added; the stream then ends), within the deadline. The
        events held after the answer's end are at most `max_event_bytes` together."""
        cap = self.backend.spec.max_event_bytes
        held = 0
        while True:
            try:
                async with asyncio.timeout_at(self.deadline_at):
                    event = await anext(stream, None)
            except TimeoutError:
                raise self._deadline() from None
            if event is None:
                raise BackendError("incomplete_stream", "the backend ended the stream without "
                                   "[DONE]")
            if event.done:
                return
            if event.error:
                self.verdict, self.status = False, 502
                self.state.metrics.backend_errors.labels(self.backend.name, "error_event").inc()
                self._cut("error_event", "the stream reported an error after the answer began")
                for e in tail:
                    yield e.raw
                yield self._recorded(dict(event.data))
                return
            piece = self._pass(event, tail)
            if piece:
                yield piece
            else:
                held += len(event.raw)
                if held > cap:
                    raise BackendError("bad_response", f"more than {cap} bytes of events "
                                       "after the answer's end")

    def _broken(self, err: BackendError, tail: list[sse.Event]) -> list[bytes]:
        """The end of a stream whose backend failed after the answer began: what was held, then
        an error event carrying the record (never a silent end, never `[DONE]`); the attempt
        is recorded as what it met."""
        pieces = [e.raw for e in tail]
        name = self.backend.name
        if self.aborted:
            self.verdict, self.status = None, 503
            self._cut("aborted", "the gateway shut down before the answer ended")
            return pieces + [self._recorded(error_body(
                503, "the gateway is shutting down; the answer is incomplete", None,
                "draining"))]
        self.state.metrics.backend_errors.labels(name, err.kind).inc()
        self._cut(err.kind, err.message)
        if err.kind == "deadline":  # the request's limit, not the backend's failure
            self.verdict, self.status = None, 504
            return pieces + [self._recorded(error_body(
                504, f"{err.message}; the answer is incomplete", None, "deadline_exceeded"))]
        self.verdict, self.status = False, 502
        return pieces + [self._recorded({"error": {
            "message": f"the backend {name!r} failed after the answer began "
                       f"({err.message}); the answer is incomplete", "type": "server_error",
            "param": None, "code": "backend_failed_mid_stream"}})]

    def _cut(self, kind: str, message: str) -> None:
        """The relayed attempt did not end its answer: its entry says what it met instead."""
        entry = self._served
        if entry is not None:
            entry.update(outcome=kind, error=message, after_output=True,
                         ms=record.ms(time.perf_counter() - self.sent_at))
        log.info("%s: backend %s failed after the answer began (%s: %s)", self.id,
                 self.backend.name, kind, message)

    def _recorded(self, data: dict[str, Any]) -> bytes:
        """An event closing the stream early (an error), with `timings` and `routing`."""
        self.stamps.mark("last_byte")
        data["timings"], data["routing"] = self.timings(), self.decision_dict()
        return sse.encode(data)

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

    async def _closing(self, tail: list[sse.Event]) -> list[bytes]:
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
        pieces[last] = b"data: " + await bodies.encode(data, len(tail[last].raw)) + b"\n\n"
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
