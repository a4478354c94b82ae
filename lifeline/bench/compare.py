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
