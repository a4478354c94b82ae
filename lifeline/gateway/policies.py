"""How a route picks: a pool by weight (the traffic split), then a replica of that pool by its
balancing policy. Every pick says which candidates it weighed, their scores, and why the winner
won: that is the decision record (`lifeline.gateway.router.Decision`).

- round_robin: in turn.
- least_outstanding: the fewest requests in flight from this gateway (ties in turn).
- power_of_two: two replicas drawn at random, the less loaded of them (Mitzenmacher's two
  choices: nearly least-outstanding's balance from two reads).
- prefix_affinity: the prompt's leading characters hashed onto a ring of replicas (consistent
  hashing: equal prefixes meet the same replica, whose prefix cache holds them), with a bound on
  load (Mirrokni et al.'s consistent hashing with bounded loads, as SGLang's router bounds its
  cache-aware choice): a replica already holding more than `load_factor` times its fair share
  of the pool's requests is passed over for the next one on the ring."""
from __future__ import annotations

import bisect
import hashlib
import math
import random
from dataclasses import dataclass, field
from typing import Any

from lifeline.server.tenants import reported_hash

RING_POINTS = 64
"""Points per replica on the affinity ring (more: an evener share of the keys)."""


def digest(text: str) -> int:
    """A stable 64-bit hash (Python's `hash` is salted per process), for placement only: every
    gateway in front of the same replicas puts a key at the same place. Records show
    `lifeline.server.tenants.reported_hash` instead, keyed per process."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"),
                                          digest_size=8).digest(), "big")


@dataclass(slots=True)
class Scored:
    backend: str
    score: float | None
    outstanding: int
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "score": self.score, "outstanding": self.outstanding,
                "note": self.note}


@dataclass(slots=True)
class Pick:
    """Replicas in the order to try them (the chosen one first), how each scored, and why."""
    order: list[Any]
    scored: list[Scored]
    reason: str
    code: str
    """A short name of the reason, for the decisions counter."""
    extra: dict[str, Any] = field(default_factory=dict)


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self.turn = 0

    def pick(self, replicas: list[Any], key: str | None) -> Pick:
        start = self.turn % len(replicas)
        self.turn += 1
        order = replicas[start:] + replicas[:start]
        return Pick(order, [Scored(b.name, i, b.outstanding) for i, b in enumerate(order)],
                    f"next in turn (turn {start} of {len(replicas)})", "in_turn")


class LeastOutstanding(RoundRobin):
    name = "least_outstanding"

    def pick(self, replicas: list[Any], key: str | None) -> Pick:
        turned = super().pick(replicas, key).order  # ties go in turn
        order = sorted(turned, key=lambda b: b.outstanding)
        least = order[0].outstanding
        tied = sum(1 for b in order if b.outstanding == least)
        reason = f"fewest requests in flight ({least})" + (
            f", first in turn of {tied} tied" if tied > 1 else "")
        return Pick(order, [Scored(b.name, b.outstanding, b.outstanding) for b in order],
                    reason, "least_outstanding")


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    def pick(self, replicas: list[Any], key: str | None) -> Pick:
        drawn = self.rng.sample(replicas, min(2, len(replicas)))
        drawn.sort(key=lambda b: b.outstanding)
        rest = sorted((b for b in replicas if b not in drawn), key=lambda b: b.outstanding)
        scored = [Scored(b.name, b.outstanding, b.outstanding, "drawn") for b in drawn]
        scored += [Scored(b.name, None, b.outstanding, "not drawn") for b in rest]
        if len(drawn) == 1:
            return Pick(drawn + rest, scored, "the only replica", "only_one")
        return Pick(drawn + rest, scored,
                    f"less loaded of two drawn ({drawn[0].name}: {drawn[0].outstanding}, "
                    f"{drawn[1].name}: {drawn[1].outstanding})", "two_choices")


class PrefixAffinity:
    name = "prefix_affinity"

    def __init__(self, names: list[str], load_factor: float):
        self.load_factor = load_factor
        points = sorted((digest(f"{name}#{i}"), name) for name in names
                        for i in range(RING_POINTS))
        self.hashes = [h for h, _ in points]
        self.owners = [n for _, n in points]
        self.fallback = LeastOutstanding()

    def ring_order(self, key: str) -> list[str]:
        """Distinct replicas clockwise from the key's point."""
        start = bisect.bisect(self.hashes, digest(key)) % len(self.hashes)
        seen: list[str] = []
        for i in range(len(self.owners)):
            owner = self.owners[(start + i) % len(self.owners)]
            if owner not in seen:
                seen.append(owner)
        return seen

    def bound(self, replicas: list[Any]) -> int:
        """The most requests a replica may hold and still take this one: the load factor
        times the fair share, the new request included."""
        total = sum(b.outstanding for b in replicas) + 1
        return max(1, math.ceil(self.load_factor * total / len(replicas)))

    def pick(self, replicas: list[Any], key: str | None) -> Pick:
        if not key:
            chosen = self.fallback.pick(replicas, key)
            chosen.reason = f"no prompt text to hash: {chosen.reason}"
            chosen.code = "no_prefix"
            return chosen
        by_name = {b.name: b for b in replicas}
        ring = [by_name[n] for n in self.ring_order(key) if n in by_name]
        bound = self.bound(replicas)
        fits = [b for b in ring if b.outstanding + 1 <= bound]
        scored = [Scored(b.name, rank, b.outstanding,
                         "within the load bound" if b in fits else "over the load bound")
                  for rank, b in enumerate(ring)]
        extra = {"prefix_hash": reported_hash(key), "load_bound": bound}
        if not fits:
            order = sorted(ring, key=lambda b: b.outstanding)
            return Pick(order, scored, f"every replica is over the load bound ({bound}): "
                        f"least loaded", "all_over_bound", extra)
        chosen = fits[0]
        order = [chosen] + [b for b in ring if b is not chosen]
        if chosen is ring[0]:
            return Pick(order, scored, f"owns the prompt's prefix on the ring (load "
                        f"{chosen.outstanding} within bound {bound})", "prefix_owner", extra)
        return Pick(order, scored, f"the prefix's owner {ring[0].name} holds "
                    f"{ring[0].outstanding} (bound {bound}): next on the ring", "spilled", extra)


def make_policy(name: str, replicas: list[str], load_factor: float) -> Any:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_outstanding":
        return LeastOutstanding()
    if name == "power_of_two":
        return PowerOfTwo()
    if name == "prefix_affinity":
        return PrefixAffinity(replicas, load_factor)
    raise ValueError(f"unknown policy {name!r}")


class WeightedSplit:
    """The route's split across pools. Without a session key: smooth weighted round robin
    (nginx's), which keeps every window of requests at the weights, not just the long run.
    With one: the key's hash read as a point in [0, 1) on the cumulative weights, so a
    session always lands in the same pool while that pool can serve."""

    def __init__(self, weights: dict[str, float]):
        self.weights = weights
        self.current = {name: 0.0 for name in weights}

    def pick(self, available: list[str], session: str | None) -> tuple[str, str]:
        """(pool, how) among the pools that can serve now."""
        if len(available) == 1:
            return available[0], "the only pool that can serve"
        if session is not None:
            point = digest(session) / 2**64
            total = sum(self.weights[p] for p in available)
            edge = 0.0
            for pool in available:
                edge += self.weights[pool] / total
                if point < edge:
                    return pool, "the session's hash on the weights"
            return available[-1], "the session's hash on the weights"
        total = sum(self.weights[p] for p in available)
        for pool in available:
            self.current[pool] += self.weights[pool]
        best = max(available, key=lambda p: self.current[p])
        self.current[best] -= total
        return best, "smooth weighted round robin"
