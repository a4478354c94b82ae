"""What the step record costs the engine: the time `StepRecorder.record` takes in each decode
step (the step log's record and every scheduled request's own step facts), against the step.

    .venv/bin/python benchmarks/step_log_cost.py [--steps 30] [--weights fp32]

The default model decodes batches of 1, 16 and 64 requests (prompts of about 128 tokens cut
from Python's LICENSE.txt); each step's wall time and the recorder's time inside it are taken
with `perf_counter`, and the table gives their medians and the recorder's share of the step.
Run with `--step-log-size 0` to see the part the ring of records adds (the requests' own facts
stay: the responses' `timings` carry them).
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import THREADS, ForeignLoad, distinct_prompts, license_token_ids, machine


def measure(engine, batch: int, steps: int) -> dict[str, float]:
    from lifeline import SamplingParams

    spent: list[float] = []
    record = engine.recorder.record

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return record(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    prompts = distinct_prompts(license_token_ids(), [128 - batch // 2 + i for i in range(batch)])
    params = SamplingParams(max_tokens=steps + 16, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        engine.step()
    for _ in range(3):  # warm
        engine.step()
    engine.recorder.record = timed
    walls = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
    finally:
        engine.recorder.record = record
    for req in reqs:
        engine.abort_request(req.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    step_ms, record_us = statistics.median(walls) * 1e3, statistics.median(spent) * 1e6
    return {"batch": batch, "step_ms": step_ms, "record_us": record_us,
            "share": record_us / 1e3 / step_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--weights", default="fp32")
    parser.add_argument("--step-log-size", type=int, default=4096)
    args = parser.parse_args()

    import torch

    from lifeline.engine.engine import EngineConfig, LLMEngine
    from lifeline.model.loader import load_model

    torch.set_num_threads(THREADS)
    engine = LLMEngine(load_model(), EngineConfig(
        weights=args.weights, kv_cache_memory_bytes=512 << 20, max_num_seqs=64,
        step_log_size=args.step_log_size))
    load = ForeignLoad()
    rows = [measure(engine, b, args.steps) for b in (1, 16, 64)]
    print(f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC · {machine()} · "
          f"torch {torch.__version__} · {args.weights} · step log {args.step_log_size} · "
          f"other processes' CPU {load.share():.2f} cores")
    print(f"{'batch':>5}  {'step (ms)':>9}  {'record (µs)':>11}  {'share':>6}")
    for r in rows:
        print(f"{r['batch']:>5}  {r['step_ms']:>9.2f}  {r['record_us']:>11.1f}  "
              f"{100 * r['share']:>5.2f}%")


if __name__ == "__main__":
    main()
