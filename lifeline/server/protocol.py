"""The OpenAI request bodies Lifeline accepts, and their mapping to `SamplingParams`."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lifeline.engine.sampling_params import SamplingParams
from lifeline.server.errors import ParamError

MAX_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", ser_json_inf_nan="null")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingBody(_Body):
    model: str | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0, le=10, allow_inf_nan=False)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    response_format: Any = None

    @model_validator(mode="after")
    def _check_common(self) -> _SamplingBody:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options is only allowed when stream is true", "stream_options")
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ParamError("stop may hold at most 16 strings", "stop")
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise ParamError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            if not -100 <= value <= 100:
                raise ParamError(f"logit_bias values must be in [-100, 100], got {value}",
                                 "logit_bias")
        return self

    @model_validator(mode="after")
    def _check_response_format(self) -> _SamplingBody:
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise ParamError("response_format: only {'type': 'text'} is supported; this server "
                             "has no constrained decoding (json_object, json_schema)",
                             "response_format")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=max(self.top_k, 0), min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, logprobs=logprobs,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output)


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: str | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ParamError("tool_choice needs tools", "tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs needs logprobs to be true", "top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError("continue_final_message and add_generation_prompt exclude each "
                             "other; set add_generation_prompt to false",
                             "continue_final_message")
        for tool in self.tools or []:
            if tool.get("type", "function") != "function" or not isinstance(
                    tool.get("function"), dict) or "name" not in tool["function"]:
                raise ParamError("each tool must be {'type': 'function', 'function': "
                                 "{name, ...}}", "tools")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ParamError("prompt may not be an empty list", "prompt")
        if self.suffix:
            raise ParamError("suffix is not supported", "suffix")
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        params = super().sampling_params(max_tokens, logprobs)
        if self.echo and logprobs is not None:
            return replace(params, prompt_logprobs=logprobs)
        return params

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ParamError("give exactly one of prompt and messages", "prompt")
        return self

    @model_validator(mode="after")
    def _chat_options(self) -> TokenizeRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ParamError("continue_final_message and add_generation_prompt exclude each "
                             "other; set add_generation_prompt to false",
                             "continue_final_message")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
