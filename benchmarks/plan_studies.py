"""The questions docs/plan.md answers with the planner, each a set of `lifeline plan` runs:

1. dense vs MoE on one H100: Qwen3-30B-A3B against Qwen3-32B (fp8 weights) across users;
2. long context: TTFT and TPOT of Llama-3.1-8B (all global layers) and Gemma 3 27B (5 of 6
   layers slide over 1,024 tokens) from 1k to 128k tokens of prompt, and how many such
   requests their KV cache holds;
3. one model across the catalog: Llama-3.1-8B's Concurrent Users @ SLO per GPU, per dollar
   and $ per million output tokens on every GPU, with the shipped conversation trace.

    python benchmarks/plan_studies.py [--json out.json] [--svg-dir docs/img] [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import html
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from lifeline.bench.html import line_chart
from lifeline.bench.run import BenchSettings
from lifeline.bench.search import find_max_users
from lifeline.model.presets import preset_config
from lifeline.plan.cost import CostModel
from lifeline.plan.engines import ENGINES
from lifeline.plan.hardware import CATALOG, get_hardware
from lifeline.plan.run import run_plan
from lifeline.plan.sim import Deployment

SLO = "ttft=2s,tpot=50ms"


def deployment(model: str, hw: str, weights: str = "bf16", kv: str = "bf16",
               tp: int = 1, **kw: Any) -> Deployment:
    engine = ENGINES["lifeline"]
    cost = CostModel(preset_config(model), get_hardware(hw), tp=tp, weights=weights,
                     kv_dtype=kv, step_overhead_s=engine.step_overhead_s,
                     seq_overhead_s=engine.seq_overhead_s)
    return Deployment(cost, max_num_seqs=engine.max_num_seqs,
                      max_num_batched_tokens=engine.max_num_batched_tokens, **kw)


def settings(model: str, hw: str, **kw: Any) -> BenchSettings:
    return BenchSettings(url=f"plan://{hw}", model=model, **kw)


def dense_vs_moe(progress: Progress, quick: bool) -> dict[str, Any]:
    users = [1, 4, 16, 64] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    out: dict[str, Any] = {"users": users, "models": {}}
    task = progress.add_task("dense vs MoE", total=2 * len(users))
    for model in ("qwen3-30b-a3b", "qwen3-32b"):
        d = deployment(model, "h100-sxm", "fp8", "fp8")
        rows = []
        for n in users:
            r = run_plan(settings(model, "h100-sxm", concurrency=n, requests=max(16, 4 * n),
                                  input_tokens=1024, output_tokens=256, warmup=0), d)
            s = r["summary"]
            rows.append({"users": n, "ttft_p50_ms": s["ttft_ms"]["p50"],
                         "tpot_p50_ms": s["tpot_ms"]["p50"],
                         "output_tok_s": s["output_throughput_tok_s"],
                         "decode_bound": r["plan"]["bounds"].get("decode"),
                         "kv_requests": r["plan"]["memory"]["concurrency_kv_holds"]})
            progress.advance(task)
        out["models"][model] = rows
    return out


def long_context(progress: Progress, quick: bool) -> dict[str, Any]:
    lengths = [1024, 8192, 32768] if quick else [1024, 4096, 16384, 32768, 65536, 126976]
    out: dict[str, Any] = {"lengths": lengths, "models": {}}
    task = progress.add_task("long context", total=2 * len(lengths))
    for model in ("llama-3.1-8b", "gemma-3-27b"):
        d = deployment(model, "h100-sxm", "fp8", "fp8")
        rows = []
        for n in lengths:
            r = run_plan(settings(model, "h100-sxm", concurrency=1, requests=2,
                                  input_tokens=n, output_tokens=64, warmup=0), d)
            s, plan = r["summary"], r["plan"]
            rows.append({"prompt_tokens": n, "ttft_ms": s["ttft_ms"]["p50"],
                         "tpot_ms": s["tpot_ms"]["p50"],
                         "kv_tokens": plan["memory"]["kv_tokens"],
                         "requests_kv_holds": plan["memory"]["concurrency_kv_holds"],
                         "prefill_bound": plan["bounds"].get("prefill")})
            progress.advance(task)
        out["models"][model] = rows
    return out


def catalog(progress: Progress, quick: bool) -> dict[str, Any]:
    ids = ["a100-80gb", "h100-sxm", "rtx-4090"] if quick else list(CATALOG)
    out: dict[str, Any] = {"slo": SLO, "workload": "shipped conversation trace", "rows": []}
    task = progress.add_task("catalog Users @ SLO", total=len(ids))
    for hw_id in ids:
        hw = CATALOG[hw_id]
        d = deployment("llama-3.1-8b", hw_id)
        s = settings("llama-3.1-8b", hw_id, length_dist="conversation", requests=32,
                     warmup=0, slo=SLO)

        async def run(x: BenchSettings) -> dict[str, Any]:
            return run_plan(x, d)

        r = asyncio.run(find_max_users(s, 512 if not quick else 128, None, run))
        users = r["search"]["max_users"]
        tok_s = r["summary"]["output_throughput_tok_s"] or 0.0
        out["rows"].append({
            "hardware": hw_id, "name": hw.name, "price_per_hour": hw.price_per_hour,
            "users_at_slo": users, "users_per_dollar_hour": users / hw.price_per_hour,
            "output_tok_s": tok_s,
            "dollars_per_million_output_tokens": (hw.price_per_hour / (tok_s * 3600) * 1e6
                                                  if tok_s else None),
            "kv_tokens": r["plan"]["memory"]["kv_tokens"],
            "admission_bound": r["plan"]["bounds"]["admission"],
            "trials": len(r["search"]["trials"])})
        progress.advance(task)
    return out


def bar_chart(title: str, rows: list[tuple[str, float]], ylabel: str) -> str:
    """A standalone SVG of one bar per (label, value)."""
    w, h, pad = 640, 280, 56
    top = max((v for _, v in rows), default=1.0) or 1.0
    width = (w - pad - 10) / max(len(rows), 1)
    parts = [f'<line x1="{pad}" y1="{h - pad}" x2="{w - 10}" y2="{h - pad}" stroke="#333"/>',
             f'<text x="{w / 2}" y="16" text-anchor="middle">{html.escape(title)}</text>',
             (f'<text x="12" y="{h / 2}" transform="rotate(-90 12 {h / 2})" '
              f'text-anchor="middle">{html.escape(ylabel)}</text>')]
    for i, (label, v) in enumerate(rows):
        bh = (h - pad - 30) * v / top
        x = pad + i * width
        parts.append(f'<rect x="{x + 4:.1f}" y="{h - pad - bh:.1f}" width="{width - 8:.1f}" '
                     f'height="{bh:.1f}" fill="#1f77b4"/>')
        parts.append(f'<text x="{x + width / 2:.1f}" y="{h - pad - bh - 4:.1f}" '
                     f'text-anchor="middle">{v:,.3g}</text>')
        parts.append(f'<text x="{x + width / 2:.1f}" y="{h - pad + 14}" text-anchor="middle" '
                     f'font-size="10">{html.escape(label)}</text>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" style="background:#fff" width="{w}" '
            f'height="{h}" font-size="11" font-family="sans-serif">{"".join(parts)}</svg>\n')


def _svg(figure: str, title: str) -> str:
    svg = re.search(r"<svg.*</svg>", figure, re.DOTALL)[0]
    svg = svg.replace("<svg ", '<svg style="background:#fff" ', 1)
    return svg.replace(">", f'><text x="320" y="12" text-anchor="middle">'
                       f"{html.escape(title)}</text>", 1) + "\n"


def write_svgs(results: dict[str, Any], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    dvm = results["dense_vs_moe"]["models"]
    for key, label, file in (("tpot_p50_ms", "TPOT p50 ms", "plan_dense_vs_moe_tpot.svg"),
                             ("output_tok_s", "output tok/s", "plan_dense_vs_moe_tput.svg")):
        series = {m: [(r["users"], r[key]) for r in rows] for m, rows in dvm.items()}
        (folder / file).write_text(_svg(line_chart("", series, "concurrent users", label),
                                        f"H100 SXM, fp8: {label} against users"))
    lc = results["long_context"]["models"]
    for key, label, file in (("ttft_ms", "TTFT ms", "plan_long_context_ttft.svg"),
                             ("tpot_ms", "TPOT ms", "plan_long_context_tpot.svg")):
        series = {m: [(r["prompt_tokens"] / 1024, r[key]) for r in rows] for m, rows in lc.items()}
        (folder / file).write_text(_svg(line_chart("", series, "prompt (k tokens)", label),
                                        f"H100 SXM, fp8, one user: {label} against context"))
    rows = results["catalog"]["rows"]
    (folder / "plan_catalog_users.svg").write_text(bar_chart(
        f"Llama-3.1-8B bf16: Concurrent Users @ {SLO} per GPU",
        [(r["hardware"], r["users_at_slo"]) for r in rows], "users"))
    (folder / "plan_catalog_cost.svg").write_text(bar_chart(
        "Llama-3.1-8B bf16 at its Users @ SLO: $ per million output tokens",
        [(r["hardware"], r["dollars_per_million_output_tokens"] or 0) for r in rows], "$/Mtok"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--svg-dir", default=None)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    console = Console()
    t0 = time.perf_counter()
    with Progress(console=console) as progress:
        results = {"dense_vs_moe": dense_vs_moe(progress, args.quick),
                   "long_context": long_context(progress, args.quick),
                   "catalog": catalog(progress, args.quick)}
    results["wall_s"] = time.perf_counter() - t0
    for model, rows in results["dense_vs_moe"]["models"].items():
        t = Table("users", "TTFT p50 ms", "TPOT p50 ms", "output tok/s", "decode bound",
                  title=f"{model} on H100 SXM (fp8)")
        for r in rows:
            t.add_row(str(r["users"]), f"{r['ttft_p50_ms']:,.1f}", f"{r['tpot_p50_ms']:,.2f}",
                      f"{r['output_tok_s']:,.0f}", str(r["decode_bound"]))
        console.print(t)
    for model, rows in results["long_context"]["models"].items():
        t = Table("prompt", "TTFT ms", "TPOT ms", "requests the KV holds",
                  title=f"{model} on H100 SXM (fp8), one user")
        for r in rows:
            t.add_row(f"{r['prompt_tokens']:,}", f"{r['ttft_ms']:,.1f}", f"{r['tpot_ms']:,.2f}",
                      f"{r['requests_kv_holds']:,.1f}")
        console.print(t)
    t = Table("GPU", "$/h", "Users @ SLO", "users per $/h", "output tok/s", "$ per M tok",
              "admission bound", title=f"Llama-3.1-8B bf16, conversation trace, SLO {SLO}")
    for r in results["catalog"]["rows"]:
        t.add_row(r["hardware"], f"{r['price_per_hour']:.2f}", str(r["users_at_slo"]),
                  f"{r['users_per_dollar_hour']:,.1f}", f"{r['output_tok_s']:,.0f}",
                  f"{r['dollars_per_million_output_tokens'] or 0:,.3f}", r["admission_bound"])
    console.print(t)
    console.print(f"all studies simulated in {results['wall_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.svg_dir:
        write_svgs(results, Path(args.svg_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
