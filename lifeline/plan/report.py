"""The planner's own part of the results (`plan`): the deployment, its memory, what bounded each
phase, and the answer in words; and how it prints."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table

if TYPE_CHECKING:
    from rich.console import Console

    from lifeline.engine.engine import LLMEngine
    from lifeline.plan.run import CapacityWatch
    from lifeline.plan.sim import Deployment

GIB = 2 ** 30


def plan_section(deployment: Deployment, engine: LLMEngine, watch: CapacityWatch,
                 results: dict[str, Any], wall_s: float) -> dict[str, Any]:
    cost, hw = deployment.cost, deployment.cost.hw
    m = cost.model
    kv = engine.block_manager
    executor = engine.executor
    phases = {name: stats.as_dict() for name, stats in executor.phases.items() if stats.steps}
    s = results["summary"]
    mean_len = ((s["prompt_tokens"] + s["output_tokens"]) / s["successful"]
                if s["successful"] else None)
    capacity = kv.capacity_tokens()
    section = {
        "hardware": {"id": hw.id, "name": hw.name, "kind": hw.kind,
                     "price_per_hour": hw.price_per_hour, "price_source": hw.price_source,
                     "price_date": hw.price_date,
                     "efficiency": {k: getattr(hw.efficiency, k) for k in (
                         "gemm", "memory", "attention", "step_overhead_s", "seq_overhead_s",
                         "request_overhead_s", "request_serial_s", "source")}},
        "devices": cost.tp, "tp": cost.tp,
        "model": {"name": m.name, "params": m.num_params(), "active_params":
                  m.num_active_params(), "moe": bool(m.num_experts),
                  "weights": cost.weights, "kv_dtype": cost.kv_dtype},
        "memory": {"device_bytes": hw.memory_bytes,
                   "weights_bytes_per_device": cost.weight_bytes(),
                   "activation_bytes_per_device": deployment.activation_bytes(),
                   "kv_bytes_per_device": kv.groups and sum(
                       g.num_blocks * b for g, b in zip(kv.groups, kv.bytes_per_block)),
                   "kv_bytes_per_token": cost.kv_bytes_per_token(),
                   "kv_tokens": capacity, "kv_blocks": kv.num_blocks,
                   "max_model_len": engine.max_model_len,
                   "concurrency_kv_holds": capacity / mean_len if mean_len else None,
                   "peak_kv_usage": watch.peak_kv_usage},
        "scheduler": {"max_num_seqs": deployment.max_num_seqs,
                      "max_num_batched_tokens": deployment.max_num_batched_tokens,
                      "block_size": deployment.block_size,
                      "prefix_caching": deployment.enable_prefix_caching,
                      "peak_running": watch.peak_running,
                      "preemptions": engine.scheduler.num_preemptions,
                      "steps": watch.steps, "kv_limited_steps": watch.kv_limited_steps,
                      "seq_limited_steps": watch.seq_limited_steps,
                      "budget_limited_steps": watch.budget_limited_steps,
                      "prefix_hit_rate": _hit_rate(kv)},
        "phases": phases,
        "simulated_s": engine.clock(), "wall_s": wall_s,
    }
    section["bounds"] = bounds(section, s)
    return section


def _hit_rate(kv: Any) -> float | None:
    stats = kv.stats
    return stats.hits / stats.queries if stats.queries else None


def bounds(section: dict[str, Any], summary: dict[str, Any]) -> dict[str, str]:
    """Which resource bounds each phase: prefill and decode by where their steps' time went;
    concurrency by what kept requests waiting; TTFT by its largest stage."""
    out = {}
    for phase, stats in section["phases"].items():
        out[phase] = stats["bound"]
    sched = section["scheduler"]
    waits = {"KV capacity": sched["kv_limited_steps"] + 10 * sched["preemptions"],
             "max_num_seqs": sched["seq_limited_steps"],
             "token budget": sched["budget_limited_steps"]}
    worst = max(waits, key=waits.__getitem__)
    out["admission"] = worst if waits[worst] > 0.05 * max(sched["steps"], 1) else "none"
    stages = summary.get("ttft_stages") or {}
    queue = (stages.get("queue_ms") or {}).get("share")
    out["ttft"] = "queueing" if queue is not None and queue >= 0.5 else "prefill"
    return out


def print_plan(console: Console, results: dict[str, Any]) -> None:
    plan = results["plan"]
    hw, mem, m = plan["hardware"], plan["memory"], plan["model"]
    table = Table("deployment", "value", show_header=False, title="lifeline plan")
    table.add_row("hardware", f"{plan['devices']} × {hw['name']} (tp {plan['tp']})")
    table.add_row("model", f"{m['name']}: {m['params'] / 1e9:.2f}B params"
                  + (f", {m['active_params'] / 1e9:.2f}B active" if m["moe"] else ""))
    table.add_row("formats", f"weights {m['weights']}, KV cache {m['kv_dtype']}")
    table.add_row("memory per device", f"weights {mem['weights_bytes_per_device'] / GIB:.2f} GiB"
                  f" + activations {mem['activation_bytes_per_device'] / GIB:.2f} GiB"
                  f" + KV {mem['kv_bytes_per_device'] / GIB:.2f} GiB"
                  f" of {mem['device_bytes'] / GIB:.0f} GiB")
    holds = mem["concurrency_kv_holds"]
    table.add_row("KV cache holds", f"{mem['kv_tokens']:,.0f} tokens"
                  + (f" = {holds:,.0f} requests of this workload's mean length" if holds else ""))
    sched = plan["scheduler"]
    table.add_row("peak KV use / running", f"{mem['peak_kv_usage']:.0%} / "
                  f"{sched['peak_running']} requests ({sched['preemptions']} preemptions)")
    table.add_row("simulated", f"{plan['simulated_s']:,.1f} s in {plan['wall_s']:.2f} s wall, "
                  f"{sched['steps']:,} steps")
    console.print(table)
    phases = Table("phase", "steps", "time s", "compute", "memory", "comm", "overhead", "bound",
                   title="where the step time went")
    for name, p in plan["phases"].items():
        shares = p["shares"]
        phases.add_row(name, f"{p['steps']:,}", f"{p['seconds']:,.2f}",
                       *(f"{(shares[k] or 0):.0%}" for k in ("compute", "memory bandwidth",
                                                             "communication", "overhead")),
                       p["bound"] or "—")
    console.print(phases)
    b = plan["bounds"]
    console.print("[bold]bounds:[/] " + "; ".join(f"{k}: {v}" for k, v in b.items()))
