"""`lifeline bench compare a.json b.json ...`: runs side by side, each against the first."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.table import Table

ROWS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    # label, path into the results, lower is better
    ("TTFT p50 ms", ("summary", "ttft_ms", "p50"), True),
    ("TTFT p90 ms", ("summary", "ttft_ms", "p90"), True),
    ("TTFT p99 ms", ("summary", "ttft_ms", "p99"), True),
    ("TTFAT p50 ms", ("summary", "ttfat_ms", "p50"), True),
    ("TBT p50 ms", ("summary", "tbt_ms", "p50"), True),
    ("TBT p99 ms", ("summary", "tbt_ms", "p99"), True),
    ("TPOT p50 ms", ("summary", "tpot_ms", "p50"), True),
    ("TPOT p90 ms", ("summary", "tpot_ms", "p90"), True),
    ("E2E p50 ms", ("summary", "e2e_ms", "p50"), True),
    ("E2E p90 ms", ("summary", "e2e_ms", "p90"), True),
    ("output tok/s", ("summary", "output_throughput_tok_s"), False),
    ("total tok/s", ("summary", "total_throughput_tok_s"), False),
    ("requests/s", ("summary", "request_throughput_rps"), False),
    ("goodput req/s", ("summary", "goodput_rps"), False),
    ("failed", ("summary", "failed"), True),
    ("Concurrent Users @ SLO", ("search", "max_users"), False),
    ("$ per M output tokens", ("summary", "cost", "dollars_per_million_output_tokens"), True),
)


def load(path: str | Path) -> dict[str, Any]:
    results = json.loads(Path(path).read_text())
    if not str(results.get("schema", "")).startswith("lifeline.bench/"):
        raise ValueError(f"{path} is not a lifeline bench result")
    results["_label"] = Path(path).stem
    return results


def value(results: dict[str, Any], path: tuple[str, ...]) -> float | None:
    node: Any = results
    for key in path:
        if not isinstance(node, dict) or node.get(key) is None:
            return None
        node = node[key]
    return node if isinstance(node, int | float) else None


def compare_table(runs: list[dict[str, Any]]) -> Table:
    """One column per run; after the first, each value with its ratio to the first, green when
    better and red when worse."""
    table = Table("metric", *(f"{r['_label']}\n{r['settings'].get('model')}"
                              f" ×{r['settings'].get('concurrency')}" for r in runs),
                  title="lifeline bench compare")
    for label, path, lower_better in ROWS:
        values = [value(r, path) for r in runs]
        if all(v is None for v in values):
            continue
        base = values[0]
        cells = [_cell(v, base, lower_better) if i else _cell(v, None, lower_better)
                 for i, v in enumerate(values)]
        table.add_row(label, *cells)
    return table


def _cell(v: float | None, base: float | None, lower_better: bool) -> str:
    if v is None:
        return "—"
    text = f"{v:,.2f}" if isinstance(v, float) else f"{v:,}"
    if not base:
        return text
    ratio = v / base
    better = ratio < 1 if lower_better else ratio > 1
    colour = "green" if better else "red" if ratio != 1 else "white"
    return f"{text} [{colour}]({ratio:.2f}×)[/]"


def section_ms(results: dict[str, Any], section: str) -> tuple[float | None, dict[str, float]]:
    """A run's mean TTFT (or TPOT) and its ms by cause, from its diagnoses (worked out again
    for results written before there were any)."""
    diagnoses = (results.get("summary") or {}).get("diagnoses")
    if diagnoses is None:
        from lifeline.bench.diagnose import diagnose

        diagnoses = diagnose(results)
    block = diagnoses.get(section) or {}
    mean = block.get("ms_mean" if section == "ttft" else "tpot_ms_mean")
    return mean, {f["cause"]: f["ms"] for f in block.get("findings") or ()}


def is_plan(results: dict[str, Any]) -> bool:
    return str((results.get("settings") or {}).get("url", "")).startswith("plan://")


def engine_of(results: dict[str, Any]) -> dict[str, Any]:
    """Which engine served a run and its configuration as it reported it: the engine its
    metrics named (or its timings' source), what its own endpoints said (`/props`,
    `/get_server_info`, vLLM's cache config), and what its state showed of the run (the most
    requests it ran at once, the most that waited, KV use, prefix-cache hits, preemptions)."""
    state = results.get("server_state") or {}
    summary = state.get("summary") or {}
    engine = state.get("engine")
    if engine is None:
        sources = [str((r.get("server_timings") or {}).get("source"))
                   for r in results.get("requests") or () if r.get("server_timings")]
        engine = sources[0].split("/")[-1] if sources else None
    if engine is None and is_plan(results):
        engine = "plan"
    settings = results.get("settings") or {}
    log_config = ((results.get("step_log") or {}).get("config")) or {}
    out = {"engine": engine or "unknown", "model": settings.get("model"),
           "concurrency": settings.get("concurrency"), "rate": settings.get("rate"),
           "reported": {**(state.get("config") or {}), **(state.get("server_info") or {}),
                        **{k: v for k, v in log_config.items() if not isinstance(v, dict)}}}
    for key in ("capacity", "running_max", "waiting_max", "kv_usage_max", "prefix_hit_rate",
                "preemptions", "queue_ms_mean", "prefill_ms_mean", "prefill_tok_s"):
        if summary.get(key) is not None:
            out[key] = summary[key]
    if out.get("capacity") is None and log_config.get("max_num_seqs"):
        out["capacity"] = log_config["max_num_seqs"]
    return out


def describe(engine: dict[str, Any]) -> str:
    """One line: the engine and the limits it ran under."""
    bits = []
    if engine.get("capacity"):
        unit = "slots" if engine["engine"] == "llama.cpp" else "sequences at once"
        bits.append(f"{engine['capacity']:,.0f} {unit}")
    if engine.get("running_max") is not None and engine.get("waiting_max") is not None:
        bits.append(f"ran up to {engine['running_max']:,.0f} with up to "
                    f"{engine['waiting_max']:,.0f} waiting")
    if engine.get("prefix_hit_rate") is not None:
        bits.append(f"prefix-cache hits {engine['prefix_hit_rate']:.0%}")
    if engine.get("preemptions"):
        bits.append(f"{engine['preemptions']:,.0f} preemptions")
    return engine["engine"] + (f" ({'; '.join(bits)})" if bits else "")


def attribute(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Where run b's TTFT and TPOT differ from run a's, cause by cause: each cause's mean ms in
    both, the difference, and its share of the whole difference (the causes' differences sum
    to it); the cause that moved most, as an `engine_vs_model` finding."""
    out: dict[str, Any] = {"a": a.get("_label"), "b": b.get("_label"),
                           "plan": [r.get("_label") for r in (a, b) if is_plan(r)],
                           "engines": [engine_of(a), engine_of(b)]}
    for section, unit in (("ttft", "ms"), ("output", "ms per token")):
        a_mean, a_ms = section_ms(a, section)
        b_mean, b_ms = section_ms(b, section)
        if not a_mean or not b_mean:
            continue
        delta = b_mean - a_mean
        rows = [{"cause": c, "a_ms": a_ms.get(c, 0.0), "b_ms": b_ms.get(c, 0.0),
                 "delta_ms": b_ms.get(c, 0.0) - a_ms.get(c, 0.0)}
                for c in dict.fromkeys([*a_ms, *b_ms])]
        for row in rows:
            row["share"] = row["delta_ms"] / delta if delta else 0.0
        rows.sort(key=lambda r: -r["delta_ms"] * (1 if delta >= 0 else -1))
        out[section] = {"a_ms": a_mean, "b_ms": b_mean, "delta_ms": delta, "rows": rows,
                        "finding": _finding(section, unit, a, b, delta, rows,
                                            out["engines"])}
    return out


def _finding(section: str, unit: str, a: dict[str, Any], b: dict[str, Any], delta: float,
             rows: list[dict[str, Any]], engines: list[dict[str, Any]]) -> dict[str, Any]:
    name = "TTFT" if section == "ttft" else "TPOT"
    top = rows[0]
    more = "more" if delta >= 0 else "less"
    title = (f"{b.get('_label')}'s {name} is {abs(delta):,.2f} {unit} {more} than "
             f"{a.get('_label')}'s; {top['share']:.0%} of the difference is "
             f"{top['cause'].replace('_', ' ')} ({top['delta_ms']:+,.2f} {unit})")
    why = _why(top["cause"], engines, (a, b), delta)
    if why:
        title += f": {why}"
    evidence = "; ".join(f"{r['cause'].replace('_', ' ')} {r['delta_ms']:+,.2f}" for r in rows
                         if abs(r["delta_ms"]) >= 0.005)
    evidence += ". " + " vs ".join(f"{r.get('_label')}: {describe(e)}"
                                   for r, e in zip((a, b), engines))
    plans = [r.get("_label") for r in (a, b) if is_plan(r)]
    if plans:
        evidence += (f". {' and '.join(plans)} is a plan (the planner's prediction): the "
                     "difference is where the planner and the measured engine disagree")
    fix = ("the stage that moved names the part of the engine (or the model's cost) that "
           "differs: compare that stage's settings between the two servers")
    return {"cause": "engine_vs_model", "share": top["share"], "ms": top["delta_ms"],
            "title": title, "evidence": evidence + ".", "fix": fix,
            "numbers": {"delta_ms": delta, "top": top["cause"]}}


def _why(cause: str, engines: list[dict[str, Any]], runs: tuple[dict[str, Any], ...],
         delta: float) -> str | None:
    """The cause that moved, in the two engines' own terms."""
    slow, fast = (engines[1], engines[0]) if delta >= 0 else (engines[0], engines[1])
    users = slow.get("concurrency") or fast.get("concurrency")
    if cause == "queue" and slow.get("capacity"):
        unit = ("slots" if slow["engine"] == "llama.cpp" else "sequences")
        text = (f"requests queued for one of {slow['engine']}'s {slow['capacity']:,.0f} {unit}")
        ran = fast.get("running_max") or fast.get("capacity")
        if ran is not None:
            text += (f"; {fast['engine']} ran up to {ran:,.0f}"
                     + (f" of {users}" if users else "") + " at once")
        return text
    if cause == "prefill":
        hits = [e.get("prefix_hit_rate") for e in (slow, fast)]
        if None not in hits and abs(hits[0] - hits[1]) >= 0.05:
            return (f"the prefix cache served {hits[1]:.0%} of {fast['engine']}'s prompt "
                    f"tokens and {hits[0]:.0%} of {slow['engine']}'s")
        speeds = [e.get("prefill_tok_s") for e in (slow, fast)]
        if None not in speeds:
            return (f"{slow['engine']} prefilled at {speeds[0]:,.0f} tokens/s, "
                    f"{fast['engine']} at {speeds[1]:,.0f}")
        return None
    if cause == "batch":
        rows = [e.get("running_max") for e in (slow, fast)]
        if None not in rows:
            return (f"{slow['engine']} ran up to {rows[0]:,.0f} requests a step, "
                    f"{fast['engine']} up to {rows[1]:,.0f}")
    if cause == "queue" and slow.get("preemptions"):
        return f"{slow['engine']} preempted {slow['preemptions']:,.0f} requests"
    return None


def compare_html(runs: list[dict[str, Any]], atts: list[dict[str, Any]]) -> str:
    """`bench compare --html`: the metrics side by side, and for each run after the first
    where it differs cause by cause, the finding, and each engine as it reported itself."""
    import html as h

    def cell(v: float | None) -> str:
        return "—" if v is None else (f"{v:,.2f}" if isinstance(v, float) else f"{v:,}")

    head = "".join(f"<th>{h.escape(str(r['_label']))}</th>" for r in runs)
    body = []
    for label, path, _ in ROWS:
        values = [value(r, path) for r in runs]
        if all(v is None for v in values):
            continue
        body.append(f"<tr><td>{h.escape(label)}</td>"
                    + "".join(f"<td>{cell(v)}</td>" for v in values) + "</tr>")
    parts = ["<!doctype html><meta charset='utf-8'><title>lifeline bench compare</title>",
             "<style>body{font:14px sans-serif;margin:2em;max-width:70em}table{border-collapse:"
             "collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:"
             "right}td:first-child{text-align:left}.bar{display:inline-block;height:10px;"
             "background:#d62728}.neg{background:#2ca02c}</style>",
             "<h1>lifeline bench compare</h1>",
             f"<table><tr><th>metric</th>{head}</tr>{''.join(body)}</table>"]
    for att in atts:
        parts.append(f"<h2>where {h.escape(str(att['b']))} differs from "
                     f"{h.escape(str(att['a']))}</h2>")
        for section, name in (("ttft", "TTFT"), ("output", "TPOT (per token)")):
            block = att.get(section)
            if not block:
                continue
            scale = max((abs(r["delta_ms"]) for r in block["rows"]), default=0) or 1.0
            rows = "".join(
                f"<tr><td>{h.escape(r['cause'].replace('_', ' '))}</td><td>{r['a_ms']:,.2f}</td>"
                f"<td>{r['b_ms']:,.2f}</td><td>{r['delta_ms']:+,.2f}</td>"
                f"<td>{r['share']:.0%}</td><td style='text-align:left'><span class='bar"
                f"{' neg' if r['delta_ms'] < 0 else ''}' style='width:"
                f"{abs(r['delta_ms']) / scale * 200:.0f}px'></span></td></tr>"
                for r in block["rows"])
            finding = block["finding"]
            parts.append(f"<h3>{name}: {block['a_ms']:,.2f} vs {block['b_ms']:,.2f} ms</h3>"
                         f"<p><b>{h.escape(finding['title'])}</b><br>"
                         f"{h.escape(finding['evidence'])}</p>"
                         f"<table><tr><th>cause</th><th>{h.escape(str(att['a']))} ms</th>"
                         f"<th>{h.escape(str(att['b']))} ms</th><th>difference</th>"
                         f"<th>share</th><th></th></tr>{rows}</table>")
        parts.append("<h3>the engines as they reported themselves</h3><table><tr><th>run</th>"
                     "<th>engine</th><th>configuration</th></tr>" + "".join(
                         f"<tr><td>{h.escape(str(label))}</td><td>{h.escape(describe(e))}</td>"
                         f"<td style='text-align:left'>{h.escape(_config_text(e))}</td></tr>"
                         for label, e in zip((att["a"], att["b"]), att["engines"]))
                     + "</table>")
    return "\n".join(parts)


def _config_text(engine: dict[str, Any]) -> str:
    reported = engine.get("reported") or {}
    return ", ".join(f"{k}={v}" for k, v in reported.items() if v is not None
                     and not isinstance(v, dict | list))[:2000]


def engines_table(att: dict[str, Any]) -> Table:
    table = Table("run", "engine", "configuration as reported", title="the engines",
                  title_justify="left")
    for label, engine in zip((att["a"], att["b"]), att["engines"]):
        table.add_row(str(label), describe(engine), _config_text(engine)[:300])
    return table


def attribution_table(att: dict[str, Any]) -> Table:
    table = Table("cause", f"{att['a']} ms", f"{att['b']} ms", "difference", "share",
                  title=f"where {att['b']} differs from {att['a']}", title_justify="left")
    for section, name in (("ttft", "TTFT"), ("output", "TPOT (per token)")):
        block = att.get(section)
        if not block:
            continue
        table.add_row(f"[bold]{name}[/]", f"{block['a_ms']:,.2f}", f"{block['b_ms']:,.2f}",
                      f"{block['delta_ms']:+,.2f}", "100%")
        for r in block["rows"]:
            table.add_row(f"  {r['cause'].replace('_', ' ')}", f"{r['a_ms']:,.2f}",
                          f"{r['b_ms']:,.2f}", f"{r['delta_ms']:+,.2f}", f"{r['share']:.0%}")
    return table
