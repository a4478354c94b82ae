"""`lifeline plan` against published GPU results: every row replayed with the source's model,
precision, GPU, scheduler limits and workload, and the error of each metric printed.

    python benchmarks/plan_validation.py [--json out.json] [--fit]

The rows and their settings are in docs/plan.md (with where each comes from); a row marked
`fit` is one an engine profile's overheads were fitted on (`--fit` redoes the fit and prints the
values that lifeline/plan/engines.py holds), every other row is held out.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from lifeline.bench.client import BenchRequest
from lifeline.bench.run import BenchSettings
from lifeline.model.config import ModelConfig
from lifeline.model.presets import preset_config
from lifeline.plan.cost import CostModel
from lifeline.plan.calibrate import golden_section
from lifeline.plan.engines import ENGINES, EngineProfile
from lifeline.plan.hardware import get_hardware
from lifeline.plan.run import run_plan
from lifeline.plan.sim import Deployment

HERE = Path(__file__).parent
SHAREGPT_320 = HERE / "data" / "vllm054_sharegpt320_lengths.csv"

OPT_13B = ModelConfig(
    # FasterTransformer's 13B (llm-analysis test-13b.json: OPT-13B's shape). The cost model
    # prices gated MLPs (three matrices); OPT's two matrices of 20,480 are the same weights and
    # FLOPs as a gated MLP of 13,653.
    architecture="llama", name="opt-13b-shape", vocab_size=50272, hidden_size=5120,
    num_layers=40, num_heads=40, num_kv_heads=40, head_dim=128, intermediate_size=13653,
    max_position=2048)


@dataclass(slots=True)
class Metric:
    label: str
    get: Callable[[dict[str, Any]], float | None]
    published: float
    fit: bool = False
    """This number was used to fit an engine profile's overheads."""


@dataclass(slots=True)
class Row:
    name: str
    source: str
    model: str | ModelConfig
    hardware: str
    engine: str
    weights: str
    kv_dtype: str
    settings: dict[str, Any]
    metrics: list[Metric]
    tp: int = 1
    limits: dict[str, Any] = field(default_factory=dict)
    kv_free_fraction: float | None = None
    """TensorRT-LLM sizes its cache as this fraction of the memory the weights leave free."""
    replay: Path | None = None
    """A trace of (input, output) lengths replayed in order."""


def out_tok_s(r: dict[str, Any]) -> float | None:
    return r["summary"]["output_throughput_tok_s"]


def summary(key: str, stat: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda r: r["summary"][key][stat]


def vllm_mean_ttft(r: dict[str, Any]) -> float:
    """vLLM 0.5.4's `mean_ttft_ms`: requests whose visible output was empty (EOS first) count
    with TTFT 0, as in the published run (105 of 320)."""
    values = [0.0 if rec.get("visible_tokens") == 0 else rec["ttft_ms"] for rec in r["requests"]]
    return statistics.fmean(values)


def vllm_median_tpot(r: dict[str, Any]) -> float:
    """`median_tpot_ms`: (latency − TTFT) / (visible output − 1) over requests with more than
    one visible token."""
    values = [(rec["e2e_ms"] - rec["ttft_ms"]) / (rec["visible_tokens"] - 1)
              for rec in r["requests"] if (rec.get("visible_tokens") or 0) > 1]
    return statistics.median(values)


def tokens(isl: int, osl: int, n: int) -> dict[str, Any]:
    return {"rate": math.inf, "requests": n, "input_tokens": isl, "output_tokens": osl}


ROWS = [
    Row("TRT-LLM 8B FP8 H100 128/128", "NVIDIA TensorRT-LLM perf-overview.md (v1.0)",
        "llama-3.1-8b", "h100-sxm", "trtllm", "fp8", "fp8", tokens(128, 128, 30000),
        [Metric("output tok/s", out_tok_s, 28312, fit=True)],
        limits={"max_num_seqs": 4096, "max_num_batched_tokens": 8192}, kv_free_fraction=0.9),
    Row("TRT-LLM 8B FP8 H100 1000/1000", "NVIDIA TensorRT-LLM perf-overview.md (v1.0)",
        "llama-3.1-8b", "h100-sxm", "trtllm", "fp8", "fp8", tokens(1000, 1000, 3000),
        [Metric("output tok/s", out_tok_s, 15220)],
        limits={"max_num_seqs": 640, "max_num_batched_tokens": 2048}, kv_free_fraction=0.9),
    Row("TRT-LLM 8B FP8 H100 2048/128", "NVIDIA TensorRT-LLM perf-overview.md (v1.0)",
        "llama-3.1-8b", "h100-sxm", "trtllm", "fp8", "fp8", tokens(2048, 128, 3000),
        [Metric("output tok/s", out_tok_s, 3450)],
        limits={"max_num_seqs": 512, "max_num_batched_tokens": 9216}, kv_free_fraction=0.9),
    Row("vLLM 0.5.4 8B FP8 H100 ShareGPT-320", "LambdaLabsML/vllm-benchmark (2024-08-19)",
        "llama-3.1-8b", "h100-sxm", "vllm-0.5", "fp8", "bf16",
        {"rate": math.inf, "requests": 320},
        [Metric("output tok/s", out_tok_s, 3356.94, fit=True),
         Metric("requests/s", lambda r: r["summary"]["request_throughput_rps"], 24.16),
         Metric("mean TTFT ms", vllm_mean_ttft, 778.94, fit=True),
         Metric("median TPOT ms", vllm_median_tpot, 28.83, fit=True),
         Metric("median ITL ms", summary("itl_ms", "p50"), 19.88, fit=True)],
        limits={"max_num_seqs": 256, "max_num_batched_tokens": 8000, "max_model_len": 8000},
        replay=SHAREGPT_320),
    Row("vLLM 0.5.4 8B FP8 A100-80GB ShareGPT-320", "LambdaLabsML/vllm-benchmark v0 report",
        "llama-3.1-8b", "a100-80gb", "vllm-0.5", "fp8", "bf16",
        {"rate": math.inf, "requests": 320},
        [Metric("output tok/s", out_tok_s, 1517.54, fit=True),
         Metric("median ITL ms", summary("itl_ms", "p50"), 42.85)],
        limits={"max_num_seqs": 256, "max_num_batched_tokens": 2048, "max_model_len": 2000},
        replay=SHAREGPT_320),
    Row("FasterTransformer 13B fp16 A100-40GB, 512 in, batch 1",
        "cli99/llm-analysis examples/fastertransformer", OPT_13B, "a100-40gb",
        "fastertransformer", "bf16", "bf16",
        {"concurrency": 1, "requests": 3, "input_tokens": 512, "output_tokens": 10},
        [Metric("prefill ms", lambda r: r["summary"]["ttft_stages"]["prefill_ms"]["p50"], 63.17),
         Metric("decode ms/token", summary("tpot_ms", "p50"), 22.0)],
        limits={"max_num_seqs": 1, "max_num_batched_tokens": 2048}),
]


def replay_workload(path: Path, vocab: int, seed: int = 0) -> list[BenchRequest]:
    """The trace's requests in order: each generates its visible tokens plus the EOS that ended
    it (a visible length of 0 is one token: EOS first). Prompts are random ids."""
    import random

    rng = random.Random(seed)
    out = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            n_in, visible = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            prompt = [rng.randrange(1, vocab) for _ in range(n_in)]
            req = BenchRequest(prompt, visible + 1, n_in, {"visible_tokens": visible})
            out.append(req)
    return out


def deployment(row: Row, engine: EngineProfile, hw_fit: dict[str, Any] | None = None
               ) -> Deployment:
    hw = get_hardware(row.hardware)
    if hw_fit and row.hardware in hw_fit:
        hw = replace(hw, efficiency=replace(hw.efficiency,
                                            gemm_weight_only=hw_fit[row.hardware]))
    model = row.model if isinstance(row.model, ModelConfig) else preset_config(row.model)
    cost = CostModel(model, hw, tp=row.tp, weights=row.weights, kv_dtype=row.kv_dtype,
                     step_overhead_s=engine.step_overhead_s,
                     seq_overhead_s=engine.seq_overhead_s)
    limits = {"max_num_seqs": engine.max_num_seqs,
              "max_num_batched_tokens": engine.max_num_batched_tokens,
              "gpu_memory_utilization": engine.gpu_memory_utilization, **row.limits}
    kv = None
    if row.kv_free_fraction is not None:
        kv = (hw.memory_bytes - cost.weight_bytes()) * row.kv_free_fraction
    # published runs ran without prefix caching (vLLM 0.5 off by default; random prompts)
    return Deployment(cost, kv_cache_bytes=kv, enable_prefix_caching=False,
                      request_overhead_s=engine.request_overhead_s or 0.0, **limits)


def run_row(row: Row, engine: EngineProfile | None = None,
            hw_fit: dict[str, Any] | None = None) -> dict[str, Any]:
    engine = engine or ENGINES[row.engine]
    d = deployment(row, engine, hw_fit)
    s = BenchSettings(url=f"plan://{row.hardware}", model=d.cost.model.name, warmup=0,
                      **row.settings)
    workload = None
    if row.replay is not None:
        workload = replay_workload(row.replay, d.cost.model.vocab_size)
    sent: list[Any] = []
    results = run_plan(s, d, sent.append, workload=workload)
    if workload is not None:  # the records are the requests in send order, as `results` sorts
        for rec, one in zip(results["requests"], sorted(sent, key=lambda x: x.trace.sent)):
            rec["visible_tokens"] = one.request.extra["visible_tokens"]
    return results


def errors(row: Row, results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for m in row.metrics:
        predicted = m.get(results)
        err = (predicted - m.published) / m.published if predicted is not None else None
        out.append({"row": row.name, "metric": m.label, "published": m.published,
                    "predicted": predicted, "error": err, "fit": m.fit})
    return out


def _loss(rows: list[Row], engine: EngineProfile, hw: dict[str, Any] | None = None) -> float:
    loss = 0.0
    for row in rows:
        r = run_row(row, engine, hw)
        loss += sum(math.log(m.get(r) / m.published) ** 2 for m in row.metrics if m.fit)
    return loss


def golden(f: Callable[[float], float], lo: float, hi: float, evals: int) -> float:
    """The minimum of a unimodal `f` on [lo, hi] after `evals` evaluations (calibrate's
    golden-section search, its bracket narrowed `evals` − 2 times)."""
    ratio = (math.sqrt(5) - 1) / 2
    return golden_section(f, lo, hi, tol=(hi - lo) * ratio ** (evals - 2) * 1.0001)


def fit(console: Console, which: set[str]) -> tuple[dict[str, EngineProfile], dict[str, Any]]:
    """The fitted numbers, each minimising the squared log error of the metrics marked `fit`
    (every other metric stays held out): TensorRT-LLM's per-sequence overhead (its PyTorch
    backend's executor is Python), vLLM 0.5's step, per-sequence and front overheads by
    coordinate descent, and the A100's weight-only (FP8 Marlin) GEMM share."""
    fitted: dict[str, EngineProfile] = {}
    hw_fit: dict[str, Any] = {}
    with Progress(console=console, transient=True) as progress:
        rows = [r for r in ROWS if r.engine == "trtllm" and any(m.fit for m in r.metrics)]
        base = ENGINES["trtllm"]
        task = progress.add_task("fitting trtllm", total=6)

        def trt(seq: float) -> float:
            progress.advance(task)
            return _loss(rows, replace(base, seq_overhead_s=seq))

        if "trtllm" in which:
            fitted["trtllm"] = replace(base, seq_overhead_s=round(golden(trt, 0.0, 12e-6, 6), 8))
        rows = [r for r in ROWS if r.engine == "vllm-0.5" and r.hardware == "h100-sxm"]
        e = ENGINES["vllm-0.5"]
        bounds = {"step_overhead_s": (0.0, 30e-3), "seq_overhead_s": (0.0, 100e-6),
                  "request_overhead_s": (0.0, 15e-3)}
        task = progress.add_task("fitting vllm-0.5", total=2 * len(bounds) * 7)
        for _ in range(2):
            for name, (lo, hi) in bounds.items():
                def f(x: float, name: str = name) -> float:
                    progress.advance(task)
                    return _loss(rows, replace(e, **{name: x}))
                e = replace(e, **{name: round(golden(f, lo, hi, 7), 7)})
        fitted["vllm-0.5"] = e
        rows = [r for r in ROWS if r.engine == "vllm-0.5" and r.hardware == "a100-80gb"]
        task = progress.add_task("fitting A100 weight-only GEMM", total=8)

        def a100(x: float) -> float:
            progress.advance(task)
            return _loss(rows, e, {"a100-80gb": x})

        hw_fit["a100-80gb"] = round(golden(a100, 0.05, 1.0, 8), 3)
    for name, p in fitted.items():
        console.print(f"{name}: step_overhead_s={p.step_overhead_s:g} "
                      f"seq_overhead_s={p.seq_overhead_s:g} "
                      f"request_overhead_s={p.request_overhead_s or 0:g}")
    console.print(f"gemm_weight_only: {hw_fit}")
    return fitted, hw_fit


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write every row's errors and results here")
    p.add_argument("--fit", nargs="?", const="trtllm,vllm-0.5", default=None,
                   help="refit these engine profiles' numbers (default both)")
    p.add_argument("--only", default=None, help="rows whose name contains this")
    args = p.parse_args(argv)
    console = Console()
    engines, hw_fit = fit(console, set(args.fit.split(","))) if args.fit else ({}, {})
    table = Table("row", "metric", "published", "predicted", "error", "", "sim s",
                  title="lifeline plan vs published GPU results")
    out, rows = [], [r for r in ROWS if not args.only or args.only in r.name]
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("rows", total=len(rows))
        for row in rows:
            t0 = time.perf_counter()
            results = run_row(row, engines.get(row.engine), hw_fit)
            wall = time.perf_counter() - t0
            for e in errors(row, results):
                err = e["error"]
                colour = "green" if err is not None and abs(err) <= 0.25 else "red"
                table.add_row(row.name, e["metric"], f"{e['published']:,.2f}",
                              f"{e['predicted']:,.2f}", f"[{colour}]{err:+.1%}[/]",
                              "fit" if e["fit"] else "held out", f"{wall:.1f}")
                out.append({**e, "wall_s": wall, "bounds": results["plan"]["bounds"]})
            progress.advance(task)
    console.print(table)
    held = [abs(e["error"]) for e in out if not e["fit"]]
    console.print(f"held-out metrics: {len(held)}, within 25%: "
                  f"{sum(x <= 0.25 for x in held)}, worst {max(held, default=0):.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if all(abs(e["error"]) <= 0.25 for e in out) else 1


if __name__ == "__main__":
    sys.exit(main())
