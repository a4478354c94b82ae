"""Whether a backend should get requests: its circuit breaker (driven by what requests meet)
and its active health check (driven by a periodic `GET /health`).

The breaker, per backend: **closed** (requests flow) → **open** after `failures` consecutive
failed requests (none flow) → **half-open** once `cooldown_s` have passed, where exactly one
request, the probe, is let through: its success closes the circuit, its failure opens it again
for another cooldown. The health check is separate: a backend that fails `unhealthy_after`
checks in a row is out of rotation until one check passes. Only requests close a circuit, so a
backend that answers `/health` but fails requests stays out."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("lifeline.gateway")

CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
CIRCUIT_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}
"""The numbers `lifeline:gateway_circuit_state` reports."""


class CircuitBreaker:
    def __init__(self, failures: int, cooldown_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.failures, self.cooldown_s, self.clock = failures, cooldown_s, clock
        self.consecutive = 0
        self.opened_at: float | None = None
        self.probing = False
        """A half-open circuit's one probe is in flight."""
        self.opened = 0
        """Times the circuit opened (for /gateway/backends)."""

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return CLOSED
        if self.clock() - self.opened_at < self.cooldown_s:
            return OPEN
        return HALF_OPEN

    def allows(self) -> bool:
        """Whether a request could go now (no side effect)."""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self.probing)

    def acquire(self) -> bool:
        """Let one request through, claiming the probe of a half-open circuit."""
        state = self.state
        if state == CLOSED:
            return True
        if state == HALF_OPEN and not self.probing:
            self.probing = True
            return True
        return False

    def success(self) -> None:
        self.consecutive = 0
        self.opened_at = None
        self.probing = False

    def failure(self) -> None:
        self.consecutive += 1
        if self.probing or (self.opened_at is None and self.consecutive >= self.failures):
            self._open()
        self.probing = False

    def abandon(self) -> None:
        """A request ended without a verdict (the client left): a probe may go again."""
        self.probing = False

    def retry_in(self) -> float:
        """Seconds until the circuit lets a probe through (0 when it lets requests now)."""
        if self.opened_at is None:
            return 0.0
        return max(0.0, self.opened_at + self.cooldown_s - self.clock())

    def _open(self) -> None:
        if self.state != OPEN:
            self.opened += 1
        self.opened_at = self.clock()


class HealthChecker:
    """Checks every backend each `interval_s` (each check bounded by `timeout_s`) from one task,
    started with the gateway and cancelled when it stops."""

    def __init__(self, backends: Iterable[Any], interval_s: float, timeout_s: float,
                 unhealthy_after: int):
        self.backends = list(backends)
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.unhealthy_after = unhealthy_after
        self.rounds = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="lifeline-gateway-health")

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(b) for b in self.backends))
        self.rounds += 1

    async def _run(self) -> None:
        """Every interval after the first round (which the gateway awaits as it starts). A
        round that fails does not end the checks: a backend marked unhealthy is taken back
        only by a later check that passes, so a dead checker would keep it out for good."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - logged; the next round runs regardless
                log.exception("a round of health checks failed")

    async def _check(self, backend: Any) -> None:
        try:
            error = await asyncio.wait_for(backend.probe_health(), self.timeout_s)
        except asyncio.TimeoutError:
            error = f"no answer within {self.timeout_s:g} s"
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the checker itself is stopping
            # a cancellation from inside the probe (its client's timeout machinery): a failed
            # check, not the end of the checker
            error = f"no answer within {self.timeout_s:g} s (cancelled)"
        except Exception as exc:  # noqa: BLE001 - any failure to answer is unhealthy
            error = f"{type(exc).__name__}: {exc}"
        backend.health_seen(error, self.unhealthy_after)
