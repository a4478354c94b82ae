"""One record per finished request: every stage's duration, token counts, cache hits, preemptions.

The same record feeds the `timings` object of a response, the `Server-Timing` header, the
Prometheus histograms, the OpenTelemetry spans and the JSON access log. Stages are disjoint and
telescope from arrival at the server to the last byte, so they add up to `e2e` exactly; the
definitions are in docs/serve.md.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import pairwise
from typing import Any

from lifeline.engine.request import Timeline

STAGES = ("gateway", "template", "tokenize", "queue", "prefill", "decode", "detokenize",
          "stream")
"""The stages of a request, in the order they begin."""
NO_STEP_FACTS: dict[str, Any] = {"steps": None, "queue": None, "kv_bytes_read_per_token": None,
                                 "recomputed_tokens": 0}
"""The step keys of `timings` for a request the engine recorded no steps of."""


@dataclass(slots=True)
class ServerStamps:
    """`time.perf_counter()` readings the server takes around the engine."""

    arrival: float
    """The request's bytes were received."""
    parsed: float | None = None
    """The JSON body was parsed and validated."""
    templated: float | None = None
    """The chat template was rendered (equals `parsed` for /v1/completions)."""
    tokenized: float | None = None
    """The prompt became token ids, just before the hand-off to the engine."""
    last_byte: float | None = None
    """The response was finished: for a response that carries its own timings, the moment the
    final chunk (or body) is built, since a response cannot contain the time of its own write."""
    stream_s: float = 0.0
    """Time spent inside response writes, accumulated over every chunk."""
    client_ttft: float | None = None
    """Left None by the server: a place for a TTFT measured on the client side."""

    def mark(self, stamp: str) -> float:
        """Set one of `parsed`, `templated`, `tokenized`, `last_byte` to now."""
        if stamp not in ("parsed", "templated", "tokenized", "last_byte"):
            raise ValueError(f"unknown stamp {stamp!r}")
        now = time.perf_counter()
        setattr(self, stamp, now)
        return now

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Wrap a response write (`with stamps.writing(): await send(chunk)`)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stream_s += time.perf_counter() - start


@dataclass(slots=True)
class RequestRecord:
    """Everything Lifeline reports about one request. Durations in seconds."""

    request_id: str
    """The id the response carries."""
    model: str
    """The served model id."""
    endpoint: str
    """The route, e.g. `/v1/chat/completions`."""
    status: int
    """The HTTP status of the response."""
    finish_reason: str | None
    """Why generation ended (`stop`, `length`, `abort`, `tool_calls`), None if it never ran."""
    arrival: float
    """`perf_counter()` at arrival; every stage starts where the one before it ends."""
    arrival_wall: float
    """Wall-clock seconds since the epoch at arrival, for logs and traces."""
    gateway: float
    """Arrival to parsed and validated JSON."""
    template: float
    """Parsed to rendered chat template."""
    tokenize: float
    """Rendered prompt to token ids."""
    queue: float
    """Token ids to the first step that scheduled the request (includes the engine hand-off)."""
    prefill: float
    """First scheduled to first token; its steps are shared with other requests."""
    decode: float
    """First to last token, less this request's detokenize time inside that window."""
    detokenize: float
    """Engine-thread time spent detokenizing and checking stop strings, all of it."""
    stream: float
    """Last token to last byte, less the estimated detokenize time of the last token."""
    e2e: float
    """Arrival to last byte; the sum of the eight stages."""
    ttft: float | None
    """Arrival to the first output token; None without one."""
    ttfat: float | None
    """Arrival to the first answer (non-reasoning) token; None without one."""
    token_gaps: list[float]
    """Intervals between consecutive output tokens (inter-token latency)."""
    prefill_chunks: int
    """Prefill chunks that ran, recomputation after preemption included."""
    prompt_tokens: int
    """Tokens in the prompt."""
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    completion_tokens: int
    """Tokens generated."""
    reasoning_tokens: int
    """Of those, tokens inside the reasoning section."""
    preemptions: int
    """Times the request was preempted and later recomputed."""
    write: float
    """Time spent inside response writes (overlaps decode when streaming)."""
    prompt_anatomy: dict[str, int] | None = None
    """Prompt tokens by origin (system, tools, history, latest turn, scaffolding), if known."""
    moe: dict[str, Any] | None = None
    """An MoE model's routing for this request (`MoEUsage.summary`); None for a dense model."""
    images: dict[str, Any] | None = None
    """A request with images: how many, their tokens, and the seconds of their stages (decode
    and preprocess inside `template`, the tower's encode and projection inside `prefill`),
    encoder-cache hits; None without images."""
    step_facts: dict[str, Any] | None = None
    """Its share of the engine's steps (`RequestSteps.summary`): `steps`, `queue`,
    `kv_bytes_read_per_token`, `recomputed_tokens`; None if the engine recorded none."""

    @classmethod
    def build(cls, stamps: ServerStamps, timeline: Timeline, *, request_id: str, model: str,
              endpoint: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int,
              reasoning_tokens: int = 0, first_answer_token_time: float | None = None,
              finish_reason: str | None, anatomy: dict[str, int] | None,
              status: int = 200, images: Sequence[Any] = ()) -> RequestRecord:
        """Combine the server's stamps with the engine's timeline. Missing server stamps
        collapse onto the one before (that stage is 0); missing engine points collapse onto the
        end of the engine's part (see `_engine_end`)."""
        last_byte = stamps.last_byte if stamps.last_byte is not None else time.perf_counter()
        arrival = stamps.arrival
        parsed = _or(stamps.parsed, arrival)
        templated = _or(stamps.templated, parsed)
        tokenized = _or(stamps.tokenized, templated)
        times = timeline.token_times
        engine_end = max(_engine_end(timeline, last_byte, tokenized), tokenized)
        scheduled = _or(timeline.first_scheduled, engine_end)
        first = _or(timeline.first_token, engine_end)
        detok_in, detok_after = _split_detokenize(timeline.detokenize_s, len(times),
                                                  engine_end - first)
        gaps = [b - a for a, b in pairwise(times)]
        if first_answer_token_time is None and reasoning_tokens == 0:
            first_answer_token_time = timeline.first_token
        return cls(
            request_id=request_id, model=model, endpoint=endpoint, status=status,
            finish_reason=finish_reason, arrival=arrival,
            arrival_wall=_arrival_wall(timeline, arrival),
            gateway=parsed - arrival, template=templated - parsed, tokenize=tokenized - templated,
            queue=scheduled - tokenized, prefill=first - scheduled,
            decode=engine_end - first - detok_in, detokenize=timeline.detokenize_s,
            stream=last_byte - engine_end - detok_after, e2e=last_byte - arrival,
            ttft=None if timeline.first_token is None else timeline.first_token - arrival,
            ttfat=None if first_answer_token_time is None else first_answer_token_time - arrival,
            token_gaps=gaps, prefill_chunks=len(timeline.prefill_chunks),
            prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
            completion_tokens=completion_tokens, reasoning_tokens=reasoning_tokens,
            preemptions=len(timeline.preemptions), write=stamps.stream_s,
            prompt_anatomy=anatomy, images=image_summary(images),
            moe=timeline.moe.summary() if timeline.moe is not None else None,
            step_facts=timeline.steps.summary() if timeline.steps is not None else None)

    def stage_seconds(self) -> dict[str, float]:
        """Each stage's duration, in `STAGES` order."""
        return {name: getattr(self, name) for name in STAGES}

    def tbt_percentile(self, q: float) -> float | None:
        """The q-th percentile (0-100, linear interpolation) of the token gaps."""
        return _percentile(self.token_gaps, q) if self.token_gaps else None

    @property
    def prefill_tok_s(self) -> float | None:
        """Prompt tokens this request computed (not cached) per second of its prefill stage."""
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prefill if self.ttft is not None and self.prefill > 0 else None

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first per second between the first and the last token."""
        window = sum(self.token_gaps)
        return len(self.token_gaps) / window if window > 0 else None

    def timings(self) -> dict[str, Any]:
        """The `timings` object of a response (milliseconds; None where undefined)."""
        out: dict[str, Any] = {f"{name}_ms": _ms(s) for name, s in self.stage_seconds().items()}
        out["prefill_chunks"] = self.prefill_chunks
        out["ttft_ms"] = _ms(self.ttft)
        out["ttfat_ms"] = _ms(self.ttfat)
        out["tbt_p50_ms"] = _ms(self.tbt_percentile(50))
        out["tbt_p90_ms"] = _ms(self.tbt_percentile(90))
        out["tbt_max_ms"] = _ms(max(self.token_gaps, default=None))
        out["e2e_ms"] = _ms(self.e2e)
        out["prompt_tokens"] = self.prompt_tokens
        out["cached_tokens"] = self.cached_tokens
        out["completion_tokens"] = self.completion_tokens
        out["prefill_tok_s"] = self.prefill_tok_s
        out["decode_tok_s"] = self.decode_tok_s
        out["preemptions"] = self.preemptions
        out["prompt_anatomy"] = self.prompt_anatomy
        out["reasoning_tokens"] = self.reasoning_tokens
        out.update(self.step_facts or NO_STEP_FACTS)
        if self.images is not None:
            out["images"] = self.images
        if self.moe is not None:
            out["moe"] = self.moe
        return out

    def server_timing_header(self) -> str:
        """A `Server-Timing` header value: every stage, then ttft and e2e (ms)."""
        entries = [(name, s) for name, s in self.stage_seconds().items()]
        entries += [("ttft", self.ttft), ("e2e", self.e2e)]
        return ", ".join(f"{name};dur={s * 1e3:.3f}" for name, s in entries if s is not None)

    def access_log_line(self) -> str:
        """One JSON line (no newline) for the access log."""
        ts = datetime.fromtimestamp(self.arrival_wall, UTC)
        return json.dumps({
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "request_id": self.request_id, "model": self.model, "endpoint": self.endpoint,
            "status": self.status, "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "reasoning_tokens": self.reasoning_tokens, "write_ms": _ms(self.write),
            "timings": self.timings(),
        }, separators=(",", ":"))


def image_summary(images: Sequence[Any]) -> dict[str, Any] | None:
    """What `timings.images` says of a request's images (lifeline.media.inputs.ImageSpan):
    count, tokens, and each stage's milliseconds summed over them."""
    if not images:
        return None
    total = {k: 0.0 for k in ("fetch_s", "decode_s", "preprocess_s", "encode_s", "project_s",
                              "splice_s")}
    hits = in_kv = 0
    for img in images:
        for k in total:
            total[k] += img.timings.get(k, 0.0)
        hits += bool(img.timings.get("encoder_cache_hit"))
        in_kv += "encode_s" not in img.timings and not img.timings.get("encoder_cache_hit")
    out: dict[str, Any] = {"count": len(images), "tokens": sum(i.num_embeds for i in images),
                           "frames": sum(i.frames for i in images)}
    out.update({k[:-2] + "_ms": round(v * 1e3, 3) for k, v in total.items()})
    out["encoder_cache_hits"] = hits
    out["prefix_cached"] = in_kv  # every token of it in the prefix cache: no lookup at all
    return out


def combine_timelines(timelines: Sequence[Timeline]) -> Timeline:
    """One timeline for a request served by several engine requests (`n` > 1): the earliest
    start points, every token in time order, all chunks, preemptions and detokenize time.
    No timelines (the request failed before the engine) give an empty one."""
    if not timelines:
        return Timeline()
    if len(timelines) == 1:
        return timelines[0]
    firsts = [t.first_scheduled for t in timelines if t.first_scheduled is not None]
    tokens = [t.first_token for t in timelines if t.first_token is not None]
    ends = [t.finished for t in timelines if t.finished is not None]
    return Timeline(
        arrival=min(t.arrival for t in timelines),
        arrival_wall=min(t.arrival_wall for t in timelines),
        tokenized=min((t.tokenized for t in timelines if t.tokenized is not None), default=None),
        queued=min((t.queued for t in timelines if t.queued is not None), default=None),
        first_scheduled=min(firsts, default=None),
        prefill_chunks=sorted(c for t in timelines for c in t.prefill_chunks),
        first_token=min(tokens, default=None),
        token_times=sorted(x for t in timelines for x in t.token_times),
        preemptions=sorted(p for t in timelines for p in t.preemptions),
        finished=max(ends, default=None),
        detokenize_s=sum(t.detokenize_s for t in timelines),
        moe=_merged_moe([t.moe for t in timelines if t.moe is not None]),
        steps=_merged_steps([t.steps for t in timelines if t.steps is not None]),
    )


def _merged_moe(usages: list[Any]) -> Any:
    return type(usages[0]).merged(usages) if usages else None


def _merged_steps(parts: list[Any]) -> Any:
    return type(parts[0]).merged(parts) if parts else None


def _engine_end(timeline: Timeline, last_byte: float, tokenized: float) -> float:
    """The last token; without one, the abort; without that, the last byte if the engine holds
    the request still, or `tokenized` if the engine never saw it."""
    if timeline.token_times:
        return timeline.token_times[-1]
    if timeline.finished is not None:
        return min(timeline.finished, last_byte)
    return last_byte if timeline.queued is not None else tokenized


def _split_detokenize(total: float, num_tokens: int, window: float) -> tuple[float, float]:
    """Split detokenize time into the part inside the decode window and the part after the
    last token. The engine detokenizes each token right after it is sampled, so every token's
    share but the last lies inside the window; only the total is recorded, so the last token's
    share is estimated as the mean and the inside part is kept within the window."""
    if num_tokens == 0:
        return 0.0, total
    inside = min(max(total - total / num_tokens, 0.0), max(window, 0.0))
    return inside, total - inside


def _arrival_wall(timeline: Timeline, arrival: float) -> float:
    """The engine reads the wall clock when it adds the request; move that back to arrival."""
    if timeline.arrival_wall and timeline.tokenized is not None:
        return timeline.arrival_wall - (timeline.tokenized - arrival)
    return time.time() - (time.perf_counter() - arrival)


def _percentile(values: Sequence[float], q: float) -> float:
    """numpy's default (linear) percentile."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3

