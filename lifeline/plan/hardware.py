"""The hardware catalog: what the planner knows of each accelerator, and where it read it.

Peaks are the vendor's dense (no sparsity) tensor throughputs and memory bandwidths. What the
engine reaches of them is `Efficiency`: fractions of peak per op kind and the fixed time of a
step, fitted as docs/plan.md shows and stored beside their source, never hidden in the cost
model. `this-cpu` is not in the table: `lifeline plan calibrate` measures it.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

DTYPES = ("fp32", "bf16", "fp8", "int8", "int4")
"""Weight and KV formats the planner prices."""


@dataclass(frozen=True, slots=True)
class Efficiency:
    """What an engine reaches of a device's peaks (fractions in (0, 1]) and its fixed costs."""

    gemm: float = 0.7
    """Of the peak tensor FLOP/s, in a compute-bound matrix multiply (prefill, large batches)."""
    gemm_by_dtype: dict[str, float] = field(default_factory=dict)
    """`gemm` for the input dtypes that reach a different share (Hopper's fp8 GEMMs reach less
    of their peak than its bf16 ones)."""
    gemm_weight_only: float | None = None
    """`gemm` for weight-only quantized matrix multiplies (the weights dequantized inside the
    kernel and multiplied at the activations' dtype: int4 AWQ/GPTQ, fp8 on a GPU without fp8
    tensor cores, as Marlin kernels do); None: `gemm`."""
    memory: float = 0.85
    """Of the peak memory bandwidth, streaming weights and KV cache."""
    attention: float = 0.5
    """Of the peak tensor FLOP/s, in attention's matrix multiplies (FlashAttention-like)."""
    kv_memory: float | None = None
    """Of the peak memory bandwidth, attention reading and writing the KV cache, where its
    kernel reaches a different share than streaming weights; None: `memory`."""
    combine: str = "max"
    """How an op's compute and memory times make its time: "max", the roofline of a GPU,
    whose memory system feeds the tensor cores while they compute; "sum", a CPU's, whose
    cores issue the loads and the arithmetic themselves, so small matrix multiplies overlap
    little of the two (fitted on this machine's own steps, `lifeline plan calibrate`)."""
    step_overhead_s: float = 0.0
    """Fixed time of every step: scheduling, input preparation, kernel launches, sampling."""
    batch_overhead_s: float = 0.0
    """Added to `step_overhead_s` for a step of more than one token row: engines run a single
    row through a matrix-vector kernel and batches through a GEMM with its own set-up (on a CPU
    with oneDNN, Lifeline's int8 projections take fbgemm for one row and oneDNN for more)."""
    seq_overhead_s: float = 0.0
    """Time per request scheduled in a step (its inputs, sampling, output handling)."""
    served_step_factor: float = 1.0
    """How much longer a step takes in a serving process than the bare engine's same step: on
    a CPU the server's event loop and the client share the cores with the engine (measured by
    `lifeline plan calibrate`); 1 where the engine has the device to itself (a GPU)."""
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
    link_bandwidth: float | None = None
    """Bytes/s of one link to one peer (one direction) where GPUs are wired point to point
    rather than through a switch: a group of n then reaches only (n − 1) links' worth of
    `interconnect_bandwidth` (MI300X). None: a switch gives every device its full bandwidth."""

    def group_bandwidth(self, n: int) -> float:
        """Bytes/s one device of a tensor-parallel group of `n` sends to the others."""
        if self.link_bandwidth is None:
            return self.interconnect_bandwidth
        return min(self.interconnect_bandwidth, (n - 1) * self.link_bandwidth)
    """Fixed latency of one all-reduce across the tensor-parallel group."""

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s of a matrix multiply whose inputs are `dtype` (see `flops`)."""
        for candidate in DTYPES[DTYPES.index(dtype)::-1]:  # itself, then ever wider
            if candidate in self.flops:
                return self.flops[candidate]
        return min(self.flops.values())


TERA = 1e12
GB_S = 1e9
"""Bandwidths are decimal: a vendor's TB/s and GB/s are 10^12 and 10^9 bytes/s."""
GIB = 2**30
"""Memory sizes are binary: an '80 GB' H100 is 80 GiB of HBM (nvidia-smi: 81,559 MiB)."""
HOPPER = Efficiency(
    gemm=0.71, gemm_by_dtype={"fp8": 0.64}, memory=0.90, attention=0.75,
    source="published kernel results: bf16 and fp8 GEMMs of Llama-3.1-8B's shapes reach 71% "
           "and 64% of H100 peak at M=2,048 (vLLM PR #19627, benchmarks/kernels/"
           "bench_fp8_gemm.py); FlashMLA decode streams 3,000 GB/s on H800 SXM5 (90% of 3.35 "
           "TB/s); FlashAttention-3 reaches 740 TFLOP/s bf16 (75%, Shah et al. 2024)")
AMPERE = Efficiency(
    gemm=0.72, gemm_weight_only=0.333, memory=0.90, attention=0.70,
    source="published: cli99/llm-analysis's efficiencies for FasterTransformer on A100 (its "
           "profiled MLP GEMMs reach 72% of peak FLOP/s; 90% of HBM bandwidth); "
           "FlashAttention-2 reaches up to 73% of A100 peak (Dao 2023); the weight-only (FP8 "
           "Marlin) GEMM share fitted on LambdaLabs' vLLM 0.5.4 A100 ShareGPT-320 output "
           "throughput (benchmarks/plan_validation.py --fit, 2026-12-02)")
BLACKWELL = Efficiency(
    gemm=0.71, gemm_by_dtype={"fp8": 0.64}, memory=0.90, attention=0.75,
    source="assumed: Hopper's shares of peak (no published B200 row replayed yet)")
ADA = Efficiency(
    gemm=0.70, memory=0.85, attention=0.60,
    source="assumed: shares a little below Ampere's for GDDR and PCIe cards (no published "
           "row replayed)")
CDNA3 = Efficiency(
    gemm=0.55, memory=0.80, attention=0.50,
    source="assumed: below Hopper's, as public ROCm GEMM and attention microbenchmarks reach a "
           "smaller share of MI300X's peaks (no published row replayed)")
LAMBDA = "Lambda on-demand (lambda.ai/pricing), approximate list price"
RUNPOD = "RunPod Secure Cloud on-demand (runpod.io/pricing), approximate list price"


def _gpu(id: str, name: str, tflops: dict[str, float], gb_s: float, gib: float,
         link_gb_s: float, interconnect: str, price: float, price_source: str,
         price_date: str, sources: tuple[str, ...], efficiency: Efficiency) -> Hardware:
    """Peaks in the units datasheets use: TFLOP/s (TOP/s), GB/s, GiB."""
    return Hardware(id, name, "gpu", {k: v * TERA for k, v in tflops.items()}, gb_s * GB_S,
                    gib * GIB, link_gb_s * GB_S, interconnect, price, price_source, price_date,
                    sources, efficiency)


_A100_DATASHEET = ("NVIDIA A100 Tensor Core GPU datasheet "
                   "(nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)")
_HOPPER_DATASHEET = "NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100)"
# Dense peaks (the datasheets' sparse figures halved). `fp32` is the TF32 tensor-core rate,
# which fp32 matrix multiplies reach (cuBLAS with TF32 allowed); the plain fp32 (no tensor
# core) peaks are 19.5 (A100), 67 (H100 SXM), 51 (H100 PCIe), 91.6 (L40S), 82.6 (RTX 4090),
# 163.4 (MI300X, matrix) TFLOP/s.
_GPUS = (
    _gpu("a100-40gb", "NVIDIA A100 40GB SXM4",
         {"fp32": 156, "bf16": 312, "int8": 624, "int4": 1248}, 1555, 40, 300,
         "NVLink 3, 600 GB/s bidirectional (12 links)", 1.29, f"{LAMBDA}, 8x A100 SXM4 40GB "
         "instance per GPU", "2025-06", (_A100_DATASHEET,), AMPERE),
    _gpu("a100-80gb", "NVIDIA A100 80GB SXM4",
         {"fp32": 156, "bf16": 312, "int8": 624, "int4": 1248}, 2039, 80, 300,
         "NVLink 3, 600 GB/s bidirectional (12 links)", 1.79, f"{LAMBDA}, 8x A100 SXM4 80GB "
         "instance per GPU", "2025-06", (_A100_DATASHEET,), AMPERE),
    _gpu("h100-sxm", "NVIDIA H100 SXM5 80GB",
         {"fp32": 494.7, "bf16": 989.4, "fp8": 1978.9, "int8": 1978.9}, 3350, 80, 450,
         "NVLink 4, 900 GB/s bidirectional (18 links, NVSwitch)", 2.99,
         f"{LAMBDA}, 8x H100 SXM instance per GPU", "2025-06",
         (_HOPPER_DATASHEET, "NVIDIA H100 Tensor Core GPU Architecture whitepaper, table 3"), HOPPER),
    _gpu("h100-pcie", "NVIDIA H100 PCIe 80GB",
         {"fp32": 378, "bf16": 756.5, "fp8": 1513, "int8": 1513}, 2000, 80, 64,
         "PCIe Gen5 x16, 128 GB/s bidirectional (an optional NVLink bridge pairs two cards "
         "at 600 GB/s)", 2.49, f"{LAMBDA}, 1x H100 PCIe instance", "2025-06",
         (_HOPPER_DATASHEET + ", H100 PCIe column",
          "NVIDIA H100 PCIe product brief PB-11133-001_v02"), HOPPER),
    _gpu("h200", "NVIDIA H200 SXM 141GB",
         {"fp32": 494.7, "bf16": 989.4, "fp8": 1978.9, "int8": 1978.9}, 4800, 141, 450,
         "NVLink 4, 900 GB/s bidirectional (18 links, NVSwitch)", 3.99,
         f"{RUNPOD}, H200 SXM", "2025-06",
         ("NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200): H100's "
          "compute, 141 GB HBM3e at 4.8 TB/s",), HOPPER),
    _gpu("b200", "NVIDIA B200 (HGX, 1,000 W)",
         {"fp32": 1100, "bf16": 2250, "fp8": 4500, "int8": 4500}, 8000, 180, 900,
         "NVLink 5, 1.8 TB/s bidirectional (18 links, NVSwitch)", 4.99,
         f"{LAMBDA}, 8x B200 SXM6 instance per GPU", "2025-06",
         ("NVIDIA DGX B200 datasheet: 1,440 GB HBM3e at 64 TB/s for 8 GPUs, "
          "72 PFLOPS FP8 sparse", "NVIDIA HGX B200 specifications (nvidia.com/en-us/data-center/"
          "hgx): per-GPU dense FP4 9, FP8 4.5, BF16 2.25, TF32 1.1 PFLOPS",
          "glennklockwood.com/garden/processors/B200 (HGX variant table)"), BLACKWELL),
    # L40S: the datasheet also quotes INT4 at the INT8 rate; not listed, int4 falls back to
    # int8's peak, the same number.
    _gpu("l40s", "NVIDIA L40S 48GB",
         {"fp32": 183, "bf16": 362.05, "fp8": 733, "int8": 733}, 864, 48, 32,
         "PCIe Gen4 x16, 64 GB/s bidirectional (no NVLink)", 0.86, f"{RUNPOD}, L40S",
         "2025-06", ("NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s)",), ADA),
    # GeForce tensor cores run bf16/fp16 and fp8 with fp32 accumulation (what LLM kernels use)
    # at half the rate of fp16 accumulation: 165.2 and 330.3, not 330.3 and 660.6.
    _gpu("rtx-4090", "NVIDIA GeForce RTX 4090 24GB",
         {"fp32": 82.6, "bf16": 165.2, "fp8": 330.3, "int8": 660.6, "int4": 1321.2}, 1008,
         24, 32, "PCIe Gen4 x16, 64 GB/s bidirectional (no NVLink; no GPU peer-to-peer on "
         "GeForce 40)", 0.69, f"{RUNPOD}, RTX 4090", "2025-06",
         ("NVIDIA Ada Lovelace GPU Architecture whitepaper v2.1, appendix A, table 2 "
          "(GeForce RTX 4090)",), ADA),
    # AMD quotes 128 GB/s (bidirectional) per Infinity Fabric link; an MI300X in an 8-GPU
    # platform has 7, one to each peer: 896 GB/s bidirectional in all, 448 GB/s out of one
    # GPU across the group (64 GB/s to any single peer).
    _gpu("mi300x", "AMD Instinct MI300X 192GB",
         {"fp32": 653.7, "bf16": 1307.4, "fp8": 2614.9, "int8": 2614.9}, 5300, 192, 448,
         "AMD Infinity Fabric, 7 links x 128 GB/s bidirectional to the other 7 GPUs of an "
         "8-GPU platform (896 GB/s aggregate)", 1.85,
         "Vultr on-demand MI300X per GPU (vultr.com/pricing), approximate list price", "2025-06",
         ("AMD Instinct MI300X accelerator data sheet (amd.com/en/products/accelerators/"
          "instinct/mi300/mi300x.html)", "AMD CDNA 3 architecture whitepaper"), CDNA3),
)

_GPUS = tuple(replace(hw, link_bandwidth=64 * GB_S) if hw.id == "mi300x" else hw for hw in _GPUS)
CATALOG: dict[str, Hardware] = {hw.id: hw for hw in _GPUS}
"""Accelerators by lower-case id; each architecture's `Efficiency` says where it comes from."""
THIS_CPU = "this-cpu"


def known_ids() -> list[str]:
    return [*CATALOG, THIS_CPU]


def get_hardware(id: str) -> Hardware:
    """A catalog entry, or `this-cpu` as `lifeline plan calibrate` measured it."""
    key = id.strip().lower()
    if key == THIS_CPU:
        return load_calibrated()
    try:
        return CATALOG[key]
    except KeyError:
        raise ValueError(f"unknown hardware {id!r}; known: {', '.join(known_ids())}") from None


def calibration_path() -> Path:
    """Where `lifeline plan calibrate` keeps this machine's measurements:
    `$LIFELINE_CACHE/plan/this-cpu.json`, `~/.cache/lifeline/plan/this-cpu.json` by default."""
    cache = os.environ.get("LIFELINE_CACHE") or Path.home() / ".cache" / "lifeline"
    return Path(cache) / "plan" / f"{THIS_CPU}.json"


def save_calibrated(hw: Hardware, path: str | Path | None = None) -> Path:
    """Write `hw` as JSON (atomically: a reader never sees half a file); returns the path."""
    path = Path(path) if path is not None else calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(hardware_to_dict(hw), indent=2) + "\n")
    partial.replace(path)
    return path


def load_calibrated(path: str | Path | None = None) -> Hardware:
    path = Path(path) if path is not None else calibration_path()
    if not path.is_file():
        raise ValueError(f"{THIS_CPU} is not calibrated yet (no {path}): run "
                         "`lifeline plan calibrate` on this machine first")
    try:
        return hardware_from_dict(json.loads(path.read_text()))
    except ValueError as e:  # JSONDecodeError included
        raise ValueError(f"{path}: {e}; rerun `lifeline plan calibrate`") from None


def hardware_to_dict(hw: Hardware) -> dict[str, Any]:
    return asdict(hw)


_HARDWARE_FIELDS = {f.name for f in fields(Hardware)}
_EFFICIENCY_FIELDS = {f.name for f in fields(Efficiency)}


def hardware_from_dict(data: dict[str, Any]) -> Hardware:
    """The inverse of `hardware_to_dict`, checked: unknown or missing fields, dtypes outside
    `DTYPES` and peaks that are not positive are errors, not silent defaults."""
    if not isinstance(data, dict):
        raise ValueError("hardware must be a JSON object")
    _check_keys("hardware", data, _HARDWARE_FIELDS,
                {f.name for f in fields(Hardware) if f.name not in ("sources", "efficiency",
                                                                      "allreduce_latency_s")})
    efficiency = data.get("efficiency", {})
    _check_keys("efficiency", efficiency, _EFFICIENCY_FIELDS, set())
    flops = {str(k): float(v) for k, v in data["flops"].items()}
    if not flops or not set(flops) <= set(DTYPES):
        raise ValueError(f"flops must name some of {DTYPES}, got {sorted(flops)}")
    peaks = [*flops.values(), data["memory_bandwidth"], data["memory_bytes"]]
    if not all(float(v) > 0 for v in peaks):
        raise ValueError("peak flops, memory bandwidth and memory size must be positive")
    return Hardware(**{**data, "flops": flops, "sources": tuple(data.get("sources", ())),
                       "efficiency": Efficiency(**efficiency)})


def _check_keys(what: str, data: Any, known: set[str], required: set[str]) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object")
    if unknown := set(data) - known:
        raise ValueError(f"unknown {what} fields {sorted(unknown)}")
    if missing := required - set(data):
        raise ValueError(f"missing {what} fields {sorted(missing)}")


def catalog_table() -> list[dict[str, Any]]:
    """Rows of `lifeline plan --list-hardware`: the catalog, then `this-cpu` where this
    machine is calibrated. A dtype the device has no peak for is None."""
    rows = [_row(hw) for hw in CATALOG.values()]
    if calibration_path().is_file():
        rows.append(_row(load_calibrated()))
    return rows


def _row(hw: Hardware) -> dict[str, Any]:
    def tflops(dtype: str) -> float | None:
        return hw.flops[dtype] / TERA if dtype in hw.flops else None

    return {"id": hw.id, "name": hw.name, "bf16_tflops": tflops("bf16"),
            "fp8_tflops": tflops("fp8"), "memory_gb_s": hw.memory_bandwidth / GB_S,
            "memory_gib": hw.memory_bytes / GIB, "interconnect": hw.interconnect,
            "price_per_hour": hw.price_per_hour,
            "price_source": f"{hw.price_source} ({hw.price_date})"}
