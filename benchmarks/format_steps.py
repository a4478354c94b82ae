"""One user's and 16 users' decode step in each weight format, in process: where `gguf-int8`
(the command line's default) stands between `gguf` and `int8-all`.

    .venv/bin/python benchmarks/format_steps.py MODEL.gguf [--weights gguf,int8-all,gguf-int8]
                                                [--users 1,16] [--steps 40] [--rounds 2]

Each format runs in a subprocess of its own (`LLM(MODEL, weights=W, compile=True,
num_threads=2, kv_cache_dtype="fp16")`, 4,096 positions), the formats alternating round by
round; per user count the requests' 128-token prompts are distinct token ids, greedy with
`ignore_eos`, and every `engine.step()` is timed: the figure is the median of `--steps` pure
decode steps (the last 5 left out). No peer runs here: the ratios against llama.cpp are
`benchmarks/vs_llamacpp.py`'s."""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, statistics, sys, time
sys.path.insert(0, {root!r})
from lifeline.engine.sampling_params import SamplingParams
from lifeline.llm import LLM
llm = LLM({model!r}, weights={weights!r}, compile=True, num_threads=2, max_num_seqs=16,
          max_model_len=4096, kv_cache_dtype="fp16")
engine, out = llm.engine, {{}}
for users in {users!r}:
    params = SamplingParams(max_tokens={steps} + 20, temperature=0, ignore_eos=True)
    for u in range(users):
        engine.add_request([1000 + u + i for i in range(128)], params, f"r{{users}}-{{u}}")
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    out[users] = statistics.median(times[-{steps} - 5:-5]) * 1e3
print(json.dumps(out))
"""


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--weights", default="gguf,int8-all,gguf-int8")
    p.add_argument("--users", default="1,16")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    formats, users = args.weights.split(","), [int(u) for u in args.users.split(",")]
    results: dict[str, list[dict[str, float]]] = {w: [] for w in formats}
    console = Console()
    for r in range(args.rounds):
        for weights in formats:
            console.print(f"round {r + 1}: {weights} …")
            code = _CHILD.format(root=str(ROOT), model=args.model, weights=weights,
                                 users=users, steps=args.steps)
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  check=True)
            results[weights].append(json.loads(done.stdout.strip().splitlines()[-1]))
    table = Table(title=f"decode step, ms (median of {args.steps}; each round)")
    table.add_column("weights")
    for u in users:
        table.add_column(f"{u} user{'s' if u > 1 else ''}", justify="right")
    for weights in formats:
        table.add_row(weights, *(" / ".join(f"{run[str(u)]:.1f}" for run in results[weights])
                                 for u in users))
    console.print(table)
    print(json.dumps({"model": args.model, "results": results,
                      "median": {w: {u: statistics.median(run[str(u)] for run in results[w])
                                     for u in users} for w in formats}}))


if __name__ == "__main__":
    main()
