"""The backends a gateway sends requests to, both spoken to at the OpenAI request level: an
upstream OpenAI-compatible server over HTTP (`httpx`), and a local engine, which is today's
single-model server (`lifeline.server.create_app`: its handlers, its `EngineClient`) called in
this process through `asgi_bridge`. A gateway cannot tokenize for an arbitrary upstream model,
so it forwards requests, not token ids (docs/gateway.md)."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from pathlib import Path
from typing import Any, Protocol

import httpcore
import httpx

from lifeline.gateway.asgi_bridge import AppExchange, BridgeError
from lifeline.gateway.config import BackendSpec, GatewayConfig
from lifeline.gateway.health import HALF_OPEN, CircuitBreaker
from lifeline.gateway.upstream_state import UpstreamState

log = logging.getLogger("lifeline.gateway")
_CLOSING: set[asyncio.Task] = set()


class BackendError(Exception):
    """One attempt failed in a way the next backend may not: the request moves on."""

    def __init__(self, kind: str, message: str, status: int | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.kind, self.message, self.status, self.retry_after = kind, message, status, \
            retry_after
        self.detail: dict[str, Any] = {}
        """Added to the attempt's entry in the decision record (a Ray replica's id)."""


class Exchange(Protocol):
    """A response in flight: status and headers are known, the body is read as it comes."""
    status: int
    headers: dict[str, str]

    def aiter_bytes(self) -> Any: ...

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None: ...


class Lease:
    """One attempt's slot on a backend, taken by `Backend.lease`: released once, whatever
    happens to the attempt (a second release is a no-op, so no path can release twice)."""
    __slots__ = ("backend", "probe", "released")

    def __init__(self, backend: Backend, probe: bool):
        self.backend, self.probe, self.released = backend, probe, False

    def release(self, ok: bool | None) -> bool:
        """True, the backend served; False, it failed; None, no verdict. False when this lease
        was already released (nothing happens)."""
        if self.released:
            return False
        self.released = True
        self.backend._settle(ok, self.probe)
        return True


class Backend:
    """What the router knows of one backend: its breaker, its health, its load."""

    def __init__(self, spec: BackendSpec, config: GatewayConfig):
        self.spec = spec
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
        self.outstanding = 0
        """Requests sent to it that have not ended (the balancing policies read this). Never
        below zero: a release with none outstanding is refused and counted."""
        self.unmatched_releases = 0
        """Releases refused because nothing was outstanding (a bug if ever above 0)."""
        self._healthy = True
        self.checked = False
        """A health check has answered at least once."""
        self.health_failures = 0
        self.last_health_error: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def healthy(self) -> bool:
        return self._healthy

    def model_for(self, route: str) -> str:
        """The `model` the backend must be sent for a request routed to `route`."""
        return self.spec.model or route

    def unavailable(self) -> str | None:
        """Why the router must skip it now; None when it may take a request."""
        if not self.healthy:
            return f"unhealthy ({self.last_health_error or 'not ready'})"
        if not self.breaker.allows():
            return "circuit open" if self.breaker.state == "open" else \
                "half-open, its probe in flight"
        limit = self.spec.max_concurrency
        if limit is not None and self.outstanding >= limit:
            return f"at max_concurrency ({limit})"
        return None

    @property
    def load_error(self) -> str | None:
        """Why the backend could not start (a local model that failed to load)."""
        return None

    def verdict_on(self, err: BackendError) -> bool | None:
        """What a failed attempt tells its circuit breaker: False, the backend failed; None,
        nothing about the backend (a Ray replica that died: Ray replaces it)."""
        return False

    def retries_on(self, err: BackendError) -> bool:
        """Whether the next attempt may go to this backend again (a Ray deployment, whose
        router sends it to another replica), rather than only to the next backend."""
        return False

    def acquire(self) -> bool:
        """Take a slot for one attempt; False when it can take none now."""
        return self.lease() is not None

    def lease(self) -> Lease | None:
        """Take a slot for one attempt, released through the lease; None when it can take none
        now."""
        if self.unavailable() is not None:
            return None
        probe = self.breaker.state == HALF_OPEN
        if not self.breaker.acquire():
            return None
        self.outstanding += 1
        return Lease(self, probe)

    def release(self, ok: bool | None) -> None:
        """The attempt ended: True, the backend served; False, it failed; None, no verdict
        (the client left first, or the answer was the client's own 4xx)."""
        self._settle(ok, None)

    def _settle(self, ok: bool | None, probe: bool | None) -> None:
        if self.outstanding <= 0:
            self.unmatched_releases += 1
            log.error("backend %s: a release with no request outstanding, ignored", self.name)
            return
        self.outstanding -= 1
        if ok is True:
            self.breaker.success()
        elif ok is False:
            self.breaker.failure()
        elif probe is not False:  # a probe that ended without a verdict lets another go
            self.breaker.abandon()

    def health_seen(self, error: str | None, unhealthy_after: int) -> None:
        self.checked = True
        if error is None:
            if not self._healthy:
                log.warning("backend %s is healthy again", self.name)
            self.health_failures, self._healthy = 0, True
            return
        self.health_failures += 1
        self.last_health_error = error
        if self.health_failures >= unhealthy_after and self._healthy:
            log.warning("backend %s is unhealthy: %s", self.name, error)
            self._healthy = False

    def status(self) -> dict[str, Any]:
        return {"kind": self.spec.kind, "healthy": self.healthy, "checked": self.checked,
                "last_health_error": self.last_health_error, "circuit": self.breaker.state,
                "consecutive_failures": self.breaker.consecutive,
                "circuit_opened": self.breaker.opened,
                "retry_in_s": round(self.breaker.retry_in(), 3),
                "outstanding": self.outstanding, "max_concurrency": self.spec.max_concurrency,
                "unmatched_releases": self.unmatched_releases}

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        """Begin serving (a local engine starts loading); `stack` undoes it at shutdown."""

    async def open(self, path: str, body: bytes, headers: dict[str, str],
                   marks: dict[str, float], prefix: str | None = None) -> Exchange:
        """Send one request to `path` (`/v1/...`, or the root's `/tokenize` and
        `/detokenize`); returns once the status line is in.
        `marks` gets `connected` (the connection was made, if a new one was) and `headers`."""
        raise NotImplementedError

    async def probe_health(self) -> str | None:
        """None when healthy, else why not."""
        raise NotImplementedError


_SENDING: contextvars.ContextVar[dict[str, bool] | None] = contextvars.ContextVar(
    "lifeline_gateway_sending", default=None)
"""The request the current task is sending: whether a byte of it was written yet, and whether
its kept-alive connection turned out closed before one was (`_GuardedStream`)."""
RESEND_REASON = "the upstream had closed the kept-alive connection before the request was sent"


class _GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, its streams wrapped in `_GuardedStream`."""

    def __init__(self, inner: httpcore.AsyncNetworkBackend):
        self.inner = inner

    async def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        return _GuardedStream(await self.inner.connect_tcp(*args, **kwargs))

    async def connect_unix_socket(self, *args: Any, **kwargs: Any
                                  ) -> httpcore.AsyncNetworkStream:
        return _GuardedStream(await self.inner.connect_unix_socket(*args, **kwargs))

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class _GuardedStream(httpcore.AsyncNetworkStream):
    """A connection that refuses to write a request onto a kept-alive connection the upstream
    has already closed (its socket reads as end-of-file, or holds bytes no request asked for):
    then not one byte of the request left the gateway, which is what makes a resend safe.
    httpcore's pool checks the same before it hands out an idle connection; this check is made
    again at the write itself, so a close that lands between the two is caught too."""

    def __init__(self, inner: httpcore.AsyncNetworkStream):
        self.inner = inner
        self.used = False
        """A request was written here before (a fresh connection is never refused: a TLS
        session ticket may still be unread on it)."""

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self.inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        sending = _SENDING.get()
        if sending is not None and not sending["wrote"] and buffer:
            if self.used and self.inner.get_extra_info("is_readable"):
                sending["unsent"] = True
                raise httpcore.WriteError(RESEND_REASON)
            sending["wrote"] = True
        self.used = True
        await self.inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        return _GuardedStream(await self.inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)


def _guarded(client: httpx.AsyncClient) -> httpx.AsyncClient:
    """`client` writing through `_GuardedStream` (left as it is if httpx's internals moved:
    then no request is ever resent)."""
    pool = getattr(getattr(client, "_transport", None), "_pool", None)
    inner = getattr(pool, "_network_backend", None)
    if inner is not None:
        pool._network_backend = _GuardedBackend(inner)
    else:
        log.warning("httpx's connection pool is not the one known: no request will be resent")
    return client


class UpstreamBackend(Backend):
    def __init__(self, spec: BackendSpec, config: GatewayConfig):
        super().__init__(spec, config)
        limit = spec.max_concurrency or 1000
        timeout = httpx.Timeout(spec.read_timeout_s, connect=spec.connect_timeout_s,
                                pool=spec.connect_timeout_s)
        self.http = _guarded(httpx.AsyncClient(
            timeout=timeout,
            limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
            trust_env=False))
        self.fresh_http = httpx.AsyncClient(
            timeout=timeout, limits=httpx.Limits(max_connections=limit,
                                                 max_keepalive_connections=0),
            trust_env=False)
        """Resends go here: every connection it makes is new."""
        self.health_http = httpx.AsyncClient(
            timeout=httpx.Timeout(spec.read_timeout_s, connect=spec.connect_timeout_s),
            limits=httpx.Limits(max_connections=1), trust_env=False)
        """Its own connection: a backend whose every request slot is busy still answers."""
        self.base = spec.base_url.rstrip("/")
        self.upstream_state: UpstreamState | None = None
        if spec.metrics_path:
            headers = {"authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
            self.upstream_state = UpstreamState(spec.root_url + spec.metrics_path,
                                       spec.root_url + "/slots", spec.model, headers,
                                       spec.state_interval_s, lambda: self.outstanding > 0)

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        stack.push_async_callback(self.http.aclose)
        stack.push_async_callback(self.fresh_http.aclose)
        stack.push_async_callback(self.health_http.aclose)
        if self.upstream_state is not None:
            self.upstream_state.start()
            stack.push_async_callback(self.upstream_state.stop)

    async def open(self, path: str, body: bytes, headers: dict[str, str],
                   marks: dict[str, float], prefix: str | None = None) -> Exchange:
        # identity: a compressed answer could grow past any cap inside one decompressed chunk
        headers = {**headers, "content-type": "application/json", "accept-encoding": "identity"}
        if self.spec.api_key:
            headers["authorization"] = f"Bearer {self.spec.api_key}"

        async def trace(event: str, info: Any) -> None:
            if event == "connection.connect_tcp.started":
                marks["connecting"] = time.perf_counter()
            elif event == "connection.connect_tcp.complete":
                marks["connected"] = time.perf_counter()

        # `/v1/...` lives under base_url; `/tokenize` and `/detokenize` at the server's root,
        # where vLLM, SGLang, llama-server and Lifeline all serve them
        url = self.base + path.removeprefix("/v1") if path.startswith("/v1/") else \
            self.spec.root_url + path
        # A request is sent again, once, on a new connection, only when not one byte of it
        # was written: the kept-alive connection it was given had been closed by the upstream
        # (llama-server drops them without a word). Any other failure is the attempt's: the
        # upstream may have read the request, so it goes to the next backend, never here again.
        resent: list[dict[str, Any]] = []
        client = self.http
        while True:
            sending = {"wrote": False, "unsent": False}
            token = _SENDING.set(sending)
            began = time.perf_counter()
            response: httpx.Response | None = None
            try:
                request = client.build_request("POST", url, content=body, headers=headers,
                                               extensions={"trace": trace})
                response = await client.send(request, stream=True)
            except httpx.HTTPError as exc:
                if not sending["unsent"] or resent:
                    err = transport_error(exc)
                    err.detail = {"resent": resent} if resent else {}
                    raise err from None
            finally:
                _SENDING.reset(token)
            if not sending["unsent"]:
                break
            if response is not None:  # bytes the upstream sent unasked: not this request's
                await response.aclose()
            if resent:
                err = BackendError("disconnected", "the upstream closed a new connection "
                                   "before the request was sent")
                err.detail = {"resent": resent}
                raise err
            resent.append({"reason": RESEND_REASON,
                           "ms": (time.perf_counter() - began) * 1e3})
            marks.pop("connecting", None)
            marks.pop("connected", None)
            client = self.fresh_http
        marks["headers"] = time.perf_counter()
        encoding = response.headers.get("content-encoding", "identity").lower()
        if encoding != "identity":
            await response.aclose()
            err = BackendError("bad_response", f"the answer is compressed ({encoding}) though "
                               "the gateway asked for none")
            err.detail = {"resent": resent} if resent else {}
            raise err
        exchange = _HttpxExchange(response)
        if resent:
            exchange.detail = {"resent": resent}
        return exchange

    async def probe_health(self) -> str | None:
        try:
            response = await self.health_http.get(self.spec.root_url + self.spec.health_path)
        except httpx.HTTPError as exc:
            return transport_error(exc).message
        if response.status_code != 200:
            return f"/health answered {response.status_code}"
        return None


class _HttpxExchange:
    def __init__(self, response: httpx.Response):
        self.response = response
        self.status = response.status_code
        self.headers = {k.lower(): v for k, v in response.headers.items()}
        self.detail: dict[str, Any] = {}
        """Added to the attempt's entry in the decision record (the resends it took)."""

    async def aiter_bytes(self) -> Any:
        try:
            async for chunk in self.response.aiter_raw():  # as received: nothing to inflate
                yield chunk
        except httpx.HTTPError as exc:
            raise transport_error(exc) from None
        except httpx.StreamError:  # closed under it (a drain that ran out of time)
            raise BackendError("disconnected", "the stream was closed") from None

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def aclose(self) -> None:
        await self.response.aclose()


def transport_error(exc: httpx.HTTPError) -> BackendError:
    """An httpx failure as the kind the metrics count (never the exception's internals)."""
    kinds = [(httpx.ConnectTimeout, "connect_timeout", "no connection within the timeout"),
             (httpx.PoolTimeout, "pool_timeout", "no free connection within the timeout"),
             (httpx.ConnectError, "connect", "connection refused or unreachable"),
             (httpx.ReadTimeout, "read_timeout", "the backend went silent past its timeout"),
             (httpx.WriteTimeout, "write_timeout", "the request could not be sent in time"),
             (httpx.RemoteProtocolError, "disconnected", "the backend closed the connection"),
             (httpx.ReadError, "disconnected", "the connection broke"),
             (httpx.WriteError, "disconnected", "the connection broke")]
    for cls, kind, message in kinds:
        if isinstance(exc, cls):
            return BackendError(kind, message)
    return BackendError("transport", type(exc).__name__)


class LocalBackend(Backend):
    """An engine in this process behind its own single-model app (which the gateway does not
    expose: clients reach it only through the router)."""

    def __init__(self, spec: BackendSpec, config: GatewayConfig, loaded: Any = None,
                 on_fatal: Any = None):
        super().__init__(spec, config)
        from lifeline.observe import AccessLog
        from lifeline.server.app import create_app

        self.served_name = spec.served_model_name or local_model_name(spec.model)
        self.app = create_app(loaded if loaded is not None else self._loader(),
                              self.server_config())
        self.state = self.app.state.lifeline
        self.state.access_log = AccessLog(logging.getLogger("lifeline.gateway.local_access"))
        """The gateway writes the access-log line (the backend's timings nested in it)."""
        self.state.on_fatal = (lambda: on_fatal(self)) if on_fatal else None

    @property
    def healthy(self) -> bool:
        """Read from its server's state each time: in rotation exactly while it serves."""
        return self._state_error() is None

    @property
    def load_error(self) -> str | None:
        return self.state.load_error

    def _loader(self) -> Any:
        from lifeline.model.loader import lazy_load_for, load_model

        model, engine = self.spec.model, self.spec.engine
        lazy = engine is not None and lazy_load_for(engine.weights, engine.device)
        return lambda: load_model(None if model in (None, "default") else model, lazy=lazy)

    def server_config(self) -> Any:
        return engine_server_config(self.spec, self.served_name)

    def model_for(self, route: str) -> str:
        return self.served_name

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        await stack.enter_async_context(self.app.router.lifespan_context(self.app))

    async def open(self, path: str, body: bytes, headers: dict[str, str],
                   marks: dict[str, float], prefix: str | None = None) -> Exchange:
        try:
            exchange = await AppExchange.open(self.app, "POST", path, body, {
                **headers, "content-type": "application/json",
                "content-length": str(len(body))})
        except BridgeError as exc:
            raise BackendError("internal", str(exc)) from None
        marks["headers"] = time.perf_counter()
        return _LocalExchange(exchange)

    async def probe_health(self) -> str | None:
        return self._state_error()

    def _state_error(self) -> str | None:
        state = self.state
        if state.load_error is not None:
            return "the model could not be loaded"
        if state.client is None:
            return "loading"
        if not state.alive:
            return "the engine stopped"
        if state.admission.draining:
            return "draining"
        return None

    def health_seen(self, error: str | None, unhealthy_after: int) -> None:
        self.checked = True
        self.last_health_error = error


class _LocalExchange:
    def __init__(self, exchange: AppExchange):
        self.exchange = exchange
        self.status, self.headers = exchange.status, exchange.headers

    async def aiter_bytes(self) -> Any:
        try:
            async for chunk in self.exchange.aiter_bytes():
                yield chunk
        except BridgeError as exc:
            raise BackendError("internal", str(exc)) from None

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    async def aclose(self) -> None:
        await self.exchange.aclose()


def engine_server_config(spec: BackendSpec, served_name: str) -> Any:
    """The single-model server config of a backend that runs an engine (local or on Ray)."""
    from lifeline.server.config import ServerConfig

    return ServerConfig(served_model_name=served_name, engine=spec.engine,
                        **spec.server_options)


def local_model_name(model: str | None) -> str:
    """The name `lifeline serve --model MODEL` answers to."""
    from lifeline.model.default import DEFAULT_MODEL_ID

    if model in (None, "default"):
        return DEFAULT_MODEL_ID
    if model.startswith("preset:"):
        return model.removeprefix("preset:")
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def build_backends(config: GatewayConfig, preloaded: dict[str, Any] | None = None,
                   on_fatal: Any = None) -> dict[str, Backend]:
    preloaded = preloaded or {}
    out: dict[str, Backend] = {}
    for name, spec in config.backends.items():
        if spec.kind == "upstream":
            out[name] = UpstreamBackend(spec, config)
        elif spec.kind == "ray":
            from lifeline.gateway.ray_backend import RayBackend  # the `ray` extra

            out[name] = RayBackend(spec, config, on_fatal)
        else:
            out[name] = LocalBackend(spec, config, preloaded.get(name), on_fatal)
    return out


def failure_kind(status: int) -> str | None:
    """The kind of failure a status is, or None when the answer stands (the client's own
    error, passed on as it is)."""
    if status == 429:
        return "http_429"
    if status == 503:
        return "http_503"
    if status >= 500:
        return "http_5xx"
    if status in (401, 403):
        return "upstream_auth"  # the gateway's key for the upstream, not the client's
    return None


async def read_capped(exchange: Exchange, cap: int) -> bytes:
    """The whole body, or a `bad_response` once it passes `cap` bytes (read no further)."""
    length = exchange.headers.get("content-length", "")
    if length.isdigit() and int(length) > cap:
        raise BackendError("bad_response", f"an answer of {int(length)} bytes, over the "
                           f"{cap} allowed")
    chunks: list[bytes] = []
    size = 0
    async for chunk in exchange.aiter_bytes():
        size += len(chunk)
        if size > cap:
            raise BackendError("bad_response", f"an answer of more than {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def close_soon(exchange: Exchange) -> None:
    """Close an exchange from its own task: the caller may be inside a cancelled scope, where
    an await would be interrupted before the connection is released."""
    task = asyncio.get_running_loop().create_task(exchange.aclose())
    _CLOSING.add(task)
    task.add_done_callback(_CLOSING.discard)
