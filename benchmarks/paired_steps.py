"""Decode steps of an earlier commit against this tree's, paired: which is faster, in process.

    .venv/bin/python benchmarks/paired_steps.py MODEL.gguf --base REV [--pairs 16]
                                                [--plan 1:40,16:20] [--weights gguf-int8]

The commit `REV` is checked out into a temporary git worktree (removed after). Two long-lived
processes, one per tree, each build `LLM(MODEL, weights=W, compile=True, num_threads=2,
kv_cache_dtype="fp16")` (its C++ operators built from its own sources) and then run bursts on
command: for each `USERS:STEPS` of `--plan`, USERS requests of distinct 128-token prompts,
greedy with `ignore_eos`, and the median of STEPS pure decode steps (the last 5 left out). The
two take turns burst by burst, the first of each pair alternating, so that the machine's drift
falls on both alike; each pair gives a ratio (base ÷ this tree: > 1 means this tree is faster),
reported as the median and quartiles of the pairs. No peer runs here: the ratios against
llama.cpp are `benchmarks/vs_llamacpp.py`'s."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
from lifeline.engine.sampling_params import SamplingParams
from lifeline.llm import LLM
llm = LLM(sys.argv[2], weights=sys.argv[3], compile=True, num_threads=2, max_num_seqs=16,
          max_model_len=4096, kv_cache_dtype="fp16")
engine, count = llm.engine, 0

def burst(users, steps):
    global count
    params = SamplingParams(max_tokens=steps + 12, temperature=0, ignore_eos=True)
    for _ in range(users):
        count += 1
        engine.add_request([1000 + (count * 13 + i) % 20000 for i in range(128)], params,
                           f"r{count}")
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[-steps - 5:-5]) * 1e3

burst(16, 20), burst(1, 20)  # compile (or load) every graph before the first timed burst
print("ready", flush=True)
for line in sys.stdin:
    print(json.dumps(burst(*map(int, line.split()))), flush=True)
"""


def main() -> None:
    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--base", required=True, help="the commit to compare this tree against")
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--plan", default="1:40,16:20", help="USERS:STEPS bursts, comma-separated")
    p.add_argument("--weights", default="gguf-int8")
    args = p.parse_args()
    plan = [tuple(int(v) for v in item.split(":")) for item in args.plan.split(",")]
    console = Console()
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    with tempfile.TemporaryDirectory(prefix="lifeline-base-") as tmp:
        base = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base),
                        args.base], check=True)
        try:
            trees = {"base": base, "this": ROOT}
            procs = {name: subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(root), args.model, args.weights],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                for name, root in trees.items()}
            console.print("building both engines (each compiles or loads its graphs) …")
            for proc in procs.values():
                while (line := proc.stdout.readline()) and line.strip() != "ready":
                    pass
                if not line:
                    raise SystemExit("an engine failed to start")
            results = {(name, users): [] for name in procs for users, _ in plan}
            for i in track(range(args.pairs), description="pairs", console=console):
                for users, steps in plan:
                    for name in (("base", "this") if i % 2 == 0 else ("this", "base")):
                        procs[name].stdin.write(f"{users} {steps}\n")
                        procs[name].stdin.flush()
                        results[(name, users)].append(json.loads(procs[name].stdout.readline()))
            for proc in procs.values():
                proc.stdin.close()
                proc.wait()
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                           check=False)
    table = Table(title=f"decode step, ms (median of each burst; {args.pairs} pairs)")
    for column in ("users", f"base {args.base}", "this tree", "base ÷ this (median)",
                   "quartiles"):
        table.add_column(column, justify="right")
    summary = {}
    for users, _ in plan:
        ratios = [b / t for b, t in zip(results[("base", users)], results[("this", users)])]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        summary[users] = {"base_ms": statistics.median(results[("base", users)]),
                          "this_ms": statistics.median(results[("this", users)]),
                          "ratio": statistics.median(ratios), "quartiles": [q[0], q[2]]}
        s = summary[users]
        table.add_row(str(users), f"{s['base_ms']:.2f}", f"{s['this_ms']:.2f}",
                      f"{s['ratio']:.3f}×", f"{q[0]:.3f}–{q[2]:.3f}")
    console.print(table)
    print(json.dumps({"model": args.model, "base": args.base, "weights": args.weights,
                      "results": summary}))


if __name__ == "__main__":
    main()
