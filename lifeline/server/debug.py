"""What the server saw, for people and for `lifeline bench`: `/debug/steps` (the engine's step
log), `/debug/requests` (in flight and recently finished), a request's diagnosis, and the
dashboard (its page and its `/dashboard/events` stream). The gateway middleware lets only the
admin key through once keys are configured (`Authenticator`); nothing here carries prompt or
output text."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import mimetypes
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response
from starlette.types import Receive, Scope, Send

from lifeline.engine.step_log import StepLog
from lifeline.observe.stats import EngineStats
from lifeline.server.errors import APIError, bad_request
from lifeline.server.openai_api import off_loop
from lifeline.server.recent import RECENT_REQUESTS, in_flight
from lifeline.server.state import ServerState

log = logging.getLogger("lifeline.server")
router = APIRouter()

STEPS_PAGE = 1000
"""Records `/debug/steps` answers by default; `MAX_STEPS_PAGE` at most."""
MAX_STEPS_PAGE = 4096
EVENT_INTERVAL_S = 0.5
EVENT_STEPS = 200
"""Steps one dashboard event carries at most (the newest; the rest are counted)."""
EVENT_REQUESTS = 200
SEND_TIMEOUT_S = 10.0
"""A dashboard client that takes longer than this to accept one event is dropped."""
MAX_VIEWERS = 8
"""Dashboard streams open at once; more get 503."""
DASHBOARD_DIR = Path(__file__).resolve().parent / "dashboard"
"""The dashboard's page and assets (package data)."""


def int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    """An integer query parameter within [low, high], or a 400 that names it."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer, got {raw[:40]!r}", name) from None
    if not low <= value <= high:
        raise bad_request(f"{name} must be between {low} and {high}, got {value}", name)
    return value


def _state(request: Request, request_id: str | None = None) -> ServerState:
    """The server whose records the request reads: the app's own, or, behind the gateway, the
    local backend that `app.state.debug_target(request, request_id)` picks (by `?backend=`,
    `?model=`, the request id, or the default model)."""
    pick = getattr(request.app.state, "debug_target", None)
    return pick(request, request_id) if pick is not None else request.app.state.lifeline


def _step_log(state: ServerState) -> StepLog | None:
    return state.client.step_log if state.client is not None else None


def _require_step_log(state: ServerState) -> StepLog:
    if state.client is None:
        raise APIError(503, "the model is not loaded yet", None, "loading", 1.0)
    step_log = _step_log(state)
    if step_log is None or not step_log.enabled:
        raise APIError(404, "this server keeps no step log (--step-log-size 0, or an engine "
                       "that reports none)", None, "step_log_disabled")
    return step_log


@router.get("/debug/backends")
async def debug_backends(request: Request) -> dict[str, Any]:
    """The engines these paths can read (`?backend=NAME` picks one): behind the gateway, each
    backend of the file (`app.state.debug_backends`); a single server is its own only one."""
    lister = getattr(request.app.state, "debug_backends", None)
    if lister is not None:
        return {"object": "list", "data": lister()}
    name = _state(request).model_id
    return {"object": "list", "data": [{"name": name, "model": name, "local": True,
                                        "default": True, "routes": [name]}]}


@router.get("/debug/steps")
async def debug_steps(request: Request) -> Response:
    step_log = _require_step_log(_state(request))
    since = int_param(request, "since", 0, 0, 1 << 62)
    limit = int_param(request, "limit", STEPS_PAGE, 1, MAX_STEPS_PAGE)
    page = step_log.after(since, limit)
    records = page.records
    body = {"object": "list", "data": records,
            "next": records[-1].step if records else min(since, page.latest),
            "dropped": page.dropped, "latest": page.latest,
            "config": {**step_log.config, "step_log_size": step_log.size}}
    return Response(await off_loop(_steps_json, body), media_type="application/json")


def _steps_json(body: dict[str, Any]) -> bytes:
    body["data"] = [r.as_dict() for r in body["data"]]
    return json.dumps(body, separators=(",", ":")).encode()


@router.get("/debug/requests")
async def debug_requests(request: Request) -> dict[str, Any]:
    state = _state(request)
    limit = int_param(request, "limit", RECENT_REQUESTS, 1, RECENT_REQUESTS)
    running = in_flight(state.generations, _step_log(state), state.model_id, RECENT_REQUESTS)
    return {"object": "list",
            "data": running + [f.row for f in state.recent.newest(limit)]}


def holds(state: ServerState, request_id: str) -> bool:
    """Whether the server has the request in flight or among its recent finished ones."""
    return state.recent.find(request_id) is not None or any(
        gen.choices and gen.choices[0].parent == request_id for gen in state.generations)


def _find(state: ServerState, request_id: str) -> dict[str, Any] | None:
    for gen in state.generations:
        if gen.choices and gen.choices[0].parent == request_id:
            return in_flight([gen], _step_log(state), state.model_id, 1)[0]
    finished = state.recent.find(request_id)
    return finished.row if finished is not None else None


def _not_found(request_id: str) -> APIError:
    return APIError(404, f"no request {request_id[:80]!r} in flight or among the last "
                    f"{RECENT_REQUESTS} finished", None, "request_not_found")


@router.get("/debug/requests/{request_id}")
async def debug_request(request: Request, request_id: str) -> dict[str, Any]:
    row = _find(_state(request, request_id), request_id)
    if row is None:
        raise _not_found(request_id)
    return row


@router.get("/debug/requests/{request_id}/diagnosis")
async def debug_diagnosis(request: Request, request_id: str) -> Any:
    try:
        from lifeline.bench.diagnose import diagnose_request
    except ImportError:
        raise APIError(501, "this build has no request diagnosis (lifeline.bench.diagnose)",
                       None, "diagnosis_unavailable") from None
    state = _state(request, request_id)
    finished = state.recent.find(request_id)
    if finished is None:
        if _find(state, request_id) is not None:
            raise APIError(409, "the request is still in flight; its diagnosis comes once it "
                           "has finished", None, "request_in_flight")
        raise _not_found(request_id)
    step_log = _step_log(state)
    steps = None
    if step_log is not None and step_log.enabled:
        steps = [r.as_dict() for r in step_log.between(finished.t0, finished.t1)]
    diagnosis = await off_loop(lambda: diagnose_request(finished.row["timings"], steps,
                                                       request_id=request_id))
    return {"id": request_id, **diagnosis} if isinstance(diagnosis, dict) else diagnosis


@router.get("/dashboard")
async def dashboard() -> Response:
    """The page (open to all: it holds no data; it sends the admin key with its requests)."""
    page = DASHBOARD_DIR / "index.html"
    if not page.is_file():
        raise APIError(404, "this build has no dashboard page", None, "dashboard_not_installed")
    return FileResponse(page, media_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-cache"})


@router.get("/dashboard/static/{name}")
async def dashboard_asset(name: str) -> Response:
    """A file of the dashboard's directory, by its exact name (no paths: nothing else can be
    reached). Open to all, like any page's scripts: they hold code, not data."""
    names = {p.name for p in DASHBOARD_DIR.iterdir() if p.is_file()} if DASHBOARD_DIR.is_dir() \
        else set()
    if name not in names:
        raise APIError(404, f"no dashboard file {name[:80]!r}", None, "not_found")
    kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
    return FileResponse(DASHBOARD_DIR / name, media_type=kind)


@router.get("/dashboard/events")
async def dashboard_events(request: Request) -> Response:
    state = _state(request)
    if len(state.viewers) >= MAX_VIEWERS:
        raise APIError(503, f"{MAX_VIEWERS} dashboards are open already", None,
                       "too_many_viewers", 5.0)
    return EventStream(state)


@dataclass(slots=True)
class Cursor:
    """What one stream has sent: the last step and the last finished request."""
    step: int | None = None
    seq: int = 0


def dashboard_event(state: ServerState, cursor: Cursor) -> dict[str, Any]:
    """One event: the engine now, the steps and requests since the last event, histograms."""
    client = state.client
    stats = client.stats() if client is not None else EngineStats()
    steps, dropped, batch = _new_steps(_step_log(state), cursor)
    running = in_flight(state.generations, _step_log(state), state.model_id, EVENT_REQUESTS)
    finished = state.recent.after(cursor.seq, EVENT_REQUESTS)
    cursor.seq = max(cursor.seq, state.recent.last_seq)
    queries = stats.prefix_cache_queries
    return {
        "now": time.time(),
        "engine": {"running": stats.num_running, "waiting": stats.num_waiting,
                   "kv_blocks_used": stats.kv_blocks_used,
                   "kv_blocks_total": stats.kv_blocks_total,
                   "prefix_hit_rate": stats.prefix_cache_hits / queries if queries else None,
                   "batch_size": batch},
        "steps": steps, "steps_dropped": dropped,
        "requests": running + [f.row for f in finished],
        "histograms": state.recent.histograms()}


def _new_steps(step_log: StepLog | None, cursor: Cursor
               ) -> tuple[list[dict[str, Any]], int, int]:
    """The newest `EVENT_STEPS` records since the cursor, the others since it left out, and
    the last step's batch size."""
    if step_log is None or not step_log.enabled:
        return [], 0, 0
    if cursor.step is None:
        records, dropped = step_log.latest(EVENT_STEPS), 0
        latest = records[-1].step if records else 0
    else:
        page = step_log.after(cursor.step, MAX_STEPS_PAGE)
        records, latest = page.records[-EVENT_STEPS:], page.latest
        dropped = page.dropped + len(page.records) - len(records)
    cursor.step = records[-1].step if records else max(cursor.step or 0, latest)
    last = records[-1] if records else next(iter(step_log.latest(1)), None)
    return [r.as_dict() for r in records], dropped, len(last.rows) if last else 0


class EventStream(Response):
    """`text/event-stream`: an event every `EVENT_INTERVAL_S` until the client goes. One task
    and one cursor per client; a client that does not take an event within `SEND_TIMEOUT_S`
    is dropped, so nothing queues behind it."""

    def __init__(self, state: ServerState):  # no body, so no Content-Length: not Response's
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.state.viewers.add(self)
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(receive, gone))
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": self.raw_headers})
            await self._stream(send, gone)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            self.state.viewers.discard(self)

    async def _stream(self, send: Send, gone: asyncio.Event) -> None:
        cursor = Cursor()
        while not gone.is_set():
            event = dashboard_event(self.state, cursor)
            body = f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
            try:
                await asyncio.wait_for(send({"type": "http.response.body", "body": body,
                                             "more_body": True}), SEND_TIMEOUT_S)
            except TimeoutError:
                log.warning("a dashboard client took over %.0f s to take an event: dropped",
                            SEND_TIMEOUT_S)
                return
            except OSError:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gone.wait(), EVENT_INTERVAL_S)
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return
