"""Where the time went: server-reported stage timings, normalised across servers, split a
client's TTFT into client and network, front (gateway, template, tokenize), queue and prefill."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lifeline.bench.metrics import RequestMetrics, RequestTrace, distribution

TTFT_STAGES = ("client_network", "front", "queue", "prefill")
"""The parts of a client-measured TTFT, in the order a request meets them."""


def normalize(body: dict[str, Any]) -> dict[str, float | None] | None:
    """Stage timings (ms) from a response or final chunk: Lifeline's and llama.cpp's `timings`,
    vLLM's per-request `metrics`, and a Lifeline gateway's (its backend's nested in them).
    None when the server reported none."""
    timings = body.get("timings")
    if isinstance(timings, dict):
        if "routing_ms" in timings:
            return _gateway(timings)
        if "gateway_ms" in timings:
            return _lifeline(timings)
        if "prompt_ms" in timings:
            return _llama_cpp(timings)
    metrics = body.get("metrics")
    if isinstance(metrics, dict) and "first_token_time" in metrics:
        return _vllm(metrics)
    return None


def _lifeline(t: dict[str, Any]) -> dict[str, float | None]:
    front = sum(t.get(k) or 0.0 for k in ("gateway_ms", "template_ms", "tokenize_ms"))
    return {"source": "lifeline", "front_ms": front, "queue_ms": t.get("queue_ms"),
            "prefill_ms": t.get("prefill_ms"), "decode_ms": t.get("decode_ms"),
            "server_ttft_ms": t.get("ttft_ms"), "server_e2e_ms": t.get("e2e_ms"),
            "cached_tokens": t.get("cached_tokens")}


def _gateway(t: dict[str, Any]) -> dict[str, float | None]:
    """The gateway's own time (parsing, routing, failed attempts) joins the backend's front;
    the backend's queue, prefill and decode stay its own; TTFT and E2E are the gateway's,
    which start when the request reached it."""
    backend = t.get("backend") or {}
    inner = normalize(backend) or {}
    own = sum(t.get(k) or 0.0 for k in ("gateway_ms", "routing_ms", "retry_ms"))
    source = inner.get("source")
    queue = inner.get("queue_ms")
    state = backend.get("state") if isinstance(backend.get("state"), dict) else {}
    extra = {}
    if queue is None and state.get("queue_ms") is not None:
        # an upstream that reports no queue of its own: the wait its metrics showed
        queue, extra = state["queue_ms"], {"queue_from": "upstream_state"}
        source = source or state.get("engine")
    return {"source": f"gateway/{source}" if source else "gateway", **extra,
            "front_ms": own + (inner.get("front_ms") or 0.0), "queue_ms": queue,
            "prefill_ms": inner.get("prefill_ms"), "decode_ms": inner.get("decode_ms"),
            "server_ttft_ms": t.get("ttft_ms"), "server_e2e_ms": t.get("e2e_ms"),
            "cached_tokens": inner.get("cached_tokens")}


def _llama_cpp(t: dict[str, Any]) -> dict[str, float | None]:
    return {"source": "llama.cpp", "front_ms": None, "queue_ms": None,
            "prefill_ms": t.get("prompt_ms"), "decode_ms": t.get("predicted_ms"),
            "server_ttft_ms": None, "server_e2e_ms": None, "cached_tokens": t.get("cache_n")}


def _vllm(m: dict[str, Any]) -> dict[str, float | None]:
    def ms(a: str, b: str) -> float | None:
        if m.get(a) is None or m.get(b) is None:
            return None
        return (m[b] - m[a]) * 1e3
    queue = m.get("time_in_queue")
    return {"source": "vllm", "front_ms": None,
            "queue_ms": queue * 1e3 if queue is not None else ms("arrival_time",
                                                                "first_scheduled_time"),
            "prefill_ms": ms("first_scheduled_time", "first_token_time"),
            "decode_ms": ms("first_token_time", "last_token_time"),
            "server_ttft_ms": ms("arrival_time", "first_token_time"),
            "server_e2e_ms": ms("arrival_time", "finished_time"), "cached_tokens": None}


def ttft_split(trace: RequestTrace, m: RequestMetrics) -> dict[str, float | None] | None:
    """The client's TTFT as client_network + front + queue + prefill (ms). Stages the server
    did not report are None and their time stays in `client_network`."""
    t = trace.server_timings
    if t is None or m.ttft_ms is None:
        return None
    parts = {"front": t.get("front_ms"), "queue": t.get("queue_ms"),
             "prefill": t.get("prefill_ms")}
    server = t.get("server_ttft_ms")
    if server is None:
        server = sum(v for v in parts.values() if v is not None)
    return {"client_network": m.ttft_ms - server, **parts}


def breakdown(splits: Sequence[dict[str, float | None] | None]) -> dict[str, Any] | None:
    """Each TTFT stage's distribution and its share of the summed TTFT."""
    splits = [s for s in splits if s is not None]
    if not splits:
        return None
    total = sum(sum(v for v in s.values() if v is not None) for s in splits)
    out: dict[str, Any] = {}
    for stage in TTFT_STAGES:
        values = [s[stage] for s in splits if s.get(stage) is not None]
        if not values:
            continue
        out[f"{stage}_ms"] = distribution(values)
        out[f"{stage}_ms"]["share"] = sum(values) / total if total > 0 else None
    return out
