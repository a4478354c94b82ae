"""What one engine step costs on a device: a roofline of the work the step does.

Each op of a layer takes max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth) (on a CPU,
whose cores do both, their sum: `Efficiency.combine`), where achieved = peak × the device's
`Efficiency` for that op kind (the KV cache's traffic at `kv_memory`); the step adds its
layers' ops, the LM head of the rows it samples, tensor-parallel all-reduces and a fixed
overhead. The ops:

- projections (`gemm`): Q, K, V and O (MLA's low-rank ones for DeepSeek) and dense MLPs: 2 FLOPs
  per weight per token; every weight read once a step, plus the activations in and out;
- routed experts (`moe`): the experts a step's tokens touch are read (with T tokens routed top-k
  of E uniformly, E·(1 − (1 − k/E)^T) of them per layer), 2·k·expert weights FLOPs per token;
- attention (`attention`): for each new token, QKᵀ and PV over its context (the window on a
  sliding layer; causal inside a prefill chunk); the KV of each request's context read once a
  step and the new tokens' KV written; GQA/MQA read kv_heads' K and V, MLA one latent;
- elementwise kernels (`elementwise`): norms, residual adds, RoPE and the MLP's activation read
  and write each token's hidden state, Q/K and intermediate once each, memory-bound (engines
  fuse some of them, so this is the unfused count);
- the LM head (`lm_head`) over the rows that sample (a prefill chunk that does not end its
  prompt samples nothing); kept in bf16 when the weights are fp8 or int4, as fp8 and AWQ
  checkpoints leave it;
- tensor parallelism (`comm`): weights, heads and the head's vocabulary split `tp` ways (KV heads
  replicated when fewer than `tp`; MLA's latent on every rank), two ring all-reduces of the
  hidden state per layer;
- `overhead`: the engine's fixed time per step and per scheduled request, and a batch's
  (more than one token row) own;
- a served step's slowdown over the bare engine's (`served_step_factor`: on a CPU the server
  shares the cores with the engine), applied to all of it.

The numbers are in `Hardware` and its `Efficiency`; nothing here is a fitted constant.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from lifeline.engine.kv_layout import kv_bytes_per_token
from lifeline.model.config import ModelConfig
from lifeline.plan.hardware import DTYPES, Hardware

BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5 + 2 / 128}
"""Bytes per weight or cached K/V element; int4 carries a bf16 scale per group of 128."""
KINDS = ("gemm", "moe", "attention", "elementwise", "lm_head", "comm", "overhead")


def compute_dtype(weights: str, hw: Hardware) -> str:
    """The dtype a projection multiplies in: the weights' own (fp8 and int8 as W8A8), except
    int4, which is weight-only (AWQ/GPTQ style): dequantized and multiplied in bf16. A dtype
    the device has no throughput for runs at the next wider one's (`Hardware.peak_flops`)."""
    if weights == "int4" and hw.kind == "gpu":
        return "bf16"
    return weights


def weight_only(weights: str, hw: Hardware) -> bool:
    """Whether `weights` run as a weight-only quantized GEMM on `hw` (int4 on a GPU; fp8 or int8
    where the device has no tensor throughput of its own for them)."""
    if weights == "int4":
        return hw.kind == "gpu"
    return weights in ("fp8", "int8") and weights not in hw.flops


def gemm_rate(hw: Hardware, weights: str) -> float:
    """Achieved FLOP/s of a compute-bound matrix multiply of `weights` on `hw`."""
    eff = hw.efficiency
    dtype = compute_dtype(weights, hw)
    if weight_only(weights, hw) and eff.gemm_weight_only is not None:
        return hw.peak_flops(dtype) * eff.gemm_weight_only
    return hw.peak_flops(dtype) * eff.gemm_by_dtype.get(dtype, eff.gemm)


@dataclass(slots=True)
class StepCost:
    """One step's time and where it went."""

    seconds: float = 0.0
    by_kind: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    """Seconds per op kind (`KINDS`)."""
    compute_s: float = 0.0
    """Time of the ops whose FLOPs outweighed their bytes."""
    memory_s: float = 0.0
    """Time of the ops whose bytes outweighed their FLOPs."""
    flops: float = 0.0
    bytes: float = 0.0

    @property
    def bound(self) -> str:
        """What most of the step waited on: 'compute', 'memory', 'communication' or
        'overhead'."""
        parts = {"compute": self.compute_s, "memory": self.memory_s,
                 "communication": self.by_kind["comm"], "overhead": self.by_kind["overhead"]}
        return max(parts, key=parts.__getitem__)


@dataclass(frozen=True, slots=True)
class Work:
    """One scheduled request of a step: `tokens` new tokens from position `start`."""
    tokens: int
    start: int


class CostModel:
    """Step times of `model` on `tp` devices of `hw` with `weights` and `kv_dtype` formats."""

    def __init__(self, model: ModelConfig, hw: Hardware, *, tp: int = 1, weights: str = "bf16",
                 kv_dtype: str = "bf16", step_overhead_s: float | None = None,
                 seq_overhead_s: float | None = None):
        for name, value in (("weights", weights), ("kv_dtype", kv_dtype)):
            if value not in DTYPES:
                raise ValueError(f"{name} is one of {', '.join(DTYPES)}, not {value!r}")
        if tp < 1 or model.num_heads % tp:
            raise ValueError(f"tp={tp} must divide the model's {model.num_heads} heads")
        self.model, self.hw, self.tp = model, hw, tp
        self.weights, self.kv_dtype = weights, kv_dtype
        eff = hw.efficiency
        self.step_overhead_s = eff.step_overhead_s if step_overhead_s is None else step_overhead_s
        self.seq_overhead_s = eff.seq_overhead_s if seq_overhead_s is None else seq_overhead_s
        act = "fp32" if hw.kind == "cpu" else "bf16"
        self.act_bytes = BYTES[act]
        self.wbytes = BYTES[weights]
        head = weights if weights not in ("fp8", "int4") else "bf16"
        self.head_bytes = BYTES[head]
        # achieved rates
        self.gemm_flops = gemm_rate(hw, weights)
        self.head_flops = gemm_rate(hw, head)
        self.attn_flops = hw.peak_flops(act) * eff.attention
        self.bandwidth = hw.memory_bandwidth * eff.memory
        self.kv_bandwidth = hw.memory_bandwidth * (eff.kv_memory if eff.kv_memory is not None
                                                   else eff.memory)
        if eff.combine not in ("max", "sum"):
            raise ValueError(f"efficiency.combine is 'max' or 'sum', not {eff.combine!r}")
        self.additive = eff.combine == "sum"
        self.batch_overhead_s = eff.batch_overhead_s
        self.served_step_factor = eff.served_step_factor
        self._shapes(model)

    def _shapes(self, m: ModelConfig) -> None:
        tp, h = self.tp, m.hidden_size
        self.num_full = sum(t != "sliding" for t in m.layer_types) if m.sliding_window else \
            m.num_layers
        self.num_sliding = m.num_layers - self.num_full
        self.window = m.sliding_window or 0
        heads = m.num_heads / tp
        if getattr(m, "kv_lora_rank", 0):  # MLA (DeepSeek-V2/V3): one latent per token
            rope, nope, v = m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
            q_in = m.q_lora_rank or h
            attn = ((h * m.q_lora_rank if m.q_lora_rank else 0)
                    + q_in * m.num_heads * (nope + rope)
                    + h * (m.kv_lora_rank + rope)
                    + m.kv_lora_rank * m.num_heads * (nope + v)
                    + m.num_heads * v * h)
            # absorbed: scores over (latent + rope), values over the latent, per head
            self.attn_flops_per_pair = 2 * heads * (2 * m.kv_lora_rank + rope)
            self.kv_bytes = kv_bytes_per_token(m, BYTES[self.kv_dtype])  # replicated on ranks
            self.attn_io = 2 * h + m.num_heads * (nope + rope + 2 * v) / tp
        else:
            q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
            attn = h * (q + 2 * kv) + q * h
            self.attn_flops_per_pair = 4 * heads * m.head_dim
            kv_heads = max(1.0, m.num_kv_heads / tp)
            self.kv_bytes = 2 * kv_heads * m.head_dim * BYTES[self.kv_dtype]
            self.attn_io = 2 * h + (2 * q + 2 * kv) / tp
        self.attn_params = attn / tp
        q_k = (m.num_heads * m.head_dim + m.num_kv_heads * m.head_dim) / tp
        width = max(m.intermediate_size, m.moe_intermediate_size * max(m.num_experts_per_tok, 1))
        self.elementwise_per_token = 6 * h + 2 * q_k + 3 * width / tp
        """Elements one token's norms, residuals, RoPE and MLP activation read and write."""
        moe = [i for i in range(m.num_layers) if m.is_moe_layer(i)]
        self.num_moe = len(moe)
        self.num_dense_ffn = m.num_layers - self.num_moe
        self.dense_ffn_params = 3 * h * m.intermediate_size / tp
        self.ffn_io = 2 * h + 3 * m.intermediate_size / tp
        self.experts, self.top_k = m.num_experts, m.num_experts_per_tok
        self.expert_params = (3 * h * m.moe_intermediate_size / tp) if self.experts else 0.0
        shared = m.shared_expert_intermediate_size
        self.moe_static_params = (h * m.num_experts + 3 * h * shared / tp) if self.experts else 0.0
        self.head_params = m.vocab_size * h / tp
        self.hidden = h

    def _op(self, cost: StepCost, kind: str, flops: float, nbytes: float, rate: float,
            count: int = 1) -> None:
        bandwidth = self.kv_bandwidth if kind == "attention" else self.bandwidth
        compute, memory = flops / rate, nbytes / bandwidth
        if self.additive:
            cost.by_kind[kind] += (compute + memory) * count
            cost.compute_s += compute * count
            cost.memory_s += memory * count
        else:
            t = max(compute, memory) * count
            cost.by_kind[kind] += t
            if compute >= memory:
                cost.compute_s += t
            else:
                cost.memory_s += t
        cost.flops += flops * count
        cost.bytes += nbytes * count

    def step(self, work: Sequence[Work] | Sequence[tuple[int, int]], sampled: int) -> StepCost:
        """The cost of a step running `work` ((tokens, start) per request) of which `sampled`
        rows go through the LM head."""
        cost = StepCost()
        total = 0
        full_pairs = full_kv = slide_pairs = slide_kv = 0.0
        w = self.window
        for item in work:
            n, start = item
            total += n
            end = start + n
            full_pairs += n * start + n * (n + 1) / 2
            full_kv += end
            if self.num_sliding:
                slide_pairs += _window_pairs(start, n, w)
                slide_kv += min(end, w + n - 1)
        if total == 0:
            return cost
        act = self.act_bytes
        layers = self.model.num_layers
        # projections of every layer
        self._op(cost, "gemm", 2 * total * self.attn_params,
                 self.attn_params * self.wbytes + total * self.attn_io * act, self.gemm_flops,
                 layers)
        if self.num_dense_ffn:
            self._op(cost, "gemm", 2 * total * self.dense_ffn_params,
                     self.dense_ffn_params * self.wbytes + total * self.ffn_io * act,
                     self.gemm_flops, self.num_dense_ffn)
        if self.num_moe:
            touched = self.experts * (1 - (1 - self.top_k / self.experts) ** total)
            params = touched * self.expert_params + self.moe_static_params
            flops = 2 * total * (self.top_k * self.expert_params + self.moe_static_params)
            io = total * (2 * self.hidden + self.top_k * 3 * self.model.moe_intermediate_size
                          / self.tp) * act
            self._op(cost, "moe", flops, params * self.wbytes + io, self.gemm_flops,
                     self.num_moe)
        self._op(cost, "elementwise", 0.0, total * self.elementwise_per_token * act,
                 self.gemm_flops, layers)
        # attention over each request's context
        kv_write = total * self.kv_bytes
        if self.num_full:
            self._op(cost, "attention", full_pairs * self.attn_flops_per_pair,
                     full_kv * self.kv_bytes + kv_write, self.attn_flops, self.num_full)
        if self.num_sliding:
            self._op(cost, "attention", slide_pairs * self.attn_flops_per_pair,
                     slide_kv * self.kv_bytes + kv_write, self.attn_flops, self.num_sliding)
        if sampled:
            self._op(cost, "lm_head", 2 * sampled * self.head_params,
                     self.head_params * self.head_bytes + sampled * self.model.vocab_size
                     / self.tp * 4, self.head_flops)
        if self.tp > 1:
            hw = self.hw
            message = total * self.hidden * act
            per = hw.allreduce_latency_s + 2 * (self.tp - 1) / self.tp * message / \
                hw.group_bandwidth(self.tp)
            cost.by_kind["comm"] += 2 * layers * per
        cost.by_kind["overhead"] += (self.step_overhead_s + self.seq_overhead_s * len(work)
                                     + (self.batch_overhead_s if total > 1 else 0.0))
        if self.served_step_factor != 1.0:
            f = self.served_step_factor
            cost.by_kind = {k: v * f for k, v in cost.by_kind.items()}
            cost.compute_s *= f
            cost.memory_s *= f
        cost.seconds = sum(cost.by_kind.values())
        return cost

    def weight_bytes(self) -> float:
        """Weights one device holds (all experts; the head at its own format; a tied head
        once; the input embedding at the weights' format)."""
        m = self.model
        layers = (self.attn_params * m.num_layers + self.dense_ffn_params * self.num_dense_ffn
                  + (self.experts * self.expert_params + self.moe_static_params) * self.num_moe)
        embed = 0.0 if m.tie_word_embeddings else self.head_params * self.wbytes
        return layers * self.wbytes + self.head_params * self.head_bytes + embed

    def kv_bytes_per_token(self) -> float:
        """KV bytes one device holds per cached token, over every layer (sliding ones too)."""
        return self.kv_bytes * self.model.num_layers


def _window_pairs(start: int, n: int, window: int) -> float:
    """Σ over positions p = start+1 .. start+n of min(p, window): (query, key) pairs of a chunk
    on a sliding layer."""
    if start + n <= window:
        return n * start + n * (n + 1) / 2
    if start >= window:
        return n * window
    m = window - start
    return (start + 1 + window) * m / 2 + (n - m) * window
