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

`--quick` uses fewer requests (about 5 minutes for all but `slo`; `slo` adds about 10).
"""
from __future__ import annotations

import argparse
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
WORKLOADS = ("users16", "single", "ttft512", "prefix", "slo")


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
    argv = [str(binary), "-m", str(model), "-t", str(THREADS), "-tb", str(THREADS),
            "-np", str(slots), "-c", str(ctx), "--host", "127.0.0.1", "--port", str(port)]
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
        "slo": {"np": 32, "ctx": 16384, "args": ["--find-max-users", "--max-users", "64",
                                   "--slo", "ttft=2s,tpot=200ms", "--slo-attainment", "0.9",
                                   "--input-tokens", "128", "--output-tokens", "64",
                                   "--requests", str(48 // n)]},
    }


def _figures(name: str, result: dict[str, Any]) -> dict[str, float | None]:
    s = result["summary"]
    if name == "users16":
        return {"output tok/s": s["output_throughput_tok_s"]}
    if name == "single":
        return {"decode tok/s": 1000 / s["tpot_ms"]["mean"] if s["tpot_ms"]["mean"] else None}
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
        figures, memory = {}, {}
        for label, make in servers:
            console.print(f"[bold]{name}[/]: {label} …")
            started = time.monotonic()
            with make() as server:
                figures[label] = _figures(name, bench(server, spec["args"]))
                memory[label] = server.resident_mib()
            console.print(f"  {figures[label]}, {memory[label]} MiB "
                          f"({time.monotonic() - started:.0f} s)")
        rows.append({"workload": name, "bench_args": spec["args"], "figures": figures,
                     "resident_mib": memory})
    return rows


def _ratio(workload: str, ours: float | None, theirs: float | None) -> str:
    if not ours or not theirs:
        return "-"
    lower_is_better = workload in ("ttft512", "prefix")
    value = theirs / ours if lower_is_better else ours / theirs
    return f"{value:.2f}×"


def table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Lifeline vs llama.cpp (> 1× means Lifeline is better)")
    for col in ("workload", "figure", "llama.cpp", "lifeline", "ratio", "other"):
        t.add_column(col, justify="right")
    for row in rows:
        figs = row["figures"]
        (key,) = figs["lifeline"].keys()
        theirs, ours = figs.get("llama.cpp", {}).get(key), figs["lifeline"][key]
        other = figs.get("lifeline, no prefix cache", {}).get(key)
        extra = (f"no prefix cache {other:,.0f} ({_ratio('prefix', ours, other)} better with)"
                 if other else "")
        t.add_row(row["workload"], key, _fmt(theirs), _fmt(ours),
                  _ratio(row["workload"], ours, theirs), extra)
        mem = row.get("resident_mib") or {}
        theirs, ours = mem.get("llama.cpp", {}).get("rss"), mem.get("lifeline", {}).get("rss")
        t.add_row("", "RSS after, MiB", _fmt(theirs), _fmt(ours),
                  f"{ours / theirs:.2f}× theirs" if ours and theirs else "-",
                  "peak " + ", ".join(f"{k} {v.get('peak', 0):,.0f}" for k, v in mem.items()))
    Console(width=140).print(t)


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


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
    parser.add_argument("--only", type=lambda s: s.split(","), default=list(WORKLOADS))
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
            "weights": args.weights or "lifeline serve default", "threads": THREADS, "quick": args.quick, "rows": rows},
            indent=1))


if __name__ == "__main__":
    main()
