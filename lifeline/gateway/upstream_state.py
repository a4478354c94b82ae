"""An upstream's own state, sampled by the gateway while it has requests there, so that a
request routed to a vLLM, SGLang or llama.cpp upstream carries the upstream's side of its wait
beside the gateway's own stages (`timings.backend.state`).

The samples are the bench's (`lifeline.bench.server_state`): the upstream's Prometheus
`/metrics` and, for llama.cpp, `/slots`, on a connection of their own, every `interval_s` while
any request is outstanding there and for one interval after. A request's `queue_ms` is the part
of its wait before the upstream's prefill during which the upstream showed requests waiting
(`lifeline.bench.server_join`)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Any

import httpx

from lifeline.bench.server_join import Timeline, _limit, capacity, waiting
from lifeline.bench.server_state import MAX_SAMPLES, ServerSampler

log = logging.getLogger("lifeline.gateway")

KEEP_S = 600.0
"""Samples older than this are let go (a request's wait is looked up when it ends)."""


class UpstreamState:
    def __init__(self, metrics_url: str, slots_url: str, model: str | None,
                 headers: dict[str, str], interval_s: float, busy: Any):
        self.sampler = ServerSampler(metrics_url, slots_url=slots_url, interval_s=interval_s,
                                     model=model, headers=headers)
        keep = min(int(KEEP_S / interval_s), MAX_SAMPLES)
        self.sampler.samples = deque(maxlen=keep)  # type: ignore[assignment]
        self.busy = busy
        """A callable: whether the upstream has requests outstanding."""
        self.interval_s = interval_s
        self.failures = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self.sampler._http = httpx.AsyncClient(headers=self.sampler.headers, trust_env=False,
                                               timeout=httpx.Timeout(2.0),
                                               limits=httpx.Limits(max_connections=1))
        self._task = asyncio.create_task(self._run(), name="lifeline-gateway-upstream-state")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.sampler._http is not None:
            await self.sampler._http.aclose()

    async def _run(self) -> None:
        """Samples while busy and once after; gives up after 3 failed samples in a row (an
        upstream without metrics), trying again every minute."""
        idle_sampled = True
        while True:
            await asyncio.sleep(self.interval_s if self.failures < 3 else 60.0)
            if not self.busy():
                if idle_sampled:
                    continue
                idle_sampled = True
            else:
                idle_sampled = False
            try:
                ok = await self.sampler.sample()
            except Exception:  # noqa: BLE001 - sampling never takes the gateway down
                log.exception("sampling an upstream's metrics failed")
                ok = False
            self.failures = 0 if ok else self.failures + 1

    def attribution(self, sent: float, first: float | None, prefill_ms: float | None
                    ) -> dict[str, Any] | None:
        """The upstream's side of one request's wait: sent to the upstream at `sent`, first
        token back at `first` (perf_counter), its own prefill where it reported one."""
        samples = list(self.sampler.samples)
        if self.sampler.engine is None or len(samples) < 1 or first is None:
            return None
        timeline = Timeline(samples)
        gap = max(first - sent - (prefill_ms or 0.0) / 1e3, 0.0)
        waited = timeline.seconds(sent, sent + gap, waiting)
        at = timeline.at(sent)
        state = {"engine": self.sampler.engine, "config": self.sampler.config}
        cap = capacity(state, samples)
        held = [_limit(self.sampler.engine, s, cap)
                for _, s in timeline.pieces(sent, sent + gap) if waiting(s)]
        return {"engine": self.sampler.engine, "queue_ms": waited * 1e3,
                "waiting_seen_ms": waited * 1e3, "wait_ms": gap * 1e3,
                "running_at_arrival": at.get("running"), "waiting_at_arrival": at.get("waiting"),
                "kv_usage_at_arrival": at.get("kv_usage"),
                "capacity": cap, "limit": max(set(held), key=held.count) if held else None,
                "interval_s": self.interval_s,
                "samples": sum(1 for s in samples if sent - self.interval_s <= s["t"]
                               <= first + self.interval_s)}
