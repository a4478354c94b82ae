"""Routing policies over two replicas (issue 15): round robin, least outstanding and prefix
affinity on a multi-turn chat workload, side by side in one run; and the gateway's added latency
against calling a replica directly.

    .venv/bin/python benchmarks/routing.py [--quick] [--json out.json] [--rounds 2]
        [--users 8] [--turns 4] [--sessions 32] [--kv-tokens 3072] [--threads 1]

Starts, on loopback, two `lifeline serve` replicas of the default model (Gemma 3 270M,
`OMP_NUM_THREADS=--threads` each, a KV cache of `--kv-tokens` tokens each) and one gateway
(`lifeline serve --config`, a generated TOML) with one route per policy over the same two
replicas, plus a route to replica A alone for the latency comparison. Then:

1. **Added latency.** The same short streaming chat request, sent alternately to replica A
   directly and through the gateway's one-replica route (which goes to A), `--latency-pairs`
   pairs: TTFT and E2E of each, p50 and p99 of the pairwise difference (gateway − direct), and
   the gateway's own stages from its `timings` (`gateway_ms`, `routing_ms`).
2. **Warm-up.** A short pass of the multi-turn workload through the round-robin route, so the
   replicas' first requests (allocator, compiled shapes) are paid before any policy is timed.
3. **Policies.** For each policy (each round, in turn), `lifeline bench`'s closed loop
   (`lifeline.bench`: `--users` users, sessions of `--turns` turns whose history grows, every
   turn a fresh `--input-tokens` user message and `--output-tokens` of answer) against that
   policy's route. Each policy's run carries its own `cache_salt`, so the replicas' prefix
   caches hold nothing one run can reuse from another: a flush without a restart (the salted
   blocks of earlier runs are idle, the first to be evicted, and never hit). Users think
   between turns (`--think-time`, mean 1 s, exponential) as people do; with no think time a
   closed loop hands least-outstanding an affinity of its own: the user whose request just
   ended on a replica is the one that replica's free slot goes to next.

Prefix hit rate: the replicas' own `cached_tokens` (Lifeline's `timings`, nested by the gateway
under its own, read by `lifeline.bench.stages`) summed over the run's requests, over their
`usage.prompt_tokens`. Also from the gateway's `/metrics`: requests per replica and the prefix
policy's decisions (owner, spilled past the load bound).

Why the cache is small: with a KV cache that holds every session's history twice over, round
robin loses only what the split costs it (half the time a session's previous turn is on the
other replica, whose copy is older); with one that holds about the sessions of one replica's
share (`--kv-tokens`, default 3,072 tokens a replica for 8 users of up to ~550-token
histories), round robin, which spreads every session over both replicas, also evicts what it
would have reused, while prefix affinity keeps each session where its history is.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ForeignLoad, machine  # noqa: E402
from vs_llamacpp import ROOT, Server, free_port  # noqa: E402

MODEL = "gemma-3-270m"
POLICIES = ("round_robin", "least_outstanding", "prefix_affinity")
DIRECT_ROUTE = "replica_a_only"
KV_BYTES_PER_TOKEN = 2 * 18 * 1 * 256 * 4
"""Gemma 3 270M, float32 K and V: 18 layers × 1 KV head × 256 dims. Its sliding-window layers
keep only their window, but a prefix hit needs the full layers' blocks for the whole prefix and
the window's blocks before it, so below a few thousand tokens the cache holds about
memory ÷ this many tokens (lifeline/engine/kv_layout.py splits it that way)."""
LATENCY_PROMPT = "Say hello."


def replica(name: str, kv_tokens: int, threads: int, log_dir: Path, extra: list[str]) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "lifeline.cli", "serve", "--port", str(port),
            "--kv-cache-memory-bytes", str(kv_tokens * KV_BYTES_PER_TOKEN), *extra]
    env = {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    return Server(name, argv, port, "/ready", env, log_dir / f"{name}.log")


def gateway_config(urls: dict[str, str], prefix_chars: int, load_factor: float) -> str:
    """The gateway's TOML: the replicas as upstreams, one route per policy over both of them,
    and one route to the first replica alone."""
    lines = ["[health]", "interval_s = 5", ""]
    for name, url in urls.items():
        lines += [f"[backends.{name}]", f'base_url = "{url}"', f'model = "{MODEL}"', ""]
    both = ", ".join(f'"{n}"' for n in urls)
    for policy in POLICIES:
        lines += [f"[models.{policy}]", f"backends = [{both}]", f'policy = "{policy}"',
                  f"prefix_chars = {prefix_chars}", f"load_factor = {load_factor}",
                  "max_attempts = 1", ""]
    first = next(iter(urls))
    lines += [f"[models.{DIRECT_ROUTE}]", f'backends = ["{first}"]', ""]
    return "\n".join(lines)


def gateway(config: Path, log_dir: Path) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "lifeline.cli", "serve", "--config", str(config),
            "--host", "127.0.0.1", "--port", str(port)]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return Server("gateway", argv, port, "/ready", env, log_dir / "gateway.log")


# --- the gateway's added latency -----------------------------------------------------------

async def timed_stream(http: Any, url: str, model: str, max_tokens: int) -> dict[str, Any]:
    """One short streaming chat request: client TTFT and E2E (ms) and the final `timings`."""
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "messages": [{"role": "user", "content": LATENCY_PROMPT}]}
    sent = time.perf_counter()
    first = None
    timings = None
    async with http.stream("POST", url + "/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if first is None and any((c.get("delta") or {}).get("content")
                                     for c in event.get("choices") or []):
                first = time.perf_counter()
            timings = event.get("timings") or timings
    done = time.perf_counter()
    return {"ttft_ms": (first - sent) * 1e3 if first else None, "e2e_ms": (done - sent) * 1e3,
            "timings": timings}


async def added_latency(direct: str, through: str, pairs: int, max_tokens: int,
                        progress: Any) -> dict[str, Any]:
    """`pairs` pairs of the same request, direct and through the gateway, in alternating
    order; the pairwise differences' distribution."""
    import httpx

    from lifeline.bench.metrics import distribution

    task = progress.add_task("added latency", total=pairs)
    rows = []
    async with httpx.AsyncClient(timeout=60) as http:
        for _ in range(3):  # connections up, the prompt cached on the replica
            await timed_stream(http, direct, MODEL, max_tokens)
            await timed_stream(http, through, DIRECT_ROUTE, max_tokens)
        for i in range(pairs):
            if i % 2 == 0:
                d = await timed_stream(http, direct, MODEL, max_tokens)
                g = await timed_stream(http, through, DIRECT_ROUTE, max_tokens)
            else:
                g = await timed_stream(http, through, DIRECT_ROUTE, max_tokens)
                d = await timed_stream(http, direct, MODEL, max_tokens)
            rows.append((d, g))
            progress.advance(task)

    def dist(values: list[float | None]) -> dict[str, Any]:
        return distribution(values)

    own = [(g["timings"] or {}) for _, g in rows]
    return {
        "pairs": pairs, "max_tokens": max_tokens, "prompt": LATENCY_PROMPT,
        "direct_ttft_ms": dist([d["ttft_ms"] for d, _ in rows]),
        "gateway_ttft_ms": dist([g["ttft_ms"] for _, g in rows]),
        "added_ttft_ms": dist([g["ttft_ms"] - d["ttft_ms"] for d, g in rows
                               if g["ttft_ms"] is not None and d["ttft_ms"] is not None]),
        "direct_e2e_ms": dist([d["e2e_ms"] for d, _ in rows]),
        "gateway_e2e_ms": dist([g["e2e_ms"] for _, g in rows]),
        "added_e2e_ms": dist([g["e2e_ms"] - d["e2e_ms"] for d, g in rows]),
        "gateway_stage_ms": dist([(t.get("gateway_ms") or 0) + (t.get("routing_ms") or 0)
                                  for t in own]),
        "gateway_ms": dist([t.get("gateway_ms") for t in own]),
        "routing_ms": dist([t.get("routing_ms") for t in own]),
        "upstream_headers_ms": dist([t.get("upstream_headers_ms") for t in own]),
    }


# --- the policies ----------------------------------------------------------------------------

def settings(url: str, route: str, args: argparse.Namespace, sessions: int) -> Any:
    from lifeline.bench.run import BenchSettings
    from lifeline.model.default import default_model_path

    return BenchSettings(url=url, model=route, endpoint="chat", concurrency=args.users,
                         requests=sessions * args.turns, warmup=0, turns=args.turns,
                         think_time_s=args.think_time,
                         input_tokens=args.input_tokens, output_tokens=args.output_tokens,
                         tokenizer=str(default_model_path()), seed=args.seed,
                         timeout_s=600.0)


async def chat_run(s: Any, salt: str, progress: Any, label: str) -> dict[str, Any]:
    """`lifeline bench`'s run of `s`, every request carrying `cache_salt` (the library's own
    steps: `run_bench` less its fixed request body)."""
    from datetime import UTC, datetime

    from lifeline.bench.client import BenchClient
    from lifeline.bench.load import run_load
    from lifeline.bench.run import build_workload, results
    from lifeline.bench.workloads import cycle

    task = progress.add_task(label, total=s.requests)
    async with BenchClient(s.url, s.model, endpoint="chat", max_connections=max(16, s.concurrency),
                           timeout_s=s.timeout_s, pin_output=True,
                           extra_body={"cache_salt": salt}) as c:
        workload = await build_workload(s, c)
        started = datetime.now(UTC)
        result = await run_load(c, cycle(workload), s.plan(),
                                lambda _sent: progress.advance(task))
    return results(s, result, None, started)


def scrape(root: str) -> dict[str, float]:
    """The gateway's counters this benchmark reads, by series."""
    import httpx

    text = httpx.get(root + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("lifeline:gateway_backend_requests_total",
                            "lifeline:gateway_routing_decisions_total",
                            "lifeline:gateway_backend_errors_total")):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def counted(before: dict[str, float], after: dict[str, float], name: str, label: str,
            route: str | None = None) -> dict[str, int]:
    """Increments of one counter family over a run, by one label's value."""
    out: Counter[str] = Counter()
    for series, value in after.items():
        if not series.startswith(name + "{") or (route and f'model_name="{route}"' not in series):
            continue
        m = re.search(label + r'="([^"]*)"', series)
        if m:
            out[m.group(1)] += int(value - before.get(series, 0.0))
    return {k: v for k, v in out.items() if v}


def figures(res: dict[str, Any], before: dict[str, float], after: dict[str, float],
            route: str) -> dict[str, Any]:
    s = res["summary"]
    ok = [r for r in res["requests"] if r["ok"]]
    prompt = sum(r["usage_prompt_tokens"] or 0 for r in ok)
    cached = sum((r["server_timings"] or {}).get("cached_tokens") or 0 for r in ok)
    later = [r for r in ok if r["turn"] > 0]
    prompt_later = sum(r["usage_prompt_tokens"] or 0 for r in later)
    cached_later = sum((r["server_timings"] or {}).get("cached_tokens") or 0 for r in later)
    by_turn = {}
    for turn in sorted({r["turn"] for r in ok}):
        rs = [r for r in ok if r["turn"] == turn]
        p = sum(r["usage_prompt_tokens"] or 0 for r in rs)
        c = sum((r["server_timings"] or {}).get("cached_tokens") or 0 for r in rs)
        by_turn[turn + 1] = {"requests": len(rs), "prompt_tokens": p, "cached_tokens": c,
                             "hit_rate": c / p if p else None}
    return {
        "requests": s["requests"], "failed": s["failed"], "errors": s["errors"],
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else None,
        "hit_rate_later_turns": cached_later / prompt_later if prompt_later else None,
        "by_turn": by_turn,
        "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"],
        "e2e_p50_ms": s["e2e_ms"]["p50"],
        "output_tok_s": s["output_throughput_tok_s"], "duration_s": s["duration_s"],
        "per_replica": counted(before, after, "lifeline:gateway_backend_requests_total",
                               "backend"),
        "decisions": counted(before, after, "lifeline:gateway_routing_decisions_total",
                             "reason", route),
        "backend_errors": counted(before, after, "lifeline:gateway_backend_errors_total",
                                  "kind"),
    }


async def policies(gw: str, root: str, args: argparse.Namespace, progress: Any
                   ) -> list[dict[str, Any]]:
    rows = []
    warm = settings(gw, "round_robin", args, max(args.users, 4))
    await chat_run(warm, "warm-up", progress, "warm-up")
    for rnd in range(args.rounds):
        for policy in args.policies:
            s = settings(gw, policy, args, args.sessions)
            before = scrape(root)
            res = await chat_run(s, f"{policy}-{rnd}-{time.time_ns()}", progress,
                                 f"{policy} (round {rnd + 1})")
            row = {"policy": policy, "round": rnd + 1,
                   **figures(res, before, scrape(root), policy)}
            if args.keep_requests:
                row["bench"] = res
            rows.append(row)
    return rows


# --- the report ------------------------------------------------------------------------------

def _f(v: float | None, digits: int = 0, unit: str = "") -> str:
    return "-" if v is None else f"{v:,.{digits}f}{unit}"


def _ratio(v: float | None, base: float | None) -> str:
    return "" if not v or not base else f" ({v / base:.2f}×)"


def policy_table(rows: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    t = Table(title="Routing policies, two replicas, multi-turn chat (ratio: ÷ round robin "
                    "of the same round)")
    for col in ("policy", "round", "hit rate", "turns 2+", "by turn", "TTFT p50 ms", "TTFT p90 ms",
                "output tok/s", "requests A/B", "failed", "decisions"):
        t.add_column(col, justify="right", no_wrap=col != "decisions")
    base = {r["round"]: r for r in rows if r["policy"] == "round_robin"}
    for r in rows:
        b = base.get(r["round"], {})
        split = "/".join(str(v) for _, v in sorted(r["per_replica"].items()))
        t.add_row(r["policy"], str(r["round"]),
                  _f(r["hit_rate"] and r["hit_rate"] * 100, 1, "%")
                  + _ratio(r["hit_rate"], b.get("hit_rate")),
                  _f(r["hit_rate_later_turns"] and r["hit_rate_later_turns"] * 100, 1, "%"),
                  "/".join(_f((t["hit_rate"] or 0) * 100) for t in r["by_turn"].values()) + "%",
                  _f(r["ttft_p50_ms"]) + _ratio(r["ttft_p50_ms"], b.get("ttft_p50_ms")),
                  _f(r["ttft_p90_ms"]) + _ratio(r["ttft_p90_ms"], b.get("ttft_p90_ms")),
                  _f(r["output_tok_s"], 1) + _ratio(r["output_tok_s"], b.get("output_tok_s")),
                  split, str(r["failed"]),
                  ", ".join(f"{k} {v}" for k, v in sorted(r["decisions"].items())))
    return t


def latency_table(lat: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"The gateway's added latency: {lat['pairs']} pairs, direct vs through, "
                    f"alternating ({lat['max_tokens']}-token streams)")
    for col in ("ms", "p50", "p90", "p99", "mean"):
        t.add_column(col, justify="right")
    for label, key in (("direct TTFT", "direct_ttft_ms"), ("gateway TTFT", "gateway_ttft_ms"),
                       ("added TTFT (pairwise)", "added_ttft_ms"),
                       ("direct E2E", "direct_e2e_ms"), ("gateway E2E", "gateway_e2e_ms"),
                       ("added E2E (pairwise)", "added_e2e_ms"),
                       ("gateway_ms + routing_ms", "gateway_stage_ms"),
                       ("  gateway_ms", "gateway_ms"), ("  routing_ms", "routing_ms"),
                       ("upstream_headers_ms", "upstream_headers_ms")):
        d = lat[key]
        t.add_row(label, *(_f(d[k], 2) for k in ("p50", "p90", "p99", "mean")))
    return t


def commit() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return done.stdout.strip() + ("+dirty" if dirty else "")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, \
        TimeElapsedColumn

    console = Console(width=190)
    log_dir = Path(tempfile.mkdtemp(prefix="routing-bench-"))
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    t0 = time.monotonic()
    foreign = ForeignLoad()
    console.print(f"[bold]replicas[/]: 2 × lifeline serve, OMP_NUM_THREADS={args.threads}, "
                  f"KV cache {args.kv_tokens} tokens each; logs in {log_dir}")
    extra = ["--no-compile"] if args.no_compile else []
    with replica("replica_a", args.kv_tokens, args.threads, log_dir, extra) as a, \
            replica("replica_b", args.kv_tokens, args.threads, log_dir, extra) as b:
        config = log_dir / "gateway.toml"
        config.write_text(gateway_config({"replica_a": a.url, "replica_b": b.url},
                                         args.prefix_chars, args.load_factor))
        with gateway(config, log_dir) as gw:
            root = f"http://127.0.0.1:{gw.port}"
            console.print(f"ready after {time.monotonic() - t0:.0f} s")
            columns = (TextColumn("[bold]{task.description}"), BarColumn(),
                       MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns, console=console) as progress:
                lat = asyncio.run(added_latency(a.url, gw.url, args.latency_pairs,
                                                args.latency_tokens, progress))
                rows = asyncio.run(policies(gw.url, root, args, progress))
            others = foreign.share(tuple(s.proc.pid for s in (a, b, gw) if s.proc))
    console.print(policy_table(rows))
    console.print(latency_table(lat))
    console.print(f"other processes used {others:.2f} cores on average during the run")
    return {"date": started, "commit": commit(), "machine": machine(),
            "wall_s": time.monotonic() - t0, "foreign_cores": others,
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "kv_bytes_per_replica": args.kv_tokens * KV_BYTES_PER_TOKEN,
            "policies": rows, "added_latency": lat}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="fewer sessions and latency pairs (a few minutes)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--users", type=int, default=8, help="concurrent chat users")
    p.add_argument("--turns", type=int, default=4, help="turns per session")
    p.add_argument("--sessions", type=int, default=None,
                   help="sessions per policy run (default 32, --quick 16)")
    p.add_argument("--think-time", type=float, default=1.0,
                   help="mean seconds (exponential) a user waits before its next turn")
    p.add_argument("--input-tokens", type=int, default=96, help="each turn's new user message")
    p.add_argument("--output-tokens", type=int, default=32, help="each answer")
    p.add_argument("--kv-tokens", type=int, default=3072, help="KV cache of each replica, tokens")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each replica")
    p.add_argument("--prefix-chars", type=int, default=256, help="prefix affinity's key length")
    p.add_argument("--load-factor", type=float, default=1.25, help="prefix affinity's bound")
    p.add_argument("--rounds", type=int, default=1, help="runs of every policy, in turn")
    p.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES))
    p.add_argument("--latency-pairs", type=int, default=None,
                   help="direct/gateway request pairs (default 200, --quick 60)")
    p.add_argument("--latency-tokens", type=int, default=4, help="output tokens of each")
    p.add_argument("--no-compile", action="store_true",
                   help="replicas run eager (faster start, slower decode; development)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-requests", action="store_true",
                   help="put every request's bench record in the JSON")
    args = p.parse_args()
    unknown = set(args.policies) - set(POLICIES)
    if unknown:
        p.error(f"unknown policies {sorted(unknown)}; choose from {POLICIES}")
    if args.sessions is None:
        args.sessions = 16 if args.quick else 32
    if args.latency_pairs is None:
        args.latency_pairs = 60 if args.quick else 200
    sys.path.insert(0, str(ROOT))
    out = run(args)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
