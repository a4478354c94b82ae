"""The run's verdict in one line (`summary.diagnosis`): for each section of the diagnosis (TTFT,
TTFAT, TPOT), its first-ranked cause with its share, the finding's title and its fix. The
bench's table, its HTML report and the JSON all print this line, made from the same ranked
findings they list under it, so the headline never names another cause than the first."""
from __future__ import annotations

from typing import Any

SECTIONS = (("ttft", "TTFT", "ms_p50"), ("answer", "TTFAT", "ttfat_ms_p50"),
            ("output", "TPOT", "tpot_ms_p50"))
"""Each section's key in `summary.diagnoses`, its name and its p50's key, in the verdict's
order: what a user waits for first, first."""
DOMINANT = 0.5
"""A section is "mostly" its first cause from this share on; below it the verdict says no cause
dominates and names the largest."""
LABELS = {("ttft", "client_network"): "client and network",
          ("answer", "client_network"): "client and network",
          ("output", "client_network"): "stream delivery",
          ("output", "kv_context"): "KV context"}


def verdict(diagnoses: dict[str, Any] | None) -> str | None:
    """The verdict of `summary.diagnoses`; None when no section has a finding."""
    if not diagnoses:
        return None
    lines = [line for key, name, p50_key in SECTIONS
             if (line := _section_line(key, name, diagnoses.get(key), p50_key))]
    return " ".join(lines) or None


def _section_line(key: str, name: str, section: dict[str, Any] | None,
                  p50_key: str) -> str | None:
    findings = (section or {}).get("findings") or []
    if not findings:
        return None
    first = findings[0]
    p50 = section.get(p50_key)
    head = f"{name} (p50 {_ms(p50)})" if p50 is not None else name
    cause = f"{cause_label(key, first['cause'])} ({first['share']:.0%})"
    if first["share"] >= DOMINANT:
        line = f"{head} is mostly {cause}: {first['title']}"
    else:
        line = f"{head}: no cause dominates; the largest is {cause}: {first['title']}"
    return line + (f"; fix: {first['fix']}." if first.get("fix") else ".")


def cause_label(section: str, cause: str) -> str:
    return LABELS.get((section, cause), cause.replace("_", " "))


def _ms(value: float) -> str:
    return f"{value:,.2f} ms" if abs(value) < 10 else f"{value:,.0f} ms"
