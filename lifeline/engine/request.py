"""A request's state as the engine sees it: ids, progress and timeline."""
from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import Any

from lifeline.engine.sampling_plan import SamplingPlan
from lifeline.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class RequestError(str, enum.Enum):
    """Why the engine ended a request without an answer (its finish reason is then ABORT)."""
    STEP_FAILED = "step_failed"
    """A step that ran this request raised; the step's other requests failed with it."""
    TIMEOUT = "timeout"
    """The request reached its deadline before its first token."""
    UNSCHEDULABLE = "unschedulable"
    """The request cannot fit the KV cache even alone."""


@dataclass(slots=True)
class Timeline:
    """Monotonic timestamps (seconds, `time.perf_counter()`) of a request's life in the engine.

    The engine fills what it sees; the server adds the stages before and after it.
    `arrival_wall` is the only wall-clock reading, for logs."""

    arrival: float = 0.0
    arrival_wall: float = 0.0
    tokenized: float | None = None
    queued: float | None = None
    first_scheduled: float | None = None
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)
    """(start, end, tokens) of every prefill chunk that ran."""
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    """When each output token became available, in order."""
    preemptions: list[float] = field(default_factory=list)
    finished: float | None = None
    detokenize_s: float = 0.0
    """Engine-thread time spent detokenizing and checking stop strings for this request."""
    moe: Any = None
    """Expert routing of an MoE model's request (`lifeline.engine.moe_usage.MoEUsage`), set
    when the request leaves the engine; None for a dense model."""
    steps: Any = None
    """The request's share of the steps that ran it (`lifeline.engine.step_log.RequestSteps`),
    set when the engine adds it."""

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache at the first scheduling."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Digests of the request's full blocks (`block_manager.hash_chain`); its block tables
    are the KV manager's (`KVCacheManager.get_blocks`)."""
    extra_hash_key: bytes = b""
    """Mixed into the first block's hash (the cache salt), so equal ids can differ: requests
    whose keys differ never share a prefix-cache block."""
    timeline: Timeline = field(default_factory=Timeline)
    logprobs: list[Any] = field(default_factory=list)
    want_prompt_logits: bool = False
    prompt_logits: list[Any] = field(default_factory=list)
    num_preemptions: int = 0
    arrival_order: int = 0
    deadline: float | None = None
    """Engine-clock time by which the request must end (None: no limit)."""
    error: RequestError | None = None
    suspect: bool = False
    """Was in a step that raised: runs alone until a step of it succeeds."""
    num_step_failures: int = 0
    """Steps that raised while running this request since it last ran alone without raising."""
    client_id: str | None = None
    """The id of the response this request serves, where the server gave the engine another
    one (each of a response's choices is an engine request); the step log names it so."""
    choice_index: int | None = None
    """Which of the response's choices, when it has several."""
    fault: str | None = None
    """A fault to inject when a step runs this request ('step': that step raises), set only
    by a server started with fault injection on."""
    images: tuple[Any, ...] = ()
    """The prompt's images (lifeline.media.inputs.ImageSpan), in prompt order: their
    positions take the vision tower's embeddings, their hashes key the prefix cache."""
    sampling_plan: SamplingPlan = field(init=False)
    """The parameters worked out once for every step: bias tensors, stop-id set."""

    def __post_init__(self) -> None:
        self.sampling_plan = SamplingPlan(self.params)

    def image_key(self, img: Any) -> str:
        """The encoder cache's key of one of its images: the image's hash, salted as its
        prefix-cache blocks are (requests whose `extra_hash_key` differ share no image
        embeddings either, so no tenant's timings show another's image encoded)."""
        if not self.extra_hash_key:
            return img.hash
        return hashlib.sha256(self.extra_hash_key + b"\0" + img.hash.encode()).hexdigest()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]
