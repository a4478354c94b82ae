"""The backends a gateway sends requests to, both spoken to at the OpenAI request level: an
upstream OpenAI-compatible server over HTTP (`httpx`), and a local engine, which is today's
single-model server (`lifeline.server.create_app`: its handlers, its `EngineClient`) called in
this process through `asgi_bridge`. A gateway cannot tokenize for an arbitrary upstream model,
so it forwards requests, not token ids (docs/gateway.md)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Protocol

import httpx

from lifeline.gateway.asgi_bridge import AppExchange, BridgeError
from lifeline.gateway.config import BackendSpec, GatewayConfig
from lifeline.gateway.health import CircuitBreaker
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


class Backend:
    """What the router knows of one backend: its breaker, its health, its load."""

    def __init__(self, spec: BackendSpec, config: GatewayConfig):
        self.spec = spec
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
        self.outstanding = 0
        """Requests sent to it that have not ended (the balancing policies read this)."""
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
        if self.unavailable() is not None or not self.breaker.acquire():
            return False
        self.outstanding += 1
        return True

    def release(self, ok: bool | None) -> None:
        """The attempt ended: True, the backend served; False, it failed; None, no verdict
        (the client left first)."""
        self.outstanding -= 1
        if ok is True:
            self.breaker.success()
        elif ok is False:
            self.breaker.failure()
        else:
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
                "outstanding": self.outstanding, "max_concurrency": self.spec.max_concurrency}

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


class UpstreamBackend(Backend):
    def __init__(self, spec: BackendSpec, config: GatewayConfig):
        super().__init__(spec, config)
        limit = spec.max_concurrency or 1000
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(spec.read_timeout_s, connect=spec.connect_timeout_s,
                                  pool=spec.connect_timeout_s),
            limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
            trust_env=False)
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
        stack.push_async_callback(self.health_http.aclose)
        if self.upstream_state is not None:
            self.upstream_state.start()
            stack.push_async_callback(self.upstream_state.stop)

    async def open(self, path: str, body: bytes, headers: dict[str, str],
                   marks: dict[str, float], prefix: str | None = None) -> Exchange:
        headers = {**headers, "content-type": "application/json"}
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
        for fresh in (False, True):
            request = self.http.build_request("POST", url, content=body, headers=headers,
                                              extensions={"trace": trace})
            try:
                response = await self.http.send(request, stream=True)
                break
            except httpx.RemoteProtocolError as exc:
                if fresh or "connecting" in marks:
                    raise transport_error(exc) from None
                # A kept-alive connection the server had dropped without a word (llama-server
                # does): once more, on a new connection. It sent no byte, so no answer is lost.
            except httpx.HTTPError as exc:
                raise transport_error(exc) from None
        marks["headers"] = time.perf_counter()
        return _HttpxExchange(response)

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

    async def aiter_bytes(self) -> Any:
        try:
            async for chunk in self.response.aiter_bytes():
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
        from lifeline.model.loader import load_model

        model = self.spec.model
        return lambda: load_model(None if model in (None, "default") else model)

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


def close_soon(exchange: Exchange) -> None:
    """Close an exchange from its own task: the caller may be inside a cancelled scope, where
    an await would be interrupted before the connection is released."""
    task = asyncio.get_running_loop().create_task(exchange.aclose())
    _CLOSING.add(task)
    task.add_done_callback(_CLOSING.discard)
