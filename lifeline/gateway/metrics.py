"""The gateway's Prometheus series, per backend: requests, errors by kind, fallbacks, circuit
state, health, requests in flight, time to first token and latency; per route: the split
across pools and the policy's reasons. `/metrics` shows them beside the series of every local
engine (`lifeline.observe.Metrics`, labelled by their model), merged into one exposition."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric

from lifeline.gateway.health import CIRCUIT_VALUES
from lifeline.observe.metrics import CONTENT_TYPE, E2E_BUCKETS, STAGE_BUCKETS, TTFT_BUCKETS


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("lifeline:gateway_requests", "Requests the gateway answered, by "
                                "route and HTTP status.", ["model_name", "status"], registry=r)
        self.backend_requests = Counter("lifeline:gateway_backend_requests",
                                        "Attempts sent to each backend.", ["backend"],
                                        registry=r)
        self.backend_errors = Counter("lifeline:gateway_backend_errors", "Failed attempts, by "
                                      "backend and kind of failure.", ["backend", "kind"],
                                      registry=r)
        self.resends = Counter("lifeline:gateway_backend_resends", "Requests sent to a backend "
                               "again on a new connection because the kept-alive one it was "
                               "given was closed before a byte of them was written.",
                               ["backend"], registry=r)
        self.fallbacks = Counter("lifeline:gateway_fallbacks", "Requests moved on to another "
                                 "backend, by route and the backend that failed.",
                                 ["model_name", "backend"], registry=r)
        self.split = Counter("lifeline:gateway_route_split", "Requests per pool of each route "
                             "(the traffic split, as first chosen).", ["model_name", "pool"],
                             registry=r)
        self.decisions = Counter("lifeline:gateway_routing_decisions", "Replica choices, by "
                                 "route, policy and reason (e.g. prefix_owner, spilled).",
                                 ["model_name", "policy", "reason"], registry=r)
        self.outstanding = Gauge("lifeline:gateway_backend_outstanding", "Requests in flight "
                                 "to each backend.", ["backend"], registry=r)
        self.circuit = Gauge("lifeline:gateway_circuit_state", "Each backend's circuit: 0 "
                             "closed, 1 half-open, 2 open.", ["backend"], registry=r)
        self.healthy = Gauge("lifeline:gateway_backend_healthy", "1 while a backend passes "
                             "its health checks.", ["backend"], registry=r)
        self.ttft = Histogram("lifeline:gateway_backend_ttft_seconds", "Attempt sent to its "
                              "first output token, per backend (streams).", ["backend"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.latency = Histogram("lifeline:gateway_backend_latency_seconds", "Attempt sent to "
                                 "its last byte, per backend (served attempts).", ["backend"],
                                 buckets=E2E_BUCKETS, registry=r)
        self.routing = Histogram("lifeline:gateway_routing_time_seconds", "Parsed request to "
                                 "its first attempt: resolving the route and choosing.",
                                 buckets=STAGE_BUCKETS, registry=r)

    def render(self, backends: Iterable[Any], others: Iterable[CollectorRegistry]
               ) -> tuple[bytes, str]:
        """The exposition: this registry (gauges read from `backends` now) and `others`."""
        for b in backends:
            self.outstanding.labels(b.name).set(b.outstanding)
            self.circuit.labels(b.name).set(CIRCUIT_VALUES[b.breaker.state])
            self.healthy.labels(b.name).set(1 if b.healthy else 0)
        merged = CollectorRegistry(auto_describe=False)
        merged.register(_Merged([self.registry, *others]))
        return generate_latest(merged), CONTENT_TYPE


class _Merged:
    """Families of several registries as one: two local engines both report
    `lifeline:time_to_first_token_seconds`, and a family may appear only once."""

    def __init__(self, registries: list[CollectorRegistry]):
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                have = families.get(family.name)
                if have is None:
                    have = families[family.name] = Metric(family.name, family.documentation,
                                                          family.type, family.unit)
                have.samples.extend(family.samples)
        yield from families.values()
