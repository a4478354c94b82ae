"""What naming prefix-cache blocks by SHA-256 costs against Python's `hash()` of token tuples.

    .venv/bin/python benchmarks/prefix_hash.py              # (a) the hashing alone, < 1 minute
    .venv/bin/python benchmarks/prefix_hash.py --workload [--quick] [--rounds 2]
        [--model FILE.gguf] [--weights FORMAT]              # (b) the prefix workload, served

(a) times the block manager's own paths in one process, alternating the old chain (Python's
`hash((parent, tuple(tokens), extra))`) and the new one (SHA-256) round by round: the hashes of
a 1,000-token prompt, of 16 such prompts (one step admitting 16 users), the prefix lookup of 16
prompts already cached, and 16 decodes that each complete a block. It prints the median time of
each and the ratio new ÷ old.

(b) serves `benchmarks/vs_llamacpp.py`'s `prefix` workload (16 users in a closed loop sharing a
1,000-token system prompt, `lifeline bench`) with `lifeline serve` twice per round, once with
each chain (the old one patched in by this script), and prints TTFT and throughput of both.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lifeline.engine import block_manager  # noqa: E402
from lifeline.engine.block_manager import BlockManager  # noqa: E402
from lifeline.engine.request import Request  # noqa: E402
from lifeline.engine.sampling_params import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
PROMPT_TOKENS = 1000
USERS = 16
SHA256 = block_manager.hash_chain


def legacy_chain(parent: Any, token_ids: Sequence[int], block_size: int,
                 extra_key: bytes = b"") -> list[int]:
    """The chain before SHA-256: Python's hash() of (parent, token tuple, extra key)."""
    digests = []
    for start in range(0, len(token_ids) // block_size * block_size, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size]), extra_key))
        digests.append(parent)
    return digests


CHAINS = {"hash()": legacy_chain, "sha256": SHA256}


PROMPTS = [[(user * 7919 + i * 104729) % 262144 for i in range(PROMPT_TOKENS)]
           for user in range(USERS)]
"""One distinct prompt per user (token ids spread over Gemma 3's vocabulary)."""


def _prompt(user: int) -> list[int]:
    return PROMPTS[user]


def _request(prompt: list[int], output: int = 0) -> Request:
    req = Request("r", prompt, SamplingParams(max_tokens=64))
    req.output_token_ids = [5] * output
    return req


def _prefill(users: int) -> tuple[Callable[[], object], Callable[[object], None]]:
    kv = BlockManager(4096, BLOCK_SIZE)

    def setup() -> object:
        return [_request(_prompt(u)) for u in range(users)]

    def run(reqs: object) -> None:
        for req in reqs:
            kv.compute_hashes(req, PROMPT_TOKENS)
    return setup, run


def _lookup() -> tuple[Callable[[], object], Callable[[object], None]]:
    kv = BlockManager(4096, BLOCK_SIZE)
    warm = _request(_prompt(0))
    kv.allocate(warm, PROMPT_TOKENS)
    warm.num_computed_tokens = PROMPT_TOKENS
    kv.commit(warm)

    def setup() -> object:
        return [_request(_prompt(0)) for _ in range(USERS)]

    def run(reqs: object) -> None:
        for req in reqs:
            assert len(kv.find_cached_prefix(req)) == (PROMPT_TOKENS - 1) // BLOCK_SIZE
    return setup, run


def _decode() -> tuple[Callable[[], object], Callable[[object], None]]:
    kv = BlockManager(4096, BLOCK_SIZE)
    output = 40  # the context reaches 1,040 tokens: block 65 is complete
    done = (PROMPT_TOKENS + output - 1) // BLOCK_SIZE

    def setup() -> object:
        reqs = [_request(_prompt(u), output) for u in range(USERS)]
        for req in reqs:
            kv.compute_hashes(req, done * BLOCK_SIZE)
        return reqs

    def run(reqs: object) -> None:
        for req in reqs:
            kv.compute_hashes(req, PROMPT_TOKENS + output)
    return setup, run


SCENARIOS = {
    "1 prompt of 1,000 tokens: block hashes": lambda: _prefill(1),
    f"{USERS} prompts of 1,000 tokens (one step)": lambda: _prefill(USERS),
    f"{USERS} cached prompts: prefix lookup": _lookup,
    f"{USERS} decodes completing a block": _decode,
}


def _time(setup: Callable[[], object], run: Callable[[object], None], reps: int) -> float:
    """Median seconds of one `run` over `reps` runs, each on fresh inputs."""
    inputs = [setup() for _ in range(reps)]
    times = []
    for item in inputs:
        start = time.perf_counter()
        run(item)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def micro(rounds: int, reps: int) -> dict[str, dict[str, float]]:
    """Median over rounds of each scenario's median, the chains alternating within a round."""
    samples: dict[str, dict[str, list[float]]] = {s: {c: [] for c in CHAINS} for s in SCENARIOS}
    try:
        for r in range(rounds):
            order = list(CHAINS) if r % 2 == 0 else list(reversed(CHAINS))
            for scenario, make in SCENARIOS.items():
                for chain in order:
                    block_manager.hash_chain = CHAINS[chain]
                    samples[scenario][chain].append(_time(*make(), reps))
    finally:
        block_manager.hash_chain = SHA256
    return {s: {c: statistics.median(v) for c, v in by.items()} for s, by in samples.items()}


def micro_table(results: dict[str, dict[str, float]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Prefix-cache block hashes, block size {BLOCK_SIZE} (median µs)")
    for col in ("scenario", "blocks", "hash()", "sha256", "sha256 ÷ hash()"):
        t.add_column(col, justify="right")
    blocks = [PROMPT_TOKENS // BLOCK_SIZE, USERS * (PROMPT_TOKENS // BLOCK_SIZE),
              USERS * ((PROMPT_TOKENS - 1) // BLOCK_SIZE), USERS]
    for (scenario, by), n in zip(results.items(), blocks):
        old, new = by["hash()"] * 1e6, by["sha256"] * 1e6
        t.add_row(scenario, f"{n:,}", f"{old:,.1f}", f"{new:,.1f}", f"{new / old:.2f}×")
    Console(width=120).print(t)


def _serve_legacy(argv: list[str]) -> int:
    """`lifeline serve` with the old chain patched in (the --workload's other server)."""
    from lifeline.cli import main

    block_manager.hash_chain = legacy_chain
    return main(argv)


def workload(args: argparse.Namespace) -> list[dict[str, Any]]:
    from rich.console import Console

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from vs_llamacpp import _runs, bench, lifeline_server

    if args.model is None:
        from lifeline.model.default import default_model_path

        args.model = Path(default_model_path())
    console = Console()
    spec = _runs(args.quick)["prefix"]
    rows = []
    for r in range(args.rounds):
        for chain in (CHAINS if r % 2 == 0 else reversed(CHAINS)):
            server = lifeline_server(args.model, args.weights)
            if chain == "hash()":
                server.argv[1:3] = [str(Path(__file__).resolve()), "--serve-legacy-hash"]
                server.name = "lifeline, hash() chain"
            console.print(f"round {r + 1}: {server.name} …")
            with server:
                s = bench(server, spec["args"])["summary"]
            rows.append({"round": r + 1, "chain": chain, "ttft_p50_ms": s["ttft_ms"]["p50"],
                         "ttft_p90_ms": s["ttft_ms"]["p90"],
                         "output_tok_s": s["output_throughput_tok_s"]})
            console.print(f"  {rows[-1]}")
    return rows


def workload_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="prefix workload (16 users, 1,000 shared tokens): median over rounds")
    for col in ("figure", "hash()", "sha256", "sha256 ÷ hash()"):
        t.add_column(col, justify="right")
    for key in ("ttft_p50_ms", "ttft_p90_ms", "output_tok_s"):
        old = statistics.median(r[key] for r in rows if r["chain"] == "hash()")
        new = statistics.median(r[key] for r in rows if r["chain"] == "sha256")
        t.add_row(key, f"{old:,.1f}", f"{new:,.1f}", f"{new / old:.3f}×" if old else "-")
    Console(width=120).print(t)


def main() -> None:
    if sys.argv[1:2] == ["--serve-legacy-hash"]:
        sys.exit(_serve_legacy(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None,
                        help="alternations of the two chains (default: 7, or 2 with --workload)")
    parser.add_argument("--reps", type=int, default=200, help="timed runs per scenario and round")
    parser.add_argument("--workload", action="store_true",
                        help="serve the prefix workload instead (minutes per round)")
    parser.add_argument("--quick", action="store_true", help="--workload: fewer requests")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--weights", default=None)
    args = parser.parse_args()
    if args.workload:
        args.rounds = args.rounds or 2
        workload_table(workload(args))
    else:
        micro_table(micro(args.rounds or 7, args.reps))


if __name__ == "__main__":
    main()
