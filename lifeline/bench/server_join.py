"""Each request of a bench run joined to the server's own state around its life (arrival, first
token, end), as `ServerSampler` recorded it: what was running and waiting when it arrived, how
much of its wait the server showed requests waiting, which limit held them, the batch and the
other requests' prefill during its output, preemptions.

Where the server reports no queue time of its own (llama.cpp, vLLM, SGLang), the join gives the
request one: the part of its wait before prefill during which the server's metrics showed
requests waiting (a request that has arrived and not started is among them), less the wait of
requests that found a free slot (the network and HTTP floor). Its prefill is the server's own
per-request number where there is one (llama.cpp's `prompt_ms`), else the run's mean from the
server's histograms, scaled by the request's prompt length."""
from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

KV_FULL = 0.95
"""KV usage at or above which a wait is put down to the KV cache, not the batch limit."""

LIMIT_NAMES = {
    "llama.cpp": {"seqs": "slots", "kv": "kv_cache"},
    "vllm": {"seqs": "max_num_seqs", "kv": "kv_cache", "budget": "token_budget"},
    "sglang": {"seqs": "max_running_requests", "kv": "kv_cache", "budget": "token_budget"},
    "lifeline": {"seqs": "max_num_seqs", "kv": "kv_cache", "budget": "token_budget"},
}


class Timeline:
    """The samples as a step function: each sample holds from halfway after the one before it
    to halfway before the one after it (the nearest sample tells the value at any time)."""

    def __init__(self, samples: Sequence[dict[str, Any]]):
        self.samples = sorted(samples, key=lambda s: s["t"])
        self.times = [s["t"] for s in self.samples]
        self.edges = [(a + b) / 2 for a, b in zip(self.times, self.times[1:])]

    def __len__(self) -> int:
        return len(self.samples)

    def at(self, t: float) -> dict[str, Any]:
        return self.samples[bisect_left(self.edges, t)]

    def pieces(self, a: float, b: float) -> list[tuple[float, dict[str, Any]]]:
        """(seconds, sample) covering [a, b]."""
        if b <= a or not self.samples:
            return []
        out = []
        i = bisect_left(self.edges, a)
        start = a
        while True:
            end = self.edges[i] if i < len(self.edges) else float("inf")
            stop = min(end, b)
            if stop > start:
                out.append((stop - start, self.samples[i]))
            if end >= b:
                return out
            start, i = end, i + 1

    def seconds(self, a: float, b: float, pred: Callable[[dict[str, Any]], bool]) -> float:
        return sum(d for d, s in self.pieces(a, b) if pred(s))

    def mean(self, a: float, b: float, key: str) -> float | None:
        parts = [(d, s[key]) for d, s in self.pieces(a, b) if s.get(key) is not None]
        total = sum(d for d, _ in parts)
        if total <= 0:
            return self.at(a).get(key) if b <= a else None
        return sum(d * v for d, v in parts) / total

    def peak(self, a: float, b: float, key: str) -> float | None:
        values = [s[key] for _, s in self.pieces(a, b) if s.get(key) is not None]
        return max(values) if values else None

    def delta(self, a: float, b: float, key: str) -> float | None:
        """A counter's change from the sample before `a` to the first one after `b`."""
        before = [s for s in self.samples if s["t"] <= a and s.get(key) is not None]
        after = [s for s in self.samples if s["t"] >= b and s.get(key) is not None]
        if not before or not after:
            return None
        return _value(after[0][key]) - _value(before[-1][key])


def _value(v: Any) -> float:
    return v[0] if isinstance(v, list) else v


def waiting(sample: dict[str, Any]) -> bool:
    return (sample.get("waiting") or 0) > 0


def run_summary(state: dict[str, Any]) -> dict[str, Any]:
    """What the server's counters and histograms say of the whole run (first to last sample):
    means from its own histograms, its prefix-cache hit rate, preemptions, peaks."""
    samples = sorted(state.get("samples") or [], key=lambda s: s["t"])
    out: dict[str, Any] = {"samples": len(samples), "engine": state.get("engine")}
    if len(samples) < 2:
        return out
    first, last = samples[0], samples[-1]
    for key in ("queue_s", "prefill_s", "decode_s", "ttft_s", "e2e_s", "iteration_tokens"):
        if isinstance(first.get(key), list) and isinstance(last.get(key), list):
            dsum, dcount = last[key][0] - first[key][0], last[key][1] - first[key][1]
            if dcount > 0:
                scale = 1.0 if key == "iteration_tokens" else 1e3
                name = key if key == "iteration_tokens" else key[:-2] + "_ms"
                out[f"{name}_mean"] = dsum / dcount * scale
                out[f"{name}_count"] = dcount
    for key in ("prompt_tokens", "generation_tokens", "preemptions", "prefix_queries",
                "prefix_hits", "decode_calls", "prompt_seconds", "generation_seconds"):
        if first.get(key) is not None and last.get(key) is not None:
            out[key] = last[key] - first[key]
    if first.get("cached_tokens") is not None and last.get("cached_tokens") is not None:
        # llama.cpp counts prompt tokens computed and reused from a slot's cache apart
        out["cached_tokens"] = last["cached_tokens"] - first["cached_tokens"]
        out["prefix_hits"] = out["cached_tokens"]
        out["prefix_queries"] = out["cached_tokens"] + out.get("prompt_tokens", 0)
    if out.get("prefix_queries"):
        out["prefix_hit_rate"] = out.get("prefix_hits", 0) / out["prefix_queries"]
    elif "prefix_queries" in out and out.get("prompt_tokens"):
        out["prefix_hit_rate"] = 0.0  # caching off: nothing looked up, nothing served
    elif state.get("engine") == "sglang" and last.get("cache_hit_rate") is not None:
        out["prefix_hit_rate"] = last["cache_hit_rate"]
    if out.get("prompt_seconds") and out.get("prompt_tokens"):
        out["prefill_tok_s"] = out["prompt_tokens"] / out["prompt_seconds"]
    for key in ("running", "waiting", "kv_usage", "slots_busy"):
        values = [s[key] for s in samples if s.get(key) is not None]
        if values:
            out[f"{key}_max"] = max(values)
    slots = next((s["slots"] for s in samples if s.get("slots")), None)
    if slots:
        out["slots"] = slots
    out["capacity"] = capacity(state, samples)
    return out


def capacity(state: dict[str, Any], samples: Sequence[dict[str, Any]]) -> int | None:
    """The most requests the server ran at once: llama.cpp's slots, SGLang's
    max_running_requests, else the most seen running while others waited."""
    info = state.get("server_info") or {}
    config = state.get("config") or {}
    for v in (next((s.get("slots") for s in samples if s.get("slots")), None),
              info.get("total_slots"), info.get("max_running_requests"),
              config.get("max_running")):
        if v:
            return int(v)
    held = [s.get("running") for s in samples if waiting(s) and s.get("running") is not None]
    return int(max(held)) if held else None


def join(results: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """Adds `server_state` to each measured request record (and returns the run's summary)."""
    summary = run_summary(state)
    timeline = Timeline(state.get("samples") or [])
    engine = state.get("engine") or "unknown"
    records = [r for r in results.get("requests") or () if r.get("ok")]
    if len(timeline) < 2 or not records:
        return summary
    cap = summary.get("capacity")
    sees_queue = any(s.get("waiting") is not None for s in timeline.samples)
    mean_prompt = _mean([_prompt(r) for r in records if _prompt(r)])
    windows = []
    for r in records:
        sent = r.get("sent_s") or 0.0
        ttft = (r.get("ttft_ms") or 0.0) / 1e3
        reported = r.get("server_timings") or {}
        prefill = reported.get("prefill_ms")
        prefill_from = "server" if prefill is not None else None
        if prefill is None and summary.get("prefill_ms_mean") is not None:
            scale = (_prompt(r) / mean_prompt) if mean_prompt and _prompt(r) else 1.0
            prefill, prefill_from = summary["prefill_ms_mean"] * scale, "histogram"
        elif prefill is None and summary.get("ttft_ms_mean") is not None and \
                summary.get("queue_ms_mean") is not None:
            prefill = max(summary["ttft_ms_mean"] - summary["queue_ms_mean"], 0.0)
            prefill_from = "histogram"
        prefill = min(prefill or 0.0, ttft * 1e3)
        gap = ttft - prefill / 1e3
        windows.append((r, sent, gap, prefill, prefill_from))
    front_mean = None
    if None not in (summary.get("ttft_ms_mean"), summary.get("queue_ms_mean"),
                    summary.get("prefill_ms_mean")):
        front_mean = max(summary["ttft_ms_mean"] - summary["queue_ms_mean"]
                         - summary["prefill_ms_mean"], 0.0)
    floor = _floor([(gap, timeline.seconds(sent, sent + gap, waiting))
                    for _, sent, gap, _, _ in windows])
    prefill_windows = [(sent + gap, sent + gap + prefill / 1e3, _prompt(r) or 0)
                       for r, sent, gap, prefill, _ in windows]
    queues = _queues(windows, timeline, floor, summary)
    kv_total = kv_tokens(state)
    for i, (r, sent, gap, prefill, prefill_from) in enumerate(windows):
        waited = timeline.seconds(sent, sent + gap, waiting)
        queue_ms = queues[i]
        front_ms = None
        if front_mean is not None and reported_front(r) is None:
            # the server's own histograms: arrival to first token, less queue and prefill
            front_ms = min(front_mean, max(gap * 1e3 - queue_ms, 0.0))
        arrival = timeline.at(sent)
        limits = Counter(_limit(engine, s, cap, kv_total, mean_prompt)
                         for _, s in timeline.pieces(sent, sent + gap) if waiting(s))
        first = sent + (r.get("ttft_ms") or 0.0) / 1e3
        end = sent + (r.get("e2e_ms") or 0.0) / 1e3
        others_prefill = sum(_overlap(first, end, a, b) / (b - a) * n
                             for j, (a, b, n) in enumerate(prefill_windows)
                             if j != i and b > a)
        view = {
            "running_at_arrival": arrival.get("running"),
            "waiting_at_arrival": arrival.get("waiting"),
            "kv_usage_at_arrival": arrival.get("kv_usage"),
            "wait_ms": gap * 1e3, "waiting_seen_ms": waited * 1e3, "floor_ms": floor * 1e3,
            "queue_ms": queue_ms, "prefill_ms": prefill, "prefill_from": prefill_from,
            "front_ms": front_ms, "front_from": "histogram" if front_ms is not None else None,
            "limit": limits.most_common(1)[0][0] if limits else None,
            "limits": dict(limits), "capacity": cap,
            "batch_mean": timeline.mean(first, end, "running"),
            "running_max": timeline.peak(first, end, "running"),
            "kv_usage_mean": timeline.mean(first, end, "kv_usage"),
            "others_prefill_tokens": others_prefill,
            "preemptions_during": timeline.delta(sent, end, "preemptions"),
            "engine": engine, "interval_s": state.get("interval_s"),
        }
        view["preempted_ms"] = _stalls(r) if view["preemptions_during"] else 0.0
        prompt, n = _prompt(r) or 0, int(r.get("output_tokens") or 0)
        view.update({"context_first": prompt, "context_last": prompt + n,
                     "context_mean": prompt + n / 2})
        view["stages"] = _stages(r, engine, view, summary) if sees_queue else None
        r["server_state"] = view
    return summary


def _stages(r: dict[str, Any], engine: str, view: dict[str, Any],
            summary: dict[str, Any]) -> dict[str, Any] | None:
    """The request's stages with the join's queue (and prefill, decode) where the server
    reported none; None for a server that reports its own queue (Lifeline)."""
    reported = dict(r.get("server_timings") or {})
    if reported.get("queue_ms") is not None:
        return None
    source = reported.get("source") or engine
    front = reported.get("front_ms")
    if front is None and view.get("front_ms") is not None:
        front = view["front_ms"]
    out = {"source": source, "front_ms": front,
           "queue_ms": view["queue_ms"], "prefill_ms": view["prefill_ms"],
           "decode_ms": reported.get("decode_ms"), "server_ttft_ms": None,
           "server_e2e_ms": reported.get("server_e2e_ms"),
           "cached_tokens": reported.get("cached_tokens"), "queue_from": "server_state"}
    n = int(r.get("output_tokens") or 0)
    if out["decode_ms"] is None and summary.get("decode_ms_mean") is not None and n > 1:
        out["decode_ms"] = summary["decode_ms_mean"]
        out["decode_from"] = "histogram"
    return out


def _queues(windows: Sequence[tuple[dict[str, Any], float, float, float, str | None]],
            timeline: Timeline, floor: float, summary: dict[str, Any]) -> list[float]:
    """Each request's queue (ms): the part of its wait the samples showed requests waiting.
    Where the server also keeps a queue-time histogram (vLLM, SGLang), the run's mean is the
    server's own and the samples only share it out: a server whose gauges move once a step
    (vLLM's, while one step runs a second on a CPU) shows less waiting than there was. Each
    request's queue stays within its wait."""
    seen = [min(timeline.seconds(sent, sent + gap, waiting), max(gap - floor, 0.0)) * 1e3
            for _, sent, gap, _, _ in windows]
    room = [max(gap, 0.0) * 1e3 for _, _, gap, _, _ in windows]
    target = summary.get("queue_ms_mean")
    own = [(r.get("server_timings") or {}).get("queue_ms") for r, *_ in windows]
    if target is None or any(q is not None for q in own) or not windows:
        return seen
    weights = seen if sum(seen) > 0 else room
    total = target * len(windows)
    out = [0.0] * len(windows)
    for _ in range(4):  # share out, capping at each request's wait, the rest to the others
        left = total - sum(out)
        free = [i for i in range(len(out)) if out[i] < room[i] - 1e-9 and weights[i] > 0]
        if left <= 1e-6 or not free:
            break
        weight = sum(weights[i] for i in free)
        for i in free:
            out[i] = min(room[i], out[i] + left * weights[i] / weight)
    return out


STALL = 5.0
"""A token gap this many times the request's median is a stall (with preemptions, the time
the request was preempted and recomputed)."""


def _stalls(r: dict[str, Any]) -> float:
    """The time a request's stream stood still beyond its usual pace (ms): the gaps over
    `STALL` times its median, less the median. Counted only while the server preempted."""
    gaps = sorted(r.get("itl_ms") or ())
    if len(gaps) < 4:
        return 0.0
    median = gaps[len(gaps) // 2]
    return sum(g - median for g in gaps if g > STALL * median)


def reported_front(r: dict[str, Any]) -> float | None:
    return (r.get("server_timings") or {}).get("front_ms")


def kv_tokens(state: dict[str, Any]) -> int | None:
    """The KV cache's size in tokens, where the engine says (vLLM's cache config, SGLang's
    max_total_num_tokens)."""
    config = state.get("config") or {}
    cache = config.get("cache_config") or {}
    try:
        if cache.get("num_gpu_blocks") and cache.get("block_size"):
            return int(float(cache["num_gpu_blocks"])) * int(float(cache["block_size"]))
    except ValueError:
        return None
    return int(config["max_tokens"]) if config.get("max_tokens") else None


def _limit(engine: str, sample: dict[str, Any], cap: int | None,
           kv_total: int | None = None, need: float | None = None) -> str:
    """Which limit held a waiting request in this sample: the KV cache when it was full, or
    when what it had free could not hold a prompt of the run's (`need` tokens)."""
    names = LIMIT_NAMES.get(engine, LIMIT_NAMES["vllm"])
    usage = sample.get("kv_usage") or 0
    if usage >= KV_FULL or (kv_total and need and (1 - usage) * kv_total < need):
        return names["kv"]
    running = sample.get("running")
    if engine == "llama.cpp" or cap is None or running is None or running >= cap:
        return names["seqs"]
    return names.get("budget", names["seqs"])


def _floor(gaps: Sequence[tuple[float, float]]) -> float:
    """The wait of requests that saw nobody waiting (network, HTTP, tokenizing): their
    median, or 0 when every request waited."""
    free = sorted(g for g, w in gaps if w <= 0)
    return free[len(free) // 2] if free else 0.0


def _overlap(a: float, b: float, c: float, d: float) -> float:
    return max(0.0, min(b, d) - max(a, c))


def _prompt(r: dict[str, Any]) -> int | None:
    return r.get("usage_prompt_tokens") or r.get("expected_prompt_tokens")


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None
