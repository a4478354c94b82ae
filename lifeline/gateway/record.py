"""What one request through the gateway leaves behind: the gateway's stage timings with the
backend's nested in them, the decision joined with what the backend did, the Prometheus series
and the access-log line."""
from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime
from typing import Any

from lifeline.bench.stages import normalize

access = logging.getLogger("lifeline.access")
SERVER_TIMING = ("gateway", "routing", "retry", "upstream_connect", "upstream_headers", "ttft",
                 "e2e")


def timings(relay: Any) -> dict[str, Any]:
    """The gateway's stage (ms), the backend's own timings nested under `backend`."""
    s, marks, sent = relay.stamps, relay.marks, relay.sent_at
    parsed = s.parsed or s.arrival
    routed = relay.routed or parsed
    connect = None
    if "connected" in marks and "connecting" in marks:
        connect = ms(marks["connected"] - marks["connecting"])
    elif sent is not None:
        connect = 0.0  # a kept-alive connection, or a local engine
    headers = ms(marks["headers"] - sent) if "headers" in marks and sent is not None else None
    end = s.last_byte or time.perf_counter()
    backend = None
    if relay.backend is not None:
        backend = {"name": relay.backend.name, **(relay.reported or {})}
        upstream = getattr(relay.backend, "upstream_state", None)
        if upstream is not None and sent is not None:
            prefill = (normalize(relay.reported) or {}).get("prefill_ms") \
                if relay.reported else None
            attribution = upstream.attribution(sent, relay.first_output, prefill)
            if attribution is not None:
                backend["state"] = attribution
    return {"gateway_ms": ms(parsed - s.arrival), "routing_ms": ms(routed - parsed),
            "retries": sum(1 for a in relay.decision.attempts
                           if a["outcome"] not in ("skipped", "served", "answered")
                           and not a.get("after_output")),
            "retry_ms": ms(relay.failed_s), "upstream_connect_ms": connect,
            "upstream_headers_ms": headers, "ttft_ms": _since(relay.first_output, s.arrival),
            "e2e_ms": ms(end - s.arrival), "backend": backend}


def outcome(relay: Any) -> dict[str, Any]:
    """What the chosen backend did, joined to the decision: its cached prompt tokens and its
    own TTFT (the bench's normalisation of whatever timings it reported)."""
    reported = normalize(relay.reported) if relay.reported else {}
    usage = relay.usage or {}
    cached = reported.get("cached_tokens")
    if cached is None:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"backend": relay.backend.name if relay.backend else None, "status": relay.status,
            "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": cached,
            "backend_ttft_ms": reported.get("server_ttft_ms"),
            "backend_timings_source": reported.get("source"),
            "ttft_ms": _since(relay.first_output, relay.stamps.arrival)}


def account(relay: Any, routing: dict[str, Any], stage: dict[str, Any]) -> None:
    """Prometheus, the recent decisions, the access log."""
    state, spec, decision = relay.state, relay.route.spec, relay.decision
    m = state.metrics
    m.requests.labels(spec.name, str(relay.status)).inc()
    if relay.routed is not None:
        m.routing.observe(max(relay.routed - (relay.stamps.parsed or relay.stamps.arrival), 0))
    if decision.pool:
        m.split.labels(spec.name, decision.pool).inc()
        m.decisions.labels(spec.name, decision.policy, decision.code).inc()
    if relay.backend is not None and relay.verdict and relay.sent_at is not None:
        m.latency.labels(relay.backend.name).observe(relay.stamps.last_byte - relay.sent_at)
    state.router.remember(decision)
    if access.isEnabledFor(logging.INFO):
        access.info(json.dumps({
            "ts": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "request_id": relay.id, "model": spec.name, "endpoint": relay.endpoint,
            "status": relay.status, "stream": relay.stream,
            "backend": relay.backend.name if relay.backend else None, "timings": stage,
            "routing": routing}, separators=(",", ":")))


def server_timing(stage: dict[str, Any]) -> str:
    """A `Server-Timing` header value with the gateway's stages."""
    return ", ".join(f"{n};dur={stage[f'{n}_ms']:.3f}" for n in SERVER_TIMING
                     if stage.get(f"{n}_ms") is not None)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _since(point: float | None, start: float) -> float | None:
    return None if point is None else ms(point - start)
