"""The executor seam: what runs one scheduled step and what it hands back.

The engine loop (`LLMEngine.step`) is `schedule(now) -> executor.execute(scheduler_output) ->
scheduler.update -> output processing`, as vLLM V1's `EngineCore.step`. The model executor
(`lifeline.engine.model_executor.ModelExecutor`: torch, real weights) is one `Executor`; any
object with `execute` and `compiled` is another, such as a simulated executor that advances a
virtual clock.
Nothing here imports torch: the loop, scheduler, KV manager and request types run without it.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from lifeline.engine.kv_layout import KVLayout
from lifeline.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    import torch

_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    """The token that was chosen."""
    logprob: float
    """Its logprob under the raw logits."""
    top: list[tuple[int, float]]
    """The `params.logprobs` most likely (token id, logprob) pairs, most likely first."""


@dataclass(frozen=True, slots=True)
class MoECounts:
    """Expert routing of one step (see `lifeline.engine.moe_usage`)."""
    counts: torch.Tensor
    """`[num_moe_layers, len(request_ids), num_experts]` (token, expert) pairs, on the CPU."""
    request_ids: tuple[str, ...]
    """The request of each segment (each scheduled request is one)."""
    tokens: tuple[int, ...]
    """The tokens each segment ran."""


@dataclass(frozen=True, slots=True)
class ModelOutput:
    """What one step produced; nothing of it changes after `execute` returns it."""
    request_ids: tuple[str, ...] = ()
    """The requests that sampled a token this step, in the order of `token_ids`."""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    """Per sampled token, where its request asked for logprobs (empty: none did)."""
    shortlist_argmax: tuple[int, ...] | None = None
    """Where greedy took every token from the LM head's shortlist proof
    (`lifeline.model.weight_format.shortlist_argmax`) instead of a pass over the vocabulary:
    that proof, one entry per token. None otherwise."""
    prompt_logprobs: Mapping[str, tuple[tuple[int, TokenLogprobs], ...]] = field(
        default_factory=lambda: _EMPTY)
    """Per request with `params.prompt_logprobs`: (position, logprobs of the prompt token
    there) for the positions this step's chunk predicts."""
    prompt_logits: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    """Per request recording its raw prompt logits (`LLMEngine.prompt_logits`): this chunk's
    rows, `[tokens, vocab]`."""
    moe: MoECounts | None = None
    """An MoE model's routing this step; None for a dense one."""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.request_ids):
            raise ValueError("one sampled token per request id")
        if not self.logprobs:
            object.__setattr__(self, "logprobs", (None,) * len(self.token_ids))
        elif len(self.logprobs) != len(self.token_ids):
            raise ValueError("logprobs, when given, are one per sampled token")


class Executor(Protocol):
    compiled: bool
    """Whether the forward runs compiled: the engine warms it up before the first request."""

    def execute(self, scheduled: SchedulerOutput) -> ModelOutput:
        """Run the step: a token for every `ScheduledRequest` with `samples` set. The
        scheduler's state is not the executor's to change: `scheduler.update` advances it."""
        ...


ExecutorFactory = Callable[[KVLayout], Executor]
"""Builds the engine's executor once the KV cache is laid out (its pools follow the layout)."""
