"""Engine replicas on Ray Serve (docs/scale-out.md): the Ray side.

- `EngineReplica`, the deployment: each replica is today's single-model server
  (`lifeline.server.create_app`: its handlers, its `EngineClient`, its engine thread) in a Ray
  actor, called through the same ASGI bridge a local backend uses. `generate` streams what the
  app sends: first `{"status", "headers", "replica"}`, then the body's bytes as they come.
- `LifelineRequestRouter` (`ray_router.py`), Ray Serve's `RequestRouter` interface filled with Lifeline's own
  balancing policies (`lifeline.gateway.policies`): the replica choice happens inside Ray's
  router (so Ray's queue-length probes, its rejection protocol and its autoscaler all see the
  traffic), and the choice (candidates, their loads, the reason) is kept for the gateway's
  decision record.
- `deploy`: the deployment's options (replicas or autoscaling, the router, actor resources)
  from a backend spec, and `serve.run`.

Imported only where Ray is used (the `ray` extra): `lifeline serve` without Ray never imports
it."""
from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from lifeline.gateway.config import BackendSpec

DEPLOYMENT = "engine"
"""The deployment's name inside its application (`lifeline-<backend>`)."""
KEPT_PICKS = 1024
"""Router choices kept for the gateway to collect (it takes each one at its first byte)."""

_picks: OrderedDict[str, dict[str, Any]] = OrderedDict()
_picks_lock = threading.Lock()
"""Ray's router runs on its own event loop thread in the gateway's process; the gateway reads
its choices from the request's loop."""


def app_name(backend: str) -> str:
    return f"lifeline-{backend}"


def take_pick(key: str) -> dict[str, Any] | None:
    """The router's choice for the request sent under `key` (once; None if none is kept)."""
    with _picks_lock:
        return _picks.pop(key, None)


def keep_pick(key: str, update: dict[str, Any]) -> None:
    with _picks_lock:
        _picks.setdefault(key, {}).update(update)
        _picks.move_to_end(key)
        while len(_picks) > KEPT_PICKS:
            _picks.popitem(last=False)


# -- the replica -------------------------------------------------------------------------


class EngineReplica:
    """One replica: Lifeline's single-model server, loaded before Ray counts it as running
    (so `serve.run` returns, and Ray routes to it, only once its engine serves)."""

    async def __init__(self, model: str | None, server_config: Any):
        import logging

        from lifeline.model.loader import load_model
        from lifeline.observe import AccessLog
        from lifeline.server.app import create_app

        spec = None if model in (None, "default") else model
        self.app = create_app(lambda: load_model(spec), server_config)
        self.state = self.app.state.lifeline
        self.state.access_log = AccessLog(logging.getLogger("lifeline.ray.replica_access"))
        """The gateway writes the access-log line (the replica's timings nested in it)."""
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        while self.state.admission.loading and self.state.load_error is None:
            await asyncio.sleep(0.05)
        if self.state.load_error is not None:
            raise RuntimeError(f"cannot load the model: {self.state.load_error}")
        await self._warm_up()
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.actor_name = context.replica_id.to_full_id_str()

    async def _warm_up(self) -> None:
        """One two-token request through the app before Ray routes here: what a process does
        once, on its first prefill and decode (the C++ operators' build check in a child
        process, the kernels' first calls), is then not paid by a client's first request."""
        import json

        from lifeline.gateway.asgi_bridge import AppExchange

        body = json.dumps({"model": self.state.model_id, "prompt": [1, 2, 3], "max_tokens": 2,
                           "temperature": 0, "ignore_eos": True}).encode()
        exchange = await AppExchange.open(self.app, "POST", "/v1/completions", body, {
            "content-type": "application/json", "content-length": str(len(body))})
        try:
            answer = await exchange.aread()
        finally:
            await exchange.aclose()
        if exchange.status != 200:
            raise RuntimeError(f"the warm-up request failed ({exchange.status}): "
                               f"{answer[:300]!r}")

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[Any]:
        """One request through the replica's app: its status line, then its body."""
        from lifeline.gateway.asgi_bridge import AppExchange, BridgeError

        body = request["body"]
        headers = {**request["headers"], "content-type": "application/json",
                   "content-length": str(len(body))}
        try:
            exchange = await AppExchange.open(self.app, "POST", request["path"], body, headers)
        except BridgeError as exc:
            yield {"error": str(exc), "replica": self.replica}
            return
        try:
            yield {"status": exchange.status, "headers": exchange.headers,
                   "replica": self.replica, "actor": self.actor_name}
            async for chunk in exchange.aiter_bytes():
                yield chunk
        except BridgeError as exc:
            yield {"error": str(exc), "replica": self.replica}
        finally:
            await exchange.aclose()  # a cancelled request (the gateway hung up) aborts

    def check_health(self) -> None:
        """Ray's periodic check: a replica whose engine stopped is replaced."""
        state = self.state
        if not state.alive or state.client is None:
            raise RuntimeError("the engine stopped")

    async def __del__(self) -> None:
        lifespan, self._lifespan = getattr(self, "_lifespan", None), None
        if lifespan is not None:
            await lifespan.__aexit__(None, None, None)


# -- deploying ---------------------------------------------------------------------------


def deployment_options(spec: BackendSpec) -> dict[str, Any]:
    """`serve.deployment(...).options(...)` for a backend of kind `ray`: a fixed number of
    replicas or Ray's autoscaling settings as given, Lifeline's router, actor resources."""
    ray = spec.ray
    assert ray is not None
    from lifeline.gateway.ray_router import LifelineRequestRouter

    options: dict[str, Any] = {
        "name": DEPLOYMENT,
        "max_ongoing_requests": ray.max_ongoing_requests or spec.engine.max_num_seqs,
        "ray_actor_options": {"num_cpus": ray.num_cpus},
        "health_check_period_s": ray.health_check_period_s,
        "graceful_shutdown_timeout_s": ray.graceful_shutdown_timeout_s,
        "request_router_config": RequestRouterConfig(
            request_router_class=LifelineRequestRouter,
            request_router_kwargs={"policy": ray.router_policy,
                                   "load_factor": ray.load_factor})}
    if ray.autoscaling:
        options["autoscaling_config"] = dict(ray.autoscaling)
    else:
        options["num_replicas"] = ray.replicas
    return options


def deploy(spec: BackendSpec, server_config: Any) -> Any:
    """Deploy (or update) the backend's application and wait until its replicas serve;
    returns the deployment's handle. Blocking: call it off the event loop."""
    from ray.serve.config import ProxyLocation

    serve.start(proxy_location=ProxyLocation.Disabled)  # the gateway is the ingress
    deployment = serve.deployment(EngineReplica).options(**deployment_options(spec))
    return serve.run(deployment.bind(spec.model, server_config), name=app_name(spec.name),
                     route_prefix=None)
