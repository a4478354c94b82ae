"""A server's step log (`GET /debug/steps`) as the diagnosis reads it: each request's steps by
id, the steps in between, the run's step-cost fit; and the bench's fetch of it."""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from lifeline.bench.step_fit import StepCost, fit_steps, periods

PAGE = 4096
"""The most records `/debug/steps` returns at once."""
WINDOW_MARGIN_S = 1.0
"""Wall-clock slack around the run's window (the server's clock and the bench's may differ a
little even on one machine: the step's `start` is read before its forward)."""


@dataclass(slots=True)
class StepIndex:
    """Step records (oldest first) and, for each request id, its entries in them."""

    steps: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    dropped: int = 0
    """Records of the run's window the server's ring had already let go."""
    numbers: list[int] = field(init=False)
    by_request: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = field(init=False)
    periods: dict[int, float] = field(init=False)
    """Step number → ms to the next step's start, where the engine went straight on."""
    cost: StepCost | None = field(init=False)

    def __post_init__(self) -> None:
        self.steps = sorted(self.steps, key=lambda s: s["step"])
        self.numbers = [s["step"] for s in self.steps]
        self.by_request = {}
        for step in self.steps:
            for entry in step.get("requests") or ():
                for key in {entry.get("id"), entry.get("parent")} - {None}:
                    self.by_request.setdefault(key, []).append((step, entry))
        self.periods = periods(self.steps)
        self.cost = fit_steps(self.steps)

    @classmethod
    def of(cls, log: dict[str, Any] | Sequence[dict[str, Any]] | None) -> StepIndex | None:
        """From a `/debug/steps` body (or the bench's stored `step_log`) or a list of records;
        None when there is nothing."""
        if log is None:
            return None
        if isinstance(log, dict):
            records = log.get("data") or []
            config, dropped = log.get("config") or {}, int(log.get("dropped") or 0)
        else:
            records, config, dropped = list(log), {}, 0
        return cls(list(records), config, dropped) if records else None

    def of_request(self, request_id: str | None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        return self.by_request.get(request_id, []) if request_id else []

    def period(self, step: dict[str, Any]) -> float:
        """The step's period, or its forward alone where the engine did not go straight on."""
        return self.periods.get(step["step"], step["duration_ms"])

    def between(self, lo: int, hi: int) -> list[dict[str, Any]]:
        """Steps numbered strictly between `lo` and `hi`."""
        return self.steps[bisect.bisect_right(self.numbers, lo):bisect.bisect_left(self.numbers,
                                                                                     hi)]


async def fetch_steps(http: httpx.AsyncClient, root: str, since_wall: float, until_wall: float,
                      admin_key: str | None = None, model: str | None = None
                      ) -> tuple[dict[str, Any] | None, str | None]:
    """The step log of the window [since_wall, until_wall] (wall-clock seconds) from a Lifeline
    server at `root` (the URL without /v1): `(log, None)`, or `(None, why not)`. `model`: the
    model benchmarked, which picks the backend behind a gateway (a single server ignores it)."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    records: list[dict[str, Any]] = []
    since, dropped, config = 0, 0, {}
    while True:
        try:
            r = await http.get(f"{root}/debug/steps", params={
                "since": since, "limit": PAGE, **({"model": model} if model else {})},
                headers=headers)
        except httpx.HTTPError as exc:
            return None, f"its step log could not be read ({type(exc).__name__})"
        if r.status_code != 200:
            return None, _refusal(r)
        try:
            body = r.json()
            page, nxt = body["data"], int(body["next"])
        except (ValueError, KeyError, TypeError):
            return None, "its /debug/steps is not a Lifeline step log"
        config = body.get("config") or config
        if since == 0 and page and page[0].get("start", 0) > since_wall:
            dropped = int(body.get("dropped") or 0)  # the ring let go of the window's start
        records += [s for s in page
                    if since_wall - WINDOW_MARGIN_S <= s.get("start", 0)
                    <= until_wall + WINDOW_MARGIN_S]
        if not page or nxt <= since:
            break
        since = nxt
    return {"object": "list", "data": records, "config": config, "dropped": dropped}, None


def _refusal(r: httpx.Response) -> str:
    if r.status_code == 404:
        return "it serves no step log (/debug/steps: 404; not a Lifeline server)"
    if r.status_code in (401, 403):
        return (f"its step log needs the admin key (/debug/steps: {r.status_code}; "
                "pass --admin-key)")
    return f"its step log could not be read (/debug/steps: {r.status_code})"
