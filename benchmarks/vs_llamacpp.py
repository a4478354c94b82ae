"""Lifeline against llama.cpp's own server, same GGUF, same 2 threads, same machine, one run.

    .venv/bin/python benchmarks/vs_llamacpp.py --llama-server PATH/TO/llama-server [--quick]
        [--model FILE.gguf] [--weights FORMAT] [--json out.json] [--only users16,single,...]
    .venv/bin/python benchmarks/vs_llamacpp.py --lifeline-only --only prefix [--quick]

`--lifeline-only` runs Lifeline's side alone (no llama.cpp binary needed; the ratio column is
then empty).

Installs nothing and imports nothing heavy at import time. It starts each server on loopback as
a subprocess (llama.cpp: `llama-server -t 2 -np N -c C`, 2,048 tokens
per slot, or -np 32 -c 16384 for the SLO search as the issue sets it; Lifeline: `lifeline serve`), one
server at a time, runs `lifeline bench` against it as a subprocess, stops it, and prints the
ratio table (Lifeline ÷ llama.cpp; for latencies, llama.cpp ÷ Lifeline, so > 1 always means
Lifeline is better). Workloads (issue 6):

- `users16`: 16 concurrent streaming users, 128-token prompts, 64 output tokens pinned with
  `ignore_eos`: total output tokens/s (`llama-server -np 16`).
- `single`: one user, 128-token prompts, 128 output tokens: decode tokens/s (1000 / mean TPOT).
- `ttft512`: one user, 512-token prompts, 1 output token: TTFT p50.
- `prefix`: 16 users in a closed loop sharing a 1,000-token system prompt, each turn a distinct
  32-token suffix, 16 output tokens: TTFT p90 — Lifeline with prefix caching on and off, and
  llama.cpp (whose slots keep their own prompt cache).
- `slo`: Concurrent Users @ SLO (`--slo ttft=2s,tpot=200ms`, 90% attainment, 128/64 tokens),
  found by `lifeline bench --find-max-users` (`llama-server -np 32 -c 16384`).
- `busy`: `single` while another process keeps one of the two cores busy (a Python loop,
  started after the server is ready and stopped after the run): token gap p50 and p90/p50.

`single` and `busy` also report the token gap (p50 ms, p90/p50) and the memory-bandwidth
ceiling: the bytes one decode step reads (every weight matrix once: llama.cpp the GGUF's own
blocks, Lifeline its format's int8 or blocks, `step_bytes`) divided by the machine's read
bandwidth, measured (`read_bandwidth`: 2 threads summing 512 MiB, best of 5) just before each
server's run, so the fraction of the ceiling each server reaches is its own run's. Machines of
this kind drift (the bandwidth moved 2x within an hour in one session): `--rounds N` runs the
servers in turn N times and prints every round's ratio.

`--quick` uses fewer requests (about 5 minutes for all but `slo`; `slo` adds about 10).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Self

ROOT = Path(__file__).resolve().parents[1]
THREADS = 2
WORKLOADS = ("users16", "single", "ttft512", "prefix", "slo", "busy")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server subprocess on loopback; `with Server(...) as s:` waits until it answers."""

    def __init__(self, name: str, argv: list[str], port: int, ready_path: str,
                 env: dict[str, str] | None = None, log: Path | None = None):
        self.name, self.argv, self.port, self.ready_path = name, argv, port, ready_path
        self.env = {**os.environ, **(env or {})}
        self.log = log or Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> Self:
        import httpx

        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                r = httpx.get(f"http://127.0.0.1:{self.port}{self.ready_path}", timeout=2)
                if r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"{self.name} did not become ready in 300 s; see {self.log}")

    def resident_mib(self) -> dict[str, float]:
        """The server process's resident memory now and at its peak (/proc, MiB)."""
        fields = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields["rss" if key == "VmRSS" else "peak"] = int(value.split()[0]) / 1024
        return fields

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def llama_server(binary: Path, model: Path, slots: int, ctx: int) -> Server:
    port = free_port()
    env = {"LD_LIBRARY_PATH": f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    # --metrics: the bench scrapes both servers' /metrics alike (every 0.2 s; without it
    # llama-server has none, and only Lifeline paid for being scraped)
    argv = [str(binary), "-m", str(model), "-t", str(THREADS), "-tb", str(THREADS),
            "-np", str(slots), "-c", str(ctx), "--metrics", "--host", "127.0.0.1", "--port",
            str(port)]
    return Server(f"llama.cpp -np {slots}", argv, port, "/health", env)


def lifeline_server(model: Path, weights: str | None, extra: list[str] = (),
                    slots: int | None = None, ctx: int | None = None) -> Server:
    """`lifeline serve` with llama.cpp's `-np` and `-c` where given: as many running requests
    (`--max-num-seqs`) and a KV cache sized by need for the same context (`--max-model-len`)."""
    port = free_port()
    same = ([*(["--max-num-seqs", str(slots)] if slots else []),
             *(["--max-model-len", str(ctx)] if ctx else [])])
    argv = [sys.executable, "-m", "lifeline.cli", "serve", "--model", str(model), "--port",
            str(port), *(["--weights", weights] if weights else []), *same,
            "--no-compile-in-background", *extra]  # measured compiled, never mid-compile
    env = {"OMP_NUM_THREADS": str(THREADS), "PYTHONPATH": str(ROOT)}
    label = "lifeline" + (" " + " ".join(extra) if extra else "")
    return Server(label, argv, port, "/ready", env)


def bench(server: Server, args: list[str]) -> dict[str, Any]:
    """`lifeline bench` against `server`; its JSON results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "lifeline.cli", "bench", "--url", server.url, "--quiet",
               "--json", str(out), *args]
        done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=3600, check=False)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"bench against {server.name} failed:\n{done.stderr[-2000:]}")
        return json.loads(out.read_text())


def read_bandwidth() -> float:
    """The machine's read bandwidth now, GB/s, with the servers' 2 threads
    (`lifeline.plan.calibrate.measure_bandwidth`: 512 MiB summed, best of 5), in a subprocess:
    this script imports nothing heavy."""
    code = (f"import torch; torch.set_num_threads({THREADS})\n"
            "from lifeline.plan.calibrate import measure_bandwidth\n"
            "print(measure_bandwidth() / 1e9)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    return float(out.stdout.strip())


def step_bytes(model: Path, weights: str | None) -> dict[str, float]:
    """Bytes one decode step reads from the weights, per server: every 2-D weight once, the
    output head included (the token embedding where the head is tied to it); norms and the
    KV cache (a few MB at these contexts) left out. llama.cpp reads the file's blocks; Lifeline
    int8 (one byte a value) under `int8-all`/`int8`, the file's blocks under `gguf` and, for
    the one-row step, `gguf-int8` (its head int8 in all). `weights` None: `lifeline serve`'s
    default."""
    sys.path.insert(0, str(ROOT))
    from lifeline.cli import DEFAULT_WEIGHTS
    from lifeline.model.gguf_reader import GGUFReader

    weights = weights or DEFAULT_WEIGHTS

    tensors = {t.name: t for t in GGUFReader(str(model), skip=("tokenizer.",)).tensors}
    head = tensors.get("output.weight") or tensors["token_embd.weight"]
    layers = [t for name, t in tensors.items() if name.startswith("blk.") and len(t.shape) == 2]
    values = lambda t: int(t.shape[0]) * int(t.shape[1])  # noqa: E731
    ours_layers = sum(t.n_bytes for t in layers) if weights in ("gguf", "gguf-int8") else \
        sum(values(t) for t in layers)
    return {"llama.cpp": sum(t.n_bytes for t in layers) + head.n_bytes,
            "lifeline": ours_layers + values(head)}


class Busy:
    """Another process keeping one core busy (a Python loop) while the block runs."""

    def __enter__(self) -> Self:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


IDLE_S = 1.5
"""Seconds each server idles after its run before its RSS is read: Lifeline hands the heap's
free pages back once idle for 0.5 s (lifeline/server/async_engine.py), so both are read at rest."""


def _runs(quick: bool) -> dict[str, dict[str, Any]]:
    n = 2 if quick else 1
    return {
        "users16": {"np": 16, "ctx": 32768, "args": ["--concurrency", "16", "--requests", str(64 // n),
                                       "--warmup", "16", "--input-tokens", "128",
                                       "--output-tokens", "64"]},
        "single": {"np": 16, "ctx": 32768, "args": ["--concurrency", "1", "--requests", str(8 // n),
                                      "--warmup", "1", "--input-tokens", "128",
                                      "--output-tokens", "128"]},
        "ttft512": {"np": 16, "ctx": 32768, "args": ["--concurrency", "1", "--requests", str(8 // n),
                                       "--warmup", "1", "--input-tokens", "512",
                                       "--output-tokens", "1"]},
        "prefix": {"np": 16, "ctx": 32768, "args": ["--concurrency", "16", "--requests", str(64 // n),
                                      "--warmup", "16", "--prefix-groups", "1",
                                      "--prefix-tokens", "1000", "--input-tokens", "1032",
                                      "--output-tokens", "16"]},
        "busy": {"np": 16, "ctx": 32768, "busy": True,
                 "args": ["--concurrency", "1", "--requests", str(8 // n), "--warmup", "1",
                          "--input-tokens", "128", "--output-tokens", "128"]},
        "slo": {"np": 32, "ctx": 16384, "args": ["--find-max-users", "--max-users", "64",
                                   "--slo", "ttft=2s,tpot=200ms", "--slo-attainment", "0.9",
                                   "--input-tokens", "128", "--output-tokens", "64",
                                   "--requests", str(48 // n)]},
    }


def _figures(name: str, result: dict[str, Any]) -> dict[str, float | None]:
    s = result["summary"]
    if name == "users16":
        return {"output tok/s": s["output_throughput_tok_s"]}
    if name in ("single", "busy"):
        gap = s.get("tbt_ms") or {}
        return {"decode tok/s": 1000 / s["tpot_ms"]["mean"] if s["tpot_ms"]["mean"] else None,
                "token gap p50 ms": gap.get("p50"),
                "token gap p90/p50": gap["p90"] / gap["p50"] if gap.get("p50") else None}
    if name == "ttft512":
        return {"TTFT p50 ms": s["ttft_ms"]["p50"]}
    if name == "prefix":
        return {"TTFT p90 ms": s["ttft_ms"]["p90"]}
    search = result.get("search") or {}
    return {"users @ SLO": search.get("max_users")}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from rich.console import Console

    console = Console()
    runs = _runs(args.quick)
    per_step = step_bytes(args.model, args.weights)
    rows = []
    for name in args.only:
        spec = runs[name]
        servers = [("llama.cpp", lambda s=spec: llama_server(args.llama_server, args.model,
                                                              s["np"], s["ctx"])),
                   ("lifeline", lambda s=spec: lifeline_server(args.model, args.weights,
                                                               slots=s["np"], ctx=s["ctx"]))]
        if args.lifeline_only:
            servers = servers[1:]
        if name == "prefix":
            servers.append(("lifeline, no prefix cache", lambda s=spec: lifeline_server(
                args.model, args.weights, ["--no-prefix-caching"], s["np"], s["ctx"])))
        rounds = []
        for _ in range(args.rounds):
            figures, memory, bandwidth = {}, {}, {}
            for label, make in servers:
                console.print(f"[bold]{name}[/]: {label} …")
                started = time.monotonic()
                if name in ("single", "busy"):
                    bandwidth[label] = read_bandwidth()
                with make() as server:
                    with Busy() if spec.get("busy") else contextlib.nullcontext():
                        figures[label] = _figures(name, bench(server, spec["args"]))
                    time.sleep(IDLE_S)
                    memory[label] = server.resident_mib()
                if label in bandwidth and figures[label].get("decode tok/s"):
                    ceiling = bandwidth[label] * 1e9 / per_step[label.split(",")[0]]
                    figures[label]["of bandwidth ceiling"] = figures[label]["decode tok/s"] / ceiling
                console.print(f"  {figures[label]}, {memory[label]} MiB, "
                              f"{bandwidth.get(label, 0):.1f} GB/s "
                              f"({time.monotonic() - started:.0f} s)")
            rounds.append({"figures": figures, "resident_mib": memory,
                           "read_gb_s": bandwidth})
        rows.append({"workload": name, "bench_args": spec["args"], "rounds": rounds,
                     "step_bytes": per_step if name in ("single", "busy") else None,
                     # the last round's, as one run printed them before --rounds
                     "figures": rounds[-1]["figures"], "resident_mib": rounds[-1]["resident_mib"]})
    return rows


def _ratio(workload: str, ours: float | None, theirs: float | None, key: str = "") -> str:
    if not ours or not theirs:
        return "-"
    lower_is_better = workload in ("ttft512", "prefix") or key.startswith("token gap")
    value = theirs / ours if lower_is_better else ours / theirs
    return f"{value:.2f}×"


def table(rows: list[dict[str, Any]]) -> None:
    """One line per figure: each server's median over the rounds, and every round's ratio."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Lifeline vs llama.cpp (> 1× means Lifeline is better)")
    for col in ("workload", "figure", "llama.cpp", "lifeline", "ratio (each round)", "other"):
        t.add_column(col, justify="right")
    for row in rows:
        rounds = row.get("rounds") or [{"figures": row["figures"],
                                        "resident_mib": row["resident_mib"]}]
        for i, key in enumerate(rounds[0]["figures"]["lifeline"]):
            theirs = _median([r["figures"].get("llama.cpp", {}).get(key) for r in rounds])
            ours = _median([r["figures"]["lifeline"].get(key) for r in rounds])
            ratios = " ".join(_ratio(row["workload"], r["figures"]["lifeline"].get(key),
                                     r["figures"].get("llama.cpp", {}).get(key), key)
                              for r in rounds)
            if key == "of bandwidth ceiling":
                ratios, bw = "", [r.get("read_gb_s", {}) for r in rounds]
                extra = "read GB/s " + ", ".join(f"{k} {_median([b.get(k) for b in bw]):.1f}"
                                                 for k in bw[0])
                extra += "; MB a step " + ", ".join(f"{k} {v / 1e6:,.0f}"
                                                    for k, v in row["step_bytes"].items())
            elif i == 0 and "lifeline, no prefix cache" in rounds[0]["figures"]:
                other = _median([r["figures"]["lifeline, no prefix cache"].get(key)
                                 for r in rounds])
                extra = f"no prefix cache {other:,.0f} ({_ratio('prefix', ours, other)} better with)"
            else:
                extra = ""
            fmt = _percent if key == "of bandwidth ceiling" else _fmt
            t.add_row(row["workload"] if i == 0 else "", key, fmt(theirs), fmt(ours), ratios,
                      extra)
        mem = rounds[-1].get("resident_mib") or {}
        theirs, ours = mem.get("llama.cpp", {}).get("rss"), mem.get("lifeline", {}).get("rss")
        t.add_row("", "RSS after, MiB", _fmt(theirs), _fmt(ours),
                  f"{ours / theirs:.2f}× theirs" if ours and theirs else "-",
                  "peak " + ", ".join(f"{k} {v.get('peak', 0):,.0f}" for k, v in mem.items()))
    Console(width=150).print(t)


def _median(values: list[float | None]) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def _percent(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.2f}" if abs(v) < 10 else f"{v:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="llama.cpp's llama-server binary")
    parser.add_argument("--lifeline-only", action="store_true",
                        help="run only Lifeline's servers (no llama.cpp)")
    parser.add_argument("--model", type=Path, default=None,
                        help="GGUF file (default: the default model, Gemma 3 270M)")
    parser.add_argument("--weights", default=None,
                        help="Lifeline's --weights (default: `lifeline serve`'s own default)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the servers in turn this many times per workload")
    parser.add_argument("--only", type=lambda s: s.split(","),
                        default=[w for w in WORKLOADS if w != "busy"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.llama_server is None and not args.lifeline_only:
        parser.error("--llama-server is required unless --lifeline-only")
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from lifeline.model.default import default_model_path

        args.model = Path(default_model_path())
    unknown = set(args.only) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {WORKLOADS}")
    rows = run(args)
    table(rows)
    if args.json:
        args.json.write_text(json.dumps({
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "llama_server": None if args.lifeline_only else str(args.llama_server),
            "model": str(args.model),
            "weights": args.weights or "lifeline serve default", "threads": THREADS, "quick": args.quick, "rounds": args.rounds, "rows": rows},
            indent=1))


if __name__ == "__main__":
    main()
