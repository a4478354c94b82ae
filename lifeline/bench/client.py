"""An async streaming client for any OpenAI-compatible server that records what it sees.

One shared `httpx.AsyncClient` (a connection per concurrent request, kept alive) sends every
request; each event is stamped with `time.perf_counter()` as soon as its line is read, before
any JSON parsing, so the client's own work lands after the stamp.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Self

import httpx

from lifeline.bench.metrics import ANSWER, REASONING, Chunk, RequestTrace
from lifeline.bench.stages import normalize

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}


@dataclass(slots=True)
class BenchRequest:
    """One request of a workload."""

    prompt: str | list[int]
    """Text, or token ids (completions only: the exact prompt length)."""
    max_tokens: int
    prompt_tokens: int | None = None
    """The prompt's length as the workload counted it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """More body fields (e.g. `messages` for chat, sampling settings)."""


class BenchClient:
    """`async with BenchClient(url, model) as c: trace = await c.send(request)`."""

    def __init__(self, base_url: str, model: str, *, endpoint: str = "completions",
                 api_key: str | None = None, max_connections: int = 256,
                 timeout_s: float = 600.0, pin_output: bool = True,
                 extra_body: dict[str, Any] | None = None):
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint is one of {sorted(ENDPOINTS)}")
        self.base_url = base_url.rstrip("/")
        self.model, self.endpoint, self.pin_output = model, endpoint, pin_output
        self.extra_body = extra_body or {}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections)
        self.http = httpx.AsyncClient(headers=headers, limits=limits,
                                      timeout=httpx.Timeout(timeout_s, connect=30.0))

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    @property
    def server_root(self) -> str:
        """The base URL without its `/v1`: where `/tokenize` lives."""
        return self.base_url.removesuffix("/v1")

    def body(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True,
                                "stream_options": {"include_usage": True},
                                "max_tokens": req.max_tokens, "temperature": 0.0}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        if self.pin_output:
            body["ignore_eos"] = True
            body["min_tokens"] = req.max_tokens
        body.update(self.extra_body)
        body.update(req.extra)
        return body

    async def send(self, req: BenchRequest) -> RequestTrace:
        """Send one streaming request and record it; never raises for a failed request."""
        body = self.body(req)
        trace = RequestTrace(sent=time.perf_counter(), expected_prompt_tokens=req.prompt_tokens)
        try:
            async with self.http.stream("POST", self.base_url + ENDPOINTS[self.endpoint],
                                        json=body,
                                        extensions={"trace": _connect_timer(trace)}) as response:
                if response.status_code != 200:
                    await response.aread()
                    return _failed(trace, f"http_{response.status_code}", response.text)
                await self._read_events(response, trace)
        except httpx.TimeoutException as exc:
            return _failed(trace, "timeout", str(exc))
        except httpx.ConnectError as exc:
            return _failed(trace, "connect", str(exc))
        except httpx.HTTPError as exc:
            return _failed(trace, "transport", f"{type(exc).__name__}: {exc}")
        return trace

    async def _read_events(self, response: httpx.Response, trace: RequestTrace) -> None:
        async for line in response.aiter_lines():
            at = time.perf_counter()
            if not line.startswith("data:"):
                continue  # blank separators, comments (pings), event names
            data = line[5:].strip()
            if data == "[DONE]":
                trace.done = at
                return
            try:
                event = json.loads(data)
            except json.JSONDecodeError:
                _failed(trace, "bad_event", data[:200])
                return
            if "error" in event:
                _failed(trace, "stream_error", json.dumps(event["error"])[:500])
                return
            absorb(event, at, trace)
        trace.done = time.perf_counter()  # a server that ends the stream without [DONE]


def _connect_timer(trace: RequestTrace):
    """An httpx `trace` hook that adds the time spent opening a connection (TCP, then TLS) to
    `trace.connect_ms`; a kept-alive connection opens none."""
    opened: list[float] = []

    async def hook(event: str, info: dict[str, Any]) -> None:
        if event in ("connection.connect_tcp.started", "connection.start_tls.started"):
            opened.append(time.perf_counter())
        elif event in ("connection.connect_tcp.complete", "connection.start_tls.complete") \
                and opened:
            trace.connect_ms += (time.perf_counter() - opened.pop()) * 1e3

    return hook


def absorb(event: dict[str, Any], at: float, trace: RequestTrace) -> None:
    """Fold one parsed SSE event (completions or chat) received at `at` into the trace."""
    if trace.response_id is None and isinstance(event.get("id"), str):
        trace.response_id = event["id"]
    for choice in event.get("choices") or []:
        kind, tokens = _output_of(choice)
        if tokens:
            trace.chunks.append(Chunk(at, tokens, kind))
            trace.answer += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        if choice.get("finish_reason"):
            trace.finish_reason = choice["finish_reason"]
    usage = event.get("usage")
    if isinstance(usage, dict):
        trace.prompt_tokens = usage.get("prompt_tokens", trace.prompt_tokens)
        trace.output_tokens = usage.get("completion_tokens", trace.output_tokens)
    timings = normalize(event)
    if timings is not None:
        trace.server_timings = timings
        raw = event.get("timings") if isinstance(event.get("timings"), dict) else \
            event.get("metrics")
        trace.timings_raw = raw


def _output_of(choice: dict[str, Any]) -> tuple[str, int]:
    """The kind of output a choice entry carries and how many tokens: logprobs entries when
    present (exact), else 1 for an entry with any output (usage reconciles the total)."""
    if "delta" in choice:
        delta = choice["delta"] or {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        answer = delta.get("content") or delta.get("tool_calls")
        logprobs = (choice.get("logprobs") or {}).get("content")
    else:
        reasoning, answer = None, choice.get("text")
        logprobs = choice.get("logprobs") or {}  # OpenAI: `tokens`; llama.cpp: `content`
        logprobs = logprobs.get("tokens") or logprobs.get("content")
    if not (reasoning or answer):
        return ANSWER, 0
    kind = ANSWER if answer else REASONING
    return kind, len(logprobs) if logprobs else 1


def _failed(trace: RequestTrace, kind: str, message: str) -> RequestTrace:
    trace.error, trace.error_message = kind, message[:500]
    trace.done = time.perf_counter()
    return trace
