"""One request's TTFT split by cause, exactly: client and network, front, queue, and its prefill
split into the prompt's own computed tokens (what the template added, what an unusually fine
tokenizer added, the rest) and other requests' work in the same steps."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lifeline.bench.request_view import RequestView
from lifeline.bench.step_index import StepIndex
from lifeline.bench.text_cost import RAISE_AT

TTFT_CAUSES = ("client_network", "front", "queue", "prompt_assembly", "tokenizer", "prefill",
               "prefill_interference")
ASSEMBLY_PARTS = ("template", "system", "tools", "history")
PROMPT_ORDER = ("template", "system", "tools", "history", "latest_user")
"""The order a cached prefix eats the anatomy's parts in (scaffolding and the system prompt
lead a rendered prompt; the template's tokens are spread through it, so this is a fair
approximation, not an exact one)."""


@dataclass(slots=True)
class TtftSplit:
    """Milliseconds by cause (summing to the request's TTFT) and the facts behind them."""

    parts: dict[str, float]
    facts: dict[str, Any] = field(default_factory=dict)


def split_ttft(view: RequestView, index: StepIndex | None,
               text: dict[str, Any] | None) -> TtftSplit | None:
    """None when the request has no TTFT or the server reported no stages."""
    server = view.server_ttft_ms()
    if view.ttft_ms is None or server is None:
        return None
    s = view.stages or {}
    queue, prefill = s.get("queue_ms") or 0.0, s.get("prefill_ms") or 0.0
    parts = {"client_network": view.ttft_ms - server if view.client else 0.0,
             "front": server - queue - prefill, "queue": queue}
    own, others, by_tokens, chunk_facts = _own_and_others(view, index, prefill)
    facts = {"ttft_ms": view.ttft_ms, "server_ttft_ms": server, **chunk_facts,
             **_front_facts(view), **_queue_facts(view)}
    facts["connect_ms"] = view.connect_ms
    parts["prefill_interference"] = others
    ratio = (text or {}).get("ratio")
    excess = 1 - 1 / ratio if ratio and ratio >= RAISE_AT else 0.0
    parts["tokenizer"] = by_tokens * excess
    rest = by_tokens - parts["tokenizer"]
    computed = _computed_parts(view)
    facts["computed_parts"] = computed
    facts["own_prefill_ms"] = own
    assembly = sum(computed.get(p, 0) for p in ASSEMBLY_PARTS) if computed else 0
    total = sum(computed.values()) if computed else 0
    parts["prompt_assembly"] = rest * assembly / total if total else 0.0
    parts["prefill"] = own - parts["tokenizer"] - parts["prompt_assembly"]
    return TtftSplit({c: parts[c] for c in TTFT_CAUSES}, facts)


def _own_and_others(view: RequestView, index: StepIndex | None, prefill_ms: float
                    ) -> tuple[float, float, dict[str, Any]]:
    """Split the prefill stage between this request's tokens and the others' work in its
    steps: each step's time by its tokens; steps between its chunks that left it out are
    others'; time outside any step (scheduling, the engine's bookkeeping) goes to both in
    proportion."""
    chunks = _chunks(view, index)
    facts: dict[str, Any] = {"prefill_ms": prefill_ms, "chunks": len(chunks)}
    raw = view.backend_raw()
    facts["prompt_tokens"] = raw.get("prompt_tokens")
    if facts["prompt_tokens"] is None and raw.get("prompt_n") is not None:
        # llama.cpp: the tokens it computed, and those its slot's cache served
        facts["prompt_tokens"] = raw["prompt_n"] + (raw.get("cache_n") or 0)
    if facts["prompt_tokens"] is None and view.state.get("context_first"):
        facts["prompt_tokens"] = view.state["context_first"]
    facts["cached_tokens"] = (view.stages or {}).get("cached_tokens")
    if not chunks:
        return prefill_ms, 0.0, prefill_ms, facts
    own = sum(c["duration_ms"] * c["tokens"] / max(c["batch_tokens"], 1) for c in chunks)
    steps = sum(c["duration_ms"] for c in chunks) + sum(c.get("skipped_ms", 0.0) for c in chunks)
    facts["computed_tokens"] = sum(c["tokens"] for c in chunks)
    facts["largest_other_chunk"] = max((c.get("other_chunk") or 0 for c in chunks), default=0)
    facts["others_tokens"] = sum(c["batch_tokens"] - c["tokens"] for c in chunks)
    if steps <= 0:
        return prefill_ms, 0.0, prefill_ms, facts
    own_ms = own * prefill_ms / steps
    return own_ms, prefill_ms - own_ms, min(own, own_ms), facts


def _chunks(view: RequestView, index: StepIndex | None) -> list[dict[str, Any]]:
    """This request's prefill chunks up to its first token: from the step log when it has
    them (with the steps between chunks that left the request out), else from the rows of
    its timings."""
    entries = [(s, e) for s, e in (index.of_request(view.id) if index else [])
               if e.get("kind") == "prefill"]
    if entries:
        first_token = next((i for i, (_, e) in enumerate(entries) if e.get("sampled")),
                           len(entries) - 1)
        entries = entries[:first_token + 1]
        out = []
        previous = None
        for i, (step, entry) in enumerate(entries):
            others = [e for e in step.get("requests") or () if e is not entry]
            skipped = index.between(previous, step["step"]) if previous is not None else []
            last = i == len(entries) - 1
            out.append({"tokens": entry["tokens"],
                        "duration_ms": step["duration_ms"] if last else index.period(step),
                        "batch_tokens": sum(e["tokens"] for e in step["requests"]),
                        "other_chunk": max((e["tokens"] for e in others
                                            if e.get("kind") == "prefill"), default=0),
                        "skipped_ms": sum(index.period(s) for s in skipped)})
            previous = step["step"]
        return out
    rows = ((view.backend_raw().get("steps") or {}).get("prefill")) or []
    return [{"tokens": r[1], "batch_tokens": r[4], "duration_ms": r[5]} for r in rows
            if len(r) >= 6]


def _computed_parts(view: RequestView) -> dict[str, int]:
    """The anatomy's parts less what the prefix cache served (taken from the front)."""
    anatomy = view.backend_raw().get("prompt_anatomy")
    if not isinstance(anatomy, dict):
        return {}
    cached = int((view.stages or {}).get("cached_tokens") or 0)
    out = {}
    for part in PROMPT_ORDER:
        n = int(anatomy.get(part) or 0)
        eaten = min(n, cached)
        cached -= eaten
        out[part] = n - eaten
    return out


def _front_facts(view: RequestView) -> dict[str, Any]:
    raw = view.backend_raw()
    return {**{k: raw.get(f"{k}_ms") for k in ("gateway", "template", "tokenize")},
            "front_from": (view.state or {}).get("front_from"),
            "engine": (view.state or {}).get("engine")}


def _queue_facts(view: RequestView) -> dict[str, Any]:
    """The server's own account of the wait (Lifeline's `timings.queue`), else what its
    sampled state showed around the request (`lifeline.bench.server_join`)."""
    raw = view.backend_raw()
    queue = raw.get("queue") if isinstance(raw.get("queue"), dict) else {}
    state = view.state or {}
    # a gateway's upstream that reports no queue: the gateway sampled its metrics
    upstream = raw.get("state") if isinstance(raw.get("state"), dict) else {}
    sampled = upstream or state
    if not queue and sampled:
        queue = {"limit": sampled.get("limit") if sampled.get("queue_ms") else None,
                 "max_num_seqs": sampled.get("capacity"), "from": "server_state",
                 **{k: sampled.get(k) for k in ("running_at_arrival", "waiting_at_arrival",
                                                "engine", "waiting_seen_ms",
                                                "kv_usage_at_arrival")}}
    return {"queue_info": queue, "preemptions": raw.get("preemptions"),
            "server_preemptions": state.get("preemptions_during"),
            "recomputed_tokens": raw.get("recomputed_tokens"),
            "anatomy": raw.get("prompt_anatomy"), "turn": view.turn}
