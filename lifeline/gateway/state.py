"""What the gateway's handlers share, built once by `create_gateway_app`. It has the shape
`lifeline.server.run.DrainingServer` and `GatewayMiddleware` expect of a server's state
(`config`, `admission`, `generations`, `auth`, `log_plain`, `fail`), so the gateway drains,
authenticates and limits bodies exactly as the single-model server does."""
from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from lifeline.gateway.backends import Backend, LocalBackend
from lifeline.gateway.config import GatewayConfig, RouteSpec
from lifeline.gateway.health import HealthChecker
from lifeline.gateway.metrics import GatewayMetrics
from lifeline.gateway.router import Router
from lifeline.observe import ServerStamps
from lifeline.server.errors import APIError
from lifeline.server.gateway import Admission, Authenticator, RateLimiter

log = logging.getLogger("lifeline.gateway")
access = logging.getLogger("lifeline.access")


@dataclass(slots=True, eq=False)
class GatewayState:
    config: GatewayConfig
    backends: dict[str, Backend]
    router: Router
    health: HealthChecker
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    auth: Authenticator = None  # type: ignore[assignment]
    limiter: RateLimiter = None  # type: ignore[assignment]
    admission: Admission = field(default_factory=lambda: Admission(None))
    generations: set = field(default_factory=set)
    """Relays in flight (a drain that runs out of time aborts them)."""
    created: int = field(default_factory=lambda: int(time.time()))
    load_error: str | None = None
    on_fatal: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.auth = Authenticator(self.config.api_keys, self.config.protect_metrics,
                                  self.config.admin_key, frozenset({"/gateway/decisions"}))
        self.limiter = RateLimiter(self.config.rate_limit_rpm, None)

    def fail_backend(self, backend: Backend) -> None:
        """A local model could not be loaded (or a Ray deployment could not be deployed): the
        gateway stops, as `lifeline serve` does."""
        error = backend.load_error
        self.load_error = f"backend {backend.name!r}: {error}"
        log.error("cannot load the model of backend %s: %s", backend.name, error)
        if self.on_fatal is not None:
            self.on_fatal()

    def readiness(self) -> dict[str, bool]:
        """Per model: whether at least one of its backends can take a request now."""
        return {name: any(b.unavailable() is None for b in route.members())
                for name, route in self.router.routes.items()}

    def log_plain(self, stamps: ServerStamps, endpoint: str, status: int) -> None:
        """The access-log line of a request no handler accounted for (401, 404, 413); the
        gateway's own status pages only when they fail."""
        if endpoint.startswith("/gateway/") and status < 400:
            return
        if access.isEnabledFor(logging.INFO):
            ms = ((stamps.last_byte or time.perf_counter()) - stamps.arrival) * 1e3
            access.info(json.dumps({
                "ts": datetime.now(UTC).isoformat(timespec="milliseconds").replace(
                    "+00:00", "Z"), "endpoint": endpoint, "status": status,
                "timings": {"e2e_ms": ms}}, separators=(",", ":")))

    def local(self) -> dict[str, Any]:
        """The backends whose engine runs in this process -> their server state."""
        return {name: b.state for name, b in self.backends.items() if isinstance(b, LocalBackend)}

    def debug_target(self, request: Any, request_id: str | None = None) -> Any:
        """The local backend a `/debug/*` or `/dashboard/events` request reads: the one
        `?backend=` names, else the first local backend of the route `?model=` names, else
        the one that holds `request_id`, else the default model's (or the first local one)."""
        from lifeline.server.debug import holds

        local = self.local()
        query = request.query_params
        if (name := query.get("backend")) is not None:
            backend = self.backends.get(name)
            if backend is None:
                raise APIError(404, f"no backend named {name[:80]!r} (the backends: "
                               f"{', '.join(self.backends)})", "backend", "backend_not_found")
            if name not in local:
                raise APIError(404, f"backend {name!r} runs outside this process; read its own "
                               "/debug/* where it is served", "backend", "backend_not_local")
            return local[name]
        if not local:
            raise APIError(404, "this gateway runs no engine in its own process: read each "
                           "backend's own /debug/* where it is served", None,
                           "no_local_backend")
        if (model := query.get("model")) is not None:
            route = self.router.resolve(model).spec
            for name in route_backends(route):
                if name in local:
                    return local[name]
            raise APIError(404, f"model {route.name!r} has no backend in this process", "model",
                           "backend_not_local")
        if request_id is not None:
            for server in local.values():
                if holds(server, request_id):
                    return server
        return self.default_local(local)

    def default_local(self, local: dict[str, Any]) -> Any:
        """The default model's first local backend, else the first local one (None: none)."""
        with contextlib.suppress(APIError):
            for name in route_backends(self.router.resolve(None).spec):
                if name in local:
                    return local[name]
        return next(iter(local.values()), None)

    def local_registries(self) -> list[Any]:
        """The Prometheus registries of the local engines, their gauges brought up to date."""
        out = []
        for backend in self.backends.values():
            server = getattr(backend, "state", None)
            if server is None:
                continue
            if server.client is not None:
                server.metrics.update_stats(server.client.stats())
            out.append(server.metrics.registry)
        return out


def route_backends(route: RouteSpec) -> list[str]:
    """A route's backends in the order it tries them: its pools', then its fallbacks."""
    return list(dict.fromkeys([b for p in route.pools for b in p.backends]
                              + list(route.fallbacks)))
