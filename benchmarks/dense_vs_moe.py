"""Dense vs Mixture-of-Experts on this CPU, side by side in one run.

Three models with random weights that differ only in their feed-forward block
(lifeline/model/presets.py): `scaled-moe` (64 experts, top-4), `scaled-dense-same-total`
(one MLP as wide as all 64 experts: the same total weights) and `scaled-dense-same-active`
(one MLP as wide as 4 experts: the same active weights). Each runs in its own process, one
after the other, on 2 threads:

    .venv/bin/python benchmarks/dense_vs_moe.py [--quick] [--json out.json] [--svg-dir docs/img]

For each model: prefill tokens/s (one 512-token prompt), memory, and decode at 1, 4, 16 and 64
concurrent requests: engine steps in which every request decodes one token are timed (after two
warm-up steps), giving tokens/s per request (1 / step time) and in total (batch / step time).
Beside them, what a step reads from memory: the engine's own MoE accounting
(`lifeline.engine.moe_usage`: every non-expert weight once plus each touched expert once) for
the MoE model; all weights but the input embedding table for a dense one. Divided by the batch,
that is the weights read per token, in MB of fp32; the experts a step touches are compared with
what uniform routing predicts, E·(1 − (1 − k/E)^tokens).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("scaled-moe", "scaled-dense-same-total", "scaled-dense-same-active")
CONCURRENCY = (1, 4, 16, 64)
PROMPT = 32
PREFILL = 512
WARM_STEPS = 2
THREADS = 2


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def run_model(name: str, steps: int) -> dict[str, Any]:
    """One model in this process: load, prefill, then decode at each concurrency."""
    sys.path.insert(0, str(ROOT))
    import torch

    from lifeline.engine.engine import EngineConfig, LLMEngine
    from lifeline.engine.kv_layout import kv_bytes_per_token
    from lifeline.engine.sampling_params import SamplingParams
    from lifeline.model.loader import load_model

    torch.set_num_threads(THREADS)
    rss0 = _rss_mb()
    loaded = load_model(f"preset:{name}")
    cfg = loaded.config
    blocks = max(CONCURRENCY) * -(-(PROMPT + 2 * max(CONCURRENCY) + steps) // 16) + PREFILL // 16
    engine = LLMEngine(loaded, EngineConfig(
        num_kv_blocks=blocks, max_num_seqs=max(CONCURRENCY), max_num_batched_tokens=PREFILL,
        enable_prefix_caching=False))
    kv_mb = blocks * 16 * kv_bytes_per_token(cfg, num_layers=cfg.num_layers) / 2**20
    rss_loaded = _rss_mb()
    out: dict[str, Any] = {
        "model": name, "total_params": cfg.num_params(), "active_params": cfg.num_active_params(),
        "weights_mb": cfg.num_params() * 4 / 2**20, "kv_pool_mb": kv_mb,
        "rss_mb": rss_loaded - rss0, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
    }
    greedy = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    timings = []
    for i, prompt in enumerate(_prompts(3, PREFILL, cfg.vocab_size, seed=1)):
        start = time.perf_counter()
        engine.add_request(prompt, greedy)
        while engine.has_unfinished_requests():
            engine.step()
        if i:  # the first is warm-up
            timings.append(time.perf_counter() - start)
    out["prefill_tok_s"] = PREFILL / statistics.median(timings)
    out["decode"] = [_decode(engine, cfg, c, steps) for c in CONCURRENCY]
    out["peak_rss_mb"] = _rss_mb() - rss0
    return out


def _decode(engine: Any, cfg: Any, batch: int, steps: int) -> dict[str, Any]:
    from lifeline.engine.sampling_params import SamplingParams

    # Requests prefilled early decode while later ones prefill; room for that, then abort.
    params = SamplingParams(max_tokens=batch + WARM_STEPS + steps, temperature=0,
                            ignore_eos=True)
    reqs = [engine.add_request(p, params)
            for p in _prompts(batch, PROMPT, cfg.vocab_size, seed=batch)]
    while any(r.timeline.first_token is None for r in reqs):
        engine.step()
    times, touched, read = [], [], []
    for i in range(WARM_STEPS + steps):
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if i < WARM_STEPS:
            continue
        times.append(elapsed)
        if engine.moe is not None:
            step = engine.moe.last_step
            assert step.tokens == batch, "a timed step must be pure decode"
            touched.append(step.experts_touched_mean)
            read.append(step.weights_read)
        else:
            read.append(cfg.static_params_read())
    for r in reqs:
        engine.abort_request(r.request_id)
    step_s = statistics.median(times)
    row = {"concurrency": batch, "step_ms": step_s * 1e3, "per_request_tok_s": 1 / step_s,
           "total_tok_s": batch / step_s,
           "weights_read_per_token_mb": statistics.mean(read) * 4 / batch / 2**20}
    if engine.moe is not None:
        e, k = cfg.num_experts, cfg.num_experts_per_tok
        row["experts_touched"] = statistics.mean(touched)
        row["experts_touched_uniform"] = e * (1 - (1 - k / e) ** batch)
    return row


def _table(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    models = Table(title="Models (random weights, fp32)")
    for col in ("model", "total params", "active params", "weights MB", "RSS after load MB",
                "prefill tok/s (512)"):
        models.add_column(col, justify="right")
    for r in results:
        models.add_row(r["model"], f"{r['total_params'] / 1e6:.1f}M",
                       f"{r['active_params'] / 1e6:.1f}M", f"{r['weights_mb']:.0f}",
                       f"{r['rss_mb']:.0f}", f"{r['prefill_tok_s']:.0f}")
    console.print(models)
    decode = Table(title="Decode: one step in which every request emits one token")
    for col in ("model", "users", "step ms", "tok/s per user", "total tok/s",
                "weights read/token MB", "experts touched/layer (uniform)"):
        decode.add_column(col, justify="right")
    for r in results:
        for d in r["decode"]:
            experts = (f"{d['experts_touched']:.1f} ({d['experts_touched_uniform']:.1f})"
                       if "experts_touched" in d else "-")
            decode.add_row(r["model"], str(d["concurrency"]), f"{d['step_ms']:.1f}",
                           f"{d['per_request_tok_s']:.1f}", f"{d['total_tok_s']:.1f}",
                           f"{d['weights_read_per_token_mb']:.1f}", experts)
    console.print(decode)
    by = {r["model"]: r for r in results}
    if set(MODELS) <= set(by):
        ratios = Table(title="MoE total tok/s as a multiple of each dense twin")
        for col in ("users", "vs same total", "vs same active"):
            ratios.add_column(col, justify="right")
        for i, c in enumerate(CONCURRENCY):
            moe = by["scaled-moe"]["decode"][i]["total_tok_s"]
            ratios.add_row(str(c), f"{moe / by['scaled-dense-same-total']['decode'][i]['total_tok_s']:.2f}x",
                           f"{moe / by['scaled-dense-same-active']['decode'][i]['total_tok_s']:.2f}x")
        console.print(ratios)


def _svgs(results: list[dict[str, Any]], folder: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from lifeline.bench.html import line_chart

    folder.mkdir(parents=True, exist_ok=True)
    by = {r["model"]: r for r in results}
    charts = {
        "dense_vs_moe_throughput.svg": line_chart(
            "Decode throughput against concurrent users",
            {r["model"]: [(d["concurrency"], d["total_tok_s"]) for d in r["decode"]]
             for r in results}, "concurrent users", "total tok/s"),
    }
    moe = by.get("scaled-moe")
    if moe:
        charts["dense_vs_moe_experts.svg"] = line_chart(
            "Distinct experts a decode step runs per MoE layer (of 64)",
            {"measured": [(d["concurrency"], d["experts_touched"]) for d in moe["decode"]],
             "uniform routing": [(d["concurrency"], d["experts_touched_uniform"])
                                 for d in moe["decode"]]}, "concurrent users", "experts")
        twins = {f"MoE / {name.removeprefix('scaled-')}": [
            (m["concurrency"], m["total_tok_s"] / d["total_tok_s"])
            for m, d in zip(moe["decode"], by[name]["decode"])]
            for name in ("scaled-dense-same-total", "scaled-dense-same-active") if name in by}
        if twins:
            charts["dense_vs_moe_ratio.svg"] = line_chart(
                "MoE decode throughput as a multiple of each dense twin", twins,
                "concurrent users", "x")
    for file, figure in charts.items():
        svg = re.search(r"<svg.*</svg>", figure, re.DOTALL)[0]
        (folder / file).write_text(svg.replace("<svg ", '<svg style="background:#fff" ', 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 timed steps instead of 8")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--svg-dir", type=Path, help="write the two plots here")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=MODELS)
    parser.add_argument("--plot", type=Path, metavar="JSON",
                        help="only redraw the tables and plots of an earlier --json run")
    args = parser.parse_args()
    if args.plot:
        results = json.loads(args.plot.read_text())["results"]
        _table(results)
        if args.svg_dir:
            _svgs(results, args.svg_dir)
        return
    steps = 3 if args.quick else 8
    results = []
    ctx = get_context("spawn")
    for name in args.models:  # one process each: clean memory figures, no shared caches
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            print(f"running {name} ...", flush=True)
            results.append(pool.submit(run_model, name, steps).result())
    _table(results)
    meta = {"date": datetime.date.today().isoformat(), "threads": THREADS, "timed_steps": steps,
            "cpu": os.cpu_count(), "results": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(meta, indent=1))
    if args.svg_dir:
        _svgs(results, args.svg_dir)


if __name__ == "__main__":
    main()
