"""`lifeline` command line: generate (offline), later serve, bench and plan."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text offline with the engine")
    p.add_argument("prompt", nargs="*", help="prompt text (several prompts run as one batch)")
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: Gemma 3 270M)")
    p.add_argument("--prompts-file", type=Path, help="one prompt per line")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from lifeline import LLM, SamplingParams

    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
    if not prompts:
        print("lifeline generate: give a prompt or --prompts-file", file=sys.stderr)
        return 2
    console = Console()
    with console.status("loading model"):
        llm = LLM(args.model, enable_prefix_caching=not args.no_prefix_caching,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    results = llm.generate(prompts, params)
    table = Table("prompt", "completion", "tokens in/out", "TTFT ms", "decode tok/s", "finish")
    for r in results:
        tl = r.timeline
        ttft = (tl.first_token - tl.arrival) * 1e3
        decode_s = tl.token_times[-1] - tl.first_token if len(tl.token_times) > 1 else 0.0
        rate = (len(tl.token_times) - 1) / decode_s if decode_s else float("nan")
        table.add_row(r.prompt or "", r.text, f"{len(r.prompt_token_ids)}/{len(r.token_ids)}",
                      f"{ttft:.0f}", f"{rate:.1f}", r.finish_reason or "")
    console.print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lifeline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    args = parser.parse_args(argv)
    return {"generate": cmd_generate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
