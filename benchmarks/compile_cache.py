"""Decode speed of the forward compiled ahead of time and loaded from the on-disk cache
(lifeline.model.compiled.CachedForward, the default) against `torch.compile` in process
(`LIFELINE_COMPILE_CACHE=0`), and eager: the cache must cost no speed.

Each run is a fresh process (`LLM(model, weights="int8-all", compile=...)`, 2 threads): one
user's 128 greedy tokens (best of 5 after one warm-up) and 16 users' 64 tokens each (one
batch); the kinds alternate, `--rounds` times, so a busy moment hits each alike. The cache
lives in a temporary directory, filled by the first cached run.

    python benchmarks/compile_cache.py [--model smollm2-135m-instruct] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import THREADS, machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"cached (aot)": {"compile": True, "cache": "1"},
         "in process": {"compile": True, "cache": "0"},
         "eager": {"compile": False, "cache": "1"}}

RUN = """
import json, sys, time
from lifeline import LLM, SamplingParams
llm = LLM(sys.argv[1], weights="int8-all", compile=sys.argv[2] == "1")
one = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
llm.generate(["Once upon a time"], one)
times = []
for _ in range(5):
    t = time.perf_counter(); llm.generate(["Once upon a time"], one); times.append(time.perf_counter() - t)
many = [SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)] * 16
t = time.perf_counter(); llm.generate([f"Story number {i}:" for i in range(16)], many)
batch = time.perf_counter() - t
print(json.dumps({"one": 128 / min(times), "sixteen": 16 * 64 / batch}))
"""


def run(model: str, kind: dict, cache: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "PYTHONPATH": str(ROOT),
           "LIFELINE_CACHE_DIR": str(cache), "LIFELINE_COMPILE_CACHE": kind["cache"]}
    done = subprocess.run([sys.executable, "-c", RUN, model, "1" if kind["compile"] else "0"],
                          env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    console = Console(width=120)
    console.print(f"machine: {machine()}")
    results: dict[str, list[dict]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory(prefix="lifeline-cc-") as tmp:
        for r in range(args.rounds):
            for name, kind in KINDS.items():
                with console.status(f"round {r + 1}: {name}"):
                    results[name].append(run(args.model, kind, Path(tmp)))
                console.print(f"round {r + 1} {name}: {results[name][-1]}")
    table = Table(title=f"{args.model}, int8-all: decode tok/s (median of {args.rounds} runs)")
    for col in ("forward", "one user", "16 users", "÷ in process (one, 16)"):
        table.add_column(col, justify="left" if col == "forward" else "right")
    base = {k: statistics.median(r[k] for r in results["in process"]) for k in ("one", "sixteen")}
    for name, runs in results.items():
        one = statistics.median(r["one"] for r in runs)
        sixteen = statistics.median(r["sixteen"] for r in runs)
        table.add_row(name, f"{one:.1f}", f"{sixteen:.1f}",
                      f"{one / base['one']:.2f}, {sixteen / base['sixteen']:.2f}")
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
