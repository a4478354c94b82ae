"""Cold and warm starts of `lifeline serve`, phase by phase.

Cases: one model (SmolLM2-135M-Instruct, Gemma 3 270M, each `lifeline serve --model NAME`)
and `make serve`'s two behind one server (configs/serve.toml). Each case starts once cold, with
every cache a start writes new and empty (Inductor's caches and Lifeline's compiled graphs in a
fresh directory: a fresh clone's first start after `make install`, which builds Lifeline's C++
operators), then `--warm` more times
with those same caches: a second start.

A start is timed from the spawn to the first 200 from `/ready` (polled every 50 ms). The phases
are the server's own (`/ready`'s `startup_seconds`, lifeline.engine.startup): read weights,
native ops, weight format, KV pools, compile and warm-up, other (imports, the app, the chat
template); `make serve`'s two models load at once on two engine threads, so their phases
overlap. RSS is the server's at `/ready`, and once the forward runs compiled ("compiled RSS":
`gguf-int8`'s int8 copies are built after `/ready`, from float32 weights held until then).

    python benchmarks/startup.py [--case smollm2 --case gemma --case make-serve] [--warm 2]
        [--json results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import THREADS, machine  # noqa: E402
from benchmarks.vs_llamacpp import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "smollm2": ["--model", "smollm2-135m-instruct"],
    "gemma": ["--model", "gemma-3-270m"],
    "make-serve": ["--config", str(ROOT / "configs" / "serve.toml")],
}
PHASES = ("read_weights", "native_ops", "weight_format", "kv_pools", "compile_warmup", "other")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _compiling(body: dict[str, Any]) -> bool:
    forward = body.get("forward")
    states = forward.values() if isinstance(forward, dict) else [forward]
    return "compiling" in states or "loading" in states


def _decode_tok_s(port: int) -> float:
    """One user's decode speed now: a greedy 64-token completion, the server's own timing."""
    base = f"http://127.0.0.1:{port}"
    model = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
    start = time.perf_counter()
    r = httpx.post(base + "/v1/completions", timeout=300, json={
        "model": model, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0,
        "ignore_eos": True})
    wall = time.perf_counter() - start
    r.raise_for_status()
    body = r.json()
    speed = (body.get("timings") or {}).get("decode_tok_s")
    if speed is None:  # the gateway's answer: the client's clock, prefill included
        speed = body["usage"]["completion_tokens"] / wall
    return float(speed)


def start_once(case: str, caches: Path, log: Path, extra: list[str] = (),
               probe: int = 0) -> dict[str, Any]:
    port = free_port()
    argv = [sys.executable, "-m", "lifeline.cli", "serve", *CASES[case], "--port", str(port),
            *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "PYTHONPATH": str(ROOT),
           "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
           "LIFELINE_CACHE_DIR": str(caches / "lifeline")}
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{case} exited ({proc.returncode}); see {log}")
            if time.perf_counter() - start > 900:
                raise RuntimeError(f"{case} not ready in 900 s; see {log}")
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - start
        body = r.json()
        rss = _rss_mib(proc.pid)
        compiled = ready
        while_compiling: list[float] = []
        while _compiling(body):  # serving eagerly while a child compiles: until it has
            if time.perf_counter() - start > 900:
                raise RuntimeError(f"{case} still compiling after 900 s; see {log}")
            if len(while_compiling) < probe:
                while_compiling.append(_decode_tok_s(port))
            else:
                time.sleep(0.2)
            body = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).json()
            compiled = time.perf_counter() - start
        rss_compiled = _rss_mib(proc.pid)  # the background's work done (weights, graphs)
        after = [_decode_tok_s(port) for _ in range(3)] if probe else []
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    phases = body.get("startup_seconds") or {}
    if phases and all(isinstance(v, dict) for v in phases.values()):  # the gateway's, by backend
        by_backend = phases
        phases = {p: max(b.get(p, 0.0) for b in by_backend.values()) for p in PHASES}
    else:
        by_backend = None
    return {"case": case, "ready_s": ready, "compiled_s": compiled, "phases": phases,
            "by_backend": by_backend, "rss_mib": rss, "rss_compiled_mib": rss_compiled,
            "forward": body.get("forward"),
            "decode_tok_s_while_compiling": while_compiling, "decode_tok_s_after": after}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    ap.add_argument("--warm", type=int, default=2, help="warm starts after the cold one")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--foreground", action="store_true",
                    help="compile before /ready (--no-compile-in-background), as before "
                         "background compiles")
    ap.add_argument("--probe", type=int, default=0, metavar="N",
                    help="measure one user's decode (64 tokens, greedy) N times in a row while "
                         "the forward compiles in the background (then leave it the machine), "
                         "and 3 times once compiled")
    args = ap.parse_args(argv)
    cases = args.case or ["smollm2", "gemma", "make-serve"]
    console = Console(width=150)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    console.print(f"machine: {machine()}; commit {commit}")
    results = []
    with tempfile.TemporaryDirectory(prefix="lifeline-startup-") as tmp:
        log = Path(tmp) / "servers.log"
        for case in cases:
            caches = Path(tmp) / case
            for i in range(1 + args.warm):
                label = "cold" if i == 0 else f"warm {i}"
                with console.status(f"{case}: {label} start"):
                    r = start_once(case, caches, log, ["--no-compile-in-background"]
                                   if args.foreground else [], args.probe)
                r["start"] = label
                results.append(r)
                console.print(f"{case} {label}: ready in {r['ready_s']:.1f} s")
        table = Table(title="lifeline serve: spawn to /ready (s), by phase")
        for col in ("case", "start", "ready", "compiled", *PHASES, "RSS MiB", "compiled RSS"):
            table.add_column(col.replace("_", " "), justify="left" if col in ("case", "start")
                             else "right")
        for r in results:
            table.add_row(r["case"], r["start"], f"{r['ready_s']:.1f}", f"{r['compiled_s']:.1f}",
                          *(f"{r['phases'].get(p, 0.0):.1f}" for p in PHASES),
                          f"{r['rss_mib']:.0f}", f"{r['rss_compiled_mib']:.0f}")
        console.print(table)
        probed = [r for r in results if r["decode_tok_s_after"]]
        if probed:
            speed = Table(title="one user's decode, tok/s (64 tokens, greedy; median)")
            for col in ("case", "start", "while compiling", "requests", "compiled"):
                speed.add_column(col)
            for r in probed:
                during = r["decode_tok_s_while_compiling"]
                speed.add_row(r["case"], r["start"],
                              f"{statistics.median(during):.1f}" if during else "-",
                              str(len(during)), f"{statistics.median(r['decode_tok_s_after']):.1f}")
            console.print(speed)
        if any(r["by_backend"] for r in results):
            console.print("make-serve's phases are the slower backend's, per phase (the two "
                          "load at once)")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "commit": commit,
                                         "date": time.strftime("%Y-%m-%d %H:%M"),
                                         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
