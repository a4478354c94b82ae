"""The C++ decode attention (`lifeline_ext::decode_attention`) of this checkout against the same
operator built from another commit's source, in one process, alternating.

    .venv/bin/python benchmarks/decode_attention.py [--base REV] [--layers 30] [--json out.json]

The base commit's lifeline/csrc/cpu_ops.cpp is built under another operator namespace
(`lifeline_base`), with that commit's compiler flags (lifeline/model/native.py `FLAGS`), so
both libraries live in one process and see the same machine minute by minute. Each case is a
decode step's shape: the query heads, KV heads and head size of SmolLM2-135M (9, 3, 64) and
Gemma 3 270M (4, 1, 256), one or 16 sequences, contexts of ~200 or ~700 positions laid out
as the engine lays them (blocks of 16 slots, the blocks scattered over a pool), a float16
cache as the server's default, and `--layers` distinct pools cycled so that each call reads
its keys and values from memory as a step's 30 layers do. Time: the best of 5 rounds of 10
passes over the layers, per call (µs). The outputs of the two must agree bit for bit (the
`max |diff|` column), with each a context's first three positions masked.
"""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import THREADS, machine

ROOT = Path(__file__).resolve().parents[1]
CASES = [  # (label, sequences, context, query heads, KV heads, head size)
    ("SmolLM2, 1 x 190", 1, 190, 9, 3, 64), ("SmolLM2, 1 x 700", 1, 700, 9, 3, 64),
    ("SmolLM2, 16 x 190", 16, 190, 9, 3, 64), ("Gemma 3, 1 x 300", 1, 300, 4, 1, 256),
    ("Gemma 3, 16 x 200", 16, 200, 4, 1, 256),
]
POOL = 4096 * 16


def _base_library(rev: str) -> None:
    """Build and load `rev`'s cpu_ops.cpp as `torch.ops.lifeline_base` with `rev`'s flags."""
    from lifeline.model import native

    show = lambda path: subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True,
                                       capture_output=True, text=True).stdout
    source = show("lifeline/csrc/cpu_ops.cpp").replace("lifeline_ext", "lifeline_base")
    flags_line = next(line for line in show("lifeline/model/native.py").splitlines()
                      if line.startswith("FLAGS = "))
    flags = ast.literal_eval(flags_line.split("=", 1)[1].strip())  # a list of strings
    staged = Path(tempfile.mkdtemp()) / "cpu_ops_base.cpp"
    staged.write_text(source)
    if not native._load(staged, flags, "lifeline_base_ops"):
        raise SystemExit(f"{rev}'s cpu_ops.cpp did not build")


def _case(torch, sequences: int, context: int, heads: int, kv_heads: int, head_dim: int,
          layers: int):
    gen = torch.Generator().manual_seed(context + sequences)
    pools = [(torch.randn(POOL, kv_heads, head_dim, generator=gen).half(),
              torch.randn(POOL, kv_heads, head_dim, generator=gen).half()) for _ in range(layers)]
    blocks = -(-context // 16)
    slots = torch.stack([
        (torch.randperm(POOL // 16, generator=gen)[:blocks].repeat_interleave(16) * 16
         + torch.arange(16).repeat(blocks))[:context] for _ in range(sequences)])
    mask = torch.zeros(sequences, context)
    mask[:, :3] = float("-inf")
    q = torch.randn(sequences, heads, head_dim, generator=gen)
    return pools, q, slots, mask


def _time(op, pools, q, slots, mask, rounds: int = 5, passes: int = 10) -> float:
    for k, v in pools[:4]:
        op(q, k, v, slots, mask, 0.125)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(passes):
            for k, v in pools:
                op(q, k, v, slots, mask, 0.125)
        best = min(best, (time.perf_counter() - start) / (passes * len(pools)))
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="HEAD~1", help="the commit to compare with")
    parser.add_argument("--layers", type=int, default=30, help="distinct pools cycled")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from lifeline.model.native import native_ops

    if not native_ops():
        raise SystemExit("this checkout's C++ operators did not build")
    _base_library(args.base)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    table = Table(title=f"decode attention, µs a call: {args.base} against {rev} "
                        f"({machine()})")
    for column in ("case", "threads", args.base, rev, "ratio", "max |diff|"):
        table.add_column(column, justify="left" if column == "case" else "right")
    rows = []
    for threads in (THREADS, 1):
        torch.set_num_threads(threads)
        for label, *shape in CASES:
            pools, q, slots, mask = _case(torch, *shape, args.layers)
            base = _time(torch.ops.lifeline_base.decode_attention, pools, q, slots, mask)
            ours = _time(torch.ops.lifeline_ext.decode_attention, pools, q, slots, mask)
            diff = (torch.ops.lifeline_base.decode_attention(q, *pools[0], slots, mask, 0.125)
                    - torch.ops.lifeline_ext.decode_attention(q, *pools[0], slots, mask, 0.125)
                    ).abs().max().item()
            rows.append({"case": label, "threads": threads, "base_us": base, "us": ours,
                         "max_abs_diff": diff})
            table.add_row(label, str(threads), f"{base:.1f}", f"{ours:.1f}",
                          f"{base / ours:.2f}x", f"{diff:.1e}")
    Console().print(table)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "base": args.base,
                                         "commit": rev, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
