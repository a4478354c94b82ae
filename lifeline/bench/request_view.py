"""One request as the diagnosis sees it, whichever side measured it: a bench record (the
client's clock and the server's timings) or a server's own timings alone (the dashboard)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lifeline.bench.stages import normalize


@dataclass(slots=True)
class RequestView:
    """What the diagnosis reads of one request (milliseconds)."""

    id: str | None
    ttft_ms: float | None
    """From the client's send (or the server's arrival when no client measured it)."""
    ttfat_ms: float | None
    tpot_ms: float | None
    output_tokens: int
    stages: dict[str, Any] | None
    """The server's timings, normalised (`lifeline.bench.stages.normalize`)."""
    raw: dict[str, Any] = field(default_factory=dict)
    """The server's timings as it sent them (Lifeline's carry the anatomy and step rows)."""
    turn: int = 0
    connect_ms: float | None = None
    """Connection set-up the client waited for (0: a kept-alive connection)."""
    client: bool = True
    """Whether the times are the client's (else the server's own)."""
    state: dict[str, Any] = field(default_factory=dict)
    """The server's sampled state around the request (`lifeline.bench.server_join`)."""

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> RequestView:
        """The server's stages as it reported them, or as the join to its sampled state
        completed them (a queue where the server reports none)."""
        state = record.get("server_state") or {}
        return cls(id=record.get("id"), ttft_ms=record.get("ttft_ms"),
                   ttfat_ms=record.get("ttfat_ms"), tpot_ms=record.get("tpot_ms"),
                   output_tokens=int(record.get("output_tokens") or 0),
                   stages=state.get("stages") or record.get("server_timings"),
                   raw=record.get("timings_raw") or {},
                   turn=int(record.get("turn") or 0), connect_ms=record.get("connect_ms"),
                   state=state)

    @classmethod
    def of_timings(cls, timings: dict[str, Any], request_id: str | None = None) -> RequestView:
        """A request seen by the server only: TTFT from its arrival, TPOT over its tokens up
        to its last byte (so the stream's delivery stays in view)."""
        stages = normalize({"timings": timings})
        n = int(timings.get("completion_tokens") or 0)
        ttft, e2e = timings.get("ttft_ms"), timings.get("e2e_ms")
        tpot = (e2e - ttft) / (n - 1) if ttft is not None and e2e is not None and n > 1 else None
        return cls(id=request_id, ttft_ms=ttft, ttfat_ms=timings.get("ttfat_ms"), tpot_ms=tpot,
                   output_tokens=n, stages=stages, raw=timings, client=False)

    @property
    def lifeline(self) -> bool:
        return bool(self.stages) and str(self.stages.get("source", "")).startswith(
            ("lifeline", "gateway/lifeline"))

    def backend_raw(self) -> dict[str, Any]:
        """The engine-side timings: a gateway's nest its backend's."""
        if "routing_ms" in self.raw:
            return self.raw.get("backend") or {}
        return self.raw

    def server_ttft_ms(self) -> float | None:
        s = self.stages or {}
        if s.get("server_ttft_ms") is not None:
            return s["server_ttft_ms"]
        parts = [s.get(k) for k in ("front_ms", "queue_ms", "prefill_ms")]
        known = [p for p in parts if p is not None]
        return sum(known) if known else None

    def decode_window_ms(self) -> float | None:
        """The server's first token to its last: what its engine spent on the output."""
        raw = self.backend_raw()
        ttft, e2e, stream = raw.get("ttft_ms"), raw.get("e2e_ms"), raw.get("stream_ms")
        if self.lifeline and None not in (ttft, e2e, stream):
            return e2e - ttft - stream
        decode = (self.stages or {}).get("decode_ms")
        if decode is None:
            return None
        return decode + (raw.get("detokenize_ms") or 0.0) if self.lifeline else decode
