"""`lifeline serve`'s resident memory under traffic, the old KV default (a 2 GiB float32 budget)
against the new one (pools sized by need, fp16), on both real models, one server at a time.

    .venv/bin/python benchmarks/serve_memory.py [--json out.json] [--weights int8-all,gguf]
                                                [--models gemma,smollm2]

Each server runs with llama.cpp's `-np 16` and `-c` as `benchmarks/vs_llamacpp.py` passes them
(`--max-num-seqs 16 --max-model-len C`); `lifeline bench` runs the users16 then the single
workload of that script (`--quick` sizes) against it, and the server's VmRSS and VmHWM are read
from /proc after /ready and after each workload. Results: docs/performance.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import vs_llamacpp as v
from rich.console import Console
from rich.table import Table

from lifeline.model.default import default_model_path, smollm2_model_path

CONFIGS = (("2 GiB fp32 (the old default)",
            ["--kv-cache-memory-bytes", "2GiB", "--kv-cache-dtype", "fp32"]),
           ("by need, fp16 (the default)", []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--weights", help="compare these weight formats (comma-separated, KV "
                        "pools by default) instead of the two KV configurations")
    parser.add_argument("--models", default="gemma,smollm2")
    args = parser.parse_args()
    console = Console()
    runs = v._runs(True)
    rows = []
    configs = CONFIGS if not args.weights else tuple(
        (f"weights {w}", ["--weights", w]) for w in args.weights.split(","))
    models = {"gemma": (default_model_path(), 32768), "smollm2": (smollm2_model_path(), 8192)}
    for model, ctx in (models[m] for m in args.models.split(",")):
        for label, extra in configs:
            row = {"model": Path(model).name, "kv": label}
            console.print(f"{row['model']}: {label} …")
            started = time.monotonic()
            with v.lifeline_server(Path(model), None, extra, slots=16, ctx=ctx) as srv:
                row["ready_s"] = time.monotonic() - started
                row["after_ready"] = srv.resident_mib()
                for name in ("users16", "single"):
                    row[name] = v._figures(name, v.bench(srv, runs[name]["args"]))
                    row["after_" + name] = srv.resident_mib()
            rows.append(row)
    table = Table(title="lifeline serve: resident memory (MiB) under traffic")
    for col in ("model", "configuration", "ready s", "after /ready", "after 16 users", "after one user",
                "peak", "16 users tok/s", "one user tok/s"):
        table.add_column(col, justify="left" if col in ("model", "configuration") else "right")
    for r in rows:
        table.add_row(r["model"], r["kv"], f"{r['ready_s']:.1f}", f"{r['after_ready']['rss']:,.0f}",
                      f"{r['after_users16']['rss']:,.0f}", f"{r['after_single']['rss']:,.0f}",
                      f"{r['after_single']['peak']:,.0f}",
                      f"{r['users16']['output tok/s']:.1f}", f"{r['single']['decode tok/s']:.1f}")
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
