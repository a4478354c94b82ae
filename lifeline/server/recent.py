"""The requests the debug endpoints and the dashboard show: the last finished ones (a bounded
ring of their timings) and the ones in flight, by stage. Ids, counts and timings only: no
prompt or output text ever enters a row."""
from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lifeline.observe.metrics import ITL_BUCKETS, TTFT_BUCKETS

if TYPE_CHECKING:
    from lifeline.engine.step_log import StepLog
    from lifeline.observe import RequestRecord
    from lifeline.server.generation import Generation

RECENT_REQUESTS = 512
"""Finished requests kept for `/debug/requests` and the dashboard."""
HISTOGRAMS = {"ttft_ms": tuple(b * 1e3 for b in TTFT_BUCKETS),
              "tpot_ms": tuple(b * 1e3 for b in ITL_BUCKETS)}
"""Upper bucket edges (ms) of the dashboard's histograms: the Prometheus ones."""


@dataclass(frozen=True, slots=True)
class Finished:
    seq: int
    """Position in the order requests finished (from 1)."""
    row: dict[str, Any]
    t0: float
    """`perf_counter()` at arrival and at the last byte: the steps that may have run it."""
    t1: float


class RecentRequests:
    """The last `size` finished requests, newest last. Used on the event loop only."""

    def __init__(self, size: int = RECENT_REQUESTS):
        self.ring: deque[Finished] = deque(maxlen=size)
        self._seq = itertools.count(1)

    def add(self, record: RequestRecord) -> None:
        row = {"id": record.request_id, "model": record.model, "endpoint": record.endpoint,
               "status": record.status, "finish_reason": record.finish_reason,
               "state": "finished", "arrival": record.arrival_wall,
               "timings": record.timings(), "prompt_anatomy": record.prompt_anatomy}
        self.ring.append(Finished(next(self._seq), row, record.arrival,
                                  record.arrival + record.e2e))

    @property
    def last_seq(self) -> int:
        return self.ring[-1].seq if self.ring else 0

    def newest(self, limit: int) -> list[Finished]:
        """Up to `limit` of them, newest first."""
        return list(itertools.islice(reversed(self.ring), limit))

    def after(self, seq: int, limit: int) -> list[Finished]:
        """Those that finished after `seq`, at most the newest `limit`, oldest first."""
        fresh = [f for f in itertools.takewhile(lambda f: f.seq > seq, reversed(self.ring))]
        return fresh[:limit][::-1]

    def find(self, request_id: str) -> Finished | None:
        return next((f for f in reversed(self.ring) if f.row["id"] == request_id), None)

    def histograms(self) -> dict[str, list[list[float | int | None]]]:
        """TTFT and TPOT of the kept requests: `[upper edge ms, count]` per bucket (counts
        not cumulative), the last bucket's edge None (above every edge)."""
        ttft, tpot = [], []
        for f in self.ring:
            t = f.row["timings"]
            if t["ttft_ms"] is not None:
                ttft.append(t["ttft_ms"])
            if t["decode_tok_s"]:
                tpot.append(1e3 / t["decode_tok_s"])
        return {"ttft_ms": _histogram(ttft, HISTOGRAMS["ttft_ms"]),
                "tpot_ms": _histogram(tpot, HISTOGRAMS["tpot_ms"])}


def _histogram(values: list[float], edges: tuple[float, ...]) -> list[list[float | int | None]]:
    counts = [0] * (len(edges) + 1)
    for v in values:
        counts[next((i for i, e in enumerate(edges) if v <= e), len(edges))] += 1
    return [[e, c] for e, c in zip([*edges, None], counts)]


def in_flight(generations: Iterable[Generation], step_log: StepLog | None, model: str,
              limit: int) -> list[dict[str, Any]]:
    """Up to `limit` requests in the engine now, oldest first, each with its stage:
    'queued' (no step has run it), 'prefill' (its prompt is being computed) or 'decode'."""
    rows = []
    now, wall = time.perf_counter(), time.time()
    for gen in sorted(generations, key=lambda g: g.arrival)[:limit]:
        choices = gen.choices
        progress = step_log.prefilling([c.request_id for c in choices]) if step_log else {}
        completion = sum(len(c.token_ids) for c in choices)
        firsts = [c.token_times[0] for c in choices if c.token_times]
        state = "decode" if completion else "prefill" if progress else "queued"
        prompts = {id(c.prompt_ids): len(c.prompt_ids) for c in choices}
        counts = {"prompt_tokens": sum(prompts.values()), "completion_tokens": completion,
                  "ttft_ms": (min(firsts) - gen.arrival) * 1e3 if firsts else None}
        rows.append({
            "id": choices[0].parent if choices else None, "model": model, "state": state,
            "status": None, "arrival": wall - (now - gen.arrival),
            "elapsed_ms": (now - gen.arrival) * 1e3, "computed_tokens": sum(progress.values()),
            **counts, "timings": counts})
    return rows
