"""Ray Serve's `RequestRouter` interface filled with Lifeline's balancing policies
(`lifeline.gateway.policies`), for the engine replicas of a `ray` backend (docs/scale-out.md).

Ray pickles this module by value into the processes that route (the gateway, which holds the
handle), so it keeps no state of its own at module level: the choices it makes go to
`lifeline.gateway.ray_serve.keep_pick`, imported by reference, where the gateway reads them."""
from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from lifeline.gateway.policies import make_policy
from lifeline.gateway.ray_serve import keep_pick


class _ReplicaView:
    """A replica as Lifeline's policies see a backend: a name and its requests in flight."""
    __slots__ = ("name", "outstanding", "known")

    def __init__(self, name: str, outstanding: int | None):
        self.name, self.outstanding, self.known = name, outstanding or 0, outstanding is not None


class LifelineRequestRouter(RequestRouter):
    """Ray Serve's router with Lifeline's policies: `least_outstanding` (default),
    `power_of_two`, `round_robin`, `prefix_affinity`. A replica's load is its number of
    ongoing requests as Ray's queue-length cache holds it (every handle's traffic, not only
    this gateway's). The policy's order becomes Ray's ranks, one replica each: Ray sends the
    request to the first that accepts it (under `max_ongoing_requests`), so a full replica is
    passed over exactly as the gateway passes over one at `max_concurrency`."""

    def initialize_state(self, policy: str = "least_outstanding", load_factor: float = 1.25,
                         **_: Any) -> None:
        self._policy_name, self._load_factor = policy, load_factor
        self._policy: Any = None
        self._ring_of: frozenset[str] = frozenset()

    def _policy_for(self, names: list[str]) -> Any:
        """The policy over the current replicas (prefix affinity's ring is rebuilt when the
        set changes: only the keys of replicas that came or went move)."""
        key = frozenset(names)
        if self._policy is None or (self._policy_name == "prefix_affinity"
                                    and key != self._ring_of):
            self._policy = make_policy(self._policy_name, sorted(names), self._load_factor)
            self._ring_of = key
        return self._policy

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [_ReplicaView(name, self.replica_queue_len_cache.get(r.replica_id))
                 for name, r in by_name.items()]
        request = _request_of(pending_request)
        pick = self._policy_for(list(by_name)).pick(views, request.get("prefix"))
        if request.get("id"):
            keep_pick(request["id"], {
                "policy": self._policy_name, "reason": pick.reason,
                "candidates": [{"replica": s.backend, "score": s.score,
                                "ongoing": s.outstanding if _known(views, s.backend) else None,
                                "note": s.note} for s in pick.scored], **pick.extra})
        return [[by_name[view.name]] for view in pick.order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any,
                          result: Any) -> None:
        request = _request_of(pending_request)
        if request.get("id"):
            keep_pick(request["id"], {"routed_to": replica_id.unique_id})


def _request_of(pending: PendingRequest | None) -> dict[str, Any]:
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return {}
    return pending.args[0]


def _known(views: list[_ReplicaView], name: str) -> bool:
    return next((v.known for v in views if v.name == name), False)
