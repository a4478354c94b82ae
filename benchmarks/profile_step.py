"""Where one decode step of the default model spends its time, at batch 1 and batch 16.

    .venv/bin/python benchmarks/profile_step.py [--weights fp32|bf16|int8] [--steps 20]
                                                [--torch-profiler] [--json out.json]

Method. On the CPU every op runs synchronously on the calling thread, so the wall time between
entering and leaving a module (or an engine method) is that part's cost. The script puts a
`time.perf_counter()` pair around each part — forward pre/post hooks on the model's modules,
thin wrappers on the instance's engine methods (`Scheduler.schedule`, `ModelRunner.prepare`,
`ModelRunner.execute`, `LLMEngine._sample`, `Scheduler.update`, `LLMEngine._process_outputs`)
— and charges each part its *exclusive* time: a part's time less the time of the timed parts
inside it. What no timed part covers is charged to its parent: inside a layer, the residual
adds ("model glue"); inside a step, the engine's own Python ("engine Python"). The rows
therefore add up to the measured step.

Requests: 1 or 16 prompts of ~128 tokens (120..135) cut from Python's LICENSE.txt, greedy,
`ignore_eos`; all prefill finishes before the timed window, so every timed step is a pure
decode step over contexts of ~130-190 tokens. Each batch first runs `--steps` steps without
timers (the plain step time) and then `--steps` steps with them; the table is the median of the
timed steps per part, and the gap between the two step medians is the timers' own cost
(~220 modules, two hooks each). `--torch-profiler` adds torch.profiler's top operators of one
more step at each batch, as an independent view of the same step.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import THREADS, ForeignLoad, distinct_prompts, license_token_ids, machine

ROWS = [
    ("scheduler: schedule", "engine"), ("prepare inputs (slots, block tables)", "engine"),
    ("embedding", "model"), ("attention: q/k/v/o projections", "model"),
    ("attention: QK-norm + RoPE", "model"), ("attention: KV write + SDPA + reshape", "model"),
    ("MLP: gate/up/down projections", "model"), ("MLP: GeGLU activation", "model"),
    ("norms (4 per layer + final)", "model"), ("model glue (residual adds)", "model"),
    ("LM head", "model"), ("logit rows: gather + cast", "engine"), ("sampling", "engine"),
    ("scheduler: update", "engine"), ("detokenize, stop, outputs", "engine"),
    ("engine Python (rest of step)", "engine"),
]


class PartTimer:
    """Exclusive wall time per part: each timed call subtracts the timed calls inside it."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.stack: list[list[Any]] = []
        self.enabled = False

    def enter(self, part: str) -> None:
        if self.enabled:
            self.stack.append([part, time.perf_counter(), 0.0])

    def leave(self) -> None:
        if not self.enabled:
            return
        part, start, inner = self.stack.pop()
        elapsed = time.perf_counter() - start
        self.totals[part] += elapsed - inner
        if self.stack:
            self.stack[-1][2] += elapsed

    def wrap(self, owner: Any, name: str, part: str) -> None:
        fn: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.enter(part)
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave()

        setattr(owner, name, timed)

    def hook(self, module: Any, part: str) -> None:
        module.register_forward_pre_hook(lambda *_: self.enter(part))
        module.register_forward_hook(lambda *_: self.leave())

    def take(self) -> dict[str, float]:
        totals, self.totals = dict(self.totals), defaultdict(float)
        return totals


def module_part(name: str) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    parts = {
        "embed_tokens": "embedding", "lm_head": "LM head", "norm": "norms (4 per layer + final)",
        "q_proj": "attention: q/k/v/o projections", "k_proj": "attention: q/k/v/o projections",
        "v_proj": "attention: q/k/v/o projections", "o_proj": "attention: q/k/v/o projections",
        "q_norm": "attention: QK-norm + RoPE", "k_norm": "attention: QK-norm + RoPE",
        "self_attn": "attention: KV write + SDPA + reshape",
        "qkv_proj": "attention: q/k/v/o projections",
        "gate_up_proj": "MLP: gate/up/down projections",
        "gate_proj": "MLP: gate/up/down projections", "up_proj": "MLP: gate/up/down projections",
        "down_proj": "MLP: gate/up/down projections", "mlp": "MLP: GeGLU activation",
    }
    if leaf in parts:
        return parts[leaf]
    if leaf.endswith("layernorm"):
        return "norms (4 per layer + final)"
    if leaf.startswith("rotary"):
        return "attention: QK-norm + RoPE"
    if name.startswith("layers.") and leaf.isdigit():
        return "model glue (residual adds)"
    return None


def instrument(engine: Any) -> PartTimer:
    timer = PartTimer()
    model = engine.executor.runner.model
    for name, module in model.named_modules():
        part = module_part(name)
        if part is not None:
            timer.hook(module, part)
    timer.hook(model, "model glue (residual adds)")
    timer.wrap(engine.scheduler, "schedule", "scheduler: schedule")
    timer.wrap(engine.scheduler, "update", "scheduler: update")
    timer.wrap(engine.executor.runner, "prepare", "prepare inputs (slots, block tables)")
    timer.wrap(engine.executor.runner, "execute", "logit rows: gather + cast")
    timer.wrap(engine.executor, "_sample", "sampling")
    timer.wrap(engine, "_process_outputs", "detokenize, stop, outputs")
    timer.wrap(engine, "step", "engine Python (rest of step)")
    return timer


def start_decoding(engine: Any, batch: int, steps: int) -> list[Any]:
    """Add the batch's requests and step until every one of them decodes."""
    from lifeline import SamplingParams

    ids = license_token_ids()
    prompts = distinct_prompts(ids, [128 - batch // 2 + i for i in range(batch)], first=batch)
    params = SamplingParams(max_tokens=3 * steps + 8, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        engine.step()
    return reqs


def time_steps(engine: Any, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - start)
        if any(o.finished for o in outs):
            raise RuntimeError("a request finished inside the timed window")
    return times


def profile_batch(engine: Any, timer: PartTimer, batch: int, steps: int,
                  torch_profiler: bool) -> dict[str, Any]:
    reqs = start_decoding(engine, batch, steps)
    time_steps(engine, 3)
    first = min(r.num_tokens for r in reqs)
    plain = time_steps(engine, steps)
    timer.enabled = True
    per_step: list[dict[str, float]] = []
    timed = []
    for _ in range(steps):
        timed.extend(time_steps(engine, 1))
        per_step.append(timer.take())
    timer.enabled = False
    result = {"batch": batch, "context_tokens": [first, max(r.num_tokens for r in reqs)],
              "plain_step_ms": statistics.median(plain) * 1e3,
              "timed_step_ms": statistics.median(timed) * 1e3,
              "parts_ms": {p: statistics.median(s.get(p, 0.0) for s in per_step) * 1e3
                           for p, _ in ROWS}}
    if torch_profiler:
        result["torch_profiler"] = torch_profile(engine)
    while engine.has_unfinished_requests():
        engine.step()
    return result


def torch_profile(engine: Any) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def print_tables(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    b1, b16 = result["batches"]
    table = Table(title=f"One decode step, Gemma 3 270M ({result['weights']} weights), "
                        f"{THREADS} threads; median of {result['steps']} steps")
    for col in ("part", "where", "batch 1 ms", "%", "batch 16 ms", "%"):
        table.add_column(col, justify="left" if col in ("part", "where") else "right")
    sums = [sum(b["parts_ms"].values()) for b in (b1, b16)]
    for part, where in ROWS:
        a, b = b1["parts_ms"][part], b16["parts_ms"][part]
        table.add_row(part, where, f"{a:.2f}", f"{100 * a / sums[0]:.1f}", f"{b:.2f}",
                      f"{100 * b / sums[1]:.1f}")
    table.add_section()
    table.add_row("sum of parts (medians)", "", f"{sums[0]:.1f}", "", f"{sums[1]:.1f}", "")
    table.add_row("step with timers (median)", "", f"{b1['timed_step_ms']:.1f}", "",
                  f"{b16['timed_step_ms']:.1f}", "")
    table.add_row("step without timers (median)", "", f"{b1['plain_step_ms']:.1f}", "",
                  f"{b16['plain_step_ms']:.1f}", "")
    console = Console(width=110)
    console.print(table)
    for b in (b1, b16):
        lo, hi = b["context_tokens"]
        console.print(f"batch {b['batch']}: contexts of {lo}..{hi} tokens, "
                      f"{1e3 * b['batch'] / b['plain_step_ms']:.1f} output tok/s without timers")
        if "torch_profiler" in b:
            console.print(f"torch.profiler, one step at batch {b['batch']}:")
            print(b["torch_profiler"])
    console.print(f"other processes used {result['foreign_cpu_share']:.2f} cores on average "
                  f"meanwhile; {result['machine']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="fp32", help="fp32 (default), bf16 or int8")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch")
    parser.add_argument("--torch-profiler", action="store_true")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    import torch

    from lifeline.engine.engine import EngineConfig, LLMEngine
    from lifeline.model.loader import load_model

    torch.set_num_threads(THREADS)
    engine = LLMEngine(load_model(), EngineConfig(weights=args.weights,
                                                  kv_cache_memory_bytes=256 << 20))
    timer = instrument(engine)
    load = ForeignLoad()
    batches = [profile_batch(engine, timer, b, args.steps, args.torch_profiler) for b in (1, 16)]
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
              "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "machine": machine(), "torch": torch.__version__, "weights": args.weights,
              "steps": args.steps, "batches": batches, "foreign_cpu_share": load.share()}
    print_tables(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
