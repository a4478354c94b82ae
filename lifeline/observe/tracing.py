"""OpenTelemetry spans per stage, emitted after a request finishes from its record.

The parent span `request` runs from arrival to the last byte; one child per stage follows it,
laid end to end with each stage's duration, so the waterfall adds up to the parent exactly.
The first five stages sit at their real times. Detokenize happens in slices after every token;
its child gathers those slices after `decode`, so `decode` and `stream` are drawn shifted by at
most the detokenize time.
"""
from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit

from lifeline.observe.record import RequestRecord

OTLP_PACKAGE = "opentelemetry-exporter-otlp-proto-http"


class Tracer:
    def __init__(self, exporter: Any | None = None, *, service_name: str = "lifeline",
                 batch: bool = False):
        """`exporter` is any OpenTelemetry `SpanExporter` (tests pass `InMemorySpanExporter`);
        None makes a no-op tracer."""
        self._provider = None
        self._tracer = None
        self._offset_ns = time.time_ns() - time.perf_counter_ns()
        if exporter is None:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("lifeline.observe")

    @classmethod
    def from_endpoint(cls, endpoint: str | None, service_name: str = "lifeline") -> Tracer:
        """An OTLP/HTTP tracer for `--otlp-endpoint` (`http://host:4318` or a full
        `.../v1/traces` URL); None gives a no-op tracer."""
        if not endpoint:
            return cls()
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise RuntimeError(f"--otlp-endpoint needs the {OTLP_PACKAGE} package: "
                               f"pip install {OTLP_PACKAGE}") from exc
        if urlsplit(endpoint).path in ("", "/"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return cls(OTLPSpanExporter(endpoint=endpoint), service_name=service_name, batch=True)

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def emit(self, record: RequestRecord) -> None:
        """Export the request span and its stage children."""
        if self._tracer is None:
            return
        from opentelemetry import trace

        start = self._epoch_ns(record.arrival)
        parent = self._tracer.start_span("request", start_time=start,
                                         attributes=_attributes(record))
        context = trace.set_span_in_context(parent)
        at = record.arrival
        for name, seconds in record.stage_seconds().items():
            end = at + max(seconds, 0.0)
            span = self._tracer.start_span(name, context=context,
                                           start_time=self._epoch_ns(at),
                                           attributes={"lifeline.duration_ms": seconds * 1e3})
            span.end(end_time=self._epoch_ns(end))
            at = end
        parent.end(end_time=max(self._epoch_ns(record.arrival + record.e2e), self._epoch_ns(at)))

    def shutdown(self) -> None:
        """Flush pending spans (call when the server stops)."""
        if self._provider is not None:
            self._provider.shutdown()

    def _epoch_ns(self, perf_seconds: float) -> int:
        return round(perf_seconds * 1e9) + self._offset_ns


def _attributes(record: RequestRecord) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "lifeline.request_id": record.request_id, "lifeline.model": record.model,
        "http.route": record.endpoint, "http.response.status_code": record.status,
        "lifeline.finish_reason": record.finish_reason or "",
        "lifeline.prompt_tokens": record.prompt_tokens,
        "lifeline.cached_tokens": record.cached_tokens,
        "lifeline.completion_tokens": record.completion_tokens,
        "lifeline.preemptions": record.preemptions,
        "lifeline.prefill_chunks": record.prefill_chunks,
    }
    if record.ttft is not None:
        attrs["lifeline.ttft_ms"] = record.ttft * 1e3
    return attrs
