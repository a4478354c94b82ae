"""The seam between the HTTP layer and an engine, as vLLM's `EngineClient`: the handlers know
an engine only as this protocol. `lifeline.server.async_engine.AsyncEngine` (an `LLMEngine` on a
thread of this process) is one implementation; an HTTP upstream (any OpenAI server) can be
another, so nothing here is an in-process type. Outputs are snapshots: what a stream reads from
one never changes as the engine goes on."""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from lifeline.engine.validation import ModelLimits
from lifeline.observe.stats import EngineStats

if TYPE_CHECKING:
    from lifeline.engine.request import Timeline
    from lifeline.engine.step_log import StepLog
    from lifeline.engine.executor import TokenLogprobs
    from lifeline.engine.sampling_params import SamplingParams

__all__ = ["EngineClient", "EngineDeadError", "EngineStats", "GenerationOutput", "ModelInfo"]


class EngineDeadError(RuntimeError):
    """The engine stopped: no request can be served any more."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model as the engine serves it (fixed once the engine is built)."""
    source: str
    """Where the weights came from (a GGUF file, an HF directory, an upstream URL)."""
    architecture: str
    vocab_size: int
    max_model_len: int
    """The longest context served (the model's, clamped to what the KV cache holds)."""
    max_model_len_limited_by: str
    """'model', 'max_model_len' or 'kv_cache'."""
    context_length: int
    """The model's own positions."""
    num_params: int
    num_active_params: int
    """Weights one token's forward uses (MoE: the top-k experts)."""
    weight_format: str
    vision: Any = None
    """A vision-language model's `VisionSpec` (lifeline.model.config); None: text only."""
    kv_bytes_per_token: int | None = None
    """K and V of every layer for one token, in the pools' format."""
    kv_pool_bytes: int | None = None
    """The KV pools' size (every cache group's blocks)."""
    startup: Any = None
    """Phase -> seconds of the engine's start (lifeline.engine.startup); None: not known."""
    chat_template: str | None = None
    """The GGUF file's chat template as the loader read it ("" where it has none); None: not
    read (the chat frontend reads the file's itself)."""

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(self.vocab_size, self.max_model_len)


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    """What one engine step added to one request, and where the request stands."""
    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    text: str
    """All output text, on the last output ('' before it)."""
    finished: bool
    finish_reason: str | None
    token_time: float | None
    """When the new tokens became available (engine clock); None when there are none."""
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache."""
    new_logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    """On the first output of a request that asked for them: one per prompt token, None for
    the first."""
    timeline: Timeline | None = None
    """A copy of the request's timeline, on its first output and its last."""


class EngineClient(Protocol):
    """An engine as the server sees it. Times (`arrival`, `deadline`, `token_time`, timelines)
    are `time.perf_counter()` readings of this process."""

    def start(self) -> None:
        """Begin bringing the engine up; returns at once."""

    def wait_started(self, timeout: float | None = None) -> bool:
        """Block until the engine serves (True) or `timeout` seconds pass (False); raises what
        stopped it from starting."""

    def stop(self) -> None: ...

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine stopped serving after it started; None while it serves."""

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, *,
                 arrival: float, cache_salt: str | None = None, deadline: float | None = None,
                 fault: str | None = None, client_id: str | None = None,
                 choice_index: int | None = None, images: Sequence[Any] = ()
                 ) -> AsyncIterator[GenerationOutput]:
        """One output per step that gave the request a token; the last is finished. Closing
        the iterator early aborts the request. `client_id` and `choice_index` name the
        response (and its choice) the request serves, for the engine's step log. A request the engine refuses raises
        `InvalidRequest`; one it ended without an answer, its `APIError`; a dead engine,
        `EngineDeadError`."""

    def abort(self, request_id: str) -> None: ...

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (None for a model without one), for templating and logprobs."""

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def model_info(self) -> ModelInfo: ...

    def stats(self) -> EngineStats:
        """The engine's counts now (callable from any thread)."""

    @property
    def step_log(self) -> StepLog | None:
        """The engine's recent steps (readable from any thread); None for an engine that keeps
        none or reports none (another process, an upstream server)."""
