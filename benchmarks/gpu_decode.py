"""Decode throughput of the engine on a GPU (or any device) with dummy weights of a real shape.

    python benchmarks/gpu_decode.py --device cuda --batches 1 16 64

Gemma 3 270M's shape (from the default GGUF's metadata, written out here so no file is needed),
random weights, 128-token prompts, 64 greedy output tokens with ignore_eos."""
from __future__ import annotations

import argparse
import time

import torch

from lifeline import LLM, SamplingParams
from lifeline.model.config import ModelConfig, gemma3_layer_types
from lifeline.model.loader import LoadedModel, build_model, init_dummy_weights

GEMMA3_270M = ModelConfig(
    architecture="gemma3", vocab_size=262144, hidden_size=640, num_layers=18, num_heads=4,
    num_kv_heads=1, head_dim=256, intermediate_size=2048, rope_theta=1e6, rope_local_theta=1e4,
    sliding_window=512, layer_types=gemma3_layer_types(18), max_position=32768,
    tie_word_embeddings=True, query_pre_attn_scalar=256, hidden_act="gelu_pytorch_tanh",
    qk_norm=True, name="gemma-3-270m (dummy)")


def run(llm: LLM, batch: int, out_tokens: int) -> tuple[float, float]:
    prompts = [{"prompt_token_ids": [2] + [(i * 7919 + j) % 200000 + 1000 for j in range(127)]}
               for i in range(batch)]
    params = SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_progress=False)
    wall = time.perf_counter() - start
    tl = results[0].timeline
    single = (len(tl.token_times) - 1) / (tl.token_times[-1] - tl.first_token)
    return batch * out_tokens / wall, single


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--output-tokens", type=int, default=64)
    args = ap.parse_args()
    model = build_model(GEMMA3_270M)
    init_dummy_weights(model)
    llm = LLM(LoadedModel(model.eval(), GEMMA3_270M, None, "dummy", "fp32"), device=args.device,
              max_num_batched_tokens=8192, max_num_seqs=max(args.batches))
    run(llm, 2, 8)
    print(f"device={args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else ''})")
    print("| concurrent | total output tok/s | per-request decode tok/s |")
    print("|---|---|---|")
    for b in args.batches:
        total, single = run(llm, b, args.output_tokens)
        print(f"| {b} | {total:.1f} | {single:.1f} |")


if __name__ == "__main__":
    main()
