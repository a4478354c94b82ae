"""KV-cache bytes per token and per request, from Lifeline's own KV manager, beside the formula.

No model runs and no torch is imported: the scheduler and KV manager are driven by a stand-in
executor (every scheduled token counts as computed), exactly as the planner will drive them.

    .venv/bin/python benchmarks/kv_accounting.py [--dtype-bytes 2]

Table 1, attention layouts: one request of 4,096 tokens through a full-attention model's
KV manager, bytes held ÷ tokens, against 2 (K and V) × layers × KV heads × head dim × bytes.
The Llama 3.1 8B shape is run three ways (MHA: 32 KV heads, GQA: 8, MQA: 1) so only the
head count changes; real models of each kind follow.

Table 2, sliding windows: Gemma 3 (five sliding-window layers to one global) at 4k, 32k and
128k tokens of context: what the manager holds once the prompt is prefilled, with the window
layers giving back what their window left behind, against the same model with every block
kept (`sliding_window_kv=False`), and the formula:
global layers × context + window layers × min(context, window), × bytes per token-layer.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lifeline.engine.kv_layout import kv_bytes_per_token, plan_kv
from lifeline.engine.request import Request
from lifeline.engine.sampling_params import SamplingParams
from lifeline.engine.scheduler import Scheduler, SchedulerConfig
from lifeline.model.config import ModelConfig
from lifeline.model.presets import preset_config

BLOCK = 16
CHUNK = 2048


def held_after_prefill(cfg: ModelConfig, context: int, dtype_bytes: int,
                       sliding_window_kv: bool = True) -> int:
    """Bytes the KV manager holds for one request of `context` prompt tokens."""
    layout = plan_kv(cfg, BLOCK, num_blocks=context // BLOCK + 8, max_num_batched_tokens=CHUNK,
                     dtype_bytes=dtype_bytes, sliding_window_kv=sliding_window_kv)
    kv = layout.manager(enable_prefix_caching=False, max_chunk_tokens=CHUNK)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=CHUNK,
                                      max_model_len=context + 8), kv)
    req = Request("r", [1] * context, SamplingParams(max_tokens=2, ignore_eos=True))
    sched.add_request(req)
    while not req.output_token_ids:
        out = sched.schedule(now=0.0)
        sched.update(out, {id(s.request): 1 for s in out.scheduled if s.samples})
    return kv.bytes_held(req)


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def attention_layouts(dtype_bytes: int) -> list[dict]:
    base = preset_config("llama-3.1-8b")
    rows = []
    cases = [(f"Llama 3.1 8B shape, MHA ({h} KV heads)" if h == 32 else
              f"Llama 3.1 8B shape, {'GQA' if h > 1 else 'MQA'} ({h} KV head{'s' * (h > 1)})",
              dataclasses.replace(base, num_kv_heads=h)) for h in (32, 8, 1)]
    cases += [("llama-2-7b (MHA)", preset_config("llama-2-7b")),
              ("qwen3-8b (GQA)", preset_config("qwen3-8b")),
              ("qwen3-30b-a3b (GQA, MoE)", preset_config("qwen3-30b-a3b")),
              ("gemma-3-1b (MQA, all layers kept)",
               dataclasses.replace(preset_config("gemma-3-1b"), sliding_window=None,
                                   layer_types=[]))]
    for name, cfg in cases:
        if not cfg.layer_types or len(cfg.layer_types) != cfg.num_layers:
            cfg.__post_init__()
        measured = held_after_prefill(cfg, 4096, dtype_bytes) / 4096
        formula = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
        rows.append({"model": name, "layers": cfg.num_layers, "kv_heads": cfg.num_kv_heads,
                     "head_dim": cfg.head_dim, "manager_kib_per_token": measured / 1024,
                     "formula_kib_per_token": formula / 1024})
    return rows


def sliding_windows(dtype_bytes: int, contexts: tuple[int, ...]) -> list[dict]:
    rows = []
    for preset in ("gemma-3-270m", "gemma-3-1b", "gemma-3-27b"):
        cfg = preset_config(preset)
        per_layer = kv_bytes_per_token(cfg, dtype_bytes)
        full = sum(t == "full" for t in cfg.layer_types)
        sliding = cfg.num_layers - full
        for context in contexts:
            if context > cfg.max_position:
                continue
            windowed = held_after_prefill(cfg, context, dtype_bytes)
            kept = held_after_prefill(cfg, context, dtype_bytes, sliding_window_kv=False)
            formula = per_layer * (full * context + sliding * min(context, cfg.sliding_window))
            rows.append({"model": preset, "window": cfg.sliding_window,
                         "layers": f"{sliding} sliding + {full} global", "context": context,
                         "all_kept_gib": kept / 2**30, "manager_gib": windowed / 2**30,
                         "formula_gib": formula / 2**30, "saved": 1 - windowed / kept})
    return rows


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype-bytes", type=int, default=2,
                        help="bytes per K/V element: 2 for fp16/bf16 (GPU servers), 4 for "
                             "fp32 (Lifeline on the CPU today)")
    args = parser.parse_args()
    console = Console(width=150)
    t1 = Table(title=f"KV bytes per token, {args.dtype_bytes}-byte elements (4,096-token request)")
    for col in ("model", "layers", "KV heads", "head dim", "KV manager KiB/token",
                "formula KiB/token"):
        t1.add_column(col, justify="right")
    for r in attention_layouts(args.dtype_bytes):
        t1.add_row(r["model"], str(r["layers"]), str(r["kv_heads"]), str(r["head_dim"]),
                   _kib(r["manager_kib_per_token"] * 1024), _kib(r["formula_kib_per_token"] * 1024))
    console.print(t1)
    t2 = Table(title="Gemma 3: one request's KV after prefill, sliding-window layers "
                     "giving back what their window left behind")
    for col in ("model", "window", "layers", "context", "every block kept MiB",
                "KV manager MiB", "formula MiB", "saved"):
        t2.add_column(col, justify="right")
    for r in sliding_windows(args.dtype_bytes, (4096, 32768, 131072)):
        t2.add_row(r["model"], str(r["window"]), r["layers"], f"{r['context']:,}",
                   _mib(r["all_kept_gib"] * 2**30), _mib(r["manager_gib"] * 2**30),
                   _mib(r["formula_gib"] * 2**30), f"{r['saved']:.0%}")
    console.print(t2)


if __name__ == "__main__":
    main()
