"""`--html`: one self-contained page (inline SVG, no scripts, no network) with the summary,
the diagnosis (each section's causes, ranked), latency and throughput against load (for a
search or sweep, the SLO knee marked), a stacked TTFT breakdown and a waterfall of sample
requests."""
from __future__ import annotations

import html
from typing import Any

W, H, PAD = 640, 260, 48
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd")
STAGE_COLOURS = {"client_network": "#8c8c8c", "front": "#9467bd", "queue": "#d62728",
                 "prefill": "#1f77b4"}
SAMPLES = 40


def _scale(lo: float, hi: float, a: float, b: float):
    span = (hi - lo) or 1.0
    return lambda v: a + (v - lo) / span * (b - a)


def _axes(xlabel: str, ylabel: str, xmax: float, ymax: float) -> list[str]:
    out = [f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - 10}" y2="{H - PAD}" stroke="#333"/>',
           f'<line x1="{PAD}" y1="10" x2="{PAD}" y2="{H - PAD}" stroke="#333"/>',
           f'<text x="{W / 2}" y="{H - 8}" text-anchor="middle">{html.escape(xlabel)}</text>',
           (f'<text x="12" y="{H / 2}" transform="rotate(-90 12 {H / 2})" '
           f'text-anchor="middle">{html.escape(ylabel)}</text>'),
           f'<text x="{W - 10}" y="{H - PAD + 14}" text-anchor="end">{xmax:,.4g}</text>',
           f'<text x="{PAD - 4}" y="16" text-anchor="end">{ymax:,.4g}</text>']
    return out


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], xlabel: str,
               ylabel: str, knee: float | None = None) -> str:
    """Lines through (x, y) points per series; a dashed vertical line at `knee`."""
    points = [p for pts in series.values() for p in pts if p[1] is not None]
    if not points:
        return ""
    xmax = max(x for x, _ in points)
    ymax = max(y for _, y in points) or 1.0
    sx, sy = _scale(0, xmax, PAD, W - 10), _scale(0, ymax, H - PAD, 10)
    parts = _axes(xlabel, ylabel, xmax, ymax)
    for i, (name, pts) in enumerate(series.items()):
        pts = [(x, y) for x, y in pts if y is not None]
        colour = COLOURS[i % len(COLOURS)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" '
                     f'stroke-width="2"/>')
        parts += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}"/>'
                  for x, y in pts]
        parts.append(f'<text x="{W - 14}" y="{24 + 14 * i}" text-anchor="end" '
                     f'fill="{colour}">{html.escape(name)}</text>')
    if knee:
        parts.append(f'<line x1="{sx(knee):.1f}" y1="10" x2="{sx(knee):.1f}" y2="{H - PAD}" '
                     f'stroke="#000" stroke-dasharray="4 3"/>')
        parts.append(f'<text x="{sx(knee) + 4:.1f}" y="22">SLO knee {knee:g}</text>')
    return _figure(title, parts)


def stacked_ttft(records: list[dict[str, Any]]) -> str:
    """One bar per sampled request (by TTFT), split into its TTFT stages."""
    splits = sorted((r["ttft_split_ms"] for r in records if r.get("ttft_split_ms")),
                    key=lambda s: sum(v for v in s.values() if v is not None))
    if not splits:
        return ""
    step = max(1, len(splits) // SAMPLES)
    splits = splits[::step][:SAMPLES]
    ymax = max(sum(max(v or 0.0, 0.0) for v in s.values()) for s in splits) or 1.0
    sy = _scale(0, ymax, 0, H - PAD - 10)
    width = (W - PAD - 10) / len(splits)
    parts = _axes("requests, by TTFT", "TTFT ms", len(splits), ymax)
    for i, split in enumerate(splits):
        base = H - PAD
        for stage, colour in STAGE_COLOURS.items():
            h = sy(max(split.get(stage) or 0.0, 0.0))
            base -= h
            parts.append(f'<rect x="{PAD + i * width:.1f}" y="{base:.1f}" '
                         f'width="{max(width - 1, 1):.1f}" height="{h:.1f}" fill="{colour}">'
                         f'<title>{stage}: {split.get(stage) or 0:.1f} ms</title></rect>')
    parts += [f'<text x="{W - 14}" y="{24 + 14 * i}" text-anchor="end" fill="{c}">{s}</text>'
              for i, (s, c) in enumerate(STAGE_COLOURS.items())]
    return _figure("TTFT breakdown (client and network, front, queue, prefill)", parts)


def waterfall(records: list[dict[str, Any]]) -> str:
    """Sampled requests on a time line: where a server reported its stages, each request's
    client and network, front, queue and prefill (with its chunk count), then decode;
    otherwise grey until the first token, then streaming."""
    rows = [r for r in records if r.get("e2e_ms") is not None][:SAMPLES]
    if not rows:
        return ""
    end = max(r["sent_s"] * 1e3 + r["e2e_ms"] for r in rows)
    sx = _scale(0, end, PAD, W - 10)
    height = (H - PAD - 10) / len(rows)
    parts = _axes("ms since the window opened", "request", end, len(rows))

    def bar(y: float, a: float, b: float, colour: str, title: str) -> None:
        parts.append(f'<rect x="{sx(a):.1f}" y="{y:.1f}" width="{max(sx(b) - sx(a), 0):.1f}"'
                     f' height="{max(height - 1, 1):.1f}" fill="{colour}">'
                     f'<title>{html.escape(title)}: {b - a:.1f} ms</title></rect>')

    for i, r in enumerate(rows):
        y, start = 10 + i * height, r["sent_s"] * 1e3
        first = start + (r["ttft_ms"] or r["e2e_ms"])
        split = r.get("ttft_split_ms")
        if split:
            at = start
            chunks = (r.get("server_timings") or {}).get("prefill_chunks")
            for stage, colour in STAGE_COLOURS.items():
                length = max(split.get(stage) or 0.0, 0.0)
                label = f"{stage} ({chunks} chunks)" if stage == "prefill" and chunks else stage
                bar(y, at, at + length, colour, label)
                at += length
        else:
            bar(y, start, first, "#bbbbbb", "until the first token")
        bar(y, first, start + r["e2e_ms"], "#2ca02c" if r["ok"] else "#d62728", "decode")
    parts += [f'<text x="{W - 14}" y="{24 + 14 * i}" text-anchor="end" fill="{c}">{s}</text>'
              for i, (s, c) in enumerate({**STAGE_COLOURS, "decode": "#2ca02c"}.items())]
    return _figure("Waterfall: client and network, front, queue, prefill, then decode "
                   "(grey until the first token where the server reports no stages)", parts)


def _figure(title: str, parts: list[str]) -> str:
    return (f"<figure><figcaption>{html.escape(title)}</figcaption>"
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
            f'font-size="11" font-family="sans-serif">{"".join(parts)}</svg></figure>')


def load_charts(results: dict[str, Any]) -> list[str]:
    """Latency p90 and throughput against load, for a search or a sweep."""
    block = results.get("search") or results.get("sweep")
    if not block:
        return []
    key = "rate" if block["metric"] == "rate" else "concurrency"
    rows = sorted(block["trials"], key=lambda t: t[key])
    knee = block.get("max_rate_rps") or block.get("max_users")
    if knee is None and any(t["met"] is False for t in rows):
        knee = max((t[key] for t in rows if t["met"]), default=None)
    label = "requests per second" if key == "rate" else "concurrent users"
    latency = {name: [(t[key], t[f"{name}_p90_ms"]) for t in rows]
               for name in ("ttft", "tpot", "e2e")}
    return [line_chart("Latency p90 against load", latency, label, "ms", knee),
            line_chart("Output throughput against load",
                       {"output tok/s": [(t[key], t["output_throughput_tok_s"]) for t in rows]},
                       label, "tok/s", knee)]


def summary_rows(summary: dict[str, Any]) -> str:
    rows = []
    for key in ("ttft_ms", "ttfat_ms", "tbt_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        d = summary[key]
        cells = "".join(f"<td>{'—' if d[k] is None else f'{d[k]:,.1f}'}</td>"
                        for k in ("mean", "p50", "p90", "p95", "p99"))
        rows.append(f"<tr><th>{key[:-3].upper()}</th>{cells}<td>{d['count']}</td></tr>")
    return ("<table><tr><th>ms</th><th>mean</th><th>p50</th><th>p90</th><th>p95</th>"
            f"<th>p99</th><th>n</th></tr>{''.join(rows)}</table>")


CAUSE_COLOURS = {"client_network": "#8c8c8c", "front": "#9467bd", "queue": "#d62728",
                 "prompt_assembly": "#e377c2", "tokenizer": "#bcbd22", "prefill": "#1f77b4",
                 "prefill_interference": "#17becf", "reasoning": "#ff7f0e", "decode": "#2ca02c",
                 "batch": "#8c564b", "kv_context": "#7f7f7f", "engine_vs_model": "#000000"}
SECTION_NAMES = (("ttft", "Why TTFT"), ("answer", "Why TTFAT (the first answer token)"),
                 ("output", "Why TPOT"))


def diagnosis_section(diagnoses: dict[str, Any] | None) -> str:
    """The causes of each section as one stacked bar (their shares) and a table: share, cause,
    the finding, its evidence and fix; then what could not be diagnosed."""
    if not diagnoses:
        return ""
    out = ["<section><h2>Diagnosis</h2>"]
    for key, name in SECTION_NAMES:
        findings = (diagnoses.get(key) or {}).get("findings") or []
        if not findings:
            continue
        out.append(f"<h3>{html.escape(name)}</h3>{_share_bar(findings)}"
                   "<table class='diag'><tr><th>share</th><th>cause</th><th>finding</th></tr>")
        for f in findings:
            out.append(f"<tr><td>{f['share']:.0%}</td><td>{html.escape(f['cause'])}</td>"
                       f"<td style='text-align:left'><b>{html.escape(f['title'])}</b><br>"
                       f"{html.escape(f.get('evidence') or '')}<br><i>fix:</i> "
                       f"{html.escape(f.get('fix') or '')}</td></tr>")
        out.append("</table>")
    failures = diagnoses.get("failures") or []
    if failures:
        out.append("<h3>Failures</h3><ul>" + "".join(
            f"<li><b>{f['count']} ({html.escape(f['kind'])})</b>: "
            f"{html.escape(f['message'])}<br><i>fix:</i> {html.escape(f['fix'])}</li>"
            for f in failures) + "</ul>")
    missing = diagnoses.get("missing") or []
    if missing:
        out.append("<h3>Not diagnosed</h3><ul>"
                   + "".join(f"<li>{html.escape(m)}</li>" for m in missing) + "</ul>")
    return "".join(out) + "</section>"


def _share_bar(findings: list[dict[str, Any]]) -> str:
    width, x, parts = W - 20, 10.0, []
    for f in findings:
        w = max(f["share"], 0.0) * width
        colour = CAUSE_COLOURS.get(f["cause"], "#cccccc")
        parts.append(f'<rect x="{x:.1f}" y="4" width="{w:.1f}" height="20" fill="{colour}">'
                     f'<title>{html.escape(f["cause"])}: {f["share"]:.0%}</title></rect>')
        if w > 60:
            parts.append(f'<text x="{x + 4:.1f}" y="18" fill="#fff">'
                         f'{html.escape(f["cause"])} {f["share"]:.0%}</text>')
        x += w
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="28" font-size="11" '
            f'font-family="sans-serif">{"".join(parts)}</svg>')


def server_state_chart(state: dict[str, Any] | None) -> str:
    """The server's own running and waiting requests through the run, as it reported them."""
    samples = [x for x in (state or {}).get("samples") or () if x.get("t", -1) >= 0]
    series = {key: [(x["t"], x[key]) for x in samples if x.get(key) is not None]
              for key in ("running", "waiting")}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return ""
    return line_chart(f"{state.get('engine')}'s own state (/metrics every "
                      f"{(state.get('interval_s') or 0) * 1e3:,.0f} ms)", series,
                      "seconds into the run", "requests")


def render(results: dict[str, Any]) -> str:
    s, settings = results["summary"], results["settings"]
    facts = [f"{s['successful']} ok, {s['failed']} failed in {s['duration_s']:.2f} s",
             (f"output {s['output_throughput_tok_s'] or 0:,.1f} tok/s, "
             f"{s['request_throughput_rps'] or 0:,.2f} req/s")]
    if s.get("diagnosis"):
        facts.append(f"verdict: {s['diagnosis']}")
    figures = [*load_charts(results), server_state_chart(results.get("server_state")),
               stacked_ttft(results["requests"]), waterfall(results["requests"])]
    title = html.escape(f"lifeline bench · {settings.get('model')} · {settings.get('url')}")
    return ("<!doctype html><html><head><meta charset='utf-8'>"
            f"<title>{title}</title><style>body{{font-family:sans-serif;margin:2em}}"
            "td,th{padding:2px 8px;text-align:right}figure{margin:1em 0}"
            "table.diag td{vertical-align:top;border-top:1px solid #ddd}</style></head><body>"
            f"<h1>{title}</h1><p>{'<br>'.join(html.escape(f) for f in facts)}</p>"
            f"{summary_rows(s)}{diagnosis_section(s.get('diagnoses'))}"
            f"{''.join(f for f in figures if f)}</body></html>")
