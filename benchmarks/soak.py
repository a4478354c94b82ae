"""Soak: `lifeline serve` at saturation for a long run, with a mix of normal requests, client
disconnects, bad inputs and injected faults (issue 13, "What to measure and show").

    .venv/bin/python benchmarks/soak.py [--minutes 30] [--workers 16] [--json out.json]
        [--svg docs/img/soak_latency.svg] [--kv-cache-memory-bytes 512MiB] [--compile]

Starts `lifeline serve --enable-fault-injection` on loopback as a subprocess (the default model,
2 threads), warms it up with the same mix, then keeps `--workers` clients busy until the time
or `--max-requests` is spent. Kinds of request:

- `chat`, `chat_stream`, `completion`, `completion_stream`: short prompts, 16-64 tokens;
  expected: 200 and a complete answer (a stream ends with `[DONE]` and no error event).
- `disconnect`: a stream the client closes after a few chunks; expected: chunks, then closed.
- `bad`: one of a list of bad inputs; expected: the status it names (a 400 is a success of
  its kind) with the OpenAI error shape.
- `fault`: a request carrying `X-Lifeline-Fault: step` (the engine step that runs it raises);
  expected: 500, or an error event mid-stream. A server without the hook answers normally:
  counted as `fault_ignored`, an unexpected outcome, not a crash.

Reports requests by kind and outcome, the server's RSS (VmRSS) after warm-up, at the middle and
at the end, KV usage (`lifeline:kv_cache_usage_perc`, blocks held by requests) at idle before
and after, p50/p99 latency per time bucket, and PASS/FAIL lines: nothing lost (no request ran
into the client timeout, none broke off without a status), RSS flat within 5% after warm-up,
KV back to its baseline, the server still healthy. Writes the raw results as JSON (`--json`)
and the latency plot as SVG (`--svg`). Loopback only; stops by itself.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llamacpp import ROOT, THREADS, Server, free_port  # noqa: E402

MODEL = "gemma-3-270m"
MIX = {"chat": 22, "chat_stream": 22, "completion": 14, "completion_stream": 14,
       "disconnect": 12, "bad": 14, "fault": 2}
"""Relative weights of the kinds (about one request in fifty carries a fault)."""
NORMAL = ("chat", "chat_stream", "completion", "completion_stream")
RSS_TOLERANCE = 0.05
KV_EPSILON = 1e-9
PROMPTS = ["Name a colour.", "What is two plus two?", "Write one word about the sea.",
           "Say hello in French.", "The capital of Italy is", "List three fruits:",
           "Once upon a time", "A haiku about rain:"]


@dataclass(slots=True)
class Result:
    kind: str
    sent_s: float
    """Seconds since its phase began."""
    latency_s: float
    outcome: str
    expected: bool
    status: int | None = None
    ttft_s: float | None = None
    detail: str = ""
    warmup: bool = False


@dataclass(slots=True)
class Bad:
    name: str
    path: str
    body: Any
    """JSON-able, or raw bytes; encoded once."""
    status: int

    def __post_init__(self) -> None:
        if not isinstance(self.body, bytes):
            self.body = json.dumps(self.body).encode()


def bad_inputs(context: int, vocab: int) -> list[Bad]:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    comp = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
    c, p = "/v1/chat/completions", "/v1/completions"
    return [
        Bad("logit_bias-not-integer", c, {**chat, "logit_bias": {"abc": 1}}, 400),
        Bad("logit_bias-outside-vocab", c, {**chat, "logit_bias": {str(vocab): 1}}, 400),
        Bad("logit_bias-too-many", p, {**comp, "logit_bias": {str(i): 1 for i in range(5000)}},
            400),
        Bad("stop-empty", c, {**chat, "stop": ""}, 400),
        Bad("stop-too-many", p, {**comp, "stop": [f"s{i}" for i in range(500)]}, 400),
        Bad("stop-very-long", c, {**chat, "stop": ["x" * 50_000]}, 400),
        Bad("stop_token_ids-outside-vocab", p, {**comp, "stop_token_ids": [vocab + 1]}, 400),
        Bad("top_logprobs-21", c, {**chat, "logprobs": True, "top_logprobs": 21}, 400),
        Bad("seed-over-64-bit", p, {**comp, "seed": 2**64}, 400),
        Bad("response_format-json_object", c, {**chat, "response_format": {"type":
                                                                             "json_object"}}, 400),
        Bad("n-times-prompts", p, {**comp, "prompt": ["Hi"] * 64, "n": 64}, 400),
        Bad("prompt-over-context", p, {**comp, "prompt": [2] + [3000] * context}, 400),
        Bad("max_tokens-over-context", p, {**comp, "max_tokens": context + 100}, 400),
        Bad("unknown-model", c, {**chat, "model": "gpt-17"}, 404),
        Bad("chat_template-refused", c, {**chat, "chat_template": "{{ 1 }}"}, 400),
        Bad("malformed-json", c, b'{"messages": [', 400),
        Bad("non-object", p, b"[1, 2]", 400),
        Bad("nested", p, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
        Bad("unpaired-surrogate", c, b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
            400),
        Bad("wrong-type", c, {**chat, "messages": "hello"}, 400),
        Bad("detokenize-outside-vocab", "/detokenize", {"tokens": [vocab]}, 400),
        Bad("tokenize-oversized", "/tokenize", {"prompt": "word " * 400_000}, 400),
        Bad("body-too-large", p, {**comp, "prompt": "x" * (9 << 20)}, 413),
    ]


@dataclass(slots=True)
class Soak:
    base_url: str
    pid: int
    args: argparse.Namespace
    bad: list[Bad]
    rng: random.Random
    results: list[Result] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since the measured run began, VmRSS in kB)."""
    t0: float = 0.0
    in_flight: int = 0
    warmup: bool = True

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def pick(self) -> str:
        kinds, weights = zip(*MIX.items())
        return self.rng.choices(kinds, weights)[0]

    async def one(self, client: Any, kind: str) -> Result:
        start = self.now()
        self.in_flight += 1
        try:
            async with asyncio.timeout(self.args.timeout):
                result = await self._run(client, kind, start)
        except TimeoutError:
            result = Result(kind, start, self.now() - start, "hang", False)
        except Exception as exc:  # noqa: BLE001 - a broken request is an outcome to count
            result = Result(kind, start, self.now() - start, "transport_error", False,
                            detail=f"{type(exc).__name__}: {exc}"[:200])
        finally:
            self.in_flight -= 1
        result.warmup = self.warmup
        self.results.append(result)
        return result

    async def _run(self, client: Any, kind: str, start: float) -> Result:
        if kind == "bad":
            return await self._bad(client, start)
        stream = kind in ("chat_stream", "completion_stream", "disconnect") or (
            kind == "fault" and self.rng.random() < 0.5)
        chat = kind.startswith("chat") or (kind in ("disconnect", "fault")
                                           and self.rng.random() < 0.5)
        body = self._body(chat, stream, kind)
        cut = self.rng.randint(1, 8) if kind == "disconnect" else None
        path = "/v1/chat/completions" if chat else "/v1/completions"
        headers = {"X-Lifeline-Fault": "step"} if kind == "fault" else {}
        if not stream:
            r = await client.post(path, json=body, headers=headers)
            return self._classify(kind, start, r.status_code, _json(r), [])
        async with client.stream("POST", path, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return self._classify(kind, start, r.status_code, _json(r), [])
            events: list[str] = []
            ttft = None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                ttft = ttft if ttft is not None else self.now() - start
                events.append(line[6:])
                if cut is not None and len(events) >= cut:
                    return Result(kind, start, self.now() - start, "closed", True, 200, ttft)
        result = self._classify(kind, start, 200, None, events)
        result.ttft_s = ttft
        return result

    def _body(self, chat: bool, stream: bool, kind: str) -> dict[str, Any]:
        prompt = self.rng.choice(PROMPTS)
        body: dict[str, Any] = {"model": MODEL, "max_tokens": self.rng.randint(16, 64),
                                "temperature": self.rng.choice([0.0, 0.7, 1.0]),
                                "stream": stream}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if kind == "disconnect":
            body.update(max_tokens=200, ignore_eos=True)
        if kind == "fault":
            body.update(ignore_eos=True)
        return body

    async def _bad(self, client: Any, start: float) -> Result:
        bad = self.rng.choice(self.bad)
        r = await client.post(bad.path, content=bad.body,
                              headers={"content-type": "application/json"})
        body = _json(r)
        shaped = _error_shaped(body)
        ok = r.status_code == bad.status and shaped
        outcome = f"{r.status_code}" + ("" if shaped or r.status_code == 200 else " unshaped")
        return Result("bad", start, self.now() - start, outcome, ok, r.status_code,
                      detail=bad.name)

    def _classify(self, kind: str, start: float, status: int, body: Any,
                  events: list[str]) -> Result:
        latency = self.now() - start
        error_events = [e for e in events if e.startswith("{") and '"error"' in e[:12]]
        if kind == "fault":
            if status == 500 and _error_shaped(body):
                return Result(kind, start, latency, "500", True, status)
            if status == 200 and error_events:
                return Result(kind, start, latency, "error_event", True, status)
            if status == 200:
                return Result(kind, start, latency, "fault_ignored", False, status)
            return Result(kind, start, latency, f"{status}", False, status)
        if status != 200:
            return Result(kind, start, latency, f"{status}", False, status,
                          detail=str(body)[:200])
        if error_events:
            return Result(kind, start, latency, "error_event", False, status,
                          detail=error_events[0][:200])
        if events and events[-1] != "[DONE]":
            return Result(kind, start, latency, "truncated", False, status)
        return Result(kind, start, latency, "ok", True, status)


def _json(r: Any) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


def _error_shaped(body: Any) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and isinstance(error["message"], str))


def rss_kb(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE).group(1))


async def gauge(client: Any, name: str) -> float:
    text = (await client.get("/metrics")).text
    match = re.search(rf"^lifeline:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


async def vocab_size(client: Any) -> int:
    """The first token id `/detokenize` refuses (a binary search)."""
    lo, hi = 0, 1 << 24
    while hi - lo > 1:
        mid = (lo + hi) // 2
        r = await client.post("/detokenize", json={"tokens": [mid]})
        lo, hi = (mid, hi) if r.status_code == 200 else (lo, mid)
    return hi


async def idle_kv(client: Any, wait_s: float = 30.0) -> tuple[float, bool]:
    """KV usage once no request runs or waits (and whether the server got idle in time)."""
    deadline = time.monotonic() + wait_s
    while True:
        busy = await gauge(client, "num_requests_running") + await gauge(
            client, "num_requests_waiting")
        if busy == 0 or time.monotonic() > deadline:
            return await gauge(client, "kv_cache_usage_perc"), busy == 0
        await asyncio.sleep(0.2)


async def drive(soak: Soak, until: float, max_requests: int, progress: Any = None,
                task: Any = None) -> None:
    """`--workers` clients in closed loops until `until` (seconds on soak's clock)."""
    import httpx

    sent = 0
    limits = httpx.Limits(max_connections=soak.args.workers * 2)
    async with httpx.AsyncClient(base_url=soak.base_url, timeout=soak.args.timeout,
                                 limits=limits) as client:
        async def worker() -> None:
            nonlocal sent
            while soak.now() < until and sent < max_requests:
                sent += 1
                await soak.one(client, soak.pick())

        async def ticker() -> None:
            next_rss = 0.0
            while soak.now() < until and sent < max_requests:
                if progress is not None:
                    ok = sum(r.expected for r in soak.results if not r.warmup)
                    progress.update(task, completed=min(soak.now(), until),
                                    description=f"{len(soak.results)} done, {ok} as expected")
                if progress is not None and soak.now() >= next_rss:
                    soak.rss.append((soak.now(), rss_kb(soak.pid)))
                    next_rss += soak.args.rss_every
                await asyncio.sleep(1.0)

        await asyncio.gather(ticker(), *(worker() for _ in range(soak.args.workers)))


def buckets(results: list[Result], width_s: float) -> list[dict[str, Any]]:
    by: dict[int, list[Result]] = defaultdict(list)
    for r in results:
        if not r.warmup and r.kind in NORMAL and r.outcome == "ok":
            by[int((r.sent_s + r.latency_s) // width_s)].append(r)
    rows = []
    for b in sorted(by):
        lat = sorted(r.latency_s for r in by[b])
        ttft = sorted(r.ttft_s for r in by[b] if r.ttft_s is not None)
        rows.append({"start_s": b * width_s, "requests": len(lat), "p50_ms": _pct(lat, 50),
                     "p99_ms": _pct(lat, 99), "ttft_p50_ms": _pct(ttft, 50),
                     "ttft_p99_ms": _pct(ttft, 99)})
    return rows


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    k = min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))
    return values[k] * 1e3


def write_svg(rows: list[dict[str, Any]], path: Path, width_s: float) -> None:
    sys.path.insert(0, str(ROOT))
    from lifeline.bench.html import line_chart

    unit = 60.0 if width_s >= 60 else 1.0
    series = {name: [((r["start_s"] + width_s / 2) / unit, r[key]) for r in rows]
              for name, key in (("p50", "p50_ms"), ("p99", "p99_ms"))}
    figure = line_chart("Soak: end-to-end latency of normal requests over time", series,
                        "minutes into the run" if unit == 60 else "seconds into the run",
                        "latency ms")
    match = re.search(r"<svg.*</svg>", figure, re.DOTALL)
    if match:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(match[0].replace("<svg ", '<svg style="background:#fff" ', 1) + "\n")


def summarize(soak: Soak, kv: dict[str, Any], health: int | None,
              duration_s: float) -> dict[str, Any]:
    measured = [r for r in soak.results if not r.warmup]
    kinds: dict[str, Any] = {}
    for kind in MIX:
        rs = [r for r in measured if r.kind == kind]
        kinds[kind] = {"sent": len(rs), "as_expected": sum(r.expected for r in rs),
                       "unexpected": sum(not r.expected for r in rs),
                       "outcomes": dict(Counter(r.outcome for r in rs).most_common())}
    bad_names = Counter(f"{r.detail}: {r.outcome}" for r in measured
                        if r.kind == "bad" and not r.expected)
    rss = soak.rss
    start_kb = rss[0][1] if rss else None
    mid_kb = min(rss, key=lambda s: abs(s[0] - duration_s / 2))[1] if rss else None
    end_kb = rss[-1][1] if rss else None
    peak_kb = max(kb for _, kb in rss) if rss else None
    hangs = sum(r.outcome == "hang" for r in soak.results)
    broken = sum(r.outcome == "transport_error" for r in soak.results)
    rss_ok = bool(start_kb) and peak_kb <= start_kb * (1 + RSS_TOLERANCE)
    kv_ok = kv["idle"] and kv["end"] <= kv["baseline"] + KV_EPSILON
    return {
        "kinds": kinds, "unexpected_bad_inputs": dict(bad_names.most_common()),
        "rss_kb": {"start": start_kb, "middle": mid_kb, "end": end_kb, "peak": peak_kb},
        "kv_usage": kv, "health_at_end": health, "hangs": hangs, "transport_errors": broken,
        "requests": len(soak.results), "measured_requests": len(measured),
        "verdicts": {"nothing_lost": hangs == 0 and broken == 0, "rss_flat": rss_ok,
                     "kv_back_to_baseline": kv_ok, "healthy_at_end": health == 200},
    }


def report(summary: dict[str, Any], rows: list[dict[str, Any]], console: Any) -> None:
    from rich.table import Table

    t = Table(title="Requests by kind (after warm-up)")
    for col in ("kind", "sent", "as expected", "unexpected", "outcomes"):
        t.add_column(col, justify="left" if col in ("kind", "outcomes") else "right")
    for kind, k in summary["kinds"].items():
        outcomes = ", ".join(f"{o}: {n}" for o, n in k["outcomes"].items())
        t.add_row(kind, str(k["sent"]), str(k["as_expected"]), str(k["unexpected"]), outcomes)
    console.print(t)
    if summary["unexpected_bad_inputs"]:
        u = Table(title="Bad inputs answered otherwise than expected")
        u.add_column("input: status")
        u.add_column("count", justify="right")
        for name, n in summary["unexpected_bad_inputs"].items():
            u.add_row(name, str(n))
        console.print(u)
    m = Table(title="Server memory and KV")
    m.add_column("figure")
    m.add_column("value", justify="right")
    rss = summary["rss_kb"]
    for name in ("start", "middle", "end", "peak"):
        m.add_row(f"RSS {name} (MiB)", f"{rss[name] / 1024:.1f}" if rss[name] else "-")
    kv = summary["kv_usage"]
    m.add_row("KV held by requests, baseline", f"{kv['baseline']:.4%}")
    m.add_row("KV held by requests, end", f"{kv['end']:.4%}")
    console.print(m)
    lat = Table(title="Latency of normal requests per time bucket (by completion)")
    for col in ("from s", "requests", "e2e p50 ms", "e2e p99 ms", "first event p50 ms",
                "first event p99 ms"):
        lat.add_column(col, justify="right")
    for r in rows:
        lat.add_row(f"{r['start_s']:.0f}", str(r["requests"]),
                    *(f"{r[k]:.0f}" if r[k] is not None else "-"
                      for k in ("p50_ms", "p99_ms", "ttft_p50_ms", "ttft_p99_ms")))
    console.print(lat)
    v = summary["verdicts"]
    lines = [("nothing lost (hangs, broken requests)", v["nothing_lost"],
              f"{summary['hangs']} hangs, {summary['transport_errors']} broken"),
             (f"RSS flat within {RSS_TOLERANCE:.0%} after warm-up", v["rss_flat"],
              f"peak {rss['peak']} kB vs start {rss['start']} kB"),
             ("KV back to its baseline", v["kv_back_to_baseline"],
              f"{kv['end']:.4%} vs {kv['baseline']:.4%}"),
             ("server healthy at the end", v["healthy_at_end"],
              f"/health {summary['health_at_end']}")]
    for name, ok, detail in lines:
        console.print(f"{'[green]PASS' if ok else '[red]FAIL'}[/] {name}: {detail}")


async def soak_run(server: Server, args: argparse.Namespace, console: Any) -> dict[str, Any]:
    import httpx
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as c:
        card = (await c.get("/v1/models")).json()["data"][0]
        vocab = await vocab_size(c)
        soak = Soak(f"http://127.0.0.1:{server.port}", server.proc.pid, args,
                    bad_inputs(card["max_model_len"], vocab), random.Random(args.seed))
        if args.skip_bad:
            soak.bad = [b for b in soak.bad if b.name not in args.skip_bad.split(",")]
        soak.t0 = time.perf_counter()
        console.print(f"warm-up: {args.warmup_s:.0f} s with the same mix")
        await drive(soak, args.warmup_s, args.max_requests)
        baseline, idle = await idle_kv(c)
        duration = args.minutes * 60
        soak.warmup, soak.t0 = False, time.perf_counter()
        soak.rss.append((soak.now(), rss_kb(soak.pid)))
        columns = (TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("soak", total=duration)
            await drive(soak, duration, args.max_requests, progress, task)
        end, idle_end = await idle_kv(c)
        soak.rss.append((soak.now(), rss_kb(soak.pid)))
        try:
            health = (await c.get("/health", timeout=5)).status_code
        except httpx.HTTPError:
            health = None
    kv = {"baseline": baseline, "end": end, "idle": idle and idle_end}
    summary = summarize(soak, kv, health, duration)
    rows = buckets(soak.results, args.bucket_s)
    report(summary, rows, console)
    if args.svg:
        write_svg(rows, args.svg, args.bucket_s)
        console.print(f"latency plot: {args.svg}")
    return {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "mix": MIX, "summary": summary, "latency_buckets": rows,
            "rss_samples_kb": soak.rss, "results": [asdict(r) for r in soak.results]}


def lifeline_serve(args: argparse.Namespace) -> Server:
    port = free_port()
    argv = [sys.executable, "-m", "lifeline.cli", "serve", "--port", str(port),
            "--enable-fault-injection", "--kv-cache-memory-bytes", args.kv_cache_memory_bytes,
            "--compile" if args.compile else "--no-compile", *args.serve_arg]
    if args.model:
        argv += ["--model", args.model]
    env = {"OMP_NUM_THREADS": str(THREADS), "PYTHONPATH": str(ROOT)}
    return Server("lifeline", argv, port, "/ready", env)


def main() -> None:
    from rich.console import Console

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--max-requests", type=int, default=200_000,
                   help="stop early after this many requests")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="client timeout per request; a request that reaches it is a hang")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="warm-up before RSS and KV baselines (default: 10%% of the run, 10-120 s)")
    p.add_argument("--bucket-s", type=float, default=None,
                   help="latency bucket (default: 60 s, or 10 s for runs under 5 minutes)")
    p.add_argument("--rss-every", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None)
    p.add_argument("--kv-cache-memory-bytes", default="512MiB")
    p.add_argument("--compile", action="store_true",
                   help="serve through torch.compile (default off: the soak measures "
                        "reliability; compiling only lengthens the start)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more argument for `lifeline serve` (repeat)")
    p.add_argument("--skip-bad", default="",
                   help="comma-separated names of bad inputs to leave out (a server that "
                        "does not refuse them yet runs them at full cost)")
    p.add_argument("--json", type=Path)
    p.add_argument("--svg", type=Path, default=ROOT / "docs" / "img" / "soak_latency.svg")
    args = p.parse_args()
    if args.warmup_s is None:
        args.warmup_s = min(120.0, max(10.0, args.minutes * 6))
    if args.bucket_s is None:
        args.bucket_s = 60.0 if args.minutes >= 5 else 10.0
    console = Console()
    console.print(f"lifeline serve, {args.workers} workers, {args.minutes:g} min; "
                  f"pid {os.getpid()}")
    with lifeline_serve(args) as server:
        out = asyncio.run(soak_run(server, args, console))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
        console.print(f"results: {args.json}")
    if not all(out["summary"]["verdicts"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
