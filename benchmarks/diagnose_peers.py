"""The diagnosis against causes made on purpose on the engines people run: llama.cpp's
`llama-server` and vLLM's CPU build, real servers on loopback, one at a time.

    .venv/bin/python benchmarks/diagnose_peers.py --llama-server PATH/llama-server \\
        --gguf SmolLM2-135M-Instruct.Q4_1.gguf \\
        [--vllm-python PATH/venv/bin/python --vllm-model HF_DIR] \\
        [--only slots,prefill,...] [--out DIR] [--capture tests/fixtures/peers]

Each scenario runs `lifeline bench` (sampling the server's `/metrics`, and llama.cpp's
`/slots`) against a server set up to produce one cause, and holds the cause the diagnosis ranks
first to a number measured another way in the same session: a control run with the limit
lifted, or the server's own counters and histograms (read here from the raw samples, not from
the join). `--capture` writes each scenario's results, trimmed, as the fixtures the CI tests
replay through the join and the diagnosis (tests/test_peer_diagnosis.py). How each engine was
built and started: ../shared/PEERS.md; the vLLM model is a same-shape directory with dummy
weights (`--load-format dummy`)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.vs_llamacpp import THREADS, Server, bench, free_port  # noqa: E402
from lifeline.bench.compare import attribute  # noqa: E402

TOLERANCE = 0.20
LLAMA = ("slots", "prefill", "batch", "prefix", "context")
VLLM = ("vllm_seqs", "vllm_prefix")
"""`vllm_kv` runs only with --only: on 2026-12-04 it did not make this vLLM CPU build preempt
(its 128-token blocks; docs/diagnosis.md)."""


def llama_server(binary: Path, model: Path, slots: int, ctx: int,
                 extra: tuple[str, ...] = ()) -> Server:
    port = free_port()
    env = {"LD_LIBRARY_PATH": f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    argv = [str(binary), "-m", str(model), "-t", str(THREADS), "-tb", str(THREADS), "-np",
            str(slots), "-c", str(ctx), "--metrics", "--host", "127.0.0.1", "--port", str(port),
            *extra]
    return Server(f"llama.cpp -np {slots} -c {ctx}", argv, port, "/health", env)


def vllm_server(python: Path, model: Path, seqs: int, kv_gib: int = 1,
                extra: tuple[str, ...] = (), max_len: int = 4096) -> Server:
    """vLLM's CPU build as ../shared/PEERS.md runs it (its default thread binding)."""
    port = free_port()
    env = {"OMP_NUM_THREADS": str(THREADS), "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--load-format", "dummy", "--runner", "generate", "--max-num-seqs", str(seqs),
            "--max-model-len", str(max_len), "--served-model-name", "model", "--host",
            "127.0.0.1", "--port", str(port), *extra]
    server = Server(f"vLLM --max-num-seqs {seqs}", argv, port, "/v1/models", env)
    return server


def first(results: dict[str, Any], section: str = "ttft") -> dict[str, Any]:
    findings = results["summary"]["diagnoses"][section]["findings"]
    return findings[0] if findings else {"cause": None, "ms": 0.0, "title": "(none)"}


def ok(results: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in results["requests"] if r.get("ok")]


def mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else 0.0


def counter_delta(results: dict[str, Any], key: str) -> float | None:
    samples = (results.get("server_state") or {}).get("samples") or []
    values = [s[key] for s in samples if s.get(key) is not None and s["t"] >= 0]
    if len(values) < 2:
        return None
    a, b = values[0], values[-1]
    if isinstance(a, list):
        return (b[0] - a[0]) / (b[1] - a[1]) * 1e3 if b[1] > a[1] else None
    return b - a


def wait_beyond_prefill(results: dict[str, Any]) -> float:
    """The client's TTFT less the server's own prefill (llama.cpp's `prompt_ms`)."""
    return mean(r["ttft_ms"] - (r.get("server_timings") or {}).get("prefill_ms", 0.0)
                for r in ok(results))


LOAD = ["--warmup", "2", "--input-tokens", "128", "--output-tokens", "64"]
RAW: dict[str, str] = {}
"""Raw `/metrics` and `/slots` bodies taken under load (for the parser's fixtures)."""


class Snapshot:
    """`with Snapshot(server, "llama.cpp", after_s=4):` fetches the server's raw `/metrics`
    (and `/slots`) once, `after_s` into the block, from a thread of its own."""

    def __init__(self, server: Server, name: str, after_s: float = 4.0):
        import threading

        self.server, self.name, self.after_s = server, name, after_s
        self.thread = threading.Thread(target=self._take, daemon=True)

    def _take(self) -> None:
        import time

        import httpx

        time.sleep(self.after_s)
        root = self.server.url.removesuffix("/v1")
        for path in ("/metrics", "/slots"):
            try:
                r = httpx.get(root + path, timeout=5)
                if r.status_code == 200:
                    RAW[f"{self.name}{path.replace('/', '.')}"] = r.text
            except httpx.HTTPError:
                pass

    def __enter__(self) -> Snapshot:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join()


def scenario_slots(a: argparse.Namespace) -> dict[str, Any]:
    """Too few slots: 8 users on llama.cpp's 2. Control: the same load on 8 slots."""
    args = ["--concurrency", "8", "--requests", "24", *LOAD]
    with llama_server(a.llama_server, a.gguf, 2, 8192) as s, Snapshot(s, "llama.cpp"):
        main = bench(s, args)
    with llama_server(a.llama_server, a.gguf, 8, 32768) as s:
        control = bench(s, args)
    independent = wait_beyond_prefill(main) - wait_beyond_prefill(control)
    return {"results": main, "control": control, "section": "ttft", "cause": "queue",
            "independent_ms": independent,
            "how": "wait beyond llama.cpp's own prompt_ms, 2 slots less 8 slots"}


def scenario_prefill(a: argparse.Namespace) -> dict[str, Any]:
    """Long prompts, one user. Independent: llama.cpp's prompt_seconds counter a request."""
    with llama_server(a.llama_server, a.gguf, 1, 4096) as s:
        main = bench(s, ["--concurrency", "1", "--requests", "6", "--warmup", "1",
                         "--input-tokens", "1500", "--output-tokens", "16"])
    seconds = counter_delta(main, "prompt_seconds")
    n = len(ok(main))
    return {"results": main, "section": "ttft", "cause": "prefill",
            "independent_ms": (seconds or 0.0) * 1e3 / max(n, 1),
            "how": "llama.cpp's /metrics prompt_seconds_total over the run, per request"}


def scenario_batch(a: argparse.Namespace) -> dict[str, Any]:
    """16 users starting over 8 s on 16 slots, short prompts and long outputs. Control: one
    user. The others' share of TPOT (batch, and their prefill in its steps) is held to TPOT
    less the control's; the batch must rank first."""
    load = ["--warmup", "1", "--input-tokens", "16", "--output-tokens", "256"]
    with llama_server(a.llama_server, a.gguf, 16, 16384) as s:
        alone = bench(s, ["--concurrency", "1", "--requests", "4", *load])
        main = bench(s, ["--concurrency", "16", "--requests", "32", "--ramp-up", "8", *load])
    independent = mean(r["tpot_ms"] for r in ok(main)) - mean(r["tpot_ms"] for r in ok(alone))
    findings = main["summary"]["diagnoses"]["output"]["findings"]
    others = sum(f["ms"] for f in findings if f["cause"] in ("batch", "prefill_interference"))
    return {"results": main, "control": alone, "section": "output", "cause": "batch",
            "independent_ms": independent, "found_ms": others,
            "how": "TPOT at 16 users less one user's, against batch + others' prefill"}


def cached_vs_uncached(cached: dict[str, Any], uncached: dict[str, Any], knob: str
                       ) -> dict[str, Any]:
    """`bench compare` of the two runs: the cause of the difference it ranks first, held to
    the client's TTFT difference."""
    att = attribute(dict(cached, _label="cached"), dict(uncached, _label="uncached"))
    difference = (mean(r["ttft_ms"] for r in ok(uncached))
                  - mean(r["ttft_ms"] for r in ok(cached)))
    return {"results": uncached, "control": cached, "section": "ttft", "cause": "prefill",
            "compare": att, "independent_ms": difference,
            "compare_cause": att["ttft"]["rows"][0]["cause"],
            "compare_ms": att["ttft"]["rows"][0]["delta_ms"],
            "how": f"client TTFT with {knob} off less on (compare's top row)"}


def scenario_prefix(a: argparse.Namespace) -> dict[str, Any]:
    """A shared 1,024-token prefix, prompt caching on (main) and off (control): compare."""
    args = ["--concurrency", "1", "--requests", "6", "--warmup", "1", "--prefix-groups", "1",
            "--prefix-tokens", "1024", "--input-tokens", "1100", "--output-tokens", "16"]
    with llama_server(a.llama_server, a.gguf, 1, 4096) as s:
        main = bench(s, args)
        control = bench(s, [*args, "--extra-body", '{"cache_prompt": false}'])
    return cached_vs_uncached(main, control, "cache_prompt")


def scenario_context(a: argparse.Namespace) -> dict[str, Any]:
    """Prompts past a slot's context: llama.cpp refuses them (it does not queue them)."""
    with llama_server(a.llama_server, a.gguf, 2, 1024) as s:
        main = bench(s, ["--concurrency", "2", "--requests", "6", "--warmup", "0",
                         "--input-tokens", "600", "--output-tokens", "16"])
    failures = main["summary"]["diagnoses"].get("failures") or []
    return {"results": main, "section": "failures", "cause": "context",
            "independent_ms": float(main["summary"]["failed"]),
            "found_ms": float(sum(f["count"] for f in failures if f["kind"] == "context")),
            "how": "failed requests (the finding's count held to the run's failures)"}


def scenario_vllm_seqs(a: argparse.Namespace) -> dict[str, Any]:
    """8 users on vLLM's --max-num-seqs 2. Control: the same load at --max-num-seqs 8 (the
    queue held to the TTFT difference; vLLM's own queue-time histogram shown beside it)."""
    args = ["--concurrency", "8", "--requests", "24", "--model", "model", *LOAD]
    with vllm_server(a.vllm_python, a.vllm_model, 2) as s, Snapshot(s, "vllm", 10.0):
        main = bench(s, args)
    with vllm_server(a.vllm_python, a.vllm_model, 8) as s:
        control = bench(s, args)
    independent = mean(r["ttft_ms"] for r in ok(main)) - mean(r["ttft_ms"] for r in ok(control))
    return {"results": main, "control": control, "section": "ttft", "cause": "queue",
            "independent_ms": independent, "histogram_ms": counter_delta(main, "queue_s"),
            "how": "client TTFT at --max-num-seqs 2 less at 8, same load"}


def scenario_vllm_prefix(a: argparse.Namespace) -> dict[str, Any]:
    """A shared 1,024-token prefix on vLLM with prefix caching on (main) and off (control):
    compare."""
    args = ["--concurrency", "1", "--requests", "6", "--warmup", "1", "--prefix-groups", "1",
            "--prefix-tokens", "1024", "--input-tokens", "1100", "--output-tokens", "16",
            "--model", "model"]
    with vllm_server(a.vllm_python, a.vllm_model, 8) as s:
        main = bench(s, args)
    with vllm_server(a.vllm_python, a.vllm_model, 8, 1, ("--no-enable-prefix-caching",)) as s:
        control = bench(s, args)
    return cached_vs_uncached(main, control, "prefix caching")


def scenario_vllm_kv(a: argparse.Namespace) -> dict[str, Any]:
    """A KV cache too small for the load: 96 blocks of 128 tokens (12,288) for 16 users that
    grow to 1,024 tokens each, so vLLM preempts mid-answer. Control: the same load with room
    for all (1 GiB); the output's preemption held to TPOT less the control's."""
    load = ["--concurrency", "16", "--requests", "16", "--model", "model", "--warmup", "1",
            "--input-tokens", "256", "--output-tokens", "768"]
    with vllm_server(a.vllm_python, a.vllm_model, 16, 1, ("--num-gpu-blocks-override", "96"),
                     max_len=1024) as s:
        main = bench(s, load)
    with vllm_server(a.vllm_python, a.vllm_model, 16, 1, max_len=1024) as s:
        control = bench(s, load)
    independent = mean(r["tpot_ms"] for r in ok(main)) - mean(r["tpot_ms"] for r in ok(control))
    return {"results": main, "control": control, "section": "output", "cause": "queue",
            "independent_ms": independent, "preemptions": counter_delta(main, "preemptions"),
            "how": "TPOT with 96 KV blocks less with room for all (vLLM's preemptions counted)"}


def sampling_cost(a: argparse.Namespace) -> list[dict[str, Any]]:
    """What sampling costs the server: one user's TPOT and TTFT with sampling off, at the
    default 200 ms, and at 50 ms (four times as often), alternated three times on one server."""
    rows = {"off": [], "200 ms": [], "50 ms": []}
    flags = {"off": ["--server-metrics", "off"], "200 ms": [],
             "50 ms": ["--server-metrics-interval", "0.05"]}
    scrape: list[float] = []
    with llama_server(a.llama_server, a.gguf, 1, 4096) as s:
        for _ in range(3):
            for label, extra in flags.items():
                r = bench(s, ["--concurrency", "1", "--requests", "6", "--warmup", "1",
                              "--input-tokens", "128", "--output-tokens", "128", *extra])
                rows[label].append((mean(x["tpot_ms"] for x in ok(r)),
                                    mean(x["ttft_ms"] for x in ok(r))))
                state = r.get("server_state") or {}
                if state.get("scrape_ms_p50"):
                    scrape.append(state["scrape_ms_p50"])
    out = []
    base = mean(t for t, _ in rows["off"])
    for label, values in rows.items():
        tpot = mean(t for t, _ in values)
        out.append({"sampling": label, "tpot_ms": tpot, "ttft_ms": mean(t for _, t in values),
                    "tpot_vs_off": tpot / base if base else None})
    out.append({"sampling": "scrape (/metrics + /slots), p50 ms", "tpot_ms": mean(scrape)})
    return out


SCENARIOS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "slots": scenario_slots, "prefill": scenario_prefill, "batch": scenario_batch,
    "prefix": scenario_prefix, "context": scenario_context, "vllm_seqs": scenario_vllm_seqs,
    "vllm_prefix": scenario_vllm_prefix, "vllm_kv": scenario_vllm_kv}


def check(name: str, out: dict[str, Any]) -> dict[str, Any]:
    """The first-ranked finding against the independent number."""
    if out["section"] == "failures":
        found = out["found_ms"]
        cause = "context" if found else None
    elif "compare_cause" in out:
        found, cause = out["compare_ms"], out["compare_cause"]
    else:
        f = first(out["results"], out["section"])
        found, cause = out.get("found_ms", f["ms"]), f["cause"]
    ref = out["independent_ms"]
    error = (found - ref) / ref if ref else None
    passed = cause == out["cause"] and error is not None and abs(error) <= TOLERANCE
    return {"scenario": name, "expected": out["cause"], "first": cause, "found_ms": found,
            "independent_ms": ref, "error": error, "passed": passed, "how": out["how"]}


def trim(results: dict[str, Any]) -> dict[str, Any]:
    """What the replay needs: settings, requests (without per-token lists), the server's
    samples and info; the join's and the diagnosis's own output left out (recomputed)."""
    keep = {k: results.get(k) for k in ("schema", "started_at", "settings", "text_cost",
                                       "diagnosis_notes", "anchor")}
    keep["summary"] = {k: v for k, v in results["summary"].items()
                       if k not in ("diagnoses", "diagnosis")}
    keep["step_log"] = None
    keep["requests"] = [{k: v for k, v in r.items() if k not in ("itl_ms", "tbt_ms",
                                                                  "server_state")}
                        for r in results["requests"]]
    state = dict(results.get("server_state") or {})
    state.pop("summary", None)
    keep["server_state"] = state or None
    return keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path)
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--vllm-python", type=Path)
    ap.add_argument("--vllm-model", type=Path)
    ap.add_argument("--only", default=None, help="comma-separated scenarios")
    ap.add_argument("--out", type=Path, default=Path("out/diagnose_peers"))
    ap.add_argument("--capture", type=Path, default=None,
                    help="write each scenario's trimmed results here as test fixtures")
    a = ap.parse_args()
    names = a.only.split(",") if a.only else [
        *(LLAMA if a.llama_server else ()), *(VLLM if a.vllm_python else ())]
    a.out.mkdir(parents=True, exist_ok=True)
    console, rows = Console(), []
    if "cost" in names:
        names.remove("cost")
        cost = sampling_cost(a)
        (a.out / "cost.json").write_text(json.dumps(cost, indent=1))
        table = Table("sampling", "TPOT ms", "TTFT ms", "TPOT vs off",
                      title="what sampling /metrics and /slots costs llama-server (one user)")
        for r in cost:
            table.add_row(r["sampling"], f"{r['tpot_ms']:,.2f}",
                          f"{r['ttft_ms']:,.1f}" if r.get("ttft_ms") is not None else "",
                          f"{r['tpot_vs_off']:.3f}" if r.get("tpot_vs_off") else "")
        console.print(table)
    for name in names:
        console.print(f"[bold]{name}[/]: {SCENARIOS[name].__doc__.splitlines()[0]}")
        out = SCENARIOS[name](a)
        row = check(name, out)
        rows.append(row)
        console.print(f"  first: {row['first']} {row['found_ms']:,.1f}; independent "
                      f"{row['independent_ms']:,.1f} ({row['how']}); "
                      f"{'[green]pass[/]' if row['passed'] else '[red]fail[/]'}")
        for key in ("results", "control"):
            if key in out:
                (a.out / f"{name}.{key}.json").write_text(json.dumps(out[key], indent=1))
        if a.capture:
            a.capture.mkdir(parents=True, exist_ok=True)
            fixture = {"scenario": name, "check": {k: v for k, v in row.items()},
                       "results": trim(out["results"]),
                       "control": trim(out["control"]) if "control" in out else None}
            (a.capture / f"{name}.json").write_text(json.dumps(fixture, indent=0))
    if a.capture and RAW:
        for name, text in RAW.items():
            (a.capture / f"{name}.txt").write_text(text)
    table = Table("scenario", "expected", "ranked first", "its ms", "independent ms", "error",
                  "", title="the diagnosis against causes made on purpose")
    for r in rows:
        table.add_row(r["scenario"], r["expected"], str(r["first"]), f"{r['found_ms']:,.1f}",
                      f"{r['independent_ms']:,.1f}",
                      f"{r['error']:+.1%}" if r["error"] is not None else "—",
                      "[green]pass[/]" if r["passed"] else "[red]fail[/]")
    console.print(table)
    (a.out / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
