"""`lifeline bench`: its flags and what it does with them."""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from lifeline.bench.run import BenchSettings


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load-test any OpenAI-compatible server",
                       description="Load-test an OpenAI-compatible server (Lifeline, llama.cpp, "
                                   "vLLM, SGLang) and report TTFT, TTFAT, TBT, TPOT, E2E, "
                                   "throughput, goodput and where the time went.")
    p.add_argument("action", nargs="*", metavar="compare A.json B.json",
                   help="put earlier runs side by side instead of running")
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the API base, with /v1")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--api-key", default=None)
    p.add_argument("--admin-key", default=None,
                   help="read the server's step log (/debug/steps) with this key, for the "
                        "diagnosis, when its API keys guard it")
    _load_args(p.add_argument_group("load"))
    _workload_args(p.add_argument_group("workload"))
    _capacity_args(p.add_argument_group("capacity"))
    _result_args(p.add_argument_group("results"))


def _load_args(load: argparse._ArgumentGroup) -> None:
    load.add_argument("--concurrency", type=int, default=None,
                      help="closed loop: users (default 1); with --rate: the most in flight")
    load.add_argument("--rate", type=float, default=None,
                      help="open loop: requests per second (Poisson unless --burstiness)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of inter-arrival times; < 1 is burstier")
    load.add_argument("--requests", type=int, default=None,
                      help="measured requests (default 100 unless --duration)")
    load.add_argument("--duration", type=float, default=None,
                      help="seconds to keep starting requests")
    load.add_argument("--warmup", type=int, default=1, help="requests sent first and left out")
    load.add_argument("--think-time", type=float, default=0.0,
                      help="closed loop: mean seconds a user waits between requests")
    load.add_argument("--ramp-up", type=float, default=0.0,
                      help="closed loop: seconds over which the users start, evenly (default "
                           "0: all at once)")
    load.add_argument("--turns", type=int, default=1,
                      help="chat, closed loop: sessions of this many turns whose history grows")


def _workload_args(work: argparse._ArgumentGroup) -> None:
    work.add_argument("--input-tokens", type=int, default=128)
    work.add_argument("--output-tokens", type=int, default=128)
    work.add_argument("--images", type=int, default=0,
                      help="chat: this many synthetic images (PNG data URLs) in every request")
    work.add_argument("--image-size", default="512x512", help="WxH of the synthetic images")
    work.add_argument("--long-context", action="store_true",
                      help="prompts fill the server's context (less the output and 16 tokens)")
    work.add_argument("--length-dist", choices=["fixed", "uniform", "normal", "conversation"],
                      default="fixed",
                      help="conversation: (input, output) pairs of real requests, from "
                           "--length-file or else the shipped Azure 2023 conversation trace sample")
    work.add_argument("--length-file", default=None,
                      help="a trace of real requests: CSV with ContextTokens,GeneratedTokens "
                           "(Azure LLM inference trace format) or JSONL")
    work.add_argument("--length-spread", type=float, default=0.0,
                      help="uniform: ± this fraction of the mean; normal: its std / mean")
    work.add_argument("--prefix-groups", type=int, default=0,
                      help="groups of requests that share a prompt prefix")
    work.add_argument("--prefix-tokens", type=int, default=0, help="the shared prefix's length")
    work.add_argument("--dataset", default=None, help="JSONL prompts: prompt or messages per line")
    work.add_argument("--tokenizer", default=None,
                      help="GGUF file or HF directory, when the server has no /tokenize")
    work.add_argument("--no-pin-output", action="store_true",
                      help="do not send ignore_eos/min_tokens (let the model stop)")
    work.add_argument("--exact-tokens", action="store_true",
                      help="request logprobs so multi-token events are counted exactly")
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--extra-body", default=None, metavar="JSON",
                      help="more fields for every request's body, e.g. '{\"cache_prompt\": "
                           "false}' for llama.cpp")


def _capacity_args(find: argparse._ArgumentGroup) -> None:
    find.add_argument("--find-max-users", action="store_true",
                      help="search the largest concurrency meeting --slo (Concurrent Users @ SLO)")
    find.add_argument("--max-users", type=float, default=None,
                      help="the search's upper bound: users (default 256), or req/s with --rate "
                           "(default 64 × --rate)")
    find.add_argument("--sweep", default=None, metavar="L1,L2,...",
                      help="one run per load: users, or req/s with --rate (e.g. 1,2,4,8)")
    find.add_argument("--cost-per-hour", type=float, default=None,
                      help="dollars per hour of the server: adds users per GPU, $ per M tokens")
    find.add_argument("--gpus", type=float, default=1.0, help="GPUs behind the server")


def _result_args(out: argparse._ArgumentGroup) -> None:
    out.add_argument("--slo", default=None, help="per-request thresholds, e.g. ttft=2s,tpot=150ms")
    out.add_argument("--slo-attainment", default="90%",
                     help="share of requests that must meet the SLO (default 90%%)")
    out.add_argument("--json", default=None, help="write the results here")
    out.add_argument("--html", default=None, help="write a report with plots here")
    out.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    out.add_argument("--quiet", action="store_true", help="no progress bar")
    out.add_argument("--server-metrics", default="auto", metavar="URL|auto|off",
                     help="sample the server's own Prometheus metrics (and llama.cpp's /slots) "
                          "during the run: its /metrics where it answers (auto), this URL, or "
                          "off")
    out.add_argument("--server-metrics-interval", type=float, default=0.2, metavar="S",
                     help="seconds between samples (default 0.2; at most 0.25 to see a queue)")


def cmd_bench(args: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console

    if args.action:
        return cmd_compare(args.action, args.html)
    try:
        settings = settings_from(args)
    except ValueError as exc:
        print(f"lifeline bench: {exc}", file=sys.stderr)
        return 2
    console = Console()
    try:
        results = _run(args, settings, console)
    except httpx.TransportError as exc:
        print(f"lifeline bench: cannot reach {settings.url}: {exc}", file=sys.stderr)
        return 1
    except (RuntimeError, ValueError, OSError, httpx.HTTPError) as exc:
        print(f"lifeline bench: {exc}", file=sys.stderr)
        return 1
    _finish(args, results, console)
    return 0


def settings_from(args: argparse.Namespace) -> BenchSettings:
    """The `BenchSettings` the flags describe (ValueError when they do not fit together)."""
    from lifeline.bench.metrics import parse_fraction
    from lifeline.bench.run import BenchSettings

    settings = BenchSettings(
        url=args.url, model=args.model, endpoint=args.endpoint, concurrency=args.concurrency,
        rate=args.rate, burstiness=args.burstiness, requests=args.requests,
        duration_s=args.duration, warmup=args.warmup, think_time_s=args.think_time,
        ramp_up_s=args.ramp_up,
        turns=args.turns, input_tokens=args.input_tokens, output_tokens=args.output_tokens,
        length_dist=args.length_dist, length_spread=args.length_spread,
        length_file=args.length_file,
        prefix_groups=args.prefix_groups, prefix_tokens=args.prefix_tokens,
        dataset=args.dataset, tokenizer=args.tokenizer, pin_output=not args.no_pin_output,
        exact_tokens=args.exact_tokens, long_context=args.long_context,
        images=args.images, image_size=args.image_size,
        slo=args.slo, slo_attainment=parse_fraction(args.slo_attainment), seed=args.seed,
        timeout_s=args.timeout, api_key=args.api_key, admin_key=args.admin_key,
        server_metrics=args.server_metrics, extra_body=_extra_body(args.extra_body),
        server_metrics_interval_s=args.server_metrics_interval)
    settings.plan()
    return settings


def _extra_body(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--extra-body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ValueError("--extra-body is a JSON object")
    return body


def _run(args: argparse.Namespace, settings: BenchSettings, console: Console) -> dict[str, Any]:
    """A sweep, a search, or one run with a progress bar."""
    import asyncio

    from lifeline.bench.report import LiveProgress, print_trial
    from lifeline.bench.run import run_bench
    from lifeline.bench.search import find_max_users, sweep

    def trial(row: dict[str, Any]) -> None:
        print_trial(console, row)

    if args.sweep:
        loads = [float(x) for x in args.sweep.split(",") if x.strip()]
        return asyncio.run(sweep(settings, loads, trial))
    if args.find_max_users:
        limit = args.max_users or (256 if settings.rate is None else 64 * settings.rate)
        return asyncio.run(find_max_users(settings, limit, trial))
    with LiveProgress(console, settings.requests, disable=args.quiet) as progress:
        return asyncio.run(run_bench(settings, progress.update))


def _finish(args: argparse.Namespace, results: dict[str, Any], console: Console) -> None:
    """Cost figures, the printed report, and the files asked for."""
    import json

    from lifeline.bench.html import render
    from lifeline.bench.report import print_report
    from lifeline.bench.search import cost

    if args.cost_per_hour is not None:
        closed = results["settings"]["rate"] is None
        users = results["settings"]["concurrency"] if closed else None
        results["summary"]["cost"] = cost(results["summary"], users, args.cost_per_hour,
                                          args.gpus)
    print_report(console, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.html:
        with open(args.html, "w") as f:
            f.write(render(results))


def cmd_compare(action: list[str], html_path: str | None = None) -> int:
    from rich.console import Console

    from rich.markup import escape

    from lifeline.bench.compare import (
        attribute,
        attribution_table,
        compare_html,
        compare_table,
        engines_table,
        load,
    )

    if action[0] != "compare" or len(action) < 2:
        print("lifeline bench: the only action is `compare A.json B.json ...`", file=sys.stderr)
        return 2
    try:
        runs = [load(path) for path in action[1:] if path]
    except (OSError, ValueError) as exc:
        print(f"lifeline bench compare: {exc}", file=sys.stderr)
        return 2
    console = Console()
    console.print(compare_table(runs))
    atts = []
    for run in runs[1:]:
        att = attribute(runs[0], run)
        atts.append(att)
        console.print(attribution_table(att))
        console.print(engines_table(att))
        for section in ("ttft", "output"):
            if att.get(section):
                finding = att[section]["finding"]
                console.print(f"[bold]{escape(finding['title'])}[/]\n{escape(finding['evidence'])}")
    if html_path:
        with open(html_path, "w") as f:
            f.write(compare_html(runs, atts))
        console.print(f"report: {html_path}")
    return 0
