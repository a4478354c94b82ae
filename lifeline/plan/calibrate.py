"""`lifeline plan calibrate`: measure this machine for `--hardware this-cpu`.

The planner prices a step by the roofline of `lifeline.plan.cost`; on a GPU its peaks come from
datasheets and its efficiencies from published runs. Here the machine is at hand, so both are
measured, in four parts:

1. Peaks, from kernels alone: the engine's own int8 GEMM (`Int8Linear`, fbgemm or oneDNN) at
   512 × 2,048 × 2,048, a float32 matmul at 1,024³ and the read bandwidth of a tensor far larger
   than the caches. They become `Hardware.flops['int8']`, `flops['fp32']` and
   `memory_bandwidth`: what this CPU does at best, as a datasheet would say.
2. Engine steps: the served configuration (the default model, Gemma 3 270M from its GGUF,
   `int8-all` weights, compiled, 64 sequences and 512 tokens a step, float32 KV: `lifeline
   serve`'s defaults) is driven with token-id prompts, greedy and `ignore_eos` as `lifeline
   bench` asks, through chosen shapes: prefill chunks of 32-512 tokens (one request, several,
   a prompt over two chunks), decode batches of 1-32 requests at short and long contexts, and
   the mixed steps that fill them. Every `engine.step()` is timed whole (scheduling, the
   forward, sampling, detokenizing) and recorded with its shape: tokens and start per request,
   rows sampled.
3. Fit: on a CPU an op's compute and memory times add (`Efficiency.combine` "sum": the cores
   issue both), so a step's time is linear in the inverse efficiencies (`gemm` of the int8
   peak, `memory` of the bandwidth for weights and activations, `kv_memory` for attention's
   KV, `attention` of the float32 peak) and the fixed costs (`step_overhead_s`,
   `seq_overhead_s`, and `batch_overhead_s` for a step of more than one row: one row runs
   fbgemm's matrix-vector path, more a GEMM with its own set-up). They minimise a robust
   (soft-L1) relative error against the measured steps, each shape weighed equally, no
   efficiency above 1 (reweighted non-negative least squares; `fit_steps`), the step overhead
   no less than the host time measured outside the executor (`host_floor`). The table printed
   sets the `CostModel`'s own predictions beside the measurements.
4. Serving: a short `lifeline bench` run (the bench's own code) against a real `lifeline
   serve` on loopback, at 1 user of 64-token prompts, 2 of 256 and 12 of 40, measures what the
   server adds over the bare engine from each request's own timings (`measure_serving`): the
   front before the engine (`request_serial_s`, on the server's one event loop, so requests
   sent together reach the engine one front apart, as `lifeline.plan.run` simulates them) and
   the time outside the server's accounting (client, network, the first event's delivery),
   together `request_overhead_s`. Streaming adds nothing measurable to TPOT (the client's TPOT
   is the server's decode time per token), so a served step costs what the bare engine's
   does; the served points are then simulated with the result, beside their measurements.
   Measured, not fitted: a fit of TPOT or TTFT here would take a slow spell of the machine
   (its speed drifts by ±25% over minutes) for a cost of serving. These load points differ
   from `benchmarks/plan_vs_bench.py`'s validation.

The hardware is saved where `--hardware this-cpu` finds it (`calibration_path()`), the
measurements and the fit beside it (`*.calibration.json`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lifeline.plan.cost import CostModel
from lifeline.plan.hardware import (Efficiency, Hardware, calibration_path, hardware_to_dict,
                                     save_calibrated)

if TYPE_CHECKING:
    import argparse

    from rich.console import Console
    from rich.progress import Progress

    from lifeline.bench.run import BenchSettings
    from lifeline.engine.engine import LLMEngine
    from lifeline.model.config import ModelConfig
    from lifeline.plan.sim import Deployment

HARDWARE_ID = "this-cpu"
DEFAULT_NAME = "gemma-3-270m"
WEIGHTS, KV_DTYPE = "int8", "fp32"
"""How the planner prices `lifeline serve`'s defaults: `int8-all` weights, float32 KV."""
SERVED = {"weights": "int8-all", "compile": True, "max_num_seqs": 64,
          "max_num_batched_tokens": 512}
"""The engine the steps are measured in: `lifeline serve`'s defaults (lifeline/cli.py) but
its weights, `int8-all` (`--weights int8-all`), whose every step reads int8 bytes as the cost
model prices them; the default `gguf-int8` reads the file's 4-6-bit blocks in a lone row's
step, which the cost model does not price yet (docs/plan.md)."""


# -- where the calibration lives: lifeline.plan.hardware (calibration_path, save/load) ------

def report_path(path: Path | None = None) -> Path:
    return (path or calibration_path()).with_suffix(".calibration.json")


class ForeignLoad:
    """Cores other processes used since it was made (this one, its reaped children and
    `own_pids`, such as a server it started, left out): a busy neighbour makes a measurement
    slow, and the calibration records how busy the machine was."""

    def __init__(self, own_pids: Sequence[int] = ()) -> None:
        self.pids = tuple(own_pids)
        self.start = time.perf_counter()
        self.busy = _busy_s() - self._own()

    def _own(self) -> float:
        return _own_s() + sum(_pid_cpu_s(pid) for pid in self.pids)

    def share(self) -> float:
        return max(0.0, (_busy_s() - self._own() - self.busy)
                   / (time.perf_counter() - self.start))


def _busy_s() -> float:
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    return sum(fields[i] for i in (0, 1, 2, 5, 6, 7)) / os.sysconf("SC_CLK_TCK")


def _own_s() -> float:
    import resource

    usage = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(r.ru_utime + r.ru_stime for r in usage)


def _pid_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / os.sysconf("SC_CLK_TCK")


# -- 1. peaks ------------------------------------------------------------------------------------

def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@dataclass(frozen=True, slots=True)
class Peaks:
    int8_ops: float
    """OP/s of the engine's int8 GEMM, 512 rows × 2,048 × 2,048."""
    fp32_flops: float
    """FLOP/s of a float32 matmul, 1,024³."""
    bandwidth: float
    """Bytes/s reading a float32 tensor of `BANDWIDTH_BYTES`."""


BANDWIDTH_BYTES = 512 << 20


def measure_peaks(repeats: int = 5) -> Peaks:
    import torch
    from torch import nn

    from lifeline.model.weight_format import Int8Linear

    torch.manual_seed(0)
    rows, width = 512, 2048
    layer = Int8Linear(nn.Linear(width, width, bias=False), rescore_top=0)
    x = torch.randn(rows, width)
    with torch.inference_mode():
        int8 = 2 * rows * width * width / _best(lambda: layer.int8_matmul(x), repeats)
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        fp32 = 2 * 1024 ** 3 / _best(lambda: a @ b, repeats)
    return Peaks(int8, fp32, measure_bandwidth(repeats))


def measure_bandwidth(repeats: int = 5) -> float:
    """Bytes/s reading a float32 tensor of `BANDWIDTH_BYTES` with PyTorch's threads, best of
    `repeats` (`benchmarks/vs_llamacpp.py` reads it before each server's run)."""
    import torch

    big = torch.ones(BANDWIDTH_BYTES // 4)
    with torch.inference_mode():
        return BANDWIDTH_BYTES / _best(big.sum, repeats)


# -- 2. engine steps -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StepSample:
    """One timed `engine.step()`: (tokens, start) per scheduled request, rows sampled."""
    label: str
    work: tuple[tuple[int, int], ...]
    sampled: int
    seconds: float
    host_seconds: float = 0.0
    """Of `seconds`, the part outside the executor (scheduling, bookkeeping, outputs)."""

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "work": [list(w) for w in self.work],
                "sampled": self.sampled, "seconds": self.seconds,
                "host_seconds": self.host_seconds}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepSample:
        return cls(d["label"], tuple(tuple(w) for w in d["work"]), d["sampled"], d["seconds"],
                   d.get("host_seconds", 0.0))


@dataclass(frozen=True, slots=True)
class StepGrid:
    """The shapes the engine is driven through."""
    prefill: tuple[int, ...]
    """Prompt lengths prefilled alone (one step each, up to the step's 512 tokens)."""
    repeats: int
    long_prompts: tuple[int, ...]
    """Prompts longer than a step: chunks after the first start past 0."""
    batched_prefill: tuple[tuple[int, int], ...]
    """(requests, prompt tokens) added at once: several prefills in a step."""
    decode: tuple[tuple[int, int], ...]
    """(batch, prompt tokens): the batch prefills (mixed steps), then decodes together."""
    decode_steps: int
    """Decode steps timed once the whole batch decodes."""
    passes: int = 1
    """Times the grid is run, each pass in its own shuffled order (`repeats` and
    `decode_steps` are per pass)."""

    def items(self) -> int:
        return 1 + self.passes * (len(self.prefill) * self.repeats + len(self.long_prompts)
                                  + len(self.batched_prefill) + len(self.decode))


FULL_GRID = StepGrid(
    prefill=(32, 64, 128, 256, 384, 512), repeats=2, long_prompts=(1024,),
    batched_prefill=((4, 128), (2, 256), (8, 48)),
    decode=((1, 64), (1, 256), (1, 1024), (2, 128), (4, 128), (4, 512), (6, 96), (8, 64),
            (8, 256), (12, 96), (16, 128), (24, 64), (32, 48)),
    decode_steps=6, passes=3)
"""On this machine a step of one shape varies by ±25% from the next and the machine's speed
drifts by as much over minutes (docs/plan.md): three passes in shuffled orders, so a slow
spell spreads over shapes instead of bending the fit, of eighteen decode steps of each batch
and six prefills of each length in all."""
QUICK_GRID = StepGrid(
    prefill=(48, 200, 512), repeats=1, long_prompts=(), batched_prefill=((4, 64),),
    decode=((1, 48), (4, 96), (12, 32)), decode_steps=4, passes=2)


class _Recorder:
    """Wraps the engine's executor to note the shape of each step it runs."""

    def __init__(self, inner: Any):
        self.inner, self.compiled = inner, inner.compiled
        self.last: tuple[tuple[tuple[int, int], ...], int] | None = None
        self.seconds = 0.0
        """The last `execute`'s time."""

    def execute(self, scheduled: Any) -> Any:
        self.last = (tuple((s.num_new_tokens, s.start) for s in scheduled.scheduled),
                     sum(1 for s in scheduled.scheduled if s.samples))
        t = time.perf_counter()
        try:
            return self.inner.execute(scheduled)
        finally:
            self.seconds = time.perf_counter() - t


def served_engine() -> LLMEngine:
    """The engine `lifeline serve` runs by default (its model, weights, compile, limits)."""
    from lifeline.cli import DEFAULT_KV_CACHE_BYTES
    from lifeline.engine.engine import EngineConfig, LLMEngine
    from lifeline.model.loader import load_model

    return LLMEngine(load_model(), EngineConfig(kv_cache_memory_bytes=DEFAULT_KV_CACHE_BYTES,
                                                **SERVED))


def measure_steps(engine: LLMEngine, grid: StepGrid, on_item: Callable[[], None] | None = None,
                  seed: int = 0) -> list[StepSample]:
    """Drive `engine` through `grid`, timing every step. Prompts are random token ids (no
    prefix-cache hits), sampling greedy with `ignore_eos`, as the bench's requests."""
    from lifeline.engine.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    inner = engine.executor
    recorder = engine.executor = _Recorder(inner)
    samples: list[StepSample] = []

    def add(tokens: int, out: int) -> None:
        params = SamplingParams(max_tokens=out, min_tokens=out, ignore_eos=True, temperature=0)
        engine.add_request([rng.randrange(2, vocab) for _ in range(tokens)], params)

    def run(label: Callable[[StepSample], str | None] | str) -> None:
        name = label if callable(label) else lambda s: label
        while engine.has_unfinished_requests():
            recorder.last = None
            t = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - t
            if recorder.last is not None and recorder.last[0]:
                sample = StepSample("", recorder.last[0], recorder.last[1], seconds,
                                    max(seconds - recorder.seconds, 0.0))
                kept = name(sample)
                if kept is not None:
                    samples.append(dataclasses.replace(sample, label=kept))
        if on_item is not None:
            on_item()

    def decode_label(batch: int, n: int) -> Callable[[StepSample], str | None]:
        """The batch's prefill steps (mixed ones too) apart from its decode steps; the last
        steps, once requests finish unevenly, left out."""
        def name(s: StepSample) -> str | None:
            if any(t > 1 for t, _ in s.work):
                return f"decode {batch}@{n}: its prefill steps"
            return f"decode {batch}@{n}" if len(s.work) == batch else None
        return name

    def prefill(prompts: list[int], label: str) -> None:
        for n in prompts:
            add(n, 1)
        run(label)

    def decode(batch: int, n: int) -> None:
        # the first prefilled decode while the others prefill: enough tokens that all decode
        # together for `decode_steps` steps
        prefill_steps = -(-batch * n // engine.config.max_num_batched_tokens) + 1
        for _ in range(batch):
            add(n, grid.decode_steps + prefill_steps)
        run(decode_label(batch, n))

    try:
        add(16, 2)  # after the engine's own warm-up: settle the allocator and the threads
        run(lambda s: None)
        items: list[Callable[[], None]] = []
        for _ in range(grid.repeats):
            items += [lambda n=n: prefill([n], f"prefill {n}") for n in grid.prefill]
        items += [lambda n=n: prefill([n], f"prefill {n} (chunked)") for n in grid.long_prompts]
        items += [lambda c=c, n=n: prefill([n] * c, f"prefill {c}×{n}")
                  for c, n in grid.batched_prefill]
        items += [lambda b=b, n=n: decode(b, n) for b, n in grid.decode]
        for _ in range(grid.passes):
            rng.shuffle(items)
            for item in items:
                item()
    finally:
        engine.executor = inner
    return samples


# -- 3. the fit ----------------------------------------------------------------------------------

PARAMS = ("gemm", "memory", "kv_memory", "attention", "step_overhead_s", "seq_overhead_s",
          "batch_overhead_s")
EFFICIENCIES = 4
"""The first four of `PARAMS` are efficiencies (fractions of a peak), the rest seconds."""


class _OpLog(CostModel):
    """A `CostModel` that notes each op (kind, FLOPs, bytes, peak rate) instead of pricing
    it at fixed efficiencies, so a fit can reprice every step for any efficiencies at once.
    Built on a hardware record whose efficiencies are 1, so each op's rate is its peak."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ops: list[tuple[str, float, float, float]] = []

    def _op(self, cost: Any, kind: str, flops: float, nbytes: float, rate: float,
            count: int = 1) -> None:
        self.ops.append((kind, flops * count, nbytes * count, rate))
        super()._op(cost, kind, flops, nbytes, rate, count)


@dataclass(slots=True)
class StepTerms:
    """Every sample's work at peak, in seconds, by what prices it: the time of a step on this
    CPU (`Efficiency.combine` "sum") for efficiencies (g, m, k, a) and overheads (s, q, b) is
    gemm_s / g + memory_s / m + kv_s / k + attention_s / a + s + q · requests
    + b · (more than one row), as `CostModel.step` adds them: linear in 1/g, ..., s, q, b."""
    gemm_s: np.ndarray
    """Projections, experts and the LM head: their FLOPs at the int8 peak."""
    memory_s: np.ndarray
    """Their bytes and the elementwise kernels' at the read bandwidth."""
    kv_s: np.ndarray
    """Attention's KV traffic at the read bandwidth."""
    attention_s: np.ndarray
    """Attention's FLOPs at the float32 peak."""
    requests: np.ndarray
    batched: np.ndarray
    """1 where the step has more than one token row."""

    def columns(self) -> np.ndarray:
        return np.stack([self.gemm_s, self.memory_s, self.kv_s, self.attention_s,
                         np.ones_like(self.requests), self.requests, self.batched], 1)

    def predict(self, p: Sequence[float]) -> np.ndarray:
        inverse = np.asarray(p, dtype=float).copy()
        inverse[:EFFICIENCIES] = 1 / inverse[:EFFICIENCIES]
        return self.columns() @ inverse


def peak_hardware(peaks: Peaks, efficiency: Efficiency | None = None) -> Hardware:
    """`this-cpu` with the measured peaks (and `efficiency`; None: every factor 1, no
    overheads)."""
    name, cores = cpu_name()
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 0
    return Hardware(
        id=HARDWARE_ID, name=f"{name} ({cores} cores)", kind="cpu",
        flops={"fp32": peaks.fp32_flops, "int8": peaks.int8_ops},
        memory_bandwidth=peaks.bandwidth, memory_bytes=float(memory),
        interconnect_bandwidth=peaks.bandwidth, interconnect="shared memory (one machine)",
        price_per_hour=0.0, price_source="this machine: no price (set --cost-per-hour)",
        price_date=datetime.now(UTC).date().isoformat(),
        sources=("lifeline plan calibrate: the engine's int8 GEMM (512×2048×2048), a float32 "
                 "matmul (1024³) and a 512 MiB read, timed on this machine",),
        efficiency=efficiency or _UNIT)


_UNIT = Efficiency(gemm=1.0, memory=1.0, attention=1.0, combine="sum", step_overhead_s=0.0,
                   seq_overhead_s=0.0, request_overhead_s=0.0, source="peaks only")


def cpu_name() -> tuple[str, int]:
    try:
        text = Path("/proc/cpuinfo").read_text()
        name = next(line.split(":", 1)[1].strip() for line in text.splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        name = platform.processor() or platform.machine()
    return name, os.cpu_count() or 1


def step_terms(model: ModelConfig, hw: Hardware, samples: Sequence[StepSample]) -> StepTerms:
    """The ops of every sample under the cost model, on `hw`'s peaks."""
    peak = dataclasses.replace(hw, efficiency=_UNIT)
    log = _OpLog(model, peak, weights=WEIGHTS, kv_dtype=KV_DTYPE)
    bandwidth = peak.memory_bandwidth
    terms = np.zeros((len(samples), 4))
    for i, s in enumerate(samples):
        before = len(log.ops)
        log.step(s.work, s.sampled)
        for kind, flops, nbytes, rate in log.ops[before:]:
            if kind == "comm":
                raise ValueError("the fit prices one device: no tensor-parallel communication")
            if kind == "attention":
                terms[i, 2] += nbytes / bandwidth
                terms[i, 3] += flops / rate
            else:
                terms[i, 0] += flops / rate
                terms[i, 1] += nbytes / bandwidth
    rows = np.array([sum(t for t, _ in s.work) for s in samples])
    return StepTerms(terms[:, 0], terms[:, 1], terms[:, 2], terms[:, 3],
                     np.array([len(s.work) for s in samples], dtype=float),
                     (rows > 1).astype(float))


def host_floor(samples: Sequence[StepSample]) -> float:
    """The least fixed cost of a step, measured: the median time outside the executor of the
    steps that ran one request (0 where the samples have no host times)."""
    one = [s.host_seconds for s in samples if len(s.work) == 1]
    return float(np.median(one)) if one else 0.0


def _weights(samples: Sequence[StepSample]) -> np.ndarray:
    """Each label weighs as much as any other, however many steps it ran."""
    labels = [s.label for s in samples]
    counts = {label: labels.count(label) for label in set(labels)}
    return np.array([1.0 / counts[label] for label in labels])


ROBUST_SCALE = 0.05
"""Relative errors beyond about 5% count linearly, not squared (a step a noisy neighbour
slowed)."""


def fit_steps(terms: StepTerms, measured: np.ndarray, weights: np.ndarray | None = None,
              iterations: int = 20, step_overhead_floor: float = 0.0) -> np.ndarray:
    """The `PARAMS` whose predictions are closest to `measured`: a soft-L1 loss of the
    relative error, by iteratively reweighted non-negative least squares (the model is linear
    in the inverse efficiencies and the overheads). No efficiency exceeds 1: each inverse is
    1 + x, x ≥ 0, so the peaks' own time is the least a step's work can take. The step
    overhead is at least `step_overhead_floor` (the host time measured outside the forward):
    weight streaming is the same in every decode step of one model, so the steps alone cannot
    tell a slower read of the weights from a fixed cost, and the fit would take either."""
    w = np.ones(len(measured)) if weights is None else np.asarray(weights, dtype=float)
    a = terms.columns()
    floor = a[:, :EFFICIENCIES].sum(1) + step_overhead_floor  # every efficiency 1
    target = measured - floor
    robust = np.ones(len(measured))
    x = np.zeros(a.shape[1])
    for _ in range(iterations):
        scale = np.sqrt(w * robust) / measured
        x_new = nnls(a * scale[:, None], target * scale)
        r = (a @ x_new + floor) / measured - 1
        robust = 1 / np.sqrt(1 + (r / ROBUST_SCALE) ** 2)
        if np.allclose(x_new, x, rtol=1e-6, atol=1e-12):
            x = x_new
            break
        x = x_new
    params = x.copy()
    params[:EFFICIENCIES] = 1 / (1 + x[:EFFICIENCIES])
    params[EFFICIENCIES] += step_overhead_floor
    return params


def nnls(a: np.ndarray, b: np.ndarray, iterations: int = 200) -> np.ndarray:
    """argmin ‖a x − b‖ over x ≥ 0 (Lawson and Hanson's active set; no scipy here)."""
    n = a.shape[1]
    x = np.zeros(n)
    free: list[int] = []
    tol = 1e-12 * max(1.0, float(np.abs(a).max()) * float(np.abs(b).max()))
    for _ in range(iterations):
        grad = a.T @ (b - a @ x)
        bound = [j for j in range(n) if j not in free]
        if not bound or max(grad[bound]) <= tol:
            break
        free.append(max(bound, key=lambda j: grad[j]))
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if all(z[j] > 0 for j in free):
                x = z
                break
            step = min(x[j] / (x[j] - z[j]) for j in free if z[j] <= 0)
            x = x + step * (z - x)
            free = [j for j in free if x[j] > 1e-15]
            if not free:
                break
    return x


def efficiency_of(params: Sequence[float], request_overhead_s: float = 0.0,
                  source: str = "") -> Efficiency:
    g, m, k, a, s, q, b = (float(v) for v in params)
    return Efficiency(gemm=g, memory=m, kv_memory=k, attention=a, combine="sum",
                      step_overhead_s=s, seq_overhead_s=q, batch_overhead_s=b,
                      request_overhead_s=request_overhead_s, source=source)


@dataclass(slots=True)
class StepFit:
    params: np.ndarray
    rows: list[dict[str, Any]]
    """Per label: steps, measured and predicted mean ms, error."""
    median_abs_error: float
    """Of single steps, |predicted / measured − 1|."""
    weighted_error: float
    """Of the labels' means, the root mean square of (predicted / measured − 1)."""


def fit_report(model: ModelConfig, hw: Hardware, samples: Sequence[StepSample]) -> StepFit:
    """The fitted hardware's predictions, by the real `CostModel`, against the samples."""
    cost = CostModel(model, hw, weights=WEIGHTS, kv_dtype=KV_DTYPE)
    pred = np.array([cost.step(s.work, s.sampled).seconds for s in samples])
    meas = np.array([s.seconds for s in samples])
    rows: list[dict[str, Any]] = []
    for label in dict.fromkeys(s.label for s in samples):
        sel = np.array([s.label == label for s in samples])
        m, p = float(meas[sel].mean()), float(pred[sel].mean())
        rows.append({"label": label, "steps": int(sel.sum()), "measured_ms": m * 1e3,
                     "predicted_ms": p * 1e3, "error": p / m - 1})
    errors = np.array([r["error"] for r in rows])
    e = efficiency_params(hw.efficiency)
    return StepFit(e, rows, float(np.median(np.abs(pred / meas - 1))),
                   float(np.sqrt(np.mean(errors ** 2))))


def efficiency_params(e: Efficiency) -> np.ndarray:
    kv = e.kv_memory if e.kv_memory is not None else e.memory
    return np.array([e.gemm, e.memory, kv, e.attention, e.step_overhead_s, e.seq_overhead_s,
                     e.batch_overhead_s])


# -- 4. serving ----------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ServedPoint:
    """A closed-loop load point of the served calibration."""
    users: int
    requests: int
    input_tokens: int = 256
    output_tokens: int = 64
    seed: int = 0
    """The workload's seed: points measured against one server need distinct ones, or the
    prompts of one are cached prefixes of another's."""


SERVED_POINTS = (ServedPoint(1, 6, 64, 16, seed=100), ServedPoint(2, 10, 256, 64, seed=101),
                 ServedPoint(12, 36, 40, 64, seed=102))
"""Each point's prompts fit one step (64, 2 × 256 and 12 × 40 tokens of the 512): TPOT and
TTFT then move smoothly with the costs fitted (a closed loop whose prompts take several steps
shifts between schedules as they change). Batch sizes far apart separate the per-step from the
per-request cost; one user finds the engine idle at each arrival, so its TTFT holds the whole
front (with more users a request mostly arrives during a step and waits for its end whatever
the front). None is a load of benchmarks/plan_vs_bench.py."""
QUICK_SERVED_POINTS = (ServedPoint(1, 3, 48, 12, seed=103), ServedPoint(4, 8, 96, 24, seed=104))


def bench_settings(url: str, point: ServedPoint, model: str | None = None) -> BenchSettings:
    from lifeline.bench.run import BenchSettings

    return BenchSettings(url=url, model=model, concurrency=point.users,
                         requests=point.requests, warmup=1, input_tokens=point.input_tokens,
                         output_tokens=point.output_tokens, seed=point.seed)


def this_cpu_model() -> ModelConfig:
    """The default model's config as its GGUF says (no weights are read)."""
    from lifeline.model.config import config_from_gguf
    from lifeline.model.default import default_model_path
    from lifeline.model.gguf_file import GGUFFile

    gf = GGUFFile(default_model_path())
    meta = dict(gf.metadata)
    meta["_has_output_tensor"] = "output.weight" in gf
    meta["_vocab_size"] = gf.tensor_shape("token_embd.weight")[0]
    cfg = config_from_gguf(meta)
    return dataclasses.replace(cfg, name=cfg.name or DEFAULT_NAME)


def served_deployment(model: ModelConfig, hw: Hardware) -> Deployment:
    """What `lifeline plan --hardware this-cpu` deploys: `lifeline serve`'s limits and KV
    cache, weights priced as int8, the cache as float32 (as lifeline.plan.command)."""
    from lifeline.cli import DEFAULT_KV_CACHE_BYTES
    from lifeline.plan.sim import Deployment

    cost = CostModel(model, hw, weights=WEIGHTS, kv_dtype=KV_DTYPE)
    return Deployment(cost, max_num_seqs=SERVED["max_num_seqs"],
                      max_num_batched_tokens=SERVED["max_num_batched_tokens"],
                      kv_cache_bytes=DEFAULT_KV_CACHE_BYTES)


def summary_point(results: dict[str, Any]) -> dict[str, float]:
    s = results["summary"]
    return {"ttft_ms": s["ttft_ms"]["p50"], "tpot_ms": s["tpot_ms"]["p50"],
            "output_tok_s": s["output_throughput_tok_s"]}


def simulate(settings: BenchSettings, model: ModelConfig, hw: Hardware) -> dict[str, Any]:
    from lifeline.plan.run import run_plan

    return run_plan(dataclasses.replace(settings), served_deployment(model, hw))


def measure_serving(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    """What serving adds to the bare engine, read from served runs' own per-request timings
    (the client's clock beside the server's, taken at the same moments, so a slow spell of the
    machine slows both alike): the front before the engine (the server's gateway, template and
    tokenizer: `request_serial_s`, on its one event loop) plus the time outside the server's
    accounting (the client's send, the network, the first event's delivery), together
    `request_overhead_s`. The outside part is the least of the runs' medians: in a loaded run
    it also holds the wait for the busy event loop, which the simulation's serial front
    models itself. `stream_s`, the client's TPOT less the server's decode time per token, is
    what streaming adds to each token (recorded, not priced: the client reads each event as
    the engine makes it)."""
    outside, front, stream = [], [], []
    for results in runs:
        gaps = []
        for r in results["requests"]:
            t = r.get("server_timings") or {}
            if r.get("ttft_ms") is not None and t.get("server_ttft_ms") is not None:
                gaps.append(r["ttft_ms"] - t["server_ttft_ms"])
            if t.get("front_ms") is not None:
                front.append(t["front_ms"])
            tokens = r.get("usage_output_tokens") or 0
            if r.get("tpot_ms") is not None and t.get("decode_ms") is not None and tokens > 1:
                stream.append(r["tpot_ms"] - t["decode_ms"] / (tokens - 1))
        if gaps:
            outside.append(float(np.median(gaps)))
    if not outside or not front:
        raise ValueError("the served runs carry no server timings: is the server Lifeline?")
    serial = float(np.median(front)) / 1e3
    rest = max(0.0, min(outside) / 1e3)
    return {"request_overhead_s": serial + rest, "request_serial_s": serial,
            "client_network_s": rest,
            "stream_s": float(np.median(stream)) / 1e3 if stream else 0.0}


def with_serving(hw: Hardware, serving: dict[str, float]) -> Hardware:
    return dataclasses.replace(hw, efficiency=dataclasses.replace(
        hw.efficiency, request_overhead_s=serving["request_overhead_s"],
        request_serial_s=serving["request_serial_s"]))


def with_served_steps(model: ModelConfig, hw: Hardware,
                      runs: Sequence[tuple[BenchSettings, dict[str, Any]]],
                      ) -> tuple[Hardware, list[float]]:
    """`hw` with `served_step_factor`, a served step's cost over the bare engine's: the median
    of the runs' measured TPOT over the simulated (at least 1), and those ratios. TPOT is read
    from the same runs as the front, so both see the same spell of the machine's speed."""
    ratios = [summary_point(r)["tpot_ms"] / summary_point(simulate(s, model, hw))["tpot_ms"]
              for s, r in runs]
    factor = max(1.0, float(np.median(ratios)))
    return dataclasses.replace(hw, efficiency=dataclasses.replace(
        hw.efficiency, served_step_factor=factor)), ratios


def golden_section(f: Callable[[float], float], lo: float, hi: float,
                   tol: float = 1e-3) -> float:
    """A minimum of `f` on [lo, hi] (unimodal there, or one of its local minima)."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    while b - a > tol:
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


class ServeProcess:
    """`lifeline serve` (its defaults: the served configuration) as a subprocess on loopback;
    `with ServeProcess() as s:` waits until `/ready` answers 200."""

    def __init__(self, extra: Sequence[str] = (), timeout_s: float = 600.0):
        from lifeline.server.testing import free_port

        self.port = free_port()
        self.argv = [sys.executable, "-m", "lifeline.cli", "serve", "--port", str(self.port),
                     *extra]
        self.timeout_s = timeout_s
        self.log = Path(tempfile.mkstemp(prefix="lifeline-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> ServeProcess:
        import httpx

        with self.log.open("w") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lifeline serve exited ({self.proc.returncode}): "
                                   f"{self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"lifeline serve was not ready in {self.timeout_s:.0f} s ({self.log})")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def measure_served(url: str, points: Sequence[ServedPoint],
                   progress: Progress | None = None) -> list[tuple[BenchSettings, dict]]:
    """`lifeline bench` (run_bench) at each point against the server at `url`."""
    from lifeline.bench.run import run_bench

    out = []
    for point in points:
        settings = bench_settings(url, point)
        task = progress.add_task(f"served: {point.users} users", total=point.requests) \
            if progress is not None else None

        def done(_: Any, task: Any = task) -> None:
            if progress is not None:
                progress.advance(task)

        results = asyncio.run(run_bench(settings, done))
        out.append((settings, results))
    return out


# -- the whole calibration ---------------------------------------------------------------------

@dataclass(slots=True)
class Calibration:
    hardware: Hardware
    peaks: Peaks
    samples: list[StepSample]
    engine_fit: StepFit
    """The bare engine's steps against the fit of part 3."""
    served: list[dict[str, Any]] = field(default_factory=list)
    """Per served point: its settings, measured and simulated p50s."""
    served_fit: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    threads: int = 0
    foreign_cores: dict[str, float] = field(default_factory=dict)
    """Cores other processes used while the steps and the served runs were measured."""

    def as_dict(self) -> dict[str, Any]:
        return {"hardware": hardware_to_dict(self.hardware),
                "peaks": dataclasses.asdict(self.peaks),
                "torch_threads": self.threads, "wall_s": self.wall_s,
                "foreign_cores": self.foreign_cores,
                "engine_fit": {"rows": self.engine_fit.rows,
                               "median_abs_error": self.engine_fit.median_abs_error,
                               "weighted_error": self.engine_fit.weighted_error},
                "served": self.served, "served_fit": self.served_fit,
                "samples": [s.as_dict() for s in self.samples]}


def calibrate(*, quick: bool = False, engine: LLMEngine | None = None, url: str | None = None,
              serve: bool = True, progress: Progress | None = None,
              model: ModelConfig | None = None) -> Calibration:
    """Measure this machine (parts 1-4 above) and return `this-cpu` with the evidence.

    `engine`: the engine to time (default: `lifeline serve`'s, built here and dropped after);
    `url`: a running server for part 4 (default: `lifeline serve` started here on loopback);
    `serve=False` skips part 4 (the bare engine's costs only). `quick`: fewer shapes and one
    load point, for tests."""
    import torch

    t0 = time.perf_counter()

    def task(name: str, total: int) -> Callable[[], None]:
        if progress is None:
            return lambda: None
        tid = progress.add_task(name, total=total)
        return lambda: progress.advance(tid)

    advance = task("peaks", 1)
    peaks = measure_peaks(3 if quick else 5)
    advance()
    grid = QUICK_GRID if quick else FULL_GRID
    own = engine is None
    advance = task("engine: loading, compiling", 1)
    engine = engine or served_engine()
    advance()
    if model is None:  # the GGUF's config, as `lifeline plan --model FILE.gguf` reads it
        model = dataclasses.replace(engine.model_config,
                                    name=engine.model_config.name or DEFAULT_NAME)
    points = (QUICK_SERVED_POINTS if quick else SERVED_POINTS) if serve else ()
    samples: list[StepSample] = []
    runs: list[tuple[int, BenchSettings, dict[str, Any]]] = []
    foreign: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        server_url, pids = url, ()
        if serve and url is None:
            advance = task("lifeline serve: loading, compiling", 1)
            server = stack.enter_context(ServeProcess())
            server_url, pids = server.url, (server.proc.pid,)
            advance()
        meter = ForeignLoad(pids)
        one_pass = dataclasses.replace(grid, passes=1)
        advance = task("engine steps", grid.passes * one_pass.items())
        for k in range(grid.passes):
            # bare steps and served runs in turn: both see each spell of the machine's speed
            samples += measure_steps(engine, one_pass, advance, seed=k)
            if points:
                varied = [dataclasses.replace(p, seed=p.seed + 1000 * k) for p in points]
                runs += [(k, s, r) for s, r in measure_served(server_url, varied, progress)]
        foreign["engine steps and served runs"] = meter.share()
    engine_label = (f"{engine.config.weights}, "
                    f"{'compiled' if engine.executor.compiled else 'eager'}")
    if own:
        del engine
    advance = task("fit", 1)
    hw = peak_hardware(peaks)
    terms = step_terms(model, hw, samples)
    measured = np.array([s.seconds for s in samples])
    params = fit_steps(terms, measured, _weights(samples),
                       step_overhead_floor=host_floor(samples))
    advance()
    threads = torch.get_num_threads()
    source = (f"lifeline plan calibrate, {datetime.now(UTC).date().isoformat()}, "
              f"{threads} torch threads: {len(samples)} engine steps of the default model "
              f"({engine_label}) fitted")
    hw = dataclasses.replace(hw, efficiency=efficiency_of(params, source=source))
    engine_fit = fit_report(model, hw, samples)
    cal = Calibration(hw, peaks, samples, engine_fit, threads=threads, foreign_cores=foreign)
    if runs:
        cal.served_fit = measure_serving([r for _, _, r in runs])
        hw = with_serving(hw, cal.served_fit)
        hw, ratios = with_served_steps(model, hw, [(s, r) for _, s, r in runs])
        cal.served_fit["served_step_factor"] = hw.efficiency.served_step_factor
        cal.served_fit["tpot_ratios"] = ratios
        for k, settings, results in runs:
            cal.served.append({"pass": k + 1, "users": settings.concurrency,
                               "input_tokens": settings.input_tokens,
                               "output_tokens": settings.output_tokens,
                               "requests": settings.requests,
                               "measured": summary_point(results),
                               "predicted": summary_point(simulate(settings, model, hw))})
        users = ", ".join(str(p.users) for p in points)
        hw = dataclasses.replace(hw, efficiency=dataclasses.replace(
            hw.efficiency, source=source + f"; the front and the served steps' slowdown "
                                           f"measured by `lifeline bench` against `lifeline "
                                           f"serve` at {users} users, between the step passes"))
        cal.hardware = hw
    cal.wall_s = time.perf_counter() - t0
    return cal


FOREIGN_WARN = 0.2
"""Cores of other processes' work beyond which the calibration warns."""


def print_calibration(console: Console, cal: Calibration) -> None:
    from rich.table import Table

    hw, e, p = cal.hardware, cal.hardware.efficiency, cal.peaks
    console.print(f"[bold]{hw.name}[/], {cal.threads} torch threads: int8 GEMM "
                  f"{p.int8_ops / 1e9:.0f} GOP/s, float32 {p.fp32_flops / 1e9:.0f} GFLOP/s, "
                  f"read {p.bandwidth / 1e9:.1f} GB/s")
    table = Table("steps", "n", "measured ms", "fitted ms", "error", title="engine steps: "
                  "measured and the cost model's fit")
    for row in cal.engine_fit.rows:
        table.add_row(row["label"], str(row["steps"]), f"{row['measured_ms']:.1f}",
                      f"{row['predicted_ms']:.1f}", f"{row['error']:+.1%}")
    console.print(table)
    busy = {k: v for k, v in cal.foreign_cores.items() if v > FOREIGN_WARN}
    if busy:
        console.print("[yellow]other processes were busy meanwhile ("
                      + ", ".join(f"{k}: {v:.2f} cores" for k, v in busy.items())
                      + "): the steps ran slower than this machine alone runs them[/]")
    console.print(f"fit error: median |error| of a step {cal.engine_fit.median_abs_error:.1%}, "
                  f"RMS of the shapes' means {cal.engine_fit.weighted_error:.1%}")
    fit = Table("parameter", "value", title="fitted")
    fit.add_row("gemm (of the int8 peak)", f"{e.gemm:.3f}")
    fit.add_row("memory (of the read bandwidth)", f"{e.memory:.3f}")
    fit.add_row("kv_memory (attention's KV, of the read bandwidth)", f"{e.kv_memory:.3f}")
    fit.add_row("attention (of the float32 peak)", f"{e.attention:.3f}")
    fit.add_row("step_overhead_s", f"{e.step_overhead_s * 1e3:.2f} ms")
    fit.add_row("seq_overhead_s", f"{e.seq_overhead_s * 1e3:.3f} ms")
    fit.add_row("batch_overhead_s (more than one row)", f"{e.batch_overhead_s * 1e3:.2f} ms")
    fit.add_row("request_overhead_s", f"{e.request_overhead_s * 1e3:.2f} ms")
    fit.add_row("  of which the event loop's: request_serial_s",
                f"{e.request_serial_s * 1e3:.2f} ms")
    fit.add_row("served_step_factor (a served step over a bare one)",
                f"{e.served_step_factor:.3f}")
    if cal.served_fit:
        fit.add_row("  the rest: client, network, first event",
                    f"{cal.served_fit['client_network_s'] * 1e3:.2f} ms")
        fit.add_row("streaming's addition to TPOT (not priced)",
                    f"{cal.served_fit['stream_s'] * 1e3:+.3f} ms")
    console.print(fit)
    if cal.served:
        served = Table("pass", "served point", "TTFT p50 ms", "plan", "TPOT p50 ms", "plan",
                       "output tok/s", "plan", title="served calibration points")
        for row in cal.served:
            m, s = row["measured"], row["predicted"]
            served.add_row(str(row.get("pass", 1)),
                           f"{row['users']} users, {row['input_tokens']}/{row['output_tokens']}",
                           f"{m['ttft_ms']:.0f}", f"{s['ttft_ms']:.0f}", f"{m['tpot_ms']:.1f}",
                           f"{s['tpot_ms']:.1f}", f"{m['output_tok_s']:.1f}",
                           f"{s['output_tok_s']:.1f}")
        console.print(served)


def cmd_calibrate(args: argparse.Namespace, console: Console) -> int:
    """`lifeline plan calibrate [--quick]`: run `calibrate`, print it, save `this-cpu`."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    if getattr(args, "exec_allowed", False) and getattr(args, "huge_pages", True):
        from lifeline.cli import exec_with_huge_pages

        exec_with_huge_pages()  # as `lifeline serve` runs: the steps are measured the same way
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn(
        "{task.completed}/{task.total}"), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=getattr(args, "quiet", False)) as progress:
        cal = calibrate(quick=getattr(args, "quick", False), progress=progress,
                        serve=not getattr(args, "no_serve", False))
    print_calibration(console, cal)
    path = save_calibrated(cal.hardware)
    report = report_path(path)
    report.write_text(json.dumps(cal.as_dict(), indent=1) + "\n")
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(cal.as_dict(), indent=1) + "\n")
    console.print(f"saved {path} (--hardware {HARDWARE_ID}); measurements in {report}; "
                  f"{cal.wall_s:.0f} s")
    return 0
