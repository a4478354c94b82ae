"""Schema fuzzing of the served API: schemathesis generates requests from OpenAI's published
OpenAPI document, restricted to the routes Lifeline serves, and sends them to a real
`lifeline serve` on loopback (issue 27).

    .venv/bin/python benchmarks/fuzz_api.py --spec openai-openapi/openapi.yaml \
        [--st /path/to/venv/bin/st] [--max-examples 150] [--json out.json]

- The spec is not in this repository: `git clone https://github.com/openai/openai-openapi`
  (its `openapi.yaml`). Schemathesis is not a dependency of Lifeline either: install it in a
  venv of its own (`python3 -m venv st && st/bin/pip install schemathesis`) and pass its `st`.
- Routes: POST /chat/completions, POST /completions, GET /models, GET /models/{model}.
  Positive and negative cases (`--mode all`), every phase but stateful; the hooks
  (benchmarks/fuzz_api_hooks.py) cap `max_tokens` at `--max-tokens` and `n` at 4, name the
  served model in seven cases of eight, log every answered case and check that each 4xx has
  the OpenAI error shape.
- The server: SmolLM2-135M-Instruct (`--model` to change), `--default-max-tokens` as the cap.

Prints the cases by operation and status class, every 5xx with the request that caused it, the
checks schemathesis failed, and the server's state after the run (/health, requests still
running, KV blocks back at idle, RSS). Exit status 1 when any case got a server error.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine  # noqa: E402
from vs_llamacpp import ROOT, THREADS, Server, free_port  # noqa: E402

OPERATION_IDS = ("createChatCompletion", "createCompletion", "listModels", "retrieveModel")
"""POST /chat/completions, POST /completions, GET /models, GET /models/{model}."""


def gauge(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    match = re.search(rf"^lifeline:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


def rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE).group(1)) / 1024


def idle(base: str, wait_s: float = 30.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if gauge(base, "num_requests_running") + gauge(base, "num_requests_waiting") == 0:
            return True
        time.sleep(0.2)
    return False


def st_command(args: argparse.Namespace, url: str, report_dir: Path) -> list[str]:
    include = [a for op in OPERATION_IDS for a in ("--include-operation-id", op)]
    return [args.st, "run", str(args.spec), "--url", url, *include,
            "--mode", "all", "--phases", "examples,coverage,fuzzing",
            "--max-examples", str(args.max_examples), "--seed", str(args.seed),
            "--checks", "not_a_server_error,openai_error_shape",
            "--workers", str(args.workers), "--request-timeout", str(args.timeout),
            "--continue-on-failure", "--suppress-health-check", "all",
            "--generation-database", "none", "--no-color",
            "--report", "junit", "--report-dir", str(report_dir)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", type=Path, required=True,
                   help="OpenAI's openapi.yaml (github.com/openai/openai-openapi)")
    p.add_argument("--st", default=shutil.which("st") or "st",
                   help="schemathesis' CLI (default: `st` on PATH)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-examples", type=int, default=150,
                   help="cases per operation and phase (schemathesis -n)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=27)
    p.add_argument("--min-cases", type=int, default=500,
                   help="fewer answered cases than this is a failed run")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    console = Console()
    console.print(f"machine: {machine()}")

    port = free_port()
    argv = [sys.executable, "-m", "lifeline.cli", "serve", "--model", args.model, "--port",
            str(port), "--default-max-tokens", str(args.max_tokens), "--no-compile",
            "--kv-cache-memory-bytes", "256MiB"]
    env = {"OMP_NUM_THREADS": str(THREADS), "PYTHONPATH": str(ROOT)}
    work = Path(tempfile.mkdtemp(prefix="fuzz-api-"))
    log = work / "calls.jsonl"
    with Server("lifeline", argv, port, "/ready", env) as server:
        base = f"http://127.0.0.1:{port}"
        served = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        kv_before = gauge(base, "kv_cache_usage_perc")
        rss_before = rss_mib(server.proc.pid)
        st_env = {**os.environ, "SCHEMATHESIS_HOOKS": str(Path(__file__).with_name(
            "fuzz_api_hooks.py")), "LIFELINE_FUZZ_LOG": str(log), "LIFELINE_FUZZ_MODEL": served,
            "LIFELINE_FUZZ_MAX_TOKENS": str(args.max_tokens)}
        cmd = st_command(args, base + "/v1", work / "report")
        console.print("$ " + " ".join(cmd[:3]) + " ...")
        t0 = time.monotonic()
        st = subprocess.run(cmd, env=st_env, cwd=work, capture_output=True, text=True)
        elapsed = time.monotonic() - t0
        back_idle = idle(base)
        kv_after = gauge(base, "kv_cache_usage_perc")
        health = httpx.get(base + "/health", timeout=5).status_code
        rss_after = rss_mib(server.proc.pid)
        alive = server.proc.poll() is None

    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    by_op: dict[str, Counter] = defaultdict(Counter)
    for c in calls:
        by_op[c["operation"]][f"{c['status'] // 100}xx"] += 1
    table = Table(title=f"{len(calls)} cases against lifeline serve ({served}) in "
                        f"{elapsed:.0f} s")
    for col in ("operation", "cases", "2xx", "4xx", "5xx", "other"):
        table.add_column(col, justify="left" if col == "operation" else "right")
    for op in sorted(by_op):
        n = by_op[op]
        other = sum(v for k, v in n.items() if k not in ("2xx", "4xx", "5xx"))
        table.add_row(op, str(sum(n.values())), str(n["2xx"]), str(n["4xx"]), str(n["5xx"]),
                      str(other))
    console.print(table)
    errors = [c for c in calls if c["status"] >= 500]
    statuses = Counter(c["status"] for c in calls)
    console.print("statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())))
    codes = Counter((c["operation"], c["status"], c.get("code"), c.get("param"))
                    for c in calls if 400 <= c["status"] < 500)
    refusals = Table(title="the 4xx answers by error code and param (the most frequent 25)")
    for col in ("operation", "status", "code", "param", "cases"):
        refusals.add_column(col, justify="right" if col == "cases" else "left")
    for (op, status, code, param), n in codes.most_common(25):
        refusals.add_row(op, str(status), str(code), str(param), str(n))
    console.print(refusals)
    for c in errors[:20]:
        console.print(f"[red]{c['status']}[/red] {c['operation']}: {c.get('body', '')[:300]}\n"
                      f"  request: {c.get('request', '')[:300]}")
    failed_checks = sorted(set(re.findall(r"^\s*(?:\d+\.\s+)?([A-Z][^\n]{0,120}?)\s*$",
                                          _failures(st.stdout), re.MULTILINE)))
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
        "cases": len(calls), "server_errors": len(errors), "statuses": dict(statuses),
        "by_operation": {k: dict(v) for k, v in by_op.items()},
        "refusals": [[*k, n] for k, n in codes.most_common()],
        "st_exit": st.returncode, "elapsed_s": round(elapsed, 1),
        "after": {"health": health, "alive": alive, "idle": back_idle,
                  "kv_usage_before": kv_before, "kv_usage_after": kv_after,
                  "rss_mib_before": round(rss_before), "rss_mib_after": round(rss_after)}}
    console.print(f"after the run: /health {health}, idle {back_idle}, KV usage "
                  f"{kv_before:.4f} -> {kv_after:.4f}, RSS {rss_before:.0f} -> "
                  f"{rss_after:.0f} MiB")
    tail = _failures(st.stdout)
    if tail:
        console.print("[bold]schemathesis' failures[/bold] (tail):\n" + tail[-6000:])
    console.print(f"schemathesis' output: {work}/st.log; its JUnit report: {work}/report")
    (work / "st.log").write_text(st.stdout + st.stderr)
    if args.json:
        args.json.write_text(json.dumps({**summary, "failed_check_lines": failed_checks,
                                         "server_error_cases": errors}, indent=1))
    ok = len(calls) >= args.min_cases and not errors and alive and health == 200 and back_idle and kv_after <= kv_before
    console.print(("[green]PASS[/green]" if ok else "[red]FAIL[/red]") +
                  f": {len(errors)} server errors over {len(calls)} cases "
                  f"(at least {args.min_cases} wanted)")
    return 0 if ok else 1


def _failures(out: str) -> str:
    start = out.find("FAILURES")
    return out[start:] if start >= 0 else ""


if __name__ == "__main__":
    sys.exit(main())
