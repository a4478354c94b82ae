"""What a 16-bit KV cache (`--kv-cache-dtype fp16|bf16`) costs and gives, against the float32
one, on both real models: perplexity and argmax agreement on each model's long essay, how many
of llama.cpp's recorded greedy continuations (tests/fixtures, made with its default f16 cache)
each format reproduces token for token, the token where the others first part, one user's decode
speed at a ~1,000-token context, and the pools' bytes for `lifeline serve`'s defaults.

    .venv/bin/python benchmarks/kv_cache_dtype.py [--json out.json]

The agreement columns run float32 weights (the format under test is the cache's only); the
speed column int8-all weights, eager, as `lifeline serve --no-compile` runs them. One engine at a
time in this process, 2 threads.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import THREADS, machine

from lifeline import LLM, SamplingParams
from lifeline.engine.engine import EngineConfig
from lifeline.engine.kv_layout import plan_kv
from lifeline.model.default import SMOLLM2_MODEL_ID
from lifeline.model.loader import load_model

FORMATS = ("fp32", "fp16", "bf16")


def _fixtures(name: str) -> tuple[list[dict], list[int], int | None]:
    data = json.loads((Path(__file__).parent.parent / "tests" / "fixtures" / name).read_text())
    prompts = data["prompts"]
    long = max(prompts, key=lambda p: len(p["prompt_ids"]))["prompt_ids"]
    return prompts, long, data.get("settings", {}).get("max_new_tokens")


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return float((-logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()).exp())


def _decode_tok_s(llm: LLM, context: list[int], tokens: int = 64) -> float:
    """Decode tokens a second after a `context`-token prefill: the time of `tokens + 1` output
    tokens less that of one (the prefill and first token), best of three."""
    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": context}, params, use_progress=False)
        return time.perf_counter() - start

    return max(tokens / (run(tokens + 1) - run(1)) for _ in range(3))


def study(model: str | None, fixtures: str) -> list[dict]:
    loaded = load_model(model)
    fast = load_model(model)  # the speed column runs the weights `lifeline serve` runs
    prompts, long, max_new = _fixtures(fixtures)
    rows, reference = [], None
    for fmt in FORMATS:
        llm = LLM(loaded, max_num_batched_tokens=512, kv_cache_dtype=fmt, num_threads=THREADS,
                  enable_prefix_caching=False)
        logits = llm.prompt_logits(long)
        reference = logits if reference is None else reference
        exact, partings = 0, []
        for p in prompts:
            n = max_new or len(p["completion_ids"])
            ignore = max_new is None
            ours = llm.generate({"prompt_token_ids": p["prompt_ids"]},
                                SamplingParams(max_tokens=n, temperature=0, ignore_eos=ignore),
                                use_progress=False)[0].token_ids
            theirs = p["completion_ids"]
            part = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            if part is None:
                exact += 1
            else:
                partings.append(part)
        cfg = EngineConfig(kv_cache_dtype=fmt)
        serve_pool = plan_kv(loaded.config, 16, context_tokens=loaded.config.max_position,
                             dtype_bytes=cfg.kv_dtype_bytes).total_bytes
        rows.append({
            "model": Path(str(loaded.source)).name, "kv_cache_dtype": fmt,
            "perplexity": _perplexity(logits, long),
            "perplexity_vs_fp32": _perplexity(logits, long) / _perplexity(reference, long),
            "argmax_agreement_vs_fp32": float((logits.argmax(-1) == reference.argmax(-1))
                                              .float().mean()),
            "llamacpp_exact": exact, "llamacpp_prompts": len(prompts),
            "median_parting_token": statistics.median(partings) if partings else None,
            "decode_tok_s_1k_context": _decode_tok_s(
                LLM(fast, kv_cache_dtype=fmt, weights="int8-all", num_threads=THREADS,
                    enable_prefix_caching=False), long[:1000]),
            "serve_default_pool_mib": serve_pool / 2**20,
        })
        del llm
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    console = Console()
    console.print(machine())
    rows = study(None, "gemma3_llamacpp.json") + study(SMOLLM2_MODEL_ID, "smollm2_llamacpp.json")
    table = Table(title="KV cache format: agreement (float32 weights) and speed (int8-all, eager)")
    for col in ("model", "KV", "ppl", "ppl/fp32", "argmax = fp32", "= llama.cpp",
                "parts at (median)", "decode tok/s @1k", "serve pool MiB"):
        table.add_column(col, justify="left" if col in ("model", "KV") else "right")
    for r in rows:
        table.add_row(r["model"], r["kv_cache_dtype"], f"{r['perplexity']:.3f}",
                      f"{r['perplexity_vs_fp32']:.4f}", f"{r['argmax_agreement_vs_fp32']:.4f}",
                      f"{r['llamacpp_exact']}/{r['llamacpp_prompts']}",
                      "-" if r["median_parting_token"] is None else f"{r['median_parting_token']}",
                      f"{r['decode_tok_s_1k_context']:.1f}", f"{r['serve_default_pool_mib']:.0f}")
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
