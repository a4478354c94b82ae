"""Stage 1's routing: a requested name (a model or an alias) to a route; the route's split to a
pool; the pool's policy to a replica; then the order of every backend to try should that one
fail. Each request's choice is a `Decision`, returned to the client beside `timings` and written
to the access log, with what happened joined to it once the backend has answered."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lifeline.gateway.backends import Backend
from lifeline.gateway.config import GatewayConfig, RouteSpec
from lifeline.gateway.policies import Pick, Scored, WeightedSplit, make_policy
from lifeline.server.errors import APIError
from lifeline.server.tenants import reported_hash

RECENT_DECISIONS = 256
"""Decisions `/gateway/decisions` keeps."""


@dataclass(slots=True)
class Decision:
    model: str
    requested: str | None
    pool: str
    split: dict[str, Any]
    policy: str
    candidates: list[dict[str, Any]]
    chosen: str | None
    reason: str
    code: str
    detail: dict[str, Any] = field(default_factory=dict)
    """What the policy computed beside the scores (the prefix hash, the load bound)."""
    order: list[Backend] = field(default_factory=list)
    """Every backend to try, in order (the chosen one first)."""
    attempts: list[dict[str, Any]] = field(default_factory=list)
    outcome: dict[str, Any] | None = None
    prefix: str | None = None
    """The prompt's leading characters the policies read (a Ray backend's router reads them
    too); not part of the record."""
    tenant: str | None = None
    """Whose request it is (`lifeline.server.tenants.tenant_of` its key): `/gateway/decisions`
    shows a caller only its own; not part of the record."""

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "requested": self.requested, "pool": self.pool,
                "split": self.split, "policy": self.policy, **self.detail,
                "candidates": self.candidates, "chosen": self.chosen, "reason": self.reason,
                "attempts": self.attempts,
                "outcome": self.outcome}


class Route:
    def __init__(self, spec: RouteSpec, backends: dict[str, Backend]):
        self.spec = spec
        self.pools = {p.name: [backends[n] for n in p.backends] for p in spec.pools}
        self.policies = {p.name: make_policy(p.policy, list(p.backends), spec.load_factor)
                         for p in spec.pools}
        self.split = WeightedSplit({p.name: p.weight for p in spec.pools})
        self.fallbacks = [backends[n] for n in spec.fallbacks]

    def members(self) -> list[Backend]:
        out: list[Backend] = []
        for replicas in self.pools.values():
            out += [b for b in replicas if b not in out]
        return out + [b for b in self.fallbacks if b not in out]


class Router:
    def __init__(self, config: GatewayConfig, backends: dict[str, Backend]):
        self.config = config
        self.backends = backends
        self.routes = {name: Route(spec, backends) for name, spec in config.models.items()}
        self.names = config.names()
        self.recent: deque[tuple[str | None, dict[str, Any]]] = deque(
            maxlen=RECENT_DECISIONS)
        """(tenant, record) of the last decisions, oldest first."""

    def resolve(self, requested: Any) -> Route:
        if requested is None:
            default = self.config.default_model or (
                next(iter(self.routes)) if len(self.routes) == 1 else None)
            if default is None:
                raise APIError(400, "name a model (this gateway serves several: GET "
                               "/v1/models lists them)", "model", "model_required")
            return self.routes[self.names[default]]
        if not isinstance(requested, str):
            raise APIError(400, f"model must be a string, got {type(requested).__name__}",
                           "model", "invalid_type")
        if requested not in self.names:
            served = ", ".join(sorted(self.names))
            raise APIError(404, f"the model {requested!r} does not exist; this gateway serves "
                           f"{served}", "model", "model_not_found")
        return self.routes[self.names[requested]]

    def decide(self, route: Route, requested: str | None, session: tuple[str, str] | None,
               prefix: str | None) -> Decision:
        """Choose a pool and a replica, and the order of everything to try after it."""
        spec = route.spec
        usable = {name: [b for b in replicas if b.unavailable() is None]
                  for name, replicas in route.pools.items()}
        available = [name for name, replicas in usable.items() if replicas]
        split: dict[str, Any] = {"weights": {p.name: p.weight for p in spec.pools}}
        if session is not None:
            split["sticky"] = {"source": session[0], "hash": reported_hash(session[1])}
        if not available:
            decision = Decision(spec.name, requested, "", split, "", self._candidates(
                route, None), None, "no pool has a replica that can serve now", "none")
        else:
            pool, how = route.split.pick(available, session[1] if session else None)
            split["how"] = how
            policy = route.policies[pool]
            pick: Pick = policy.pick(usable[pool], prefix)
            decision = Decision(spec.name, requested, pool, split, policy.name,
                                self._candidates(route, pick), pick.order[0].name,
                                pick.reason, pick.code, detail=pick.extra,
                                order=list(pick.order))
            for other in available:
                if other != pool:
                    decision.order += route.policies[other].pick(usable[other], prefix).order
        seen = set(decision.order)
        decision.order += [b for b in route.fallbacks
                           if b not in seen and b.unavailable() is None]
        if decision.chosen is None and decision.order:
            decision.chosen = decision.order[0].name
            decision.reason = f"no pool's replica can serve now: the fallback " \
                f"{decision.chosen}"
            decision.code = "fallback"
        decision.prefix = prefix
        return decision

    def _candidates(self, route: Route, pick: Pick | None) -> list[dict[str, Any]]:
        """Every backend of the route: its score where the policy scored it, its load, its
        circuit and health, and why it was skipped if it was."""
        scored: dict[str, Scored] = {s.backend: s for s in (pick.scored if pick else [])}
        out = []
        for backend in route.members():
            s = scored.get(backend.name)
            entry = {"backend": backend.name, "score": s.score if s else None,
                     "outstanding": backend.outstanding, "circuit": backend.breaker.state,
                     "healthy": backend.healthy}
            why = backend.unavailable()
            entry["eligible"] = why is None
            entry["note"] = why or (s.note if s and s.note else "")
            if backend in route.fallbacks and not any(backend in r
                                                      for r in route.pools.values()):
                entry["fallback"] = True
            out.append(entry)
        return out

    def remember(self, decision: Decision) -> None:
        self.recent.append((decision.tenant, {"at": time.time(), **decision.to_dict()}))

    def recent_of(self, tenant: str | None, limit: int) -> list[dict[str, Any]]:
        """The last `limit` decisions, oldest first: every one (tenant None: the admin), or
        the tenant's own."""
        if limit <= 0:
            return []
        rows = [row for who, row in self.recent if tenant is None or who == tenant]
        return rows[-limit:]
