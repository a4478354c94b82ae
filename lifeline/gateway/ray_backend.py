"""A backend of kind `ray`: engine replicas on Ray Serve, reached through a `DeploymentHandle`
with streaming (docs/scale-out.md). The gateway stays the ingress (keys, limits, fallback,
breakers, the decision record); Ray Serve places, restarts and autoscales the replicas, and
its router, filled with Lifeline's policies (`ray_serve.LifelineRequestRouter`), picks the
replica. Requests travel as the gateway already forwards them, OpenAI request bodies, so a
replica is today's single-model server and the relay treats it like any other backend.

A replica that dies fails its requests with Ray's actor-died error: one that had not yet
relayed a token is retried (on this backend again, so Ray's router, which has dropped the dead
replica, sends it to a live one), one that had ends with the relay's error event. Neither
charges the circuit breaker: Ray replaces the replica."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from typing import Any

from lifeline.gateway.backends import (
    Backend,
    BackendError,
    engine_server_config,
    local_model_name,
)
from lifeline.gateway.config import BackendSpec, GatewayConfig

log = logging.getLogger("lifeline.gateway")
REPLICA_DIED = "replica_died"
"""The failure kind of an attempt whose Ray replica died (or became unreachable)."""
FAILED_STATES = ("UNHEALTHY", "DEPLOY_FAILED")


class RayBackend(Backend):
    def __init__(self, spec: BackendSpec, config: GatewayConfig, on_fatal: Any = None):
        super().__init__(spec, config)
        from lifeline.gateway.ray_serve import app_name

        self.config = config
        self.served_name = spec.served_model_name or local_model_name(spec.model)
        self.app_name = app_name(spec.name)
        self.handle: Any = None
        self._load_error: str | None = None
        self._on_fatal = on_fatal
        self._sent = itertools.count()
        self.replica_states: dict[str, int] = {}
        """Replicas by state, from the last health check (Ray's `serve.status()`)."""
        self.app_status: str | None = None

    # -- deploying ---------------------------------------------------------------------

    @property
    def load_error(self) -> str | None:
        return self._load_error

    @property
    def healthy(self) -> bool:
        return self.handle is not None and self._healthy

    def model_for(self, route: str) -> str:
        return self.served_name

    def server_config(self) -> Any:
        return engine_server_config(self.spec, self.served_name)

    async def start(self, stack: contextlib.AsyncExitStack) -> None:
        """Deploy in the background (replicas load for seconds to minutes); the backend is out
        of rotation until `serve.run` returns. The deployment is deleted when the gateway
        stops."""
        task = asyncio.get_running_loop().run_in_executor(None, self._deploy)
        task.add_done_callback(self._deployed)
        stack.push_async_callback(self._stop, task)

    def _deploy(self) -> Any:
        connect(self.config.ray_address, self.config.ray_namespace)
        from lifeline.gateway.ray_serve import deploy

        return deploy(self.spec, self.server_config())

    def _deployed(self, task: asyncio.Future) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            self.handle = task.result()
            log.info("ray backend %s: application %s is running", self.name, self.app_name)
            return
        self._load_error = f"{type(exc).__name__}: {exc}"
        log.error("ray backend %s could not be deployed: %s", self.name, self._load_error)
        if self._on_fatal is not None:
            self._on_fatal(self)

    async def _stop(self, task: asyncio.Future) -> None:
        with contextlib.suppress(Exception):
            await task
        await asyncio.get_running_loop().run_in_executor(None, self._teardown)

    def _teardown(self) -> None:
        import ray
        from ray import serve

        if ray.is_initialized():
            with contextlib.suppress(Exception):
                serve.delete(self.app_name)

    # -- requests ----------------------------------------------------------------------

    def verdict_on(self, err: BackendError) -> bool | None:
        return None if err.kind == REPLICA_DIED else False

    def retries_on(self, err: BackendError) -> bool:
        return err.kind == REPLICA_DIED

    async def open(self, path: str, body: bytes, headers: dict[str, str],
                   marks: dict[str, float], prefix: str | None = None) -> _RayExchange:
        if self.handle is None:
            raise BackendError("internal", "the Ray deployment is not running yet")
        key = f"{headers.get('x-request-id', 'gw')}#{next(self._sent)}"
        request = {"id": key, "path": path, "body": body, "headers": headers}
        if self.spec.ray.router_policy == "prefix_affinity":
            request["prefix"] = prefix
        stream = self.handle.options(stream=True).generate.remote(request)
        exchange = _RayExchange(stream, key)
        try:
            first = await exchange.next_item()
        except BaseException:
            exchange.cancel()
            raise
        marks["headers"] = time.perf_counter()
        exchange.start(first)
        return exchange

    async def probe_health(self) -> str | None:
        """Out of rotation only when Ray says the deployment failed with no replica left
        running (with none running and no failure, e.g. scaled to zero, requests wait in Ray's
        router for a replica)."""
        if self.handle is None:
            return self._load_error or "deploying on Ray Serve"
        status = await asyncio.get_running_loop().run_in_executor(None, self._status)
        if status is None:
            return f"Ray has no application {self.app_name!r}"
        self.app_status, deployment = status
        self.replica_states = dict(deployment.replica_states) if deployment else {}
        running = self.replica_states.get("RUNNING", 0)
        state = str(getattr(deployment, "status", "")) if deployment else ""
        if running == 0 and any(s in state for s in FAILED_STATES):
            return f"no replica running ({state}: {getattr(deployment, 'message', '')})"
        return None

    def _status(self) -> tuple[str, Any] | None:
        from ray import serve

        from lifeline.gateway.ray_serve import DEPLOYMENT

        app = serve.status().applications.get(self.app_name)
        if app is None:
            return None
        return str(app.status), app.deployments.get(DEPLOYMENT)

    def status(self) -> dict[str, Any]:
        return {**super().status(), "ray": {
            "application": self.app_name, "status": self.app_status,
            "replicas": self.replica_states,
            "autoscaling": dict(self.spec.ray.autoscaling) or None,
            "num_replicas": None if self.spec.ray.autoscaling else self.spec.ray.replicas}}


class _RayExchange:
    """A streamed `DeploymentResponseGenerator` read as an `Exchange`: the replica's first item
    is the status line, the rest the body."""

    def __init__(self, stream: Any, key: str):
        self.stream, self.key = stream, key
        self.status = 0
        self.headers: dict[str, str] = {}
        self.detail: dict[str, Any] = {}
        """The replica that served, and the router's choice: the attempt's decision entry."""

    def start(self, first: Any) -> None:
        self._collect(first)
        if not isinstance(first, dict) or "error" in first:
            self.cancel()
            raise self._failure(BackendError("internal", f"the replica failed: "
                                             f"{_error_of(first)}"))
        self.status = first["status"]
        self.headers = dict(first["headers"])

    def _collect(self, first: Any = None) -> None:
        """The router's choice for this request, and the replica that took it."""
        from lifeline.gateway.ray_serve import take_pick

        pick = take_pick(self.key)
        if pick:
            self.detail["ray_router"] = pick
            self.detail.setdefault("replica", pick.get("routed_to"))
        if isinstance(first, dict) and first.get("replica"):
            self.detail["replica"] = first["replica"]

    async def next_item(self) -> Any:
        try:
            return await self.stream.__anext__()
        except StopAsyncIteration:
            raise BackendError("incomplete_stream", "the replica sent nothing") from None
        except Exception as exc:  # noqa: BLE001 - Ray's errors, mapped to a kind
            raise self._failure(exc) from None

    async def aiter_bytes(self) -> Any:
        while True:
            try:
                item = await self.stream.__anext__()
            except StopAsyncIteration:
                return
            except Exception as exc:  # noqa: BLE001
                raise self._failure(exc) from None
            if isinstance(item, dict):
                raise self._failure(BackendError("internal", f"the replica failed: "
                                                 f"{_error_of(item)}"))
            yield item

    async def aread(self) -> bytes:
        return b"".join([chunk async for chunk in self.aiter_bytes()])

    def cancel(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.cancel()

    async def aclose(self) -> None:
        """Hang up: Ray cancels the replica's generator, whose app then sees the client leave
        and aborts the request."""
        self.cancel()

    def _failure(self, exc: BaseException) -> BackendError:
        if not self.detail:
            self._collect()
        err = exc if isinstance(exc, BackendError) else replica_error(exc)
        err.detail = dict(self.detail)
        return err


def replica_error(exc: BaseException) -> BackendError:
    """A Ray failure as the kind the gateway counts."""
    from ray import exceptions

    died = (exceptions.ActorDiedError, exceptions.ActorUnavailableError,
            exceptions.RayActorError, exceptions.NodeDiedError, exceptions.WorkerCrashedError)
    if isinstance(exc, died) or isinstance(getattr(exc, "cause", None), died):
        return BackendError(REPLICA_DIED, f"the Ray replica died or is unreachable "
                            f"({type(exc).__name__})")
    if isinstance(exc, exceptions.RayTaskError):
        return BackendError("internal", f"the replica raised {type(exc.cause).__name__}")
    return BackendError("internal", f"{type(exc).__name__}")


def _error_of(item: Any) -> str:
    return str(item.get("error")) if isinstance(item, dict) else f"{type(item).__name__}"


_started_here = False


def connect(address: str | None, namespace: str = "lifeline") -> None:
    """Join the Ray cluster at `address` (else RAY_ADDRESS, else start a local instance) unless
    this process already has."""
    global _started_here
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    ray.init(address=address, namespace=namespace, include_dashboard=False,
             log_to_driver=False)
    _started_here = address is None


def disconnect() -> None:
    """Leave Ray; a local instance this process started stops with it."""
    import ray

    global _started_here
    if not ray.is_initialized():
        return
    if _started_here:
        from ray import serve

        with contextlib.suppress(Exception):
            serve.shutdown()
    ray.shutdown()
    _started_here = False
