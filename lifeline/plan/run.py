"""A planned run: the bench's workload and load shapes, played against a simulated engine in
virtual time, summarised by the bench's own code into the bench's JSON schema.

The load is the bench's: a closed loop of users (think time, multi-turn sessions whose history
grows), or an open loop at a rate (Poisson or gamma-bursty; `inf` sends everything at once), with
warm-up requests first. Each request reaches the engine after the deployment's request overhead
(HTTP, template, tokenizer) and its tokens reach the client when their step ends.
"""
from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from lifeline.bench import conversation
from lifeline.bench.client import BenchRequest
from lifeline.bench.load import RunResult, Sent, arrival_gap, ramp_up_start
from lifeline.bench.metrics import Chunk, RequestTrace, Slo
from lifeline.bench.run import BenchSettings, results
from lifeline.bench.stages import normalize
from lifeline.bench.workloads import Lengths
from lifeline.engine.request import Request
from lifeline.engine.sampling_params import SamplingParams
from lifeline.plan.sim import Deployment, VirtualClock

CHAT_TEMPLATE_TOKENS = 8
"""Tokens a chat template adds around each message of a multi-turn history (role markers)."""


def plan_requests(settings: BenchSettings, vocab: int, count: int) -> list[BenchRequest]:
    """`count` requests of random token ids, with the bench's lengths and shared-prefix groups
    (token ids: no tokenizer is needed to plan)."""
    rng = random.Random(settings.seed)
    pairs = conversation.load_pairs(settings.length_file) if settings.length_file else ()
    lengths = Lengths(settings.input_tokens, settings.output_tokens, settings.length_dist,
                      settings.length_spread, pairs)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    prefixes = [ids(settings.prefix_tokens) for _ in range(settings.prefix_groups)]
    out = []
    for i in range(count):
        n_in, n_out = lengths.pair(rng)
        prefix = prefixes[i % len(prefixes)] if prefixes else []
        prompt = prefix + ids(max(1, n_in - len(prefix)))
        out.append(BenchRequest(prompt, n_out, len(prompt)))
    return out


@dataclass(slots=True)
class _Pending:
    """A request of the load on its way: who sent it, when, and its trace so far."""
    request: BenchRequest
    scheduled: float
    user: int | None
    turn: int
    measured: bool
    trace: RequestTrace
    engine_request: Request | None = None
    reached: float = 0.0
    """When the front handed it to the engine."""


class _Load:
    """The bench's load shapes on the virtual clock."""

    def __init__(self, settings: BenchSettings, deployment: Deployment,
                 workload: Iterator[BenchRequest], on_done: Callable[[Sent], None] | None):
        self.settings, self.plan = settings, settings.plan()
        self.deployment = deployment
        self.clock = VirtualClock()
        self.engine = deployment.engine(self.clock)
        self.workload, self.on_done = workload, on_done
        self.front = deployment.front_s
        self.serial = min(deployment.serial_s, self.front)
        self.front_free = 0.0
        """When the server's front thread (its event loop) is next free."""
        self.rng = random.Random(self.plan.seed)
        self.heap: list[tuple[float, int, str, Any]] = []
        self.order = itertools.count()
        self.pending: dict[str, _Pending] = {}
        self.sent: list[Sent] = []
        self.left = self.plan.requests
        self.deadline: float | None = None
        self.in_flight = 0
        self.backlog: list[_Pending] = []
        self.history: dict[int, list[int]] = {}
        self.turns: dict[int, int] = {}
        self.ids = itertools.count()
        self.watch = CapacityWatch(deployment.max_num_seqs)

    # -- sending ---------------------------------------------------------------------------
    def push(self, at: float, kind: str, payload: Any) -> None:
        heapq.heappush(self.heap, (at, next(self.order), kind, payload))

    def take(self, now: float) -> BenchRequest | None:
        if self.left is not None and self.left <= 0:
            return None
        if self.deadline is not None and now >= self.deadline:
            return None
        if self.left is not None:
            self.left -= 1
        return next(self.workload)

    def send(self, p: _Pending, at: float) -> None:
        """The request leaves the client at `at` and reaches the engine after the front. Its
        serial part (`Efficiency.request_serial_s`: the server's one event loop) takes one
        request at a time, so requests sent together reach the engine that far apart."""
        p.trace.sent = at
        self.in_flight += 1
        arrive = max(at + self.front - self.serial, self.front_free) + self.serial
        self.front_free = arrive
        p.reached = arrive
        self.push(arrive, "arrive", p)

    def arrive(self, p: _Pending, at: float) -> None:
        """The front hands the request over at `at`; the engine takes it in at its next step
        (now, if it is idle)."""
        req = p.request
        params = SamplingParams(max_tokens=req.max_tokens, min_tokens=req.max_tokens,
                                ignore_eos=True, temperature=0)
        rid = f"plan-{next(self.ids)}"
        p.reached = at
        try:
            p.engine_request = self.engine.add_request(list(req.prompt), params, request_id=rid,
                                                       arrival=p.trace.sent)
        except ValueError as exc:  # too long for the context or the cache: a 400
            p.trace.error, p.trace.error_message = "http_400", str(exc)
            p.trace.done = self.clock.now
            self.finish(p)
            return
        self.pending[rid] = p

    # -- closed and open loops ---------------------------------------------------------------
    def user_next(self, user: int, now: float) -> None:
        req = self.take(now)
        if req is None:
            return
        turn = self.turns.get(user, 0)
        if self.plan.turns > 1 and turn:
            history = self.history.get(user, [])
            prompt = history + list(req.prompt)
            req = BenchRequest(prompt, req.max_tokens, len(prompt))
        p = _Pending(req, now, user, turn, True, RequestTrace(sent=now,
                                                               expected_prompt_tokens=len(
                                                                   req.prompt)))
        self.send(p, now)

    def open_next(self, now: float) -> None:
        req = self.take(now)
        if req is None:
            return
        p = _Pending(req, now, None, 0, True, RequestTrace(sent=now,
                                                           expected_prompt_tokens=len(req.prompt)))
        cap = self.plan.concurrency
        if cap and self.in_flight >= cap:
            self.backlog.append(p)
        else:
            self.send(p, now)
        self.push(now + arrival_gap(self.rng, self.plan.rate, self.plan.burstiness), "open",
                  None)

    def finish(self, p: _Pending) -> None:
        now = p.trace.done
        self.in_flight -= 1
        if p.measured:
            sent = Sent(p.request, p.trace, p.scheduled, p.turn)
            self.sent.append(sent)
            if self.on_done is not None:
                self.on_done(sent)
        if p.user is not None and p.measured:
            self.after_turn(p, now)
        elif self.backlog:
            self.send(self.backlog.pop(0), now)

    def after_turn(self, p: _Pending, now: float) -> None:
        user = p.user
        if self.plan.turns > 1:
            turn = p.turn + 1
            out = p.engine_request.output_token_ids if p.engine_request else []
            if turn >= self.plan.turns or p.trace.error is not None:
                self.history.pop(user, None)
                turn = 0
            else:
                self.history[user] = (list(p.request.prompt) + list(out)
                                      + [1] * CHAT_TEMPLATE_TOKENS)
            self.turns[user] = turn
        think = self.plan.think_time_s
        wait = self.rng.expovariate(1 / think) if think > 0 else 0.0
        self.push(now + wait, "user", user)

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> RunResult:
        self.warmup()
        start = self.clock.now
        if self.plan.duration_s is not None:
            self.deadline = start + self.plan.duration_s
        if self.plan.rate is None:
            for user in range(self.plan.concurrency):
                self.push(start + ramp_up_start(user, self.plan), "user", user)
        else:
            self.push(start, "open", None)
        self.loop()
        end = max((s.trace.done or s.trace.sent for s in self.sent), default=self.clock.now)
        return RunResult(self.sent, start, end)

    def warmup(self) -> None:
        """The bench's warm-up: its requests in groups as wide as the concurrency, left out."""
        reqs = [next(self.workload) for _ in range(self.plan.warmup)]
        width = max(1, self.plan.concurrency)
        for i in range(0, len(reqs), width):
            for req in reqs[i:i + width]:
                p = _Pending(req, self.clock.now, None, 0, False,
                             RequestTrace(sent=self.clock.now))
                self.send(p, self.clock.now)
            self.loop()

    def loop(self) -> None:
        engine, clock = self.engine, self.clock
        while True:
            while self.heap and self.heap[0][0] <= clock.now:
                at, _, kind, payload = heapq.heappop(self.heap)
                if kind == "arrive":
                    self.arrive(payload, at)
                # a client sends at its own time, not at the step's end that found the event
                elif kind == "user":
                    self.user_next(payload, at)
                else:
                    self.open_next(at)
            if engine.has_unfinished_requests():
                before = clock.now
                outputs = engine.step()
                self.watch.observe(engine)
                for out in outputs:
                    self.output(out)
                if clock.now == before and not outputs:
                    if not self.heap:
                        raise RuntimeError("the simulated engine made no progress")
                    clock.now = max(clock.now, self.heap[0][0])
            elif self.heap:
                clock.now = max(clock.now, self.heap[0][0])
            else:
                return

    def output(self, out: Any) -> None:
        p = self.pending.get(out.request_id)
        if p is None:
            return
        now = self.clock.now
        if out.new_token_ids:
            p.trace.chunks.append(Chunk(now, len(out.new_token_ids)))
        if out.finished:
            del self.pending[out.request_id]
            req = out.request
            p.trace.done = now
            p.trace.output_tokens = req.num_output_tokens
            p.trace.prompt_tokens = req.num_prompt_tokens
            p.trace.finish_reason = out.finish_reason
            if out.error is not None:
                p.trace.error = out.error.value
                p.trace.error_message = f"the engine ended the request: {out.error.value}"
            p.trace.response_id = req.request_id
            p.trace.timings_raw = plan_timings(req, p.trace.sent, p.reached)
            p.trace.server_timings = server_timings(req, p.trace.sent, p.reached)
            self.finish(p)


@dataclass(slots=True)
class CapacityWatch:
    """What limited admission, step by step: KV memory in use, requests running, requests
    waiting while the batch had room (the KV cache, not `max_num_seqs`, held them back)."""
    max_num_seqs: int
    steps: int = 0
    peak_kv_usage: float = 0.0
    peak_running: int = 0
    kv_limited_steps: int = 0
    """Steps after which requests waited with fewer than `max_num_seqs` running and the KV
    cache nine-tenths full."""
    budget_limited_steps: int = 0
    """Steps after which requests waited with room in the batch and in the cache: the step's
    token budget admits prompts one chunk at a time."""
    seq_limited_steps: int = 0
    """Steps after which requests waited behind a full batch of `max_num_seqs`."""

    def observe(self, engine: Any) -> None:
        sched = engine.scheduler
        self.steps += 1
        usage = engine.block_manager.usage
        running = len(sched.running)
        self.peak_kv_usage = max(self.peak_kv_usage, usage)
        self.peak_running = max(self.peak_running, running)
        if sched.waiting:
            if running >= self.max_num_seqs:
                self.seq_limited_steps += 1
            elif usage >= 0.9 or sched.num_preemptions:
                self.kv_limited_steps += 1
            else:
                self.budget_limited_steps += 1


def plan_timings(req: Request, sent: float, reached: float) -> dict[str, Any] | None:
    """The `timings` a Lifeline server reports for `req` (docs/serve.md): the front is from
    sending to reaching the engine, its steps are the engine's own record of them."""
    tl = req.timeline
    if tl.first_token is None:
        return None
    arrival, front = reached, reached - sent
    first_scheduled = tl.first_scheduled if tl.first_scheduled is not None else tl.first_token
    last = tl.token_times[-1] if tl.token_times else tl.first_token
    timings = {"gateway_ms": front * 1e3, "template_ms": 0.0, "tokenize_ms": 0.0,
               "queue_ms": (first_scheduled - arrival) * 1e3,
               "prefill_ms": (tl.first_token - first_scheduled) * 1e3,
               "decode_ms": (last - tl.first_token) * 1e3,
               "ttft_ms": (tl.first_token - sent) * 1e3, "e2e_ms": (last - sent) * 1e3,
               "stream_ms": 0.0, "cached_tokens": req.num_cached_tokens,
               "prompt_tokens": req.num_prompt_tokens,
               "completion_tokens": req.num_output_tokens,
               "prefill_chunks": len(tl.prefill_chunks), "preemptions": len(tl.preemptions)}
    if tl.steps is not None:
        timings.update(tl.steps.summary())
    return timings


def server_timings(req: Request, sent: float, reached: float
                   ) -> dict[str, float | None] | None:
    """`plan_timings` normalised as the bench normalises a real server's."""
    timings = plan_timings(req, sent, reached)
    if timings is None:
        return None
    tl = req.timeline
    out = normalize({"timings": timings})
    out["source"] = "lifeline-plan"
    out["prefill_chunks"] = len(tl.prefill_chunks)
    out["preemptions"] = len(tl.preemptions)
    return out


def measured_count(settings: BenchSettings) -> int:
    """Distinct prompts to generate: every measured and warm-up request (a duration-bound run
    repeats 256)."""
    if settings.requests is None:
        return 256 + settings.warmup
    return settings.requests + settings.warmup


def run_plan(settings: BenchSettings, deployment: Deployment,
             on_done: Callable[[Sent], None] | None = None,
             workload: list[BenchRequest] | None = None) -> dict[str, Any]:
    """Simulate the run `settings` describe on `deployment`; the bench's results plus a `plan`
    object (the deployment, its KV capacity, what bounded each phase). `workload`: these
    requests in this order (a replayed trace) instead of the ones `settings` describe."""
    import time

    from lifeline.bench.workloads import cycle
    from lifeline.plan.report import plan_section

    t0 = time.perf_counter()
    slo = Slo.parse(settings.slo, settings.slo_attainment) if settings.slo else None
    vocab = deployment.cost.model.vocab_size
    if settings.long_context:
        limit = deployment.max_model_len or deployment.cost.model.max_position
        settings.input_tokens = limit - settings.output_tokens - 16
        if settings.input_tokens < 1:
            raise ValueError("--output-tokens leaves no room for a prompt in the context")
    if workload is None:
        workload = plan_requests(settings, vocab, measured_count(settings))
    load = _Load(settings, deployment, cycle(workload), on_done)
    result = load.run()
    started = datetime.now(UTC)
    log = load.engine.step_log
    steps = {"data": [r.as_dict() for r in log.latest(log.size)], "config": log.config}
    out = results(settings, result, slo, started, step_log=steps)
    out["plan"] = plan_section(deployment, load.engine, load.watch, out,
                               time.perf_counter() - t0)
    return out

