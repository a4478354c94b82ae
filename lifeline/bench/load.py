"""Load shapes: a closed loop (N users, each sending its next request when the last one ended,
after an optional think time) or an open loop (arrivals at a rate, Poisson or gamma-bursty),
bounded by a request count or a duration, with warm-up requests sent first and left out."""
from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from lifeline.bench.client import BenchClient, BenchRequest
from lifeline.bench.metrics import RequestTrace


@dataclass(slots=True)
class LoadPlan:
    """How much load, of which shape, for how long."""

    concurrency: int = 1
    """Closed loop: the number of users. Open loop: the most requests in flight (0: no cap)."""
    rate: float | None = None
    """Open loop: requests per second; None for a closed loop."""
    burstiness: float = 1.0
    """Gamma shape of the inter-arrival times: 1 is Poisson, below 1 burstier (as vLLM)."""
    requests: int | None = None
    """Measured requests to send; None: as many as `duration_s` allows."""
    duration_s: float | None = None
    """Stop starting requests after this long (those in flight finish and count)."""
    warmup: int = 0
    """Requests sent before the measured window, left out of every number."""
    think_time_s: float = 0.0
    """Closed loop: mean pause (exponential) between a user's requests."""
    ramp_up_s: float = 0.0
    """Closed loop: the users start evenly over this long (user i of N at i·ramp_up_s/N, as
    k6's ramping VUs and Locust's spawn rate); 0 starts them all at once."""
    turns: int = 1
    """Closed loop, chat: each user holds sessions of this many turns; a turn sends the whole
    history (earlier prompts and the server's answers) plus the next prompt."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests is None and self.duration_s is None:
            raise ValueError("bound the run by a request count or a duration")
        if self.concurrency < 0 or (self.rate is None and self.concurrency < 1):
            raise ValueError("a closed loop needs at least one user")
        if (self.rate is not None and self.rate <= 0) or self.burstiness <= 0:
            raise ValueError("rate and burstiness are positive")
        if self.turns < 1 or (self.turns > 1 and self.rate is not None):
            raise ValueError("multi-turn sessions run in a closed loop")
        if self.ramp_up_s < 0 or (self.ramp_up_s > 0 and self.rate is not None):
            raise ValueError("a ramp-up is a closed loop's, of zero seconds or more")


@dataclass(slots=True)
class Sent:
    """One measured request: what was sent, what came back, when it was meant to go."""

    request: BenchRequest
    trace: RequestTrace
    scheduled: float
    """When the load meant to send it; `trace.sent − scheduled` is the client's own lag."""
    turn: int = 0
    """The request's place in its session (0 without sessions)."""


@dataclass(slots=True)
class RunResult:
    sent: list[Sent] = field(default_factory=list)
    start: float = 0.0
    """The measured window opened (after warm-up)."""
    end: float = 0.0
    """The last measured request ended."""

    @property
    def duration_s(self) -> float:
        return self.end - self.start


class _Budget:
    """Hands out measured requests until the count or the duration is spent."""

    def __init__(self, plan: LoadPlan, workload: Iterator[BenchRequest], start: float):
        self.left, self.workload = plan.requests, workload
        self.deadline = start + plan.duration_s if plan.duration_s is not None else None

    def take(self) -> BenchRequest | None:
        if self.left is not None and self.left <= 0:
            return None
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return None
        if self.left is not None:
            self.left -= 1
        return next(self.workload)


async def run_load(client: BenchClient, workload: Iterator[BenchRequest], plan: LoadPlan,
                   on_done: Callable[[Sent], None] | None = None) -> RunResult:
    """Warm up, then drive the measured load; `on_done` sees each measured request."""
    await _warmup(client, workload, plan)
    result = RunResult(start=time.perf_counter())
    budget = _Budget(plan, workload, result.start)

    async def one(req: BenchRequest, scheduled: float, turn: int = 0) -> Sent:
        sent = Sent(req, await client.send(req), scheduled, turn)
        result.sent.append(sent)
        if on_done is not None:
            on_done(sent)
        return sent

    if plan.rate is None:
        await _closed(one, budget, plan)
    else:
        await _open(one, budget, plan)
    result.end = max((s.trace.done or s.trace.sent for s in result.sent),
                     default=time.perf_counter())
    return result


async def _warmup(client: BenchClient, workload: Iterator[BenchRequest], plan: LoadPlan) -> None:
    reqs = [next(workload) for _ in range(plan.warmup)]
    width = max(1, plan.concurrency)
    for i in range(0, len(reqs), width):
        await asyncio.gather(*(client.send(r) for r in reqs[i:i + width]))


async def _closed(one, budget: _Budget, plan: LoadPlan) -> None:
    rng = random.Random(plan.seed)

    async def user(i: int) -> None:
        if plan.ramp_up_s > 0:
            await asyncio.sleep(ramp_up_start(i, plan))
        history: list[dict[str, str]] = []
        turn = 0
        while (req := budget.take()) is not None:
            if plan.turns > 1:
                req = with_history(req, history)
            sent = await one(req, time.perf_counter(), turn)
            turn += 1
            if plan.turns > 1:
                history = [*req.extra["messages"],
                           {"role": "assistant", "content": sent.trace.answer}]
                if turn == plan.turns or sent.trace.error is not None:
                    history, turn = [], 0
            if plan.think_time_s > 0:
                await asyncio.sleep(rng.expovariate(1 / plan.think_time_s))

    await asyncio.gather(*(user(i) for i in range(plan.concurrency)))


def ramp_up_start(user: int, plan: LoadPlan) -> float:
    """Seconds after the measured window opens that closed-loop user `user` starts."""
    return user * plan.ramp_up_s / plan.concurrency


def with_history(req: BenchRequest, history: list[dict[str, str]]) -> BenchRequest:
    """The request as the next turn of a conversation: history, then its prompt."""
    if not isinstance(req.prompt, str):
        raise TypeError("multi-turn sessions need text prompts (--endpoint chat)")
    messages = [*history, {"role": "user", "content": req.prompt}]
    return BenchRequest(req.prompt, req.max_tokens, req.prompt_tokens,
                        {**req.extra, "messages": messages})


async def _open(one, budget: _Budget, plan: LoadPlan) -> None:
    rng = random.Random(plan.seed)
    cap = asyncio.Semaphore(plan.concurrency) if plan.concurrency else None
    tasks: set[asyncio.Task] = set()
    next_at = time.perf_counter()

    async def capped(req: BenchRequest, scheduled: float) -> None:
        if cap is None:
            await one(req, scheduled)
            return
        async with cap:
            await one(req, scheduled)

    while (req := budget.take()) is not None:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(capped(req, next_at))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        next_at += arrival_gap(rng, plan.rate, plan.burstiness)
    if tasks:
        await asyncio.gather(*tasks)


def arrival_gap(rng: random.Random, rate: float, burstiness: float) -> float:
    """The open loop's next inter-arrival time: gamma(shape=burstiness,
    scale=1 / (rate × burstiness)), mean 1 / rate; 0 at rate inf (every request at once, as
    vLLM's `--request-rate inf`)."""
    if math.isinf(rate):
        return 0.0
    return rng.gammavariate(burstiness, 1 / (rate * burstiness))


def interarrival_times(rate: float, burstiness: float, n: int, seed: int = 0) -> list[float]:
    """The gaps the open loop draws (for tests and plots)."""
    rng = random.Random(seed)
    return [arrival_gap(rng, rate, burstiness) for _ in range(n)]
