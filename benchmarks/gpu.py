"""Lifeline's engine on an NVIDIA GPU, in one run sized for a few minutes of an H200 (issue 33;
the results are in docs/performance.md, "On a GPU"):

    PYTHONPATH=. python3 benchmarks/gpu.py --out $OUT --commit $(git rev-parse --short HEAD)
    .venv/bin/python benchmarks/gpu.py --device cpu --small --out /tmp/gpu   # the logic, on a CPU

1. agreement: Gemma 3 270M (Q4_K_M) and SmolLM2-135M-Instruct (Q4_1), dequantized and run in
   bfloat16 on the device, against the same file in float32 on the CPU, greedy over the prompts
   of the agreement tests (tests/fixtures), ties judged as there (tests/reference/agreement.py).
2. bench: `lifeline serve --device cuda --model preset:llama-3.1-8b` (Llama-3.1-8B's shape,
   random weights drawn on the GPU, Gemma 3's tokenizer to turn its ids into text) and
   `lifeline bench` (closed loop, greedy, `ignore_eos`) at 1, 16, 64 and 256 users of 128/128
   and 1,024/128 tokens: TTFT, TPOT, output throughput, and the server's KV usage (its
   `/metrics`, polled through the row).
3. plan: `lifeline plan --hardware h200` for each row with the served limits and KV size,
   run beside part 1 (on the host's cores, before any row is measured): measured against
   predicted, with the error of each.
4. OUT/gpu.json (everything, each row's plan summary too), OUT/bench_rows.json.gz (each row's
   whole `lifeline bench` results), OUT/serve.log (the server's log).

Rows not begun by `--deadline-s` are skipped and marked so.
"""
from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "tests" / "fixtures"
METRICS = (("TTFT p50 ms", "ttft_ms"), ("TPOT p50 ms", "tpot_ms"),
           ("output tok/s", "output_tok_s"))
PLAN_SUMMARY = ("ttft_ms", "tpot_ms", "e2e_ms", "output_throughput_tok_s", "duration_s")


@dataclass(frozen=True, slots=True)
class Row:
    users: int
    input_tokens: int
    output_tokens: int
    requests: int

    @property
    def key(self) -> str:
        return f"u{self.users}_{self.input_tokens}x{self.output_tokens}"

    @property
    def seed(self) -> int:  # distinct prompts per row: no prefix-cache hits across rows
        return 7000 + self.users * 10 + self.input_tokens // 128


def rows(users: list[int], workloads: list[tuple[int, int]], per_user: int) -> list[Row]:
    """`per_user` requests a user, at least 3 (after the bench's one warm-up request)."""
    return [Row(u, i, o, max(3, per_user * u)) for i, o in workloads for u in users]


# -- 1. agreement -------------------------------------------------------------------------------

def agreement(name: str, path: Path, device: str) -> dict[str, Any]:
    """The fixture prompts of `name`'s agreement test, greedy on the CPU in float32 (the
    reference, with its top 5 logprobs a step) and on `device` (bf16 on a GPU)."""
    from lifeline import LLM
    from lifeline.model.layers import attention
    from lifeline.model.loader import load_model
    from tests.reference.agreement import compare

    fixtures = json.loads((FIXTURES / f"{name}_llamacpp.json").read_text())
    prompts = fixtures["prompts"]
    if name == "gemma3":  # as tests/test_gemma3_reference.py: the fixture's length, ignore_eos
        lengths, ignore_eos = [len(p["completion_ids"]) for p in prompts], True
    else:  # as tests/test_smollm2_reference.py: up to 48 tokens or end of generation
        lengths, ignore_eos = [fixtures["settings"]["max_new_tokens"]] * len(prompts), False
    t0 = time.perf_counter()
    loaded = load_model(str(path))
    load_s = time.perf_counter() - t0
    # the reference takes the pure-PyTorch paths: the C++ operators would be built first
    attention.native_ops = lambda: False
    cpu = LLM(loaded, max_num_batched_tokens=512, kv_cache_memory_bytes=512 << 20)
    t0 = time.perf_counter()
    ref = _greedy(cpu, prompts, lengths, ignore_eos)
    cpu_s = time.perf_counter() - t0
    del cpu
    dev = LLM(loaded, device=device, max_num_batched_tokens=512, kv_cache_memory_bytes=1 << 30)
    # the device's first kernels, outside the timing (3 tokens: no block for the prefix cache)
    _greedy(dev, [{"prompt_ids": [2, 3, 4]}], [2], True)
    t0 = time.perf_counter()
    ours = _greedy(dev, prompts, lengths, ignore_eos)
    dev_s = time.perf_counter() - t0
    cases = []
    for p, (ref_ids, ref_top), (ids, top) in zip(prompts, ref, ours):
        a = compare(ids, ref_ids, ref_top)
        drift = [abs(dict(t)[i] - dict(r)[i]) for i, t, r in zip(ids[:a.matched], top, ref_top)]
        cases.append({"prompt": p["name"], "prompt_tokens": len(p["prompt_ids"]),
                      **a.as_dict(), "max_logprob_drift": max(drift, default=0.0)})
    return {"model": name, "file": path.name, "weights": loaded.weight_format,
            "device": device, "load_s": load_s, "cpu_s": cpu_s, "device_s": dev_s,
            "cases": cases, "ok": all(c["ok"] for c in cases)}


def _greedy(llm, prompts: list[dict], lengths: list[int], ignore_eos: bool) -> list[tuple]:
    from lifeline import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0, logprobs=5, ignore_eos=ignore_eos)
              for n in lengths]
    out = llm.generate([{"prompt_token_ids": p["prompt_ids"]} for p in prompts], params,
                       use_progress=False)
    return [(r.token_ids, [lp.top for lp in r.logprobs]) for r in out]


# -- 2. bench -----------------------------------------------------------------------------------

class KVPoll:
    """The server's `lifeline:kv_cache_usage_perc`, read every `interval_s` in a thread."""

    def __init__(self, root: str, interval_s: float = 0.25):
        self.url, self.interval_s = root + "/metrics", interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(self.interval_s):
                try:
                    text = client.get(self.url).text
                except httpx.HTTPError:
                    continue
                for line in text.splitlines():
                    if line.startswith("lifeline:kv_cache_usage_perc"):
                        self.samples.append(float(line.rsplit(" ", 1)[1]))

    def summary(self) -> dict[str, float | int]:
        s = self.samples
        return {"peak": max(s, default=0.0), "mean": sum(s) / len(s) if s else 0.0,
                "samples": len(s)}


def serve_args(args: argparse.Namespace) -> list[str]:
    return ["--device", args.device, "--model", f"preset:{args.model}", "--max-num-seqs",
            str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--kv-cache-memory-bytes", f"{args.kv_cache_gib}GiB", "--no-compile",
            "--no-huge-pages", "--tokenizer", str(args.serve_tokenizer),
            *(["--weights", "fp32"] if args.device == "cpu" else [])]


def bench(args: argparse.Namespace, todo: list[Row], deadline: float
          ) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Each row's results (`lifeline bench`'s JSON) and KV usage; the server's start time."""
    from lifeline.plan.calibrate import ServeProcess

    results, kv = {}, {}
    server = ServeProcess(serve_args(args), timeout_s=300)
    try:
        _bench_rows(args, todo, deadline, server, results, kv)
    finally:  # the server's log, for whatever went wrong there
        (args.out / "serve.log").write_text(server.log.read_text()[-(4 << 20):])
    return results, kv, getattr(server, "start_s", None)


def _bench_rows(args: argparse.Namespace, todo: list[Row], deadline: float, server: Any,
                results: dict[str, Any], kv: dict[str, Any]) -> None:
    from lifeline.bench.run import BenchSettings, run_bench

    t0 = time.perf_counter()
    with server:
        server.start_s = time.perf_counter() - t0
        print(f"server ready in {server.start_s:.1f} s", flush=True)
        for row in todo:
            if time.monotonic() > deadline:
                print(f"{row.key}: skipped (deadline)", flush=True)
                continue
            settings = BenchSettings(
                url=server.url, concurrency=row.users, requests=row.requests, warmup=1,
                input_tokens=row.input_tokens, output_tokens=row.output_tokens, seed=row.seed,
                tokenizer=str(args.tokenizer), timeout_s=args.row_timeout_s)
            t1 = time.perf_counter()
            with KVPoll(server.url.removesuffix("/v1")) as poll:
                results[row.key] = asyncio.run(run_bench(settings))
            kv[row.key] = {**poll.summary(), "wall_s": time.perf_counter() - t1}
            s = results[row.key]["summary"]
            print(f"{row.key}: {s['successful']}/{s['requests']} ok, TTFT p50 "
                  f"{_f(s['ttft_ms']['p50'])} ms, TPOT p50 {_f(s['tpot_ms']['p50'])} ms, "
                  f"{_f(s['output_throughput_tok_s'])} tok/s, KV peak "
                  f"{kv[row.key]['peak']:.0%}, {kv[row.key]['wall_s']:.0f} s", flush=True)
            if s["failed"]:
                print(f"  errors: {json.dumps(s['errors'])[:500]}", flush=True)


def _f(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


# -- 3. plan ------------------------------------------------------------------------------------

def start_plans(args: argparse.Namespace, todo: list[Row], folder: Path
                ) -> dict[str, tuple[subprocess.Popen, Path]]:
    """`lifeline plan` for every row at once, each its own process."""
    running = {}
    for row in todo:
        out = folder / f"{row.key}.plan.json"
        cmd = [sys.executable, "-m", "lifeline.cli", "plan", "--model", args.model,
               "--hardware", args.hardware, "--concurrency", str(row.users), "--requests",
               str(row.requests), "--warmup", "1", "--input-tokens", str(row.input_tokens),
               "--output-tokens", str(row.output_tokens), "--seed", str(row.seed),
               "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
               str(args.max_num_batched_tokens), "--weights", "bf16", "--kv-dtype", "bf16",
               "--kv-cache-gib", str(args.kv_cache_gib), "--quiet", "--json", str(out)]
        running[row.key] = (subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.PIPE, text=True), out)
    return running


def finish_plans(running: dict[str, tuple[subprocess.Popen, Path]]) -> dict[str, Any]:
    plans = {}
    for key, (proc, out) in running.items():
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"lifeline plan for {key} failed: {err[-2000:]}")
        plans[key] = json.loads(out.read_text())
    return plans


def point(results: dict[str, Any]) -> dict[str, float]:
    s = results["summary"]
    return {"ttft_ms": s["ttft_ms"]["p50"], "tpot_ms": s["tpot_ms"]["p50"],
            "output_tok_s": s["output_throughput_tok_s"]}


def compare_rows(todo: list[Row], measured: dict[str, Any], kv: dict[str, Any],
                 plans: dict[str, Any]) -> list[dict[str, Any]]:
    records = []
    for row in todo:
        plan = plans.get(row.key)
        record = {"row": row.key, "users": row.users, "input_tokens": row.input_tokens,
                  "output_tokens": row.output_tokens, "requests": row.requests}
        if plan is not None:
            record["predicted"] = point(plan)
            record["predicted_kv_peak"] = plan["plan"]["memory"]["peak_kv_usage"]
            record["predicted_steps"] = plan["plan"]["scheduler"]["steps"]
        if row.key in measured:
            s = measured[row.key]["summary"]
            record["measured"] = point(measured[row.key])
            record["measured_kv"] = kv[row.key]
            record["failed"] = s["failed"]
            record["ttft_p90_ms"] = s["ttft_ms"]["p90"]
            record["tpot_p90_ms"] = s["tpot_ms"]["p90"]
            record["step_log"] = measured[row.key].get("step_log")
        else:
            record["skipped"] = "deadline"
        if "measured" in record and "predicted" in record:
            m, p = record["measured"], record["predicted"]
            record["errors"] = {k: p[k] / m[k] - 1 if m[k] and p[k] is not None else None
                                for _, k in METRICS}
        records.append(record)
    return records


# -- the run ------------------------------------------------------------------------------------

def environment(device: str) -> dict[str, Any]:
    import platform

    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cpus": os.cpu_count(), "device": device}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30,
                   multiprocessors=props.multi_processor_count, cuda=torch.version.cuda)
    return env


def print_table(records: list[dict[str, Any]], hardware: str) -> None:
    print(f"\nmeasured (lifeline serve --device) | predicted (lifeline plan --hardware "
          f"{hardware}) | error")
    head = " | ".join(f"{name} meas/plan/err" for name, _ in METRICS)
    print(f"row | {head} | KV peak meas/plan")
    for r in records:
        if "measured" not in r:
            print(f"{r['row']} | skipped")
            continue
        cells = []
        for _, k in METRICS:
            m, p = r["measured"][k], r.get("predicted", {}).get(k)
            e = (r.get("errors") or {}).get(k)
            cells.append(f"{_f(m)} / {_f(p)} / " + (f"{e:+.0%}" if e is not None else "—"))
        kv = f"{r['measured_kv']['peak']:.0%} / {r.get('predicted_kv_peak', 0):.0%}"
        print(f"{r['row']} | {' | '.join(cells)} | {kv}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    ap.add_argument("--commit", default=None, help="the commit measured (recorded)")
    ap.add_argument("--parts", default="agreement,bench,plan")
    ap.add_argument("--models", default="gemma3,smollm2", help="the agreement's models")
    ap.add_argument("--gemma", type=Path, default=None, help="default: the installed package's")
    ap.add_argument("--smollm2", type=Path, default=None, help="default: the installed wheel's")
    ap.add_argument("--model", default="llama-3.1-8b", help="the bench's preset")
    ap.add_argument("--hardware", default="h200", help="the plan's catalog id")
    ap.add_argument("--users", default="1,16,64,256")
    ap.add_argument("--workloads", default="128/128,1024/128")
    ap.add_argument("--per-user", type=int, default=2, help="requests per user (at least 3)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-gib", type=int, default=48)
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="the bench's prompts' tokenizer (default SmolLM2's: 49,152 ids, all "
                         "in the 8B model's vocabulary)")
    ap.add_argument("--serve-tokenizer", type=Path, default=None,
                    help="the served preset's tokenizer, which must name every id the random "
                         "model can produce (default Gemma 3's: 262,144 ids for Llama's 128,256)")
    ap.add_argument("--row-timeout-s", type=float, default=180.0)
    ap.add_argument("--deadline-s", type=float, default=360.0,
                    help="no bench row starts later than this after the script's start")
    ap.add_argument("--small", action="store_true",
                    help="a CPU-sized run: a small preset, 1 and 2 users of 32/8 and 64/8")
    args = ap.parse_args()
    if args.small:
        args.model, args.users, args.workloads = "scaled-dense-same-active", "1,2", "32/8,64/8"
        args.max_num_seqs, args.max_num_batched_tokens, args.kv_cache_gib = 8, 256, 1
    return args


def model_path(args: argparse.Namespace, name: str) -> Path:
    """The GGUF file of `name`: given, or the installed package's."""
    from lifeline.model.default import default_model_path, smollm2_model_path

    if name == "gemma3":
        return args.gemma or default_model_path()
    return args.smollm2 or smollm2_model_path()


def main() -> int:
    args = parse_args()
    start = time.monotonic()
    deadline = start + args.deadline_s
    parts = set(args.parts.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    args.tokenizer = args.tokenizer or model_path(args, "smollm2")
    args.serve_tokenizer = args.serve_tokenizer or model_path(args, "gemma3")
    todo = rows([int(u) for u in args.users.split(",")],
                [tuple(int(n) for n in w.split("/")) for w in args.workloads.split(",")],
                args.per_user)
    report: dict[str, Any] = {"commit": args.commit, "environment": environment(args.device),
                              "settings": {k: str(v) for k, v in vars(args).items()},
                              "timings_s": {}}
    plan_dir = Path(tempfile.mkdtemp(prefix="lifeline-gpu-plans-"))
    running = start_plans(args, todo, plan_dir) if "plan" in parts else {}
    if "agreement" in parts:
        t0 = time.monotonic()
        report["agreement"] = []
        for name in args.models.split(","):
            try:
                report["agreement"].append(agreement(name, model_path(args, name), args.device))
            except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
                report["agreement"].append({"model": name, "ok": False, "cases": [],
                                            "error": repr(exc)[-4000:]})
        report["timings_s"]["agreement"] = time.monotonic() - t0
        for a in report["agreement"]:
            print(f"agreement {a['model']}: {'ok' if a['ok'] else 'FAILED'} "
                  + ", ".join(f"{c['prompt']} {c['matched']}/{c['tokens']}"
                              + (f" (parted, {c['preference']})" if c["parted_at"] is not None
                                 else "") for c in a["cases"]), flush=True)
    t0 = time.monotonic()
    plans = finish_plans(running)
    report["timings_s"]["plan_wait"] = time.monotonic() - t0
    measured, kv = {}, {}
    if "bench" in parts:
        t0 = time.monotonic()
        try:
            measured, kv, report["server_start_s"] = bench(args, todo, deadline)
        except Exception as exc:  # noqa: BLE001 - the other parts' results are still written
            report["bench_error"] = repr(exc)[-4000:]
            print(f"bench failed: {report['bench_error']}", flush=True)
        report["timings_s"]["bench"] = time.monotonic() - t0
    report["rows"] = compare_rows(todo, measured, kv, plans)
    report["plans"] = {k: {"summary": {m: p["summary"][m] for m in PLAN_SUMMARY},
                           "plan": p["plan"]} for k, p in plans.items()}
    report["timings_s"]["total"] = time.monotonic() - start
    (args.out / "gpu.json").write_text(json.dumps(report, indent=1))
    with gzip.open(args.out / "bench_rows.json.gz", "wt") as f:
        json.dump(measured, f)
    print_table(report["rows"], args.hardware)
    print(f"total {report['timings_s']['total']:.0f} s; JSON in {args.out}")
    return 0 if all(a["ok"] for a in report.get("agreement", [])) else 1


if __name__ == "__main__":
    sys.exit(main())
