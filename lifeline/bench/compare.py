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


def attribute(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Where run b's TTFT and TPOT differ from run a's, cause by cause: each cause's mean ms in
    both, the difference, and its share of the whole difference (the causes' differences sum
    to it); the cause that moved most, as an `engine_vs_model` finding."""
    out: dict[str, Any] = {"a": a.get("_label"), "b": b.get("_label"),
                           "plan": [r.get("_label") for r in (a, b) if is_plan(r)]}
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
                        "finding": _finding(section, unit, a, b, delta, rows)}
    return out


def _finding(section: str, unit: str, a: dict[str, Any], b: dict[str, Any], delta: float,
             rows: list[dict[str, Any]]) -> dict[str, Any]:
    name = "TTFT" if section == "ttft" else "TPOT"
    top = rows[0]
    more = "more" if delta >= 0 else "less"
    title = (f"{b.get('_label')}'s {name} is {abs(delta):,.2f} {unit} {more} than "
             f"{a.get('_label')}'s; {top['share']:.0%} of the difference is "
             f"{top['cause'].replace('_', ' ')} ({top['delta_ms']:+,.2f} {unit})")
    evidence = "; ".join(f"{r['cause'].replace('_', ' ')} {r['delta_ms']:+,.2f}" for r in rows
                         if abs(r["delta_ms"]) >= 0.005)
    plans = [r.get("_label") for r in (a, b) if is_plan(r)]
    if plans:
        evidence += (f". {' and '.join(plans)} is a plan (the planner's prediction): the "
                     "difference is where the planner and the measured engine disagree")
    fix = ("the stage that moved names the part of the engine (or the model's cost) that "
           "differs: compare that stage's settings between the two servers")
    return {"cause": "engine_vs_model", "share": top["share"], "ms": top["delta_ms"],
            "title": title, "evidence": evidence + ".", "fix": fix,
            "numbers": {"delta_ms": delta, "top": top["cause"]}}


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
