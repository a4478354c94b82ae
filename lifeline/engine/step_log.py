"""What each engine step did, and each request's share of the steps that ran it.

`StepLog` is a bounded ring of `StepRecord`s (one per executed step: which requests it ran and how
many tokens of each kind, the KV its attention read, the queue it left, which limit kept the
queue waiting), written on the engine thread and read by the server from another one.
`RequestSteps` sits on a request's timeline: a row per prefill chunk and running sums over its
decode steps, so a request's report grows with its chunks, not with its steps.
`StepRecorder` fills both from the scheduler's output. Pure Python, no torch, no clock of its own:
the planner's virtual clock drives it as well as the real one.
"""
from __future__ import annotations

import statistics
import threading
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from lifeline.engine.block_manager import KVCacheManager
    from lifeline.engine.kv_layout import KVLayout
    from lifeline.engine.request import Request
    from lifeline.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

LIMITS = ("max_num_seqs", "kv_cache", "token_budget")
"""What can keep a waiting request out of a step (`SchedulerOutput.limit`)."""
MAX_PREFILL_ROWS = 1024
"""Prefill rows one request keeps (more only after many preemptions); the rest are counted."""


class StepRow(NamedTuple):
    """One request in one step."""
    id: str
    """The id the server's response carries (the engine's own id outside a server)."""
    choice: int | None
    """The choice index when the server split the request into several engine requests."""
    prefill: bool
    tokens: int
    context: int
    """Tokens of KV the row attends over: its start plus its tokens."""
    sampled: bool


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One executed step. Never changes once in the log, so readers need no lock to use one."""
    step: int
    """Engine step counter (from 1), monotonic, never reused."""
    start: float
    """Wall clock (`time.time()`) when execution began, for display."""
    t: float
    """Engine clock (`perf_counter` in a server) when execution began: the records' clock."""
    duration_s: float
    """`Executor.execute` wall time: forward and sampling."""
    prefill_tokens: int
    decode_tokens: int
    rows: tuple[StepRow, ...]
    """Every scheduled request, in batch order."""
    waiting: int
    """Queue depth after scheduling."""
    running: int
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_bytes_read: int
    """KV bytes the step's attention reads (see `StepRecorder.kv_read`)."""
    preempted: tuple[str, ...]
    limit: str | None
    """Why waiting requests were not admitted (one of `LIMITS`); None: none waited, or all fit."""

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (docs/serve.md, "The step log")."""
        return {
            "step": self.step, "start": self.start, "t": self.t,
            "duration_ms": self.duration_s * 1e3, "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens, "requests": [_row_dict(r) for r in self.rows],
            "waiting": self.waiting, "running": self.running,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "kv_blocks_used": self.kv_blocks_used, "kv_blocks_total": self.kv_blocks_total,
            "kv_bytes_read": self.kv_bytes_read, "preempted": list(self.preempted),
            "limit": self.limit}

    def runs(self, request_id: str) -> bool:
        return any(r.id == request_id for r in self.rows)


def _row_dict(row: StepRow) -> dict[str, Any]:
    out = {"id": row.id, "kind": "prefill" if row.prefill else "decode", "tokens": row.tokens,
           "context": row.context, "sampled": row.sampled}
    if row.choice is not None:
        out["choice"] = row.choice
    return out


@dataclass(frozen=True, slots=True)
class StepPage:
    """Records after a cursor (`StepLog.after`)."""
    records: list[StepRecord]
    dropped: int
    """Records after the cursor that rotated out before this read."""
    latest: int
    """The newest step number (0 before the first step)."""


class StepLog:
    """The last `size` steps (0: none kept). Appended on the engine thread; read from any."""

    def __init__(self, size: int, config: dict[str, Any]):
        if size < 0:
            raise ValueError("step_log_size must be non-negative")
        self.size = size
        self.config = config
        """The engine's fixed facts the records refer to (limits, KV shape)."""
        self._ring: deque[StepRecord] = deque(maxlen=size or 1)
        self._lock = threading.Lock()
        self._latest = 0
        self._prefilling: dict[str, int] = {}

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def append(self, record: StepRecord) -> None:
        with self._lock:
            self._latest = record.step
            if self.size:
                self._ring.append(record)

    def after(self, step: int, limit: int) -> StepPage:
        """Up to `limit` records with a step number above `step`, oldest first."""
        with self._lock:
            ring = list(self._ring) if self.size else []
            latest = self._latest
        oldest = ring[0].step if ring else latest + 1
        skip = max(0, step + 1 - oldest)
        return StepPage(ring[skip:skip + limit], max(0, oldest - step - 1), latest)

    def latest(self, count: int) -> list[StepRecord]:
        """The newest `count` records, oldest first."""
        with self._lock:
            n = len(self._ring) if self.size else 0
            return [self._ring[i] for i in range(max(0, n - count), n)]

    def between(self, t0: float, t1: float) -> list[StepRecord]:
        """Records that began within [t0, t1] (engine clock)."""
        with self._lock:
            ring = list(self._ring) if self.size else []
        return [r for r in ring if t0 <= r.t <= t1]

    def prefilling(self, engine_ids: list[str]) -> dict[str, int]:
        """Of these engine request ids, those whose prefill has begun and produced no token
        yet, with the tokens computed so far."""
        with self._lock:
            return {i: self._prefilling[i] for i in engine_ids if i in self._prefilling}

    def set_progress(self, done: list[str], going: dict[str, int]) -> None:
        """`done` left their prefill (first token, preempted, gone); `going` are in it."""
        with self._lock:
            for rid in done:
                self._prefilling.pop(rid, None)
            self._prefilling.update(going)

    def clear(self) -> None:
        with self._lock:
            self._ring.clear()
            self._prefilling.clear()
            self._latest = 0


@dataclass(slots=True)
class RequestSteps:
    """One request's share of the steps that ran it, filled by `StepRecorder` on the engine
    thread; `summary()` is what the response's `timings` carries."""
    arrival_step: int
    """Steps recorded before the request arrived."""
    arrival_prefill_tokens: int
    """Prefill tokens the engine had computed before it arrived."""
    arrival_limits: tuple[int, ...]
    """Steps each of `LIMITS` had kept the queue waiting, before it arrived."""
    running_at_arrival: int
    max_num_seqs: int
    queue: dict[str, Any] | None = None
    """Set when the request is first scheduled (or leaves without ever being)."""
    prefill: list[tuple[int, int, int, int, int, float]] = field(default_factory=list)
    """(step, tokens, context, batch requests, batch tokens, step ms) per prefill chunk."""
    prefill_rows_dropped: int = 0
    decode_steps: int = 0
    batch_sum: int = 0
    batch_min: int = 0
    batch_max: int = 0
    context_first: int = 0
    context_last: int = 0
    decode_ms: array = field(default_factory=lambda: array("d"))
    decode_with_prefill: int = 0
    others_prefill_tokens: int = 0
    kv_bytes_read_sum: int = 0
    """Σ over its decode steps of the step's KV bytes read."""
    recomputed_tokens: int = 0
    """Tokens computed again after a preemption had dropped them."""
    computed_high: int = 0
    """The most tokens it has ever had computed."""

    def copy(self) -> RequestSteps:
        other = RequestSteps(**{name: getattr(self, name) for name in self.__slots__})
        other.prefill = list(self.prefill)
        other.decode_ms = array("d", self.decode_ms)
        other.queue = None if self.queue is None else dict(self.queue)
        return other

    def add_decode(self, batch: int, context: int, step_ms: float, prefill_tokens: int,
                   kv_bytes_read: int) -> None:
        if self.decode_steps == 0:
            self.batch_min = self.batch_max = batch
            self.context_first = context
        self.decode_steps += 1
        self.batch_sum += batch
        self.batch_min, self.batch_max = min(self.batch_min, batch), max(self.batch_max, batch)
        self.context_last = context
        self.decode_ms.append(step_ms)
        if prefill_tokens:
            self.decode_with_prefill += 1
            self.others_prefill_tokens += prefill_tokens
        self.kv_bytes_read_sum += kv_bytes_read

    def add_prefill(self, row: tuple[int, int, int, int, int, float]) -> None:
        if len(self.prefill) < MAX_PREFILL_ROWS:
            self.prefill.append(row)
        else:
            self.prefill_rows_dropped += 1

    def summary(self) -> dict[str, Any]:
        """`steps`, `queue`, `kv_bytes_read_per_token` and `recomputed_tokens` of `timings`."""
        n = self.decode_steps
        steps: dict[str, Any] = {
            "prefill": [list(row) for row in self.prefill],
            "decode_steps": n,
            "decode_batch": {"mean": self.batch_sum / n, "min": self.batch_min,
                             "max": self.batch_max} if n else None,
            "decode_context": {"first": self.context_first, "last": self.context_last}
            if n else None,
            "decode_step_ms": {"mean": statistics.fmean(self.decode_ms),
                               "p50": statistics.median(self.decode_ms)} if n else None,
            "decode_steps_with_prefill": self.decode_with_prefill,
            "others_prefill_tokens": self.others_prefill_tokens}
        if self.prefill_rows_dropped:
            steps["prefill_rows_dropped"] = self.prefill_rows_dropped
        return {"steps": steps, "queue": self.queue,
                "kv_bytes_read_per_token": self.kv_bytes_read_sum / n if n else None,
                "recomputed_tokens": self.recomputed_tokens}

    @classmethod
    def merged(cls, parts: list[RequestSteps]) -> RequestSteps:
        """One request served by several engine requests (`n` > 1): every chunk, the decode
        sums added, the queue of the one scheduled first."""
        first = min(parts, key=lambda p: p.arrival_step)
        out = first.copy()
        out.queue = next((p.queue for p in sorted(
            parts, key=lambda p: (p.queue or {}).get("steps_waited", 1 << 62))), None)
        out.prefill = sorted(row for p in parts for row in p.prefill)
        out.prefill_rows_dropped = sum(p.prefill_rows_dropped for p in parts)
        decoding = [p for p in parts if p.decode_steps]
        out.decode_steps = sum(p.decode_steps for p in decoding)
        out.batch_sum = sum(p.batch_sum for p in decoding)
        out.batch_min = min((p.batch_min for p in decoding), default=0)
        out.batch_max = max((p.batch_max for p in decoding), default=0)
        out.context_first = min((p.context_first for p in decoding), default=0)
        out.context_last = max((p.context_last for p in decoding), default=0)
        out.decode_ms = array("d", (x for p in decoding for x in p.decode_ms))
        for name in ("decode_with_prefill", "others_prefill_tokens", "kv_bytes_read_sum",
                     "recomputed_tokens"):
            setattr(out, name, sum(getattr(p, name) for p in parts))
        return out


class StepRecorder:
    """Turns each executed step into a `StepRecord` (kept in `log`) and into every scheduled
    request's `RequestSteps`. Called on the engine thread only."""

    def __init__(self, layout: KVLayout, max_num_seqs: int, max_num_batched_tokens: int,
                 size: int):
        bs = layout.block_size
        self.reads = tuple((g.bytes_per_block / bs, g.window) for g in layout.groups)
        """(KV bytes per token, window or None) of each cache group."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.log = StepLog(size, {
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
            "kv_blocks_total": sum(g.num_blocks for g in layout.groups), "block_size": bs,
            "kv_bytes_per_token": sum(b for b, _ in self.reads),
            "kv_groups": [{"name": g.name, "layers": g.num_layers, "window": g.window,
                           "bytes_per_token": g.bytes_per_block / bs} for g in layout.groups]})
        self.reset()

    def reset(self) -> None:
        """Forget every step so far (after the warm-up)."""
        self.step = 0
        self.prefill_total = 0
        self.limit_counts = [0] * len(LIMITS)
        self.log.clear()

    def kv_read(self, context: int, tokens: int) -> float:
        """KV bytes a row attends over: all `context` tokens in a full-attention group; in a
        sliding-window group, the keys its queries see: `window - 1` before the first query
        up to the last (a decode reads `min(context, window)`)."""
        total = 0.0
        for per_token, window in self.reads:
            total += per_token * (context if window is None else min(context,
                                                                     window + tokens - 1))
        return total

    def arrive(self, req: Request, running: int) -> None:
        req.timeline.steps = RequestSteps(self.step, self.prefill_total, tuple(self.limit_counts),
                                          running, self.max_num_seqs)

    def record(self, out: SchedulerOutput, scheduler: Scheduler, kv: KVCacheManager,
               t: float, wall: float, duration_s: float) -> StepRecord:
        self.step += 1
        step_ms = duration_s * 1e3
        scheduled = out.scheduled
        rows, prefill_tokens, kv_read = [], 0, 0.0
        for s in scheduled:
            req = s.request
            prefill = s.num_new_tokens > 1 or s.start < req.num_prompt_tokens
            context = s.start + s.num_new_tokens
            kv_read += self.kv_read(context, s.num_new_tokens)
            prefill_tokens += s.num_new_tokens if prefill else 0
            rows.append(StepRow(req.client_id or req.request_id, req.choice_index, prefill,
                                s.num_new_tokens, context, s.samples))
        record = StepRecord(
            self.step, wall, t, duration_s, prefill_tokens, out.num_tokens - prefill_tokens,
            tuple(rows), len(scheduler.waiting), len(scheduler.running), self.max_num_seqs,
            self.max_num_batched_tokens, kv.num_blocks - kv.num_free_blocks, kv.num_blocks,
            round(kv_read), tuple(r.client_id or r.request_id for r in out.preempted), out.limit)
        self._account(record, scheduled, step_ms)
        self._progress(scheduled, out.preempted)
        self.prefill_total += prefill_tokens
        if out.limit is not None:
            self.limit_counts[LIMITS.index(out.limit)] += 1
        self.log.append(record)
        return record

    def _account(self, record: StepRecord, scheduled: list[ScheduledRequest],
                 step_ms: float) -> None:
        batch, tokens = len(scheduled), record.prefill_tokens + record.decode_tokens
        for s, row in zip(scheduled, record.rows):
            facts: RequestSteps | None = s.request.timeline.steps
            if facts is None:
                continue
            if facts.queue is None:
                self.close_queue(facts, self.step - 1)
            end = s.start + s.num_new_tokens
            facts.recomputed_tokens += max(0, min(end, facts.computed_high) - s.start)
            facts.computed_high = max(facts.computed_high, end)
            if row.prefill:
                facts.add_prefill((record.step, row.tokens, row.context, batch, tokens, step_ms))
            else:
                facts.add_decode(batch, row.context, step_ms, record.prefill_tokens,
                                 record.kv_bytes_read)

    def _progress(self, scheduled: list[ScheduledRequest], preempted: list[Request]) -> None:
        """Which requests are in their prefill (the server's in-flight view reads it)."""
        done = [r.request_id for r in preempted]
        going = {}
        for s in scheduled:
            if s.request.num_output_tokens:
                continue
            if s.samples:
                done.append(s.request.request_id)
            else:
                going[s.request.request_id] = s.start + s.num_new_tokens
        if done or going:
            self.log.set_progress(done, going)

    def close_queue(self, facts: RequestSteps, steps_done: int) -> None:
        """The request leaves the queue after `steps_done` steps (scheduled, or ended while
        waiting): the steps it waited, the prefill the engine computed meanwhile, the limit
        that held it most often."""
        waited = [now - then for now, then in zip(self.limit_counts, facts.arrival_limits)]
        top = max(range(len(LIMITS)), key=waited.__getitem__)
        facts.queue = {"steps_waited": steps_done - facts.arrival_step,
                       "ahead_prefill_tokens": self.prefill_total - facts.arrival_prefill_tokens,
                       "limit": LIMITS[top] if waited[top] else None,
                       "running_at_arrival": facts.running_at_arrival,
                       "max_num_seqs": facts.max_num_seqs}

    def forget(self, req: Request) -> None:
        """The request left the engine."""
        facts = req.timeline.steps
        if facts is not None and facts.queue is None:
            self.close_queue(facts, self.step)
        self.log.set_progress([req.request_id], {})
