"""The hardware catalog: what the planner knows of each accelerator, and where it read it.

Peaks are the vendor's dense (no sparsity) tensor throughputs and memory bandwidths. What the
engine reaches of them is `Efficiency`: fractions of peak per op kind and the fixed time of a
step, fitted as docs/plan.md shows and stored beside their source, never hidden in the cost
model. `this-cpu` is not in the table: `lifeline plan calibrate` measures it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("fp32", "bf16", "fp8", "int8", "int4")
"""Weight and KV formats the planner prices."""


@dataclass(frozen=True, slots=True)
class Efficiency:
    """What an engine reaches of a device's peaks (fractions in (0, 1]) and its fixed costs."""

    gemm: float = 0.7
    """Of the peak tensor FLOP/s, in a compute-bound matrix multiply (prefill, large batches)."""
    memory: float = 0.85
    """Of the peak memory bandwidth, streaming weights and KV cache."""
    attention: float = 0.5
    """Of the peak tensor FLOP/s, in attention's matrix multiplies (FlashAttention-like)."""
    step_overhead_s: float = 0.0
    """Fixed time of every step: scheduling, input preparation, kernel launches, sampling."""
    seq_overhead_s: float = 0.0
    """Time per request scheduled in a step (its inputs, sampling, output handling)."""
    request_overhead_s: float = 0.0
    """Fixed time of every request before its first step: HTTP, chat template, tokenizer."""
    request_serial_s: float = 0.0
    """Of `request_overhead_s`, the part on the server's one front thread (its event loop:
    parsing, validation, tokenizer): requests sent together reach the engine this far apart,
    so the first of them can start a step alone. The rest is latency, taken in parallel."""
    source: str = ""
    """How these numbers were obtained (fit, microbenchmark, assumption)."""


@dataclass(frozen=True, slots=True)
class Hardware:
    id: str
    """Lower-case id on the command line (`h100-sxm`)."""
    name: str
    kind: str
    """'gpu' or 'cpu'."""
    flops: dict[str, float]
    """Peak dense FLOP/s (OP/s for integers) of matrix multiplies by input dtype; a dtype that
    is missing computes in the next wider one present (int4 weights on a GPU without int4
    tensor cores are dequantized and multiplied in fp8 or bf16)."""
    memory_bandwidth: float
    """Peak bytes/s of device memory."""
    memory_bytes: float
    """Device memory, bytes."""
    interconnect_bandwidth: float
    """Bytes/s one device sends to its peers (one direction), for tensor-parallel all-reduce."""
    interconnect: str
    """What the link is (e.g. 'NVLink 4, 900 GB/s bidirectional')."""
    price_per_hour: float
    """Default on-demand $/hour of one device."""
    price_source: str
    price_date: str
    sources: tuple[str, ...] = ()
    """Where the peaks come from (datasheets, with their revision)."""
    efficiency: Efficiency = field(default_factory=Efficiency)
    allreduce_latency_s: float = 10e-6
    """Fixed latency of one all-reduce across the tensor-parallel group."""

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s of a matrix multiply whose inputs are `dtype` (see `flops`)."""
        for candidate in DTYPES[DTYPES.index(dtype)::-1]:  # itself, then ever wider
            if candidate in self.flops:
                return self.flops[candidate]
        return min(self.flops.values())
