"""`lifeline plan`: its flags and what it does with them. The workload, load, capacity and result
flags are the bench's own (`lifeline.bench.command`), so a plan and a measurement are described
the same way and their JSON results compare with `lifeline bench compare`."""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from lifeline.bench import command as bench_command

if TYPE_CHECKING:
    from lifeline.bench.run import BenchSettings
    from lifeline.plan.sim import Deployment

FORMATS = ("fp32", "bf16", "fp8", "int8", "int4")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="predict serving on hardware you do not have (capacity, cost)",
        description="Simulate Lifeline's scheduler and KV cache on a roofline cost model of a "
                    "GPU (or this CPU, calibrated) and report what `lifeline bench` would: "
                    "TTFT, TPOT, throughput, Concurrent Users @ SLO, $ per million tokens, "
                    "and which resource bounds each phase.")
    p.add_argument("action", nargs="?", choices=["calibrate"], default=None,
                   help="calibrate: measure this CPU for --hardware this-cpu")
    p.add_argument("--quick", action="store_true",
                   help="calibrate: fewer shapes and one served load point (under a minute)")
    p.add_argument("--no-serve", action="store_true",
                   help="calibrate: the bare engine only, no served run (no request overhead)")
    p.add_argument("--model", default=None,
                   help="a preset name (--list-models), an HF config.json or a .gguf file")
    p.add_argument("--hardware", default=None, help="a catalog id (--list-hardware)")
    p.add_argument("--list-hardware", action="store_true", help="print the catalog and exit")
    p.add_argument("--list-models", action="store_true", help="print the presets and exit")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel devices of the replica")
    p.add_argument("--weights", choices=FORMATS, default=None,
                   help="weight format (default bf16; on a CPU the engine's int8)")
    p.add_argument("--kv-dtype", choices=FORMATS, default=None,
                   help="KV cache format (default bf16; on a CPU the engine's fp32)")
    p.add_argument("--engine", default="lifeline", help="scheduler limits and overheads to "
                   "replay (lifeline.plan.engines)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV cache per device (default: what the memory share leaves)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    bench_command._load_args(p.add_argument_group("load (as lifeline bench)"))
    bench_command._workload_args(p.add_argument_group("workload (as lifeline bench)"))
    bench_command._capacity_args(p.add_argument_group("capacity (as lifeline bench)"))
    bench_command._result_args(p.add_argument_group("results (as lifeline bench)"))


def cmd_plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console()
    if args.action == "calibrate":
        from lifeline.plan.calibrate import cmd_calibrate

        return cmd_calibrate(args, console)
    if args.list_hardware:
        _print_catalog(console)
        return 0
    if args.list_models:
        from lifeline.model.presets import FULL
        console.print(", ".join(sorted(FULL)))
        return 0
    try:
        deployment = deployment_from(args)
        settings = settings_from(args, deployment)
        results = _run(args, settings, deployment, console)
    except ValueError as exc:
        print(f"lifeline plan: {exc}", file=sys.stderr)
        return 2
    _finish(args, results, console)
    return 0


def deployment_from(args: argparse.Namespace) -> Deployment:
    from lifeline.plan.cost import CostModel
    from lifeline.plan.engines import CPU_LIMITS, get_engine
    from lifeline.plan.hardware import get_hardware
    from lifeline.plan.models import load_plan_model
    from lifeline.plan.sim import Deployment

    if not args.model or not args.hardware:
        raise ValueError("--model and --hardware are required (see --list-hardware)")
    model = load_plan_model(args.model)
    hw = get_hardware(args.hardware)
    engine = get_engine(args.engine)
    cpu = hw.kind == "cpu"
    weights = args.weights or ("int8" if cpu else "bf16")
    kv_dtype = args.kv_dtype or ("fp32" if cpu else "bf16")
    calibrated = cpu and engine.name == "lifeline"  # this CPU's overheads were measured
    cost = CostModel(model, hw, tp=args.tp, weights=weights, kv_dtype=kv_dtype,
                     step_overhead_s=None if calibrated else engine.step_overhead_s,
                     seq_overhead_s=None if calibrated else engine.seq_overhead_s)
    seqs, tokens = CPU_LIMITS if calibrated else (
        engine.max_num_seqs, engine.max_num_batched_tokens)
    kv_bytes = args.kv_cache_gib * 2 ** 30 if args.kv_cache_gib is not None else None
    if kv_bytes is None and cpu:
        from lifeline.cli import DEFAULT_KV_CACHE_BYTES  # what `lifeline serve` takes
        kv_bytes = DEFAULT_KV_CACHE_BYTES
    return Deployment(
        cost, max_num_seqs=args.max_num_seqs or seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or tokens,
        gpu_memory_utilization=args.gpu_memory_utilization or engine.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching, max_model_len=args.max_model_len,
        kv_cache_bytes=kv_bytes,
        request_overhead_s=None if calibrated else engine.request_overhead_s)


def settings_from(args: argparse.Namespace, deployment: Deployment) -> BenchSettings:
    if args.dataset:
        raise ValueError("--dataset needs a tokenizer to count its prompts; plan with "
                         "--length-dist conversation or --length-file (token counts) instead")
    if args.gpus not in (1.0, float(args.tp)):
        raise ValueError("the plan simulates one replica of --tp devices: --gpus is --tp "
                         "(R replicas behind a balancer serve R times its users and tokens)")
    args.gpus = float(args.tp)
    args.url = f"plan://{deployment.cost.hw.id}"
    args.api_key = args.admin_key = None
    args.model = deployment.cost.model.name or args.model
    return bench_command.settings_from(args)


def _run(args: argparse.Namespace, settings: BenchSettings, deployment: Deployment,
         console: Any) -> dict[str, Any]:
    import asyncio

    from rich.progress import Progress

    from lifeline.bench.report import print_trial
    from lifeline.bench.search import find_max_users, sweep
    from lifeline.plan.run import run_plan

    async def run(s: BenchSettings) -> dict[str, Any]:
        return run_plan(s, deployment)

    def trial(row: dict[str, Any]) -> None:
        print_trial(console, row)

    if args.sweep:
        loads = [float(x) for x in args.sweep.split(",") if x.strip()]
        return asyncio.run(sweep(settings, loads, trial, run))
    if args.find_max_users:
        limit = args.max_users or (1024 if settings.rate is None else 64 * settings.rate)
        return asyncio.run(find_max_users(settings, limit, trial, run))
    with Progress(console=console, disable=args.quiet, transient=True) as progress:
        task = progress.add_task("simulating", total=settings.requests)
        return run_plan(settings, deployment, lambda _: progress.advance(task))


def _finish(args: argparse.Namespace, results: dict[str, Any], console: Any) -> None:
    import json

    from lifeline.bench.html import render
    from lifeline.bench.report import print_report
    from lifeline.bench.search import cost
    from lifeline.plan.report import print_plan

    hw = results["plan"]["hardware"]
    price = args.cost_per_hour if args.cost_per_hour is not None else \
        hw["price_per_hour"] * results["plan"]["devices"]
    closed = results["settings"]["rate"] is None
    users = (results.get("search") or {}).get("max_users") or (
        results["settings"]["concurrency"] if closed else None)
    results["summary"]["cost"] = cost(results["summary"], users, price, args.gpus)
    print_report(console, results)
    print_plan(console, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.html:
        with open(args.html, "w") as f:
            f.write(render(results))


def _print_catalog(console: Any) -> None:
    from rich.table import Table

    from lifeline.plan.hardware import catalog_table

    rows = catalog_table()
    table = Table(*rows[0].keys(), title="lifeline plan --list-hardware") if rows else Table()
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    console.print(table)
