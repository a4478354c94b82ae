"""Engine settings the planner can replay: the scheduler's limits and memory share of a serving
engine, and its fixed costs where they are the engine's rather than the device's.

The scheduler that runs is always Lifeline's (continuous batching with chunked prefill, as vLLM
V1); a profile sets its limits as that engine's defaults or a published run's flags, and its
per-step overheads (None: the device's, `Efficiency.step_overhead_s`/`seq_overhead_s`).
Where each number comes from is in `source` and docs/plan.md.
"""
from __future__ import annotations

from dataclasses import dataclass


STEP_TRTLLM = 2e-3
"""Assumed, not fitted: a CUDA-graph step's launches and the PyTorch backend's Python loop."""
SEQ_TRTLLM = 3.71e-6
STEP_VLLM05, SEQ_VLLM05, FRONT_VLLM05 = 12.8115e-3, 37.1e-6, 7.2417e-3
"""Fitted by `benchmarks/plan_validation.py --fit` on 2026-12-02 (docs/plan.md: on what)."""


@dataclass(frozen=True, slots=True)
class EngineProfile:
    name: str
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float = 0.9
    step_overhead_s: float | None = None
    seq_overhead_s: float | None = None
    request_overhead_s: float | None = None
    """The API front's time per request, one at a time (None: the device's)."""
    source: str = ""


ENGINES: dict[str, EngineProfile] = {
    "lifeline": EngineProfile(
        "lifeline", 256, 8192, 0.9, step_overhead_s=STEP_TRTLLM, seq_overhead_s=SEQ_TRTLLM,
        source="Lifeline's scheduler with vLLM V1's GPU limits (256 sequences, 8,192 tokens a "
               "step, 90% of memory) and, on a GPU, TensorRT-LLM's fitted step overhead "
               "(Lifeline has not been measured on a GPU); on a CPU `lifeline serve`'s "
               "defaults (64, 512) and the overheads `lifeline plan calibrate` measured"),
    "trtllm": EngineProfile(
        "trtllm", 4096, 8192, 0.9, step_overhead_s=STEP_TRTLLM, seq_overhead_s=SEQ_TRTLLM,
        request_overhead_s=0.0,
        source="TensorRT-LLM's trtllm-bench limits (max batch 4,096, 8,192 tokens; offline, no "
               "API front); a 2 ms step overhead assumed and the per-sequence one (its PyTorch "
               "backend's executor is Python) fitted on the Llama-3.1-8B FP8 H100 128/128 row "
               "(benchmarks/plan_validation.py --fit, docs/plan.md)"),
    "vllm-0.5": EngineProfile(
        "vllm-0.5", 256, 8000, 0.9, step_overhead_s=STEP_VLLM05, seq_overhead_s=SEQ_VLLM05,
        request_overhead_s=FRONT_VLLM05,
        source="vLLM 0.5.4 defaults (256 sequences, max_num_batched_tokens = max_model_len, "
               "90% of memory); step, per-sequence and per-request overheads (its API server, "
               "scheduler and output processing share one process with the GPU loop) fitted on "
               "LambdaLabs' H100 ShareGPT-320 output throughput, mean TTFT, median TPOT and "
               "median ITL (benchmarks/plan_validation.py --fit, docs/plan.md)"),
    "fastertransformer": EngineProfile(
        "fastertransformer", 1, 2048, 0.9, step_overhead_s=0.0, seq_overhead_s=0.0,
        source="FasterTransformer at batch 1: C++ with no scheduler; no overhead assumed"),
}

CPU_LIMITS = (64, 512)
"""`lifeline serve`'s max_num_seqs and max_num_batched_tokens, the CPU defaults."""


def get_engine(name: str) -> EngineProfile:
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}") from None
