"""`lifeline` command line: generate (offline), serve, bench, plan."""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lifeline.bench.command import add_parser as bench_parser
from lifeline.bench.command import cmd_bench
from lifeline.plan.command import add_parser as plan_parser
from lifeline.plan.command import cmd_plan

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int8-all", "gguf", "gguf-int8")
"""lifeline.model.weight_format.WEIGHT_FORMATS, repeated so that parsing flags needs no torch."""
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "f16", "float16", "float32", "fp16", "fp32")
"""lifeline.engine.engine.KV_CACHE_DTYPES's names, repeated for the same reason."""

if TYPE_CHECKING:
    from lifeline.server.config import ServerConfig

DEFAULT_WEIGHTS = "gguf-int8"
"""The command line's weight format: the fastest one measured within 2% of float32's
perplexity that passes the engine core's llama.cpp agreement test: one user's decode step from
the GGUF file's own blocks, batches and prefills through int8 copies (`int8-all` where the
model has no blocks the kernels read: an HF directory, a preset; docs/performance.md). The
Python API (`LLM`, `EngineConfig`) keeps float32, the exact reference path."""

DEFAULT_KV_CACHE_DTYPE = "fp16"
"""The command line's KV cache format on the CPU: llama.cpp's default, half the float32 pools'
memory, the same perplexity to four places and as many of llama.cpp's greedy texts reproduced
on both real models (benchmarks/kv_cache_dtype.py, docs/performance.md). The Python API keeps
float32 ('auto'); on a GPU the command line does too (the activations' bf16)."""

MODEL_HELP = ("GGUF file, HF directory, or preset:NAME (random weights, token-id prompts; "
              "lifeline/model/presets.py) (default: Gemma 3 270M)")


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text offline with the engine")
    p.add_argument("prompt", nargs="*", help="prompt text (several prompts run as one batch)")
    p.add_argument("--model", default=None, help=MODEL_HELP)
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
    _kv_cache_flag(p)
    _device_flags(p)


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}
DEFAULT_KV_CACHE_BYTES: int | None = None
"""None: the KV pools sized by need (EngineConfig.kv_cache_memory_bytes)."""


def parse_bytes(text: str) -> int:
    """`512MiB`, `2GiB`, `1.5G`, `1000000` -> bytes (SI and binary suffixes, any case)."""
    value = text.strip().lower().replace("_", "")
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = value[len(number):].strip()
    try:
        amount = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (examples: 512MiB, 2GiB, 1.5G, 1000000)") from None
    if amount < 1 or amount != amount:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive")
    return int(amount)


def _device_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu",
                   help="where the model runs: cpu (default) or cuda[:N] (weights, KV cache, "
                        "attention and greedy sampling on the GPU; scheduling on the host)")
    p.add_argument("--weights", choices=WEIGHT_FORMATS, default=None,
                   help="weight format (default on the CPU: gguf-int8, a lone decode row from "
                        "the GGUF file's own blocks and batches through int8 copies, int8-all "
                        "where the model has no GGUF blocks; the fastest within 2%% of "
                        "float32's perplexity, docs/performance.md; gguf: every layer from "
                        "the file's blocks alone, the least memory, slower batches; int8-all: "
                        "int8 everywhere; on a GPU bf16, every weight in bfloat16, or fp32)")


def device_problem(device: str) -> str | None:
    """Why `device` cannot run the model here (None: it can)."""
    if device == "cpu":
        return None
    import torch

    if not device.startswith("cuda"):
        return f"--device {device}: Lifeline runs on cpu or cuda[:N]"
    if not torch.cuda.is_available():
        return (f"--device {device}: this PyTorch ({torch.__version__}) sees no CUDA GPU; "
                "install a CUDA build of torch on a machine with one")
    return None


def kv_cache_dtype_for(args: argparse.Namespace) -> str:
    """`--kv-cache-dtype`, or the command line's default for the device."""
    if args.kv_cache_dtype is not None:
        return args.kv_cache_dtype
    return DEFAULT_KV_CACHE_DTYPE if args.device == "cpu" else "auto"


def weights_for(args: argparse.Namespace) -> str | None:
    """`--weights`, or the command line's default on the CPU (None: the device's own)."""
    if args.weights is not None or args.device != "cpu":
        return args.weights
    return DEFAULT_WEIGHTS


def _kv_cache_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=DEFAULT_KV_CACHE_BYTES,
                   help="memory for the KV cache, e.g. 512MiB or 4GiB (default: by need, the "
                        "served context length shared by the running requests, sliding-window "
                        "layers holding their windows); the context is clamped to what it holds")
    p.add_argument("--kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
                   help="the KV cache's format: fp32, bf16, fp16 or auto (the activations': "
                        "fp32 on the CPU, bf16 on a GPU) (default: fp16 on the CPU, auto on a "
                        "GPU)")


def cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from lifeline import LLM, SamplingParams

    problem = device_problem(args.device)
    if problem:
        print(f"lifeline generate: {problem}", file=sys.stderr)
        return 2
    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
    if not prompts:
        print("lifeline generate: give a prompt or --prompts-file", file=sys.stderr)
        return 2
    console = Console()
    with console.status("loading model"):
        llm = LLM(args.model, enable_prefix_caching=not args.no_prefix_caching,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  weights=weights_for(args), device=args.device,
                  kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                  kv_cache_dtype=kv_cache_dtype_for(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    results = llm.generate(prompts, params)
    table = Table("#", "tokens in/out", "TTFT ms", "decode tok/s", "cached", "finish")
    for i, r in enumerate(results):
        console.print(f"[bold]{escape(r.prompt or '')}[/bold]{escape(r.text)}", soft_wrap=True)
        tl = r.timeline
        ttft = (tl.first_token - tl.arrival) * 1e3
        decode_s = tl.token_times[-1] - tl.first_token if len(tl.token_times) > 1 else 0.0
        rate = (len(tl.token_times) - 1) / decode_s if decode_s else float("nan")
        table.add_row(str(i), f"{len(r.prompt_token_ids)}/{len(r.token_ids)}", f"{ttft:.0f}",
                      f"{rate:.1f}", str(r.num_cached_tokens), r.finish_reason or "")
    console.print(table)
    return 0


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the model behind an OpenAI-compatible API")
    p.add_argument("--config", type=Path, default=None,
                   help="a gateway file (TOML or YAML) declaring several models and their "
                        "backends, local engines or upstream servers (docs/gateway.md)")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizer (GGUF file or HF directory) for a preset's random weights, "
                        "so that text clients and `lifeline bench` see text; it must cover the "
                        "model's vocabulary")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients name (default: gemma-3-270m or the file's stem)")
    p.add_argument("--chat-template", type=Path, default=None, help="a Jinja chat template file")
    p.add_argument("--allow-request-chat-template", action="store_true",
                   help="let a request bring its own chat_template")
    p.add_argument("--reasoning-parser", choices=["think"], default=None)
    p.add_argument("--tool-call-parser", choices=["hermes"], default=None)
    p.add_argument("--api-key", action="append", default=[],
                   help="accepted bearer key (repeat for several; default: no auth)")
    p.add_argument("--protect-metrics", action="store_true",
                   help="require a key for /metrics too")
    p.add_argument("--admin-key", default=None,
                   help="the key of /debug/* and /dashboard (with API keys and no admin key, "
                        "they answer 403; docs/serve.md)")
    p.add_argument("--rate-limit-rpm", type=int, default=None, help="requests per minute per key")
    p.add_argument("--rate-limit-tpm", type=int, default=None, help="tokens per minute per key")
    p.add_argument("--max-queued-requests", type=int, default=512,
                   help="refuse new requests (503) while this many wait for the engine "
                        "(default 512)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--otlp-endpoint", default=None, help="export OpenTelemetry spans here")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may spend in the engine, queue included (0: no "
                        "limit; docs/reliability.md)")
    p.add_argument("--default-max-tokens", type=int, default=2048,
                   help="max_tokens of a request that sends none (clamped to the context left)")
    p.add_argument("--sampling-defaults", type=_json_object, default={}, metavar="JSON",
                   help="sampling fields of a request that sends none, e.g. "
                        "'{\"temperature\": 0.2, \"top_p\": 0.9}' (vLLM takes these from "
                        "generation_config.json)")
    p.add_argument("--salt-cache-by-api-key", action="store_true",
                   help="salt every request's prefix cache by its API key: tenants never share "
                        "cached blocks")
    p.add_argument("--allowed-media-domains", nargs="*", default=[],
                   help="a vision model: fetch http(s) image URLs from these domains (and "
                        "their subdomains), public addresses only (default: no fetching)")
    p.add_argument("--max-images", type=int, default=8,
                   help="a vision model: images in one chat request (default 8)")
    p.add_argument("--max-image-bytes", type=parse_bytes, default=8 << 20,
                   help="a vision model: one image's encoded bytes, e.g. 4MiB (default 8MiB)")
    p.add_argument("--max-image-pixels", type=int, default=33_177_600,
                   help="a vision model: one image's width x height, read from its header "
                        "before it is decoded (default 33177600, 8K UHD)")
    p.add_argument("--max-queued-image-bytes", type=parse_bytes, default=1 << 30,
                   help="a vision model: bytes of images (decoded, preprocessed, encoded) "
                        "of requests not yet through the vision tower; over it 503 "
                        "(default 1GiB)")
    p.add_argument("--allowed-origins", nargs="*", default=[],
                   help="CORS origins allowed (default: CORS off; '*' for any)")
    p.add_argument("--allowed-methods", nargs="*", default=["*"], help="CORS methods")
    p.add_argument("--allowed-headers", nargs="*", default=["*"], help="CORS headers")
    p.add_argument("--allow-credentials", action="store_true", help="CORS credentials")
    p.add_argument("--enable-fault-injection", action="store_true",
                   help="honour the X-Lifeline-Fault header (tests and soak benchmark only)")
    _kv_cache_flag(p)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--step-log-size", type=int, default=4096,
                   help="engine steps kept for /debug/steps and the dashboard (0: none)")
    _device_flags(p)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="run the model through torch.compile (default; dense models on the CPU; "
                        "compiles for seconds to a minute before /ready); --no-compile: eager")
    p.add_argument("--compile-in-background", action=argparse.BooleanOptionalAction,
                   default=os.environ.get("LIFELINE_COMPILE_IN_BACKGROUND", "1") != "0",
                   help="with --compile, where the graphs are not in the on-disk cache yet: "
                        "serve eagerly from the start while a child process compiles them, "
                        "then run compiled (default; LIFELINE_COMPILE_IN_BACKGROUND=0 turns "
                        "the default off); --no-compile-in-background: compile before /ready")
    p.add_argument("--adaptive-threads", action=argparse.BooleanOptionalAction, default=True,
                   help="run each step with the cores other processes leave free (default, "
                        "CPU; read from /proc every 0.25 s); --no-adaptive-threads: always "
                        "PyTorch's thread count")
    _ray_flags(p)
    p.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True,
                   help="restart with glibc's malloc asking for transparent huge pages for the "
                        "weights (default, Linux with glibc 2.35+ where the kernel's mode is "
                        "madvise; docs/serve.md)")


def _ray_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scale-out on Ray Serve (pip install 'lifeline[ray]'; "
                             "docs/scale-out.md)")
    g.add_argument("--ray", action="store_true",
                   help="run the engine as Ray Serve replicas behind Lifeline's gateway")
    g.add_argument("--ray-address", default=None,
                   help="the Ray cluster to join, e.g. HEAD:6379 (default: RAY_ADDRESS, else a "
                        "local Ray instance)")
    g.add_argument("--replicas", type=int, default=None,
                   help="engine replicas (default 1; with autoscaling: the initial number)")
    g.add_argument("--min-replicas", type=int, default=None,
                   help="autoscale: the fewest replicas (0 scales to zero)")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscale: the most")
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscale: the ongoing requests per replica Ray scales to hold")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves for each replica (default 1)")


class LoadingNow:
    """`load()` begun at once on a thread of its own, so that it overlaps what a start does
    next (the server's imports: ~0.9 s on 2 cores); calling this waits for it and returns its
    model, or raises what it raised (the engine's thread calls it, as it would `load`)."""

    def __init__(self, load: Callable[[], Any]):
        self._result: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(load,), name="lifeline-load",
                                        daemon=True)
        self._thread.start()

    def _run(self, load: Callable[[], Any]) -> None:
        try:
            self._result = load()
        except BaseException as exc:  # noqa: BLE001 - raised where the model is waited for
            self._error = exc

    def __call__(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def exec_with_huge_pages() -> None:
    """Start this command again with glibc's malloc marking its large allocations for
    transparent huge pages (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, glibc 2.35+), where the
    kernel gives them only on request (`madvise`, the usual default). A decode step streams all
    the weights, and in 4 KiB pages that is one TLB entry per 4 KiB of them; docs/performance.md
    has what huge pages save a step. Returns (does nothing) where it does not apply."""
    import os

    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if sys.platform != "linux" or "glibc.malloc.hugetlb" in tunables:
        return
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except (OSError, ValueError):
        return
    version = tuple(int(p) for p in glibc.removeprefix("glibc ").split(".")[:2] if p.isdigit())
    if version < (2, 35) or "[madvise]" not in mode:
        return
    os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, [tunables, HUGE_PAGES_TUNABLE]))
    os.execv(sys.executable, [sys.executable, "-m", "lifeline.cli", *sys.argv[1:]])


def cmd_serve(args: argparse.Namespace) -> int:
    if args.huge_pages and args.exec_allowed:
        exec_with_huge_pages()
    from lifeline.engine.startup import mark_process_start

    mark_process_start()  # a start's phases count from here (lifeline.engine.startup)
    if args.config is not None:
        return serve_gateway(args)
    if args.ray:
        return serve_ray(args)
    stray = [f"--{k.replace('_', '-')}" for k in RAY_FLAGS[1:] if getattr(args, k) is not None]
    if stray:
        print(f"lifeline serve: {', '.join(stray)} need --ray", file=sys.stderr)
        return 2
    problem = device_problem(args.device)
    if problem:
        print(f"lifeline serve: {problem}", file=sys.stderr)
        return 2
    from lifeline.model.loader import attach_tokenizer, lazy_load_for, load_model

    model, device, tokenizer = args.model, args.device, args.tokenizer

    lazy = lazy_load_for(weights_for(args), device)

    def load() -> Any:
        loaded = load_model(model, device=device, lazy=lazy)
        if tokenizer is not None:
            attach_tokenizer(loaded, tokenizer)
        return loaded

    loading = LoadingNow(load)  # beside the server's imports
    from lifeline.server.run import build_app, serve

    try:
        app = build_app(loading, serve_config(args))
    except (RuntimeError, ValueError) as exc:
        print(f"lifeline serve: {exc}", file=sys.stderr)
        return 2
    return serve(app)


RAY_FLAGS = ("ray", "ray_address", "replicas", "min_replicas", "max_replicas",
             "target_ongoing_requests")
_NO_CORS = "the gateway in front of the replicas answers no CORS preflight"
NOT_WITH_RAY = {
    "rate_limit_tpm": "the gateway counts no tokens, and a replica never sees the caller's key "
                      "(--rate-limit-rpm works: the gateway counts requests)",
    "otlp_endpoint": "the gateway exports no spans",
    "allowed_origins": _NO_CORS, "allowed_methods": _NO_CORS, "allowed_headers": _NO_CORS,
    "allow_credentials": _NO_CORS,
    "enable_fault_injection": "the gateway does not pass X-Lifeline-Fault on to the replicas",
    "tokenizer": "each replica loads its model's own tokenizer"}
"""Flags of the single-model server that mean nothing in front of Ray replicas, and why: given
with `--ray` they stop it at start. Every other flag takes effect: the gateway's own
(`lifeline.gateway.config.GATEWAY_OPTIONS`) at the gateway, the rest
(`lifeline.gateway.config.BACKEND_OPTIONS`, the engine's) in every replica."""
GATEWAY_FLAGS = ("config", "host", "port", "api_key", "huge_pages", "command", "exec_allowed")
"""`serve` flags that apply with `--config`; the file says everything else."""


def serve_gateway(args: argparse.Namespace) -> int:
    """`lifeline serve --config FILE`: the gateway; `--host`, `--port` and `--api-key` apply
    where the file does not set them."""
    from lifeline.gateway.config import ConfigError, load_config

    defaults = vars(build_parser().parse_args(["serve"]))
    stray = [f"--{k.replace('_', '-')}" for k, v in vars(args).items()
             if k not in GATEWAY_FLAGS and defaults.get(k) != v]
    if stray:
        print(f"lifeline serve: {', '.join(stray)} cannot be combined with --config: set "
              "models and engine options in the file (docs/gateway.md)", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"lifeline serve: {exc}", file=sys.stderr)
        return 2
    from lifeline.gateway.app import create_gateway_app
    from lifeline.observe import AccessLog
    from lifeline.server.run import serve

    config.host = config.host or args.host
    config.port = args.port if config.port is None else config.port
    config.api_keys = [*config.api_keys, *args.api_key]
    try:
        app = create_gateway_app(config)
    except ConfigError as exc:
        print(f"lifeline serve: {exc}", file=sys.stderr)
        return 2
    AccessLog.configure()
    return serve(app)


def serve_ray(args: argparse.Namespace) -> int:
    """`lifeline serve --ray`: the model's engine as Ray Serve replicas (a fixed number, or
    autoscaled), Lifeline's gateway in front of them on `--host:--port` (docs/scale-out.md)."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        print("lifeline serve: --ray needs Ray Serve: pip install 'lifeline[ray]'",
              file=sys.stderr)
        return 2
    defaults = vars(build_parser().parse_args(["serve"]))
    stray = [k for k in NOT_WITH_RAY if defaults.get(k) != getattr(args, k)]
    if stray:
        for k in stray:
            print(f"lifeline serve: --{k.replace('_', '-')} cannot be combined with --ray: "
                  f"{NOT_WITH_RAY[k]}", file=sys.stderr)
        return 2
    try:
        config = ray_gateway_config(args)
        config.check()
    except ValueError as exc:
        print(f"lifeline serve: {exc}", file=sys.stderr)
        return 2
    from lifeline.gateway.app import create_gateway_app
    from lifeline.gateway.ray_backend import connect, disconnect
    from lifeline.observe import AccessLog
    from lifeline.server.run import serve

    try:
        connect(config.ray_address)
    except Exception as exc:  # noqa: BLE001 - ray.init's many failures, reported as one
        where = config.ray_address or "RAY_ADDRESS or a new local instance"
        print(f"lifeline serve: cannot join Ray ({where}): {exc}", file=sys.stderr)
        return 1
    try:
        app = create_gateway_app(config)
        AccessLog.configure()
        return serve(app)
    finally:
        disconnect()


def ray_gateway_config(args: argparse.Namespace) -> Any:
    """The gateway that `lifeline serve --ray` flags describe: one model, one backend of kind
    `ray` (the engine and server flags go to every replica), the gateway's own flags kept."""
    from lifeline.gateway.backends import local_model_name
    from lifeline.gateway.config import (
        BACKEND_OPTIONS,
        BackendSpec,
        GatewayConfig,
        PoolSpec,
        RaySpec,
        RouteSpec,
        backend_body_limit,
    )

    server = serve_config(args)
    autoscale = {k: v for k, v in (("min_replicas", args.min_replicas),
                                   ("max_replicas", args.max_replicas),
                                   ("target_ongoing_requests", args.target_ongoing_requests))
                 if v is not None}
    if args.replicas is not None and args.replicas < 1:
        raise ValueError("--replicas must be at least 1")
    if autoscale:
        low = autoscale.setdefault("min_replicas", 1)
        high = autoscale.setdefault("max_replicas", max(low, args.replicas or 1))
        if low < 0 or high < 1 or low > high:
            raise ValueError(f"autoscaling needs 0 <= --min-replicas <= --max-replicas and "
                             f"--max-replicas >= 1 (got {low} and {high})")
        if args.replicas is not None:
            autoscale["initial_replicas"] = args.replicas
    name = server.served_model_name or local_model_name(args.model)
    options = {k: getattr(server, k) for k in BACKEND_OPTIONS}
    backend = BackendSpec(
        name="ray", kind="ray", model=args.model, served_model_name=name,
        engine=server.engine, server_options=options,
        ray=RaySpec(replicas=args.replicas or 1, autoscaling=tuple(autoscale.items()),
                    num_cpus=args.replica_cpus))
    route = RouteSpec(name=name, pools=(PoolSpec(name, ("ray",), 1.0, "least_outstanding"),))
    config = GatewayConfig(
        backends={"ray": backend}, models={name: route}, host=args.host, port=args.port,
        api_keys=list(args.api_key), protect_metrics=args.protect_metrics,
        admin_key=args.admin_key, rate_limit_rpm=args.rate_limit_rpm,
        salt_cache_by_api_key=args.salt_cache_by_api_key,
        shutdown_timeout=args.shutdown_timeout, ray_address=args.ray_address,
        source="lifeline serve --ray")
    options["max_body_bytes"] = backend_body_limit(config)
    return config


def serve_config(args: argparse.Namespace) -> ServerConfig:
    """The `ServerConfig` that `lifeline serve` flags describe."""
    from lifeline.engine.engine import EngineConfig
    from lifeline.server.config import ServerConfig

    engine = EngineConfig(max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len,
                          enable_prefix_caching=not args.no_prefix_caching,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                          kv_cache_dtype=kv_cache_dtype_for(args),
                          weights=weights_for(args), device=args.device,
                          compile=args.compile,
                          compile_in_background=args.compile_in_background,
                          adaptive_threads=args.adaptive_threads,
                          step_log_size=args.step_log_size)
    name = args.served_model_name
    if name is None and args.model:
        path = Path(args.model)
        name = path.stem if path.suffix == ".gguf" else path.name.removeprefix("preset:")
    return ServerConfig(
        host=args.host, port=args.port, served_model_name=name,
        chat_template=args.chat_template,
        allow_request_chat_template=args.allow_request_chat_template,
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        api_keys=args.api_key, admin_key=args.admin_key, protect_metrics=args.protect_metrics,
        rate_limit_rpm=args.rate_limit_rpm, rate_limit_tpm=args.rate_limit_tpm,
        max_queued_requests=args.max_queued_requests, shutdown_timeout=args.shutdown_timeout,
        otlp_endpoint=args.otlp_endpoint, request_timeout=args.request_timeout or None,
        default_max_tokens=args.default_max_tokens, sampling_defaults=args.sampling_defaults,
        salt_cache_by_api_key=args.salt_cache_by_api_key,
        allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
        enable_fault_injection=args.enable_fault_injection,
        allowed_media_domains=args.allowed_media_domains, max_images=args.max_images,
        max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
        max_queued_image_bytes=args.max_queued_image_bytes, engine=engine)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lifeline", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    bench_parser(sub)
    plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.exec_allowed = argv is None  # a program, not a call from Python: it may re-exec
    commands = {"generate": cmd_generate, "serve": cmd_serve, "bench": cmd_bench,
                "plan": cmd_plan}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
