"""Per-request metrics from a recorded stream, and their aggregates over a run.

Definitions (and where they agree with vLLM's `bench serve`) are in docs/bench.md.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

ANSWER, REASONING = "answer", "reasoning"
PERCENTILES = (50, 90, 95, 99)


@dataclass(slots=True)
class Chunk:
    """One streamed event that carried output."""

    at: float
    """`time.perf_counter()` when the event was received."""
    tokens: int = 1
    """Output tokens the event carried (exact from logprobs, else an estimate)."""
    kind: str = ANSWER
    """`answer` (content, text, tool calls) or `reasoning` (reasoning_content/reasoning)."""

    def __post_init__(self) -> None:
        if self.kind not in (ANSWER, REASONING):
            raise ValueError(f"unknown chunk kind {self.kind!r}")
        if self.tokens < 0:
            raise ValueError("a chunk carries a non-negative number of tokens")


@dataclass(slots=True)
class RequestTrace:
    """What the client saw of one request."""

    sent: float
    """`time.perf_counter()` just before the request was sent."""
    chunks: list[Chunk] = field(default_factory=list)
    """Events that carried output, in arrival order."""
    done: float | None = None
    """The last event (or the whole body) was received; None if the stream never ended."""
    prompt_tokens: int | None = None
    """`usage.prompt_tokens` from the server."""
    output_tokens: int | None = None
    """`usage.completion_tokens` from the server."""
    expected_prompt_tokens: int | None = None
    """The prompt's length as the workload counted it: the fallback without usage."""
    server_timings: dict[str, float | None] | None = None
    """Stage timings the server reported, normalised by `lifeline.bench.stages.normalize`."""
    timings_raw: dict[str, Any] | None = None
    """The same as the server sent them (Lifeline's `timings`, vLLM's `metrics`): the
    diagnosis reads what only some servers give (prompt anatomy, step rows, the queue)."""
    response_id: str | None = None
    """The response's `id`: what the server's step log and records call the request."""
    connect_ms: float = 0.0
    """Time spent opening a connection for this request (0 on a kept-alive one)."""
    error: str | None = None
    """The kind of failure (`http_503`, `timeout`, `connect`, `stream_error`, ...); None if ok."""
    error_message: str | None = None
    """The failure's text, for the records."""
    finish_reason: str | None = None
    answer: str = ""
    """The answer's text (content or completion text), for the next turn of a session."""


@dataclass(slots=True)
class RequestMetrics:
    """Per-request numbers, in milliseconds and tokens; None where undefined."""

    ok: bool
    error: str | None
    ttft_ms: float | None
    """Send to the first event carrying output of any kind."""
    ttfat_ms: float | None
    """Send to the first answer event; None if the model never answered."""
    e2e_ms: float | None
    """Send to the end of the stream."""
    tpot_ms: float | None
    """(e2e − ttft) / (output_tokens − 1); None with fewer than 2 tokens."""
    itl_ms: list[float]
    """Gaps between consecutive output events (vLLM's ITL: one per event)."""
    tbt_ms: list[float]
    """Gaps between consecutive tokens: each event's gap shared evenly by its tokens."""
    prompt_tokens: int | None
    output_tokens: int
    prefill_tok_s: float | None
    """prompt_tokens / TTFT."""
    output_tok_s: float | None
    """(output_tokens − 1) / (e2e − ttft): the speed after the first token, 1000 / TPOT."""

    def scalars(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (
            "ok", "error", "ttft_ms", "ttfat_ms", "e2e_ms", "tpot_ms", "prompt_tokens",
            "output_tokens", "prefill_tok_s", "output_tok_s")}


def request_metrics(trace: RequestTrace) -> RequestMetrics:
    """The metrics of one traced request."""
    chunks = [c for c in trace.chunks if c.tokens > 0] or list(trace.chunks)
    n = _output_tokens(trace)
    weights = _apportion([c.tokens for c in chunks], n)
    first = next((c.at for c, w in zip(chunks, weights) if w > 0), None)
    first_answer = next((c.at for c, w in zip(chunks, weights) if w > 0 and c.kind == ANSWER),
                        None)
    ttft = _ms(first, trace.sent)
    e2e = _ms(trace.done, trace.sent)
    tpot = (e2e - ttft) / (n - 1) if ttft is not None and e2e is not None and n > 1 else None
    prompt = trace.prompt_tokens if trace.prompt_tokens is not None else \
        trace.expected_prompt_tokens
    timed = [(c.at, w) for c, w in zip(chunks, weights) if w > 0]
    return RequestMetrics(
        ok=trace.error is None and trace.done is not None,
        error=trace.error if trace.error is not None else
        (None if trace.done is not None else "incomplete"),
        ttft_ms=ttft, ttfat_ms=_ms(first_answer, trace.sent), e2e_ms=e2e, tpot_ms=tpot,
        itl_ms=[(b - a) * 1e3 for (a, _), (b, _) in itertools.pairwise(timed)],
        tbt_ms=_token_gaps(timed), prompt_tokens=prompt, output_tokens=n,
        prefill_tok_s=prompt / ttft * 1e3 if prompt and ttft else None,
        output_tok_s=1e3 / tpot if tpot else None)


def _output_tokens(trace: RequestTrace) -> int:
    if trace.output_tokens is not None:
        return trace.output_tokens
    return sum(c.tokens for c in trace.chunks)


def _apportion(counts: list[int], total: int) -> list[int]:
    """Scale per-event token counts to sum to `total` (usage wins over estimates), by largest
    remainder so every count stays a whole number."""
    have = sum(counts)
    if have == total or not counts:
        return counts
    if have == 0:
        counts, have = [1] * len(counts), len(counts)
    shares = [c * total / have for c in counts]
    out = [math.floor(s) for s in shares]
    by_remainder = sorted(range(len(out)), key=lambda i: out[i] - shares[i])
    for i in by_remainder[:total - sum(out)]:
        out[i] += 1
    return out


def _token_gaps(timed: list[tuple[float, int]]) -> list[float]:
    """A first event with k tokens gives k − 1 zero gaps; a later event arriving g after the
    previous one with k tokens gives k gaps of g / k. So the gaps sum to last − first and
    number output_tokens − 1."""
    if not timed:
        return []
    gaps = [0.0] * (timed[0][1] - 1)
    for (prev, _), (at, k) in itertools.pairwise(timed):
        gaps += [(at - prev) * 1e3 / k] * k
    return gaps


def _ms(at: float | None, start: float) -> float | None:
    return None if at is None else (at - start) * 1e3


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default, as vLLM uses)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """`count`, `mean`, `p50`, `p90`, `p95`, `p99`, `max` of the defined values."""
    vals = [v for v in values if v is not None]
    out: dict[str, float | int | None] = {
        "count": len(vals), "mean": sum(vals) / len(vals) if vals else None}
    out.update({f"p{q}": percentile(vals, q) for q in PERCENTILES})
    out["max"] = max(vals, default=None)
    return out


@dataclass(slots=True)
class Slo:
    """Per-request thresholds in milliseconds; a request meets the SLO when it succeeded and
    meets every one."""

    thresholds: dict[str, float]
    attainment: float = 0.9
    """The share of requests that must meet it for a run to meet it."""

    KEYS = ("ttft", "ttfat", "tpot", "e2e")

    def __post_init__(self) -> None:
        unknown = set(self.thresholds) - set(self.KEYS)
        if unknown:
            raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}; use {self.KEYS}")
        if not 0 < self.attainment <= 1:
            raise ValueError("attainment is a fraction in (0, 1]")

    @classmethod
    def parse(cls, text: str, attainment: float | str = 0.9) -> Slo:
        """`ttft=2s,tpot=150ms,e2e=30s` (also vLLM's `ttft:2000`; a bare number is ms)."""
        thresholds = {}
        for item in filter(None, (p.strip() for p in text.replace(" ", ",").split(","))):
            key, sep, value = item.partition("=") if "=" in item else item.partition(":")
            if not sep:
                raise ValueError(f"SLO item {item!r} is not metric=value")
            thresholds[key.strip().lower()] = parse_duration_ms(value)
        return cls(thresholds, parse_fraction(attainment))

    def met_by(self, m: RequestMetrics) -> bool:
        """tpot undefined (fewer than 2 tokens) passes; ttft/ttfat undefined fails: the user
        never saw a token (or an answer)."""
        if not m.ok:
            return False
        for key, limit in self.thresholds.items():
            value = getattr(m, f"{key}_ms")
            if (value is None and key != "tpot") or (value is not None and value > limit):
                return False
        return True

    def as_text(self) -> str:
        return ",".join(f"{k}={v:g}ms" for k, v in self.thresholds.items())


def parse_duration_ms(text: str) -> float:
    text = text.strip().lower()
    for unit, scale in (("ms", 1.0), ("us", 1e-3), ("s", 1e3), ("m", 60e3)):
        if text.endswith(unit):
            return float(text[:-len(unit)]) * scale
    return float(text)


def parse_fraction(value: float | str) -> float:
    if isinstance(value, str):
        value = value.strip()
        return float(value[:-1]) / 100 if value.endswith("%") else float(value)
    return float(value)


def summarize(metrics: Sequence[RequestMetrics], duration_s: float,
              slo: Slo | None = None) -> dict[str, Any]:
    """The `summary` object of a run: latency distributions over successful requests,
    throughputs over `duration_s` (the measured window), errors by kind, goodput."""
    ok = [m for m in metrics if m.ok]
    prompt = sum(m.prompt_tokens or 0 for m in ok)
    output = sum(m.output_tokens for m in ok)
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    out: dict[str, Any] = {
        "requests": len(metrics), "successful": len(ok), "failed": len(metrics) - len(ok),
        "errors": dict(Counter(m.error or "unknown" for m in metrics if not m.ok)),
        "duration_s": duration_s, "prompt_tokens": prompt, "output_tokens": output,
        "ttft_ms": distribution(m.ttft_ms for m in ok),
        "ttfat_ms": distribution(m.ttfat_ms for m in ok),
        "tbt_ms": distribution(g for m in ok for g in m.tbt_ms),
        "itl_ms": distribution(g for m in ok for g in m.itl_ms),
        "tpot_ms": distribution(m.tpot_ms for m in ok),
        "e2e_ms": distribution(m.e2e_ms for m in ok),
        "prefill_tok_s": distribution(m.prefill_tok_s for m in ok),
        "output_tok_s": distribution(m.output_tok_s for m in ok),
        "output_throughput_tok_s": rate(output),
        "total_throughput_tok_s": rate(prompt + output),
        "request_throughput_rps": rate(len(ok)),
        "goodput_rps": None, "slo": None,
    }
    if slo is not None:
        good = sum(slo.met_by(m) for m in metrics)
        attained = good / len(metrics) if metrics else 0.0
        out["goodput_rps"] = rate(good)
        out["slo"] = {"thresholds_ms": dict(slo.thresholds), "attainment_required": slo.attainment,
                      "requests_meeting": good, "attainment": attained,
                      "met": bool(metrics) and attained >= slo.attainment}
    return out
