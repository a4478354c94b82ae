"""`create_gateway_app(config)`: the FastAPI application behind `lifeline serve --config FILE`.

It serves every model the file declares at `/v1/chat/completions` and `/v1/completions`,
routes each request (`lifeline.gateway.router`), relays the backend's answer
(`lifeline.gateway.relay`), and reports on its backends at `/health`, `/ready`, `/metrics`,
`/gateway/backends` and `/gateway/decisions`."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from lifeline.gateway import bodies
from lifeline.gateway.backends import (
    BackendError,
    build_backends,
    close_soon,
    failure_kind,
    read_capped,
)
from lifeline.gateway.config import GatewayConfig, RouteSpec
from lifeline.gateway.health import HealthChecker
from lifeline.gateway.relay import Relay
from lifeline.gateway.router import Router
from lifeline.gateway.state import GatewayState, route_backends
from lifeline.server.app import forward_state, readiness
from lifeline.server.debug import router as debug_router
from lifeline.server.errors import APIError, install_handlers, parse_json
from lifeline.server.limits import INLINE_JSON_COMMAS
from lifeline.server.middleware import GatewayMiddleware
from lifeline.server.openai_api import off_loop
from lifeline.server.protocol import MAX_CACHE_SALT_CHARS
from lifeline.server.state import new_id, short_gil_turns
from lifeline.server.tenants import tenant_of, tenant_salt

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
TOKEN_ENDPOINTS = ("/tokenize", "/detokenize")


def create_gateway_app(config: GatewayConfig, preloaded: dict[str, Any] | None = None
                       ) -> FastAPI:
    """A gateway for `config`. `preloaded` maps local backend names to models already loaded
    (tests, notebooks); the others load in the background once the app starts. Raises
    ConfigError for options that cannot work together (`GatewayConfig.check`)."""
    config.check()
    holder: dict[str, GatewayState] = {}
    backends = build_backends(config, preloaded, lambda b: holder["state"].fail_backend(b))
    state = holder["state"] = GatewayState(
        config=config, backends=backends, router=Router(config, backends),
        health=HealthChecker(backends.values(), config.health_interval_s,
                             config.health_timeout_s, config.unhealthy_after))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            for backend in backends.values():
                await backend.start(stack)
            await state.health.check_all()
            state.health.start()
            stack.push_async_callback(state.health.stop)
            with short_gil_turns():
                yield

    app = FastAPI(title="Lifeline gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.lifeline = state
    app.state.debug_target = state.debug_target
    app.state.debug_backends = lambda: _debug_backends(state)
    install_handlers(app)
    app.include_router(debug_router)
    _add_routes(app, state)
    app.add_middleware(GatewayMiddleware, state=state)
    return app


def _add_routes(app: FastAPI, state: GatewayState) -> None:
    for endpoint in ENDPOINTS:
        app.add_api_route(endpoint, _generate_handler(endpoint), methods=["POST"])
    for endpoint in TOKEN_ENDPOINTS:
        app.add_api_route(endpoint, _token_handler(endpoint), methods=["POST"])

    @app.get("/health")
    async def health() -> JSONResponse:
        """The gateway answers: 'ok', with where each backend stands."""
        return JSONResponse({"status": "ok", "backends": {
            name: b.status() for name, b in state.backends.items()}})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        models = state.readiness()
        waiting = None if all(models.values()) else {"status": "waiting", "models": models}
        started = {name: b.state.startup for name, b in state.backends.items()
                   if getattr(getattr(b, "state", None), "startup", None)}
        forward = {name: f for name, b in state.backends.items()
                   if (f := forward_state(getattr(b, "state", None))) is not None}
        return readiness(state.load_error, state.admission.draining, waiting,
                         {"models": models, **({"startup_seconds": started} if started else {}),
                          **({"forward": forward} if forward else {})})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render(state.backends.values(),
                                                  state.local_registries())
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cards = []
        for route in state.config.models.values():
            cards.append(_card(state, route, route.name))
            cards += [_card(state, route, alias) for alias in route.aliases]
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        route = state.router.resolve(model_id).spec
        return _card(state, route, model_id)

    @app.get("/gateway/backends")
    async def backends() -> dict[str, Any]:
        return {name: b.status() for name, b in state.backends.items()}

    @app.get("/gateway/decisions")
    async def decisions(request: Request, limit: int = 50) -> dict[str, Any]:
        """The last decisions: the admin's key sees every caller's, an API key its own."""
        admin = state.auth.is_admin(request.headers.get("authorization"))
        who = None if admin else tenant_of(request.state.key)
        return {"object": "list", "data": state.router.recent_of(who, limit)}


def _debug_backends(state: GatewayState) -> list[dict[str, Any]]:
    """Every backend of the file: whether its engine runs here (only those have `/debug/*`
    at the gateway), whether it is the one read by default, the routes it serves."""
    local = state.local()
    default = state.default_local(local)
    return [{"name": name, "model": getattr(backend, "served_name", None) or backend.spec.model,
             "local": name in local, "default": default is not None and local.get(name) is default,
             "routes": [r.name for r in state.config.models.values() if name in route_backends(r)]}
            for name, backend in state.backends.items()]


def _card(state: GatewayState, route: RouteSpec, name: str) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": state.created,
                            "owned_by": "lifeline"}
    if name != route.name:
        card["parent"] = route.name
    card["root"] = route.name
    card["backends"] = sorted({b for p in route.pools for b in p.backends}
                              | set(route.fallbacks))
    return card


def _generate_handler(endpoint: str) -> Any:
    async def handler(request: Request) -> Response:
        state: GatewayState = request.app.state.lifeline
        stamps = request.state.stamps
        state.admission.check_open()
        body = await _parse(request, state)
        requested = body.get("model")
        route = state.router.resolve(requested)
        key = request.state.key
        if state.config.salt_cache_by_api_key:
            body["cache_salt"] = tenant_salt(key, _client_salt(body))
        stamps.mark("parsed")
        state.limiter.admit_request(key)
        spec = route.spec
        decision = state.router.decide(
            route, requested if isinstance(requested, str) else None,
            _session(body, request, spec), _prompt_text(body, spec.prefix_chars))
        decision.tenant = tenant_of(key)
        relay = Relay(state, stamps, new_id("gw"), endpoint, body, route, decision,
                      len(await request.body()))
        request.state.accounted = True  # the relay writes this request's access-log line
        return await _unless_client_leaves(request, relay)

    handler.__name__ = endpoint.strip("/").replace("/", "_")
    return handler


def _token_handler(endpoint: str) -> Any:
    """`/tokenize` and `/detokenize` for the model a request names: every replica of a route
    serves one model, so the first that can take the request answers, with no split, balancing
    or decision record; one that fails to connect or answers 5xx/429/503 passes it on."""
    async def handler(request: Request) -> Response:
        state: GatewayState = request.app.state.lifeline
        state.admission.check_open()
        body = await _parse(request, state)
        route = state.router.resolve(body.get("model"))
        state.limiter.admit_request(request.state.key)
        spec, tried = route.spec, []
        for name in route_backends(spec):
            backend = state.backends[name]
            if not backend.acquire():
                continue
            ok: bool | None = None
            try:
                sent = await bodies.encode({**body, "model": backend.model_for(spec.name)},
                                           len(await request.body()))
                exchange = await backend.open(endpoint, sent, {}, {})
                try:
                    answer = await read_capped(exchange, backend.spec.max_response_bytes)
                finally:
                    close_soon(exchange)
                failed = failure_kind(exchange.status) is not None
                # a client's own 4xx is no verdict on the backend
                ok = False if failed else (True if exchange.status < 400 else None)
                if not failed:  # the answer, or the client's own 4xx, as the backend gave it
                    return Response(answer, exchange.status, media_type="application/json")
                tried.append(f"{name}: HTTP {exchange.status}")
            except BackendError as exc:
                ok = False
                tried.append(f"{name}: {exc.message}")
            finally:
                backend.release(ok)
        raise APIError(503, "no backend of {!r} could answer {}{}".format(
            spec.name, endpoint, f" ({'; '.join(tried)})" if tried else ""),
            code="no_backend_available", retry_after=1)

    handler.__name__ = endpoint.strip("/")
    return handler


async def _parse(request: Request, state: GatewayState) -> dict[str, Any]:
    raw = await request.body()
    depth = state.config.max_json_depth
    if raw.count(b",") <= INLINE_JSON_COMMAS:
        return parse_json(raw, depth)
    return await off_loop(lambda: parse_json(raw, depth, True))


async def _unless_client_leaves(request: Request, relay: Relay) -> Response:
    """The relay's response; a client that leaves before the answer begins cancels the attempt
    in flight (its backend then sees the connection close and aborts)."""
    attempts = asyncio.ensure_future(relay.respond())
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({attempts, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if attempts.done():
            return attempts.result()
        attempts.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await attempts
        return Response(status_code=499)
    finally:
        for task in (attempts, watcher):
            task.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _client_salt(body: dict[str, Any]) -> str | None:
    """The request's own `cache_salt`, checked as a server checks it (the backend sees only
    the salt the gateway makes of it)."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 1 <= len(salt) <=
                             MAX_CACHE_SALT_CHARS):
        raise APIError(400, f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} "
                       "characters", "cache_salt", "invalid_value")
    return salt


def _session(body: dict[str, Any], request: Request, spec: RouteSpec
             ) -> tuple[str, str] | None:
    """The sticky key: the first of the route's sources the request has."""
    for source in spec.sticky:
        if source == "user":
            value = body.get("user")
            if isinstance(value, str) and value:
                return "user", value
        else:
            value = request.headers.get(source)
            if value:
                return f"header {source}", value
    return None


def _prompt_text(body: dict[str, Any], limit: int) -> str | None:
    """The prompt's leading `limit` characters, for prefix affinity: the messages as role and
    text in order (what a chat template keeps at the front), or the completion prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        size = 0
        for message in messages:
            if not isinstance(message, dict):
                continue
            text = f"{message.get('role')}:{_content_text(message.get('content'))}\n"
            parts.append(text)
            size += len(text)
            if size >= limit:
                break
        return "".join(parts)[:limit] or None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if not isinstance(prompt[0], int) else prompt
    if isinstance(prompt, list):
        return ",".join(str(t) for t in prompt[:limit])[:limit] or None
    if isinstance(prompt, str):
        return prompt[:limit] or None
    return None


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


__all__ = ["APIError", "create_gateway_app"]
