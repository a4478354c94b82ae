"""Concurrent Users @ SLO: the largest closed-loop concurrency at which a run still meets the
SLO, found by doubling then bisecting; and what that costs."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

Runner = Callable[..., Awaitable[dict[str, Any]]]
"""Runs the benchmark a `BenchSettings` describes and returns its results: `run_bench`
against a server, or the planner's simulation."""

from lifeline.bench.run import BenchSettings, run_bench

TRIAL_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")


async def search_max(met: Callable[[int], Awaitable[bool]], start: int = 1,
                     limit: int = 1024) -> int:
    """The largest n in [1, limit] with `met(n)`, assuming met is monotone (true up to some n,
    false after): double from `start` until it fails, then bisect. 0 if even 1 fails."""
    lo, n = 0, max(1, min(start, limit))
    while True:
        if await met(n):
            lo = n
            if n == limit:
                return lo
            n = min(2 * n, limit)
        else:
            hi = n
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if await met(mid):
            lo = mid
        else:
            hi = mid
    return lo


def trial_requests(settings: BenchSettings, users: int) -> int | None:
    """Every user sends at least 4 requests, so each trial sees a steady state."""
    if settings.requests is None:
        return None
    return max(settings.requests, 4 * users)


async def search_max_rate(met: Callable[[float], Awaitable[bool]], start: float,
                          limit: float, precision: float = 0.1) -> float:
    """The largest rate in (0, limit] with `met(rate)` to within `precision` (relative):
    double from `start` until it fails (halve while it fails), then bisect geometrically.
    0 when even start / 64 fails."""
    lo, hi, rate = 0.0, limit, min(start, limit)
    while await met(rate):
        lo = rate
        if rate >= limit:
            return lo
        rate = min(2 * rate, limit)
    hi = rate
    while lo == 0.0:
        rate /= 2
        if rate < start / 64:
            return 0.0
        if await met(rate):
            lo = rate
        else:
            hi = rate
    while hi / lo > 1 + precision:
        mid = (lo * hi) ** 0.5
        if await met(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _trial_row(results: dict[str, Any], **load: float) -> dict[str, Any]:
    s = results["summary"]
    slo = s["slo"] or {"met": None, "attainment": None}
    return {**load, "met": slo["met"], "attainment": slo["attainment"],
            "output_throughput_tok_s": s["output_throughput_tok_s"],
            "goodput_rps": s["goodput_rps"], "failed": s["failed"],
            **{f"{k[:-3]}_p90_ms": s[k]["p90"] for k in TRIAL_KEYS}}


async def find_max_users(settings: BenchSettings, limit: float = 1024,
                         on_trial: Callable[[dict[str, Any]], None] | None = None,
                         run: Runner = run_bench) -> dict[str, Any]:
    """Run trials and return the results of the best one, with a `search` object listing
    every trial and the answer: closed-loop trials for `max_users`, or, when `settings.rate`
    is set, open-loop trials for `max_rate_rps`."""
    if not settings.slo:
        raise ValueError("--find-max-users needs --slo")
    by_rate = settings.rate is not None
    runs: dict[float, dict[str, Any]] = {}
    trials: list[dict[str, Any]] = []

    async def met(load: float) -> bool:
        runs[load] = await _trial(settings, load, len(runs), run)
        row = _trial_row(runs[load], **({"rate": load} if by_rate else {"concurrency": load}))
        trials.append(row)
        if on_trial is not None:
            on_trial(row)
        return row["met"]

    if by_rate:
        best = await search_max_rate(met, settings.rate, limit)
        search = {"metric": "rate", "limit": limit, "max_rate_rps": best}
    else:
        best = await search_max(met, settings.concurrency or 1, int(limit))
        search = {"metric": "concurrency", "limit": limit, "max_users": best}
    results = runs[best] if best else runs[min(runs)]
    results["search"] = {**search, "trials": trials}
    return results


async def _trial(settings: BenchSettings, load: float, index: int,
                 run: Runner = run_bench) -> dict[str, Any]:
    """One run at `load`: a rate when `settings.rate` is set, else a number of users. Each
    trial has its own seed, so its prompts are not cached by the one before."""
    if settings.rate is not None:
        return await run(replace(settings, rate=load, seed=settings.seed + index))
    users = int(load)
    return await run(replace(settings, concurrency=users, seed=settings.seed + index,
                                   requests=trial_requests(settings, users)))


async def sweep(settings: BenchSettings, loads: list[float],
                on_trial: Callable[[dict[str, Any]], None] | None = None,
                run: Runner = run_bench) -> dict[str, Any]:
    """Runs at each load in turn (users, or rates with `settings.rate`); the last run's
    results with a `sweep` object listing every run's headline numbers."""
    if not loads:
        raise ValueError("--sweep needs at least one load")
    by_rate = settings.rate is not None
    trials, results = [], {}
    for i, load in enumerate(loads):
        results = await _trial(settings, load, i, run)
        row = _trial_row(results, **({"rate": load} if by_rate else {"concurrency": int(load)}))
        trials.append(row)
        if on_trial is not None:
            on_trial(row)
    results["sweep"] = {"metric": "rate" if by_rate else "concurrency", "trials": trials}
    return results


def cost(summary: dict[str, Any], users: int | None, cost_per_hour: float,
         gpus: float = 1.0) -> dict[str, float | None]:
    """Users per GPU, GPUs per user, users per dollar-hour, output tokens per dollar and
    dollars per million output tokens, at a run's output throughput and `users` concurrent
    users."""
    tok_per_hour = (summary["output_throughput_tok_s"] or 0.0) * 3600
    return {"cost_per_hour": cost_per_hour, "gpus": gpus, "users": users,
            "users_per_gpu": users / gpus if users is not None and gpus else None,
            "gpus_per_user": gpus / users if users else None,
            "users_per_dollar_hour": users / cost_per_hour if users and cost_per_hour else None,
            "output_tokens_per_dollar": tok_per_hour / cost_per_hour if cost_per_hour else None,
            "dollars_per_million_output_tokens":
                cost_per_hour / tok_per_hour * 1e6 if tok_per_hour else None}
