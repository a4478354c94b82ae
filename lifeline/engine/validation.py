"""A request checked against the model it is for: its prompt against the vocabulary and the
context, its token-id parameters against the vocabulary, its completion against the room left.
One module for the server and the offline `LLM` (through `LLMEngine.add_request`) alike; no torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lifeline.engine.sampling_params import SamplingParams

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
INVALID_VALUE = "invalid_value"


class InvalidRequest(ValueError):
    """A request the model cannot serve. `param` names the field at fault and `code` the
    OpenAI error code, for a server that answers with them."""

    def __init__(self, message: str, param: str | None = None, code: str = INVALID_VALUE):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    """The longest context served, prompt and completion together."""


def check_request(prompt_ids: Sequence[int], params: SamplingParams, limits: ModelLimits,
                  param: str = "prompt") -> None:
    """Everything an engine request's prompt and sampling parameters must satisfy to be
    admitted. An engine request is one sample: `n` > 1 is split into choices before it gets
    here (`lifeline.engine.parallel_sampling`, by `LLM.generate` and the server)."""
    if params.n != 1:
        raise InvalidRequest(f"an engine request is one sample, got n={params.n}: "
                             "LLM.generate or the server run n > 1 as n requests", "n")
    check_prompt(prompt_ids, limits, param)
    check_token_params(params, limits)


def check_prompt(prompt_ids: Sequence[int], limits: ModelLimits, param: str = "prompt") -> None:
    """`param` names the request field that holds the prompt ('prompt', 'messages')."""
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty", "prompt")
    check_token_ids(prompt_ids, limits.vocab_size, param)
    n, limit = len(prompt_ids), limits.max_model_len
    if n >= limit:
        raise InvalidRequest(f"the prompt has {n} tokens; this model's context is {limit} "
                             "tokens and needs room for at least one more", param,
                             CONTEXT_LENGTH_EXCEEDED)


def check_token_ids(token_ids: Sequence[int], vocab: int, param: str) -> None:
    """Every id of `token_ids` is in the vocabulary (`param` names the field that holds them)."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
        bad = next(t for t in token_ids if not 0 <= t < vocab)
        raise InvalidRequest(f"token id {short_id(bad)} is outside the vocabulary (size "
                             f"{vocab})", param)


def check_token_params(params: SamplingParams, limits: ModelLimits) -> None:
    """`logit_bias` and `stop_token_ids` name tokens of the vocabulary."""
    vocab = limits.vocab_size
    for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids",
                                                          params.stop_token_ids)):
        bad = next((t for t in ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"{name} names token {short_id(int(bad))}, outside the "
                                 f"vocabulary (size {vocab})", name)


def check_max_tokens(prompt_len: int, max_tokens: int, limits: ModelLimits,
                     param: str = "prompt") -> None:
    """A completion length the caller asked for must fit after the prompt, as OpenAI and vLLM
    require (a default one is clamped instead: `max_tokens_within`)."""
    limit = limits.max_model_len
    if prompt_len + max_tokens > limit:
        raise InvalidRequest(f"this model's context is {limit} tokens, but "
                             f"{prompt_len + max_tokens} were asked for ({prompt_len} in the "
                             f"{param}, {max_tokens} in the completion); shorten the prompt or "
                             "lower max_tokens", param, CONTEXT_LENGTH_EXCEEDED)


def max_tokens_within(wanted: int | None, prompt_len: int, limits: ModelLimits) -> int:
    """`wanted` (None: as many as fit) clamped to the room the context leaves."""
    room = limits.max_model_len - prompt_len
    return min(wanted, room) if wanted else room


def short_id(value: int) -> str:
    """A token id as an error message shows it: a huge one cut short."""
    text = str(value)
    return text if len(text) <= 20 else f"{text[:12]}..."
