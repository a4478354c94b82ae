"""The OpenAI request bodies Lifeline accepts, and their mapping to `SamplingParams`."""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from lifeline.engine.sampling_params import SamplingParams
from lifeline.server.errors import ParamError
from lifeline.server.limits import (
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_PROMPTS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
    MAX_TOOLS_CHARS,
    SEED_MAX,
    SEED_MIN,
)

MAX_CACHE_SALT_CHARS = 1024
"""Longest `cache_salt` accepted (it is hashed into the request's first KV block)."""
_TOKEN_ID = re.compile(r"[0-9]{1,9}", re.ASCII)
"""A `logit_bias` key: a plain decimal token id (no sign, exponent, spaces or other digits)."""
_CAPS = {"logit_bias": (MAX_LOGIT_BIAS, "entries"), "stop": (MAX_STOP, "strings"),
         "stop_token_ids": (MAX_STOP_TOKEN_IDS, "token ids"),
         "messages": (MAX_MESSAGES, "messages"), "tools": (MAX_TOOLS, "tools"),
         "tokens": (MAX_PROMPT_TOKEN_IDS, "token ids")}


def _capped(value: Any, name: str) -> Any:
    """Refuse an over-long list or dict before pydantic validates each of its items."""
    cap, what = _CAPS[name]
    if isinstance(value, (list, dict)) and len(value) > cap:
        raise ParamError(f"at most {cap} {what} allowed, got {len(value)}", name)
    return value


def _check_generation_prompt(continue_final_message: bool, add_generation_prompt: bool) -> None:
    if continue_final_message and add_generation_prompt:
        raise ParamError("continue_final_message and add_generation_prompt exclude each other; "
                         "set add_generation_prompt to false", "continue_final_message")


def _check_tools_size(tools: list[dict[str, Any]] | None) -> None:
    if tools and _json_size(tools, MAX_TOOLS_CHARS) > MAX_TOOLS_CHARS:
        raise ParamError(f"tools may be at most {MAX_TOOLS_CHARS} characters in all", "tools")


def _check_content_size(messages: list[Any], template_kwargs: Any = None) -> None:
    """Every string a template may render, counted toward `MAX_PROMPT_CHARS`: each message's
    content, tool calls (names and arguments), reasoning, name, tool-call id and any other
    field it carries, and the `chat_template_kwargs`. Image parts are bounded by the image
    limits instead (`ServerConfig.max_images`, `max_image_bytes`) and by the body's size."""
    size = _json_size(template_kwargs, MAX_PROMPT_CHARS) if template_kwargs else 0
    for m in messages:
        if size > MAX_PROMPT_CHARS:
            break
        fields = [m.model_extra, _text_parts(m.content), m.name, m.tool_calls, m.tool_call_id,
                  m.reasoning_content]
        size += sum(_json_size(f, MAX_PROMPT_CHARS - size) for f in fields if f)
    if size > MAX_PROMPT_CHARS:
        raise ParamError(f"the messages (contents, tool calls, reasoning and every other "
                         f"field a chat template renders) and chat_template_kwargs may be at "
                         f"most {MAX_PROMPT_CHARS} characters in all", "messages")


def _text_parts(content: Any) -> Any:
    if isinstance(content, list):
        return [p for p in content if not (isinstance(p, dict) and p.get("type") == "image_url")]
    return content


def _json_size(value: Any, budget: int) -> int:
    """Characters of every string in `value` plus one per value; stops once past `budget`."""
    size, stack = 0, [value]
    while stack and size <= budget:
        node = stack.pop()
        size += 1
        if isinstance(node, str):
            size += len(node)
        elif isinstance(node, dict):
            size += sum(len(k) for k in node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return size


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", ser_json_inf_nan="null")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """`null` for an optional field is the field left out, as OpenAI's API takes it (its
        schema marks `stream`, `n`, `temperature`, `max_tokens`, ... nullable): the default, or
        the server's sampling default, applies, and the field is not among those sent (a null
        `max_tokens` is no explicit one). A required field's `null` stays an error."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        drop = [k for k, v in data.items() if v is None and k in fields
                and not fields[k].is_required()]
        return {k: v for k, v in data.items() if k not in drop} if drop else data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingBody(_Body):
    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
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
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    """vLLM's: only requests with the same salt share prefix-cache blocks."""
    response_format: Any = None

    @model_validator(mode="after")
    def _check_common(self) -> _SamplingBody:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options is only allowed when stream is true", "stream_options")
        return self

    @field_validator("logit_bias", "stop", "stop_token_ids", mode="before")
    @classmethod
    def _cap_sampling_lists(cls, value: Any, info: ValidationInfo) -> Any:
        return _capped(value, info.field_name)

    @model_validator(mode="after")
    def _check_stop(self) -> _SamplingBody:
        for s in [self.stop] if isinstance(self.stop, str) else self.stop or []:
            if not s:
                raise ParamError("stop strings may not be empty", "stop")
            if len(s) > MAX_STOP_CHARS:
                raise ParamError(f"each stop string may be at most {MAX_STOP_CHARS} "
                                 f"characters, got {len(s)}", "stop")
        return self

    @model_validator(mode="after")
    def _check_logit_bias(self) -> _SamplingBody:
        for key, value in (self.logit_bias or {}).items():
            if not _TOKEN_ID.fullmatch(key):
                raise ParamError(f"logit_bias keys must be token ids, got {key[:32]!r}",
                                 "logit_bias")
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

    def with_defaults(self, params: SamplingParams,
                      defaults: dict[str, float]) -> SamplingParams:
        """`params` with the server's sampling defaults for the fields this request left out
        (a field it sent, even at the OpenAI default, is its own)."""
        unset = {k: v for k, v in defaults.items() if k not in self.model_fields_set}
        if "top_k" in unset:
            unset["top_k"] = max(int(unset["top_k"]), 0)
        return replace(params, **unset) if unset else params

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


SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                           "frequency_penalty", "repetition_penalty")


def check_sampling_defaults(defaults: dict[str, Any]) -> None:
    """ValueError unless `defaults` holds only sampling fields within a request's own bounds."""
    unknown = sorted(set(defaults) - set(SAMPLING_DEFAULT_FIELDS))
    if unknown:
        raise ValueError(f"sampling_defaults: unknown field {unknown[0]!r} "
                         f"(known: {', '.join(SAMPLING_DEFAULT_FIELDS)})")
    try:
        _SamplingBody.model_validate(defaults)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"sampling_defaults.{where}: {first['msg']}") from None


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

    @field_validator("messages", "tools", mode="before")
    @classmethod
    def _cap_chat_lists(cls, value: Any, info: ValidationInfo) -> Any:
        return _capped(value, info.field_name)

    @model_validator(mode="after")
    def _check_tools_chars(self) -> ChatCompletionRequest:
        _check_tools_size(self.tools)
        return self

    @model_validator(mode="after")
    def _check_content_chars(self) -> ChatCompletionRequest:
        _check_content_size(self.messages, self.chat_template_kwargs)
        return self

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ParamError("tool_choice needs tools", "tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs needs logprobs to be true", "top_logprobs")
        _check_generation_prompt(self.continue_final_message, self.add_generation_prompt)
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

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """Checked here, not by pydantic's union, whose cost on a long list is many times a
        plain scan's (it tries each branch and collects an error per item)."""
        return _check_prompt_shape(value)

    @model_validator(mode="after")
    def _check_choices(self) -> CompletionRequest:
        count = len(self.prompts)
        if count * self.n > MAX_CHOICES:
            raise ParamError(f"{count} prompts times n={self.n} is {count * self.n} choices; "
                             f"at most {MAX_CHOICES} are allowed", "n")
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
        if isinstance(p[0], int):
            return [p]
        return list(p)


_PROMPT_SHAPES = ("must be a string, a list of strings, a list of token ids or a list "
                  "of token-id lists")


def _check_prompt_shape(value: Any) -> Any:
    if isinstance(value, str):
        _check_prompt_total(len(value), MAX_PROMPT_CHARS, "characters")
        return value
    if not isinstance(value, list):
        raise ParamError(_PROMPT_SHAPES, "prompt")
    if not value:
        raise ParamError("may not be an empty list", "prompt")
    first = value[0]
    if _is_id(first):
        _check_prompt_total(len(value), MAX_PROMPT_TOKEN_IDS, "token ids")
        if not all(_is_id(t) for t in value):
            raise ParamError(_PROMPT_SHAPES, "prompt")
        return value
    if len(value) > MAX_PROMPTS:
        raise ParamError(f"at most {MAX_PROMPTS} prompts allowed, got {len(value)}", "prompt")
    if isinstance(first, str) and all(isinstance(p, str) for p in value):
        _check_prompt_total(sum(len(p) for p in value), MAX_PROMPT_CHARS, "characters")
        return value
    if isinstance(first, list) and all(isinstance(p, list) for p in value):
        _check_prompt_total(sum(len(p) for p in value), MAX_PROMPT_TOKEN_IDS, "token ids")
        if all(_is_id(t) for p in value for t in p):
            return value
    raise ParamError(_PROMPT_SHAPES, "prompt")


def _is_id(value: Any) -> bool:
    return type(value) is int


def _check_prompt_total(size: int, cap: int, what: str) -> None:
    if size > cap:
        raise ParamError(f"at most {cap} {what} allowed in all, got {size}", "prompt")


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

    @field_validator("messages", "tools", mode="before")
    @classmethod
    def _cap_lists(cls, value: Any, info: ValidationInfo) -> Any:
        return _capped(value, info.field_name)

    @model_validator(mode="after")
    def _check_sizes(self) -> TokenizeRequest:
        if self.prompt is not None and len(self.prompt) > MAX_PROMPT_CHARS:
            raise ParamError(f"the prompt may be at most {MAX_PROMPT_CHARS} characters, got "
                             f"{len(self.prompt)}", "prompt")
        _check_tools_size(self.tools)
        _check_content_size(self.messages or [], self.chat_template_kwargs)
        return self

    @model_validator(mode="after")
    def _chat_options(self) -> TokenizeRequest:
        _check_generation_prompt(self.continue_final_message, self.add_generation_prompt)
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens", mode="before")
    @classmethod
    def _cap_tokens(cls, value: Any) -> Any:
        return _capped(value, "tokens")
