"""The engine on a virtual clock: Lifeline's own `LLMEngine`, scheduler and KV manager, with a
simulated executor in place of the model.

`SimulatedExecutor.execute` prices the scheduled step with the `CostModel`, moves the clock on by
that much and hands back one token per sampling request; everything else (admission, chunked
prefill, prefix caching, sliding-window blocks, preemption, stop conditions) is the engine's code,
so the simulation cannot drift from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lifeline.engine.engine import EngineConfig, LLMEngine
from lifeline.engine.executor import ModelOutput
from lifeline.engine.kv_layout import KVLayout
from lifeline.engine.scheduler import SchedulerOutput
from lifeline.model.config import ModelConfig
from lifeline.plan.cost import BYTES, KINDS, CostModel

PHASES = ("prefill", "decode", "mixed")


class VirtualClock:
    """Seconds since the simulation began; only the executor and the load move it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class PhaseStats:
    """Steps of one phase: how many, how long, and what their time went to."""
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    compute_s: float = 0.0
    memory_s: float = 0.0
    by_kind: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))

    def as_dict(self) -> dict[str, Any]:
        parts = {"compute": self.compute_s, "memory bandwidth": self.memory_s,
                 "communication": self.by_kind["comm"], "overhead": self.by_kind["overhead"]}
        bound = max(parts, key=parts.__getitem__) if self.seconds else None
        return {"steps": self.steps, "seconds": self.seconds, "tokens": self.tokens,
                "shares": {k: v / self.seconds if self.seconds else None
                           for k, v in parts.items()},
                "by_kind_s": dict(self.by_kind), "bound": bound}


@dataclass(slots=True)
class SimulatedModel:
    """What the engine needs of a model when no weights run: its shape; no tokenizer (prompts
    are token ids, output is not detokenized)."""
    config: ModelConfig
    tokenizer: Any = None


class SimulatedExecutor:
    """The `Executor` of a planned deployment: a step costs what `cost` says, on `clock`."""

    compiled = False

    def __init__(self, cost: CostModel, clock: VirtualClock, layout: KVLayout):
        self.cost, self.clock, self.layout = cost, clock, layout
        self.vocab = cost.model.vocab_size
        self.phases = {p: PhaseStats() for p in PHASES}
        self.batch_sizes: list[int] = []
        """Requests in each step, in order."""

    def execute(self, scheduled: SchedulerOutput) -> ModelOutput:
        work, ids, tokens = [], [], []
        prefill = decode = False
        for s in scheduled.scheduled:
            work.append((s.num_new_tokens, s.start))
            if s.start >= s.request.num_prompt_tokens:
                decode = True
            else:
                prefill = True
            if s.samples:
                ids.append(s.request.request_id)
                # any id but 0 (often a special token); the position keeps it deterministic
                tokens.append(1 + (s.start + s.num_new_tokens) % (self.vocab - 1))
        step = self.cost.step(work, len(ids))
        self.clock.now += step.seconds
        stats = self.phases["mixed" if prefill and decode else "prefill" if prefill else "decode"]
        stats.steps += 1
        stats.seconds += step.seconds
        stats.tokens += scheduled.num_tokens
        stats.compute_s += step.compute_s
        stats.memory_s += step.memory_s
        for kind, t in step.by_kind.items():
            stats.by_kind[kind] += t
        self.batch_sizes.append(len(work))
        return ModelOutput(tuple(ids), tuple(tokens))


@dataclass(frozen=True, slots=True)
class Deployment:
    """One replica: a model on `tp` devices, its formats, its scheduler's limits and its
    memory, and the cost model of its steps."""

    cost: CostModel
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    """Of each device's memory, what weights, activations and the KV cache may take."""
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    kv_cache_bytes: float | None = None
    """KV cache per device; None: what `gpu_memory_utilization` leaves after the weights and
    activations."""
    request_overhead_s: float | None = None
    """The API front's time per request, all of it on the server's one event loop (an engine
    profile's: vLLM 0.5 ran its API server in one process); None: the device's
    `Efficiency.request_overhead_s`, of which `request_serial_s` is serial."""

    @property
    def front_s(self) -> float:
        """Seconds from sending a request to its reaching the engine, when nothing queues."""
        if self.request_overhead_s is not None:
            return self.request_overhead_s
        return self.cost.hw.efficiency.request_overhead_s

    @property
    def serial_s(self) -> float:
        """Of `front_s`, the part that takes one request at a time."""
        if self.request_overhead_s is not None:
            return self.request_overhead_s
        return self.cost.hw.efficiency.request_serial_s

    def activation_bytes(self) -> float:
        """A step's peak working memory per device, as vLLM's profiling run finds it to first
        order: the hidden states and MLP intermediates of a full token budget, and fp32 logits
        of the sampled rows."""
        m, tokens = self.cost.model, self.max_num_batched_tokens
        width = 4 * m.hidden_size + 2 * max(m.intermediate_size, m.moe_intermediate_size
                                            * max(m.num_experts_per_tok, 1)) / self.cost.tp
        return (tokens * width * self.cost.act_bytes
                + self.max_num_seqs * m.vocab_size / self.cost.tp * 4)

    def kv_budget(self) -> float:
        """Bytes of KV cache per device (ValueError when the weights leave none)."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        hw = self.cost.hw
        budget = (hw.memory_bytes * self.gpu_memory_utilization - self.cost.weight_bytes()
                  - self.activation_bytes())
        if budget <= 0:
            raise ValueError(
                f"{self.cost.model.name or 'the model'} does not fit: "
                f"{self.cost.weight_bytes() / 2**30:.1f} GiB of {self.cost.weights} weights per "
                f"device and {self.activation_bytes() / 2**30:.1f} GiB of activations exceed "
                f"{self.gpu_memory_utilization:.0%} of {hw.memory_bytes / 2**30:.0f} GiB on "
                f"{hw.name} (more --tp, smaller --weights)")
        return budget

    def engine_config(self) -> EngineConfig:
        cost = self.cost
        # Per device bytes of one K/V element, so the engine's own sizing (plan_kv) counts the
        # blocks a device holds: KV heads split over ranks (at least one each), MLA replicated.
        share = 1.0
        if not getattr(cost.model, "kv_lora_rank", 0):
            share = max(1.0, cost.model.num_kv_heads / cost.tp) / cost.model.num_kv_heads
        return EngineConfig(
            block_size=self.block_size, kv_cache_memory_bytes=int(self.kv_budget()),
            kv_dtype_bytes=BYTES[cost.kv_dtype] * share, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching, weights="fp32")

    def engine(self, clock: VirtualClock | None = None) -> LLMEngine:
        """A fresh engine on `clock` (a new one if None) with a simulated executor."""
        clock = clock or VirtualClock()
        engine = LLMEngine(SimulatedModel(self.cost.model), self.engine_config(),
                           executor=lambda layout: SimulatedExecutor(self.cost, clock, layout))
        engine.clock = clock
        return engine
