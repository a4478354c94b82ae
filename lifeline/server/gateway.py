"""Stage 1 of a request's life: who is asking, whether they may, and whether there is room."""
from __future__ import annotations

import hmac
import time
from collections import deque
from dataclasses import dataclass, field

from lifeline.server.errors import APIError

OPEN_PATHS = frozenset({"/health", "/ready"})
WINDOW_S = 60.0
ADMIN_QUERY_KEY = "admin_key"
"""Where a browser's `EventSource` (which cannot send headers) puts the admin key."""


def is_admin_path(path: str) -> bool:
    """The debug endpoints and the dashboard's stream: what the server holds about every
    tenant."""
    return not is_dashboard_file(path) and path.startswith(("/debug/", "/dashboard/"))


def is_dashboard_file(path: str) -> bool:
    """The dashboard's page and files: code, no data. A browser fetches them without a key
    and the page sends the admin key with its own requests."""
    return path == "/dashboard" or path.startswith("/dashboard/static/")


def bearer_key(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


class Authenticator:
    """Constant-time comparison against every configured key (no early exit on a match).
    The admin paths (`is_admin_path`) answer to the admin key alone once any key is
    configured: an API key names a tenant, and those paths show every tenant's requests."""

    def __init__(self, keys: list[str], protect_metrics: bool, admin_key: str | None = None,
                 shared_paths: frozenset[str] = frozenset()):
        self.keys = [k.encode() for k in keys]
        self.admin_key = admin_key.encode() if admin_key else None
        self.open_paths = OPEN_PATHS if protect_metrics else OPEN_PATHS | {"/metrics"}
        self.shared_paths = shared_paths
        """Paths that answer to the API keys and to the admin key (`/gateway/decisions`: each
        tenant its own requests, the admin every tenant's)."""

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def check(self, path: str, authorization: str | None, query_key: str | None = None) -> str:
        """The caller's key (its identity for rate limits); raises 401 when it is wrong (403 on
        an admin path). `query_key`: the admin key sent in the query string."""
        if is_admin_path(path):
            return self._check_admin(bearer_key(authorization) or query_key)
        if not self.keys or path in self.open_paths or is_dashboard_file(path):
            return "anonymous"
        given = (bearer_key(authorization) or "").encode()
        if path in self.shared_paths and self.is_admin(authorization):
            return "admin"
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(given, key)
        if not matched:
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer KEY')",
                           None, "invalid_api_key")
        return given.decode()

    def is_admin(self, authorization: str | None) -> bool:
        """Whether the request carries the admin key (constant time)."""
        given = (bearer_key(authorization) or "").encode()
        return self.admin_key is not None and hmac.compare_digest(given, self.admin_key)

    def _check_admin(self, given: str | None) -> str:
        if not self.keys and self.admin_key is None:
            return "anonymous"
        if self.admin_key is not None and hmac.compare_digest((given or "").encode(),
                                                              self.admin_key):
            return "admin"
        why = ("this server has no admin key (--admin-key)" if self.admin_key is None else
               "send the admin key ('Authorization: Bearer KEY' or ?admin_key=KEY)")
        raise APIError(403, f"the debug endpoints and the dashboard need the admin key: {why}",
                       None, "admin_key_required")


@dataclass(slots=True)
class _Window:
    """Events of the last minute for one key: (time, amount)."""
    events: deque[tuple[float, int]] = field(default_factory=deque)
    total: int = 0

    def expire(self, now: float) -> None:
        while self.events and self.events[0][0] <= now - WINDOW_S:
            self.total -= self.events.popleft()[1]

    def wait_for(self, amount: int, limit: int, now: float) -> float:
        """Seconds until `amount` more fits under `limit`; 0 when it fits now."""
        self.expire(now)
        if self.total + amount <= limit:
            return 0.0
        if amount > limit:
            return WINDOW_S
        excess = self.total + amount - limit
        for t, n in self.events:
            excess -= n
            if excess <= 0:
                return t + WINDOW_S - now
        return WINDOW_S

    def add(self, amount: int, now: float) -> None:
        if amount:
            self.events.append((now, amount))
            self.total += amount


class RateLimiter:
    """Per-key sliding one-minute windows for requests and tokens. A request is admitted when its
    prompt tokens (times `n`) fit in the window; its completion tokens are charged when it
    ends (finished, aborted or failed: what it generated), so a key that generated a lot waits
    longer for its next admission. A request whose prompt tokens alone exceed the limit could
    never be admitted: it gets 400, not a 429 to retry forever."""

    def __init__(self, rpm: int | None, tpm: int | None, clock=time.monotonic):
        self.rpm, self.tpm = rpm, tpm
        self.clock = clock
        self._requests: dict[str, _Window] = {}
        self._tokens: dict[str, _Window] = {}

    @property
    def enabled(self) -> bool:
        return self.rpm is not None or self.tpm is not None

    def admit_request(self, key: str) -> None:
        if self.rpm is None:
            return
        now = self.clock()
        window = self._requests.setdefault(key, _Window())
        wait = window.wait_for(1, self.rpm, now)
        if wait:
            raise APIError(429, f"rate limit of {self.rpm} requests per minute reached",
                           None, "rate_limit_exceeded", wait)
        window.add(1, now)

    def admit_tokens(self, key: str, tokens: int, param: str | None = None) -> None:
        """Charge the prompt tokens of a request (`param` names its prompt field)."""
        if self.tpm is None:
            return
        if tokens > self.tpm:
            raise APIError(400, f"this request needs {tokens} tokens (prompt tokens times n), "
                           f"more than the limit of {self.tpm} tokens per minute; send a "
                           "shorter prompt or a smaller n", param, "request_too_large")
        now = self.clock()
        window = self._tokens.setdefault(key, _Window())
        wait = window.wait_for(tokens, self.tpm, now)
        if wait:
            raise APIError(429, f"rate limit of {self.tpm} tokens per minute reached "
                           f"(this request needs {tokens})", None, "rate_limit_exceeded", wait)
        window.add(tokens, now)

    def charge_tokens(self, key: str, tokens: int) -> None:
        """Completion tokens count once generated (the prompt was counted at admission)."""
        if self.tpm is None or tokens <= 0:
            return
        self._tokens.setdefault(key, _Window()).add(tokens, self.clock())


class Admission:
    """Counts requests handed to the engine that have not yet produced a token, and refuses a
    new one (503) while `limit` of them wait; also the server's loading and draining switch."""

    def __init__(self, limit: int | None, retry_after: float = 1.0):
        self.limit = limit
        self.retry_after = retry_after
        self.waiting = 0
        self.in_flight = 0
        self.draining = False
        self.loading = False

    def check_open(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", None, "draining",
                           self.retry_after)
        if self.loading:
            raise APIError(503, "the model is still loading", None, "loading", self.retry_after)

    def enter(self, count: int, param: str | None = None) -> None:
        """Admit `count` engine requests (prompts times n) together, or none: 503 while the
        queue has no room for all of them, 400 when it never could (`param` names the field)."""
        self.check_open()
        if self.limit is not None and count > self.limit:
            raise APIError(400, f"this request asks for {count} generations (prompts times n), "
                           f"more than the server queues at once ({self.limit})", param,
                           "too_many_choices")
        if self.limit is not None and self.waiting + count > self.limit:
            raise APIError(503, f"the waiting queue is full ({self.waiting} requests wait; "
                           f"limit {self.limit})", None, "queue_full", self.retry_after)
        self.waiting += count
        self.in_flight += count

    def started(self) -> None:
        self.waiting -= 1

    def left(self) -> None:
        self.in_flight -= 1
