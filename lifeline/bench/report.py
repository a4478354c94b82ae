"""What a person reads: a live progress bar while the run goes, then a summary table, the TTFT
stages, the diagnosis (for TTFT and for TPOT the causes, ranked, with evidence and fixes) and
its verdict (`lifeline.bench.verdict`: each section's first cause, in one line)."""
from __future__ import annotations

from typing import Any, Self

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lifeline.bench.load import Sent

LATENCIES = (("TTFT", "ttft_ms"), ("TTFAT", "ttfat_ms"), ("TBT", "tbt_ms"), ("ITL", "itl_ms"),
             ("TPOT", "tpot_ms"), ("E2E", "e2e_ms"))
STATS = ("mean", "p50", "p90", "p95", "p99")


class LiveProgress:
    """`with LiveProgress(console, total) as p: run(on_done=p.update)`."""

    def __init__(self, console: Console, total: int | None, disable: bool = False):
        self.progress = Progress(TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                                 console=console, transient=False,
                                 disable=disable)
        self.task = self.progress.add_task("bench", total=total, status="")
        self.ok = self.failed = self.tokens = 0

    def update(self, sent: Sent) -> None:
        if sent.trace.error is None:
            self.ok += 1
            self.tokens += sent.trace.output_tokens or 0
        else:
            self.failed += 1
        self.progress.update(self.task, advance=1,
                             status=f"ok {self.ok}  failed {self.failed}  {self.tokens} tok")

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()


def _fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def summary_table(results: dict[str, Any]) -> Table:
    s = results["summary"]
    title = f"lifeline bench · {results['settings']['model']}"
    table = Table("metric (ms)", *STATS, "n", title=title)
    for label, key in LATENCIES:
        d = s[key]
        if d["count"]:
            table.add_row(label, *(_fmt(d[k]) for k in STATS), str(d["count"]))
    for label, key in (("client network", "client_network_ms"), ("front", "front_ms"),
                       ("queue", "queue_ms"), ("prefill", "prefill_ms")):
        d = (s.get("ttft_stages") or {}).get(key)
        if d:
            table.add_row(f"  TTFT: {label} ({d['share']:.0%})", *(_fmt(d[k]) for k in STATS),
                          str(d["count"]))
    return table


def totals_table(results: dict[str, Any]) -> Table:
    s = results["summary"]
    table = Table("totals", "value", show_header=False)
    rows = [("requests ok / failed", f"{s['successful']} / {s['failed']}"),
            ("errors", ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"),
            ("duration s", _fmt(s["duration_s"], 2)),
            ("prompt / output tokens", f"{s['prompt_tokens']:,} / {s['output_tokens']:,}"),
            ("output throughput tok/s", _fmt(s["output_throughput_tok_s"])),
            ("total throughput tok/s", _fmt(s["total_throughput_tok_s"])),
            ("request throughput req/s", _fmt(s["request_throughput_rps"], 2))]
    if s["slo"]:
        slo = s["slo"]
        verdict = "[green]met[/]" if slo["met"] else "[red]not met[/]"
        rows += [("goodput req/s", _fmt(s["goodput_rps"], 2)),
                 ("SLO attainment", (f"{slo['attainment']:.0%} of "
                                     f"{slo['attainment_required']:.0%} required: {verdict}"))]
    for row in rows:
        table.add_row(*row)
    return table


def print_trial(console: Console, row: dict[str, Any]) -> None:
    load = (f"{row['rate']:>8.2f} req/s" if "rate" in row else f"{row['concurrency']:>5} users")
    verdict = ""
    if row["met"] is not None:
        verdict = "[green]met[/]" if row["met"] else "[red]not met[/]"
        verdict = f"SLO {verdict} by {row['attainment']:.0%}  "
    console.print(f"{load}: {verdict}"
                  f"TTFT p90 {_fmt(row['ttft_p90_ms'])} ms  TPOT p90 {_fmt(row['tpot_p90_ms'])} ms"
                  f"  {_fmt(row['output_throughput_tok_s'])} tok/s")


def cost_table(c: dict[str, Any]) -> Table:
    table = Table("cost", "value", show_header=False)
    table.add_row("users per GPU", _fmt(c["users_per_gpu"], 2))
    table.add_row("GPUs per user", _fmt(c["gpus_per_user"], 4))
    if c.get("users_per_dollar_hour") is not None:
        table.add_row("users per $/hour", _fmt(c["users_per_dollar_hour"], 2))
    table.add_row("output tokens per $", _fmt(c["output_tokens_per_dollar"], 0))
    table.add_row("$ per million output tokens", _fmt(c["dollars_per_million_output_tokens"], 3))
    return table


def print_report(console: Console, results: dict[str, Any]) -> None:
    console.print(summary_table(results))
    console.print(totals_table(results))
    search = results.get("search")
    if search:
        answer = (f"Max rate @ SLO: {search['max_rate_rps']:.2f} req/s"
                  if search["metric"] == "rate" else
                  f"Concurrent Users @ SLO: {search['max_users']}")
        console.print(f"[bold]{answer}[/] ({len(search['trials'])} trials, "
                      f"limit {search['limit']:g})")
    if results["summary"].get("cost"):
        console.print(cost_table(results["summary"]["cost"]))
    diagnoses = results["summary"].get("diagnoses")
    if diagnoses:
        for table in diagnosis_tables(diagnoses):
            console.print(table)
        for f in diagnoses.get("failures") or ():
            console.print(f"[red]{f['count']} failed[/] ({f['kind']}): {escape(f['message'])}"
                          f"\n  fix: {escape(f['fix'])}")
        for line in diagnoses.get("missing") or ():
            console.print(f"[dim]not diagnosed: {escape(line)}[/]")
    if results["summary"].get("diagnosis"):
        console.print(f"[bold]verdict:[/] {escape(results['summary']['diagnosis'])}")


SECTIONS = (("ttft", "Why TTFT", "ms_p50", "TTFT p50"),
            ("answer", "Why TTFAT (time to the first answer token)", "ttfat_ms_p50", "TTFAT p50"),
            ("output", "Why TPOT", "tpot_ms_p50", "TPOT p50"))


def diagnosis_tables(diagnoses: dict[str, Any]) -> list[Table]:
    """One table per section: each finding's share, its number, what shows it, the fix."""
    tables = []
    for key, heading, p50_key, p50_label in SECTIONS:
        section = diagnoses.get(key)
        if not section or not section.get("findings"):
            continue
        p50 = section.get(p50_key)
        title = f"{heading} · {p50_label} {_fmt(p50)} ms" if p50 is not None else heading
        table = Table("share", "cause", "finding", title=title, title_justify="left",
                      show_lines=True)
        for f in section["findings"]:
            detail = f"[bold]{escape(f['title'])}[/]"
            if f.get("evidence"):
                detail += f"\n{escape(f['evidence'])}"
            if f.get("fix"):
                detail += f"\n[green]fix:[/] {escape(f['fix'])}"
            table.add_row(f"{f['share']:.0%}", f["cause"].replace("_", " "), detail)
        tables.append(table)
    return tables
