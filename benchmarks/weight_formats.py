"""Quality and speed of each LM-head weight format against float32, measured in one run.

    .venv/bin/python benchmarks/weight_formats.py [--formats fp32,bf16,int8,int8-per-call]
                                                  [--json out.json] [--no-llamacpp-check]

For each format, on a freshly loaded default model (Gemma 3 270M, 2 threads, prefix caching
off, since the prompts are cut from one text that repeats passages):
- quality on the default model's 1,180-token essay (tests/fixtures/gemma3_llamacpp.json, the
  sample tests/test_weight_format.py uses), logits at every position through the engine's
  normal step path in 512-token chunks: perplexity, its change against float32, and greedy
  agreement (the share of positions whose argmax equals float32's);
- the llama.cpp check of the engine core test (tests/reference/llamacpp_agreement.py): on the
  six fixture prompts, 32 greedy tokens part from llama.cpp's only at near-ties;
- the LM head alone: median of 50 calls on 1 and on 16 of the essay's final hidden states;
- decode tok/s of one request (128-token prompt, 64 greedy tokens, `ignore_eos`; (n - 1) /
  (last token time - first token time)) after a warm-up request with another prompt;
- total output tok/s of 16 requests (120-135-token prompts, 64 tokens each) submitted at once,
  prefill included: the median of 3 such batches with different prompts.
Baselines that exist only here: `bf16-no-rescore` and `int8-no-rescore` are the formats
without the float32 rescoring of their top 64 tokens, and `int8-per-call` the int8 head as it
was before (torch.ao `quantize_dynamic`: per-channel weights, one activation scale per call,
7-bit activations).
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import THREADS, ForeignLoad, distinct_prompts, license_token_ids, machine

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("fp32", "bf16", "int8", "bf16-no-rescore", "int8-no-rescore", "int8-per-call")
N_OUT = 64
USERS = 16
BATCH_RUNS = 3


def build_llm(fmt: str) -> Any:
    from lifeline import LLM
    from lifeline.model.loader import load_model

    engine_fmt = "fp32" if fmt == "int8-per-call" else fmt.removesuffix("-no-rescore")
    llm = LLM(load_model(), weights=engine_fmt, max_num_batched_tokens=512,
              kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False)
    if fmt.endswith("-no-rescore"):
        llm.loaded.model.lm_head.rescore_top = 0
    if fmt == "int8-per-call":
        import torch
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_dynamic(llm.loaded.model, {"lm_head": per_channel_dynamic_qconfig},
                             dtype=torch.qint8, inplace=True)
    return llm


def essay() -> list[int]:
    fixture = json.loads((ROOT / "tests" / "fixtures" / "gemma3_llamacpp.json").read_text())
    return max(fixture["prompts"], key=lambda p: len(p["prompt_ids"]))["prompt_ids"]


def essay_logits(llm: Any, ids: list[int]) -> tuple[Any, Any]:
    """Logits at every essay position, and the hidden states the LM head received."""
    import torch

    seen: list[torch.Tensor] = []
    hook = llm.loaded.model.lm_head.register_forward_pre_hook(
        lambda _, args: seen.append(args[0].detach().clone()))
    try:
        return llm.prompt_logits(ids), torch.cat(seen)
    finally:
        hook.remove()


def perplexity(logits: Any, ids: list[int]) -> float:
    import torch

    logp = torch.log_softmax(logits[:-1], dim=-1)
    return float((-logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean()).exp())


def head_ms(head: Any, hidden: Any, rows: int, calls: int = 50) -> float:
    import torch

    x = hidden[:rows].contiguous()
    times = []
    with torch.inference_mode():
        head(x)
        for _ in range(calls):
            start = time.perf_counter()
            head(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def decode_speed(llm: Any, prompts: dict[str, Any]) -> dict[str, float]:
    from lifeline import SamplingParams

    sp = SamplingParams(max_tokens=N_OUT, temperature=0, ignore_eos=True)

    def run(batch: list[list[int]]) -> list[Any]:
        return llm.generate([{"prompt_token_ids": p} for p in batch], sp, use_progress=False)

    run([prompts["warm"]])
    times = run([prompts["single"]])[0].timeline.token_times
    rates = []
    for batch in prompts["batches"]:
        start = time.perf_counter()
        outs = run(batch)
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
    return {"decode_tok_s": (len(times) - 1) / (times[-1] - times[0]),
            "batch_tok_s": statistics.median(rates), "batch_tok_s_runs": rates}


def llamacpp_check(llm: Any, reference: Any) -> list[dict[str, Any]]:
    from lifeline import SamplingParams
    from tests.reference.llamacpp_agreement import parting

    fixture = json.loads((ROOT / "tests" / "fixtures" / "gemma3_llamacpp.json").read_text())
    results = []
    for prompt in fixture["prompts"]:
        sp = SamplingParams(max_tokens=len(prompt["completion_ids"]), temperature=0,
                            ignore_eos=True)
        ours = llm.generate({"prompt_token_ids": prompt["prompt_ids"]}, sp)[0].token_ids
        part = parting(reference, prompt, ours)
        results.append({"name": part.name, "step": part.step, "preference": part.preference,
                        "llama_rank": part.llama_rank, "ok": part.ok})
    return results


def measure(fmt: str, prompts: dict[str, Any], reference: Any) -> dict[str, Any]:
    import gc

    llm = build_llm(fmt)
    ids = essay()
    logits, hidden = essay_logits(llm, ids)
    head = llm.loaded.model.lm_head
    result = {"format": fmt, "weight_format": llm.loaded.weight_format,
              "perplexity": perplexity(logits, ids),
              "head_ms_b1": head_ms(head, hidden, 1), "head_ms_b16": head_ms(head, hidden, 16),
              **decode_speed(llm, prompts)}
    if reference is not None:
        result["llamacpp"] = llamacpp_check(llm, reference)
    del llm, head, hidden
    gc.collect()
    return result | {"_argmax": logits.argmax(-1)}


def compare(results: list[dict[str, Any]]) -> None:
    """Perplexity change and greedy agreement against the float32 row."""
    base = next(r for r in results if r["format"] == "fp32")
    for r in results:
        r["delta_ppl_pct"] = 100 * (r["perplexity"] / base["perplexity"] - 1)
        r["greedy_agreement"] = float((r["_argmax"] == base["_argmax"]).float().mean())
    for r in results:
        del r["_argmax"]


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = result["formats"]
    base = next(r for r in rows if r["format"] == "fp32")
    table = Table(title=f"LM head formats, Gemma 3 270M, {THREADS} threads (× fp32: same run)")
    for col in ("format", "head ms b1", "head ms b16", "decode tok/s", f"{USERS} users tok/s",
                "perplexity", "Δppl", "greedy agree", "llama.cpp check"):
        table.add_column(col, justify="left" if col == "format" else "right")
    for r in rows:
        check = "—"
        if "llamacpp" in r:
            parted = [c for c in r["llamacpp"] if c["step"] is not None]
            ok = all(c["ok"] for c in r["llamacpp"])
            check = f"{'pass' if ok else 'FAIL'} ({len(parted)}/{len(r['llamacpp'])} parted)"
        table.add_row(
            r["format"], f"{r['head_ms_b1']:.1f}", f"{r['head_ms_b16']:.1f}",
            f"{r['decode_tok_s']:.1f} ({r['decode_tok_s'] / base['decode_tok_s']:.2f}×)",
            f"{r['batch_tok_s']:.1f} ({r['batch_tok_s'] / base['batch_tok_s']:.2f}×)",
            f"{r['perplexity']:.3f}", f"{r['delta_ppl_pct']:+.2f}%",
            f"{100 * r['greedy_agreement']:.1f}%", check)
    console = Console(width=140)
    console.print(table)
    console.print(f"other processes used {result['foreign_cpu_share']:.2f} cores on average "
                  f"meanwhile; {result['machine']}, torch {result['torch']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="fp32,bf16,int8",
                        help="comma-separated, from " + ", ".join(FORMATS) +
                        " (fp32 always runs; default: fp32,bf16,int8)")
    parser.add_argument("--no-llamacpp-check", action="store_true",
                        help="skip the llama.cpp check (it loads transformers' reference)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    formats = ["fp32"] + [f for f in args.formats.split(",") if f and f != "fp32"]
    unknown = set(formats) - set(FORMATS)
    if unknown:
        parser.error(f"unknown formats {sorted(unknown)}")

    import torch

    torch.set_num_threads(THREADS)
    sys.path.insert(0, str(ROOT))
    reference = None
    if not args.no_llamacpp_check:
        from lifeline.model.default import default_model_path
        from tests.reference.gemma3_hf import build_reference_gemma3

        reference = build_reference_gemma3(default_model_path())[0]
    ids = license_token_ids()
    lengths = [128 - USERS // 2 + i for i in range(USERS)]
    prompts = {"warm": distinct_prompts(ids, [128])[0],
               "single": distinct_prompts(ids, [128], first=1)[0],
               "batches": [distinct_prompts(ids, lengths, first=2 + USERS * k)
                           for k in range(BATCH_RUNS)]}
    load = ForeignLoad()
    rows = [measure(fmt, prompts, reference) for fmt in formats]
    compare(rows)
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
              "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "machine": machine(), "torch": torch.__version__, "formats": rows,
              "foreign_cpu_share": load.share()}
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
