"""What an upstream's answer must look like before the gateway reads it, relays it or records
it: an OpenAI completion or chunk whose fields have the types the relay, the decision record
and the bench's normalisation of timings read, and whose short fields are short. Anything else
is a `bad_response`: the attempt failed, and the request moves on (docs/gateway.md)."""
from __future__ import annotations

from typing import Any

MAX_FIELD_CHARS = 1024
"""`id`, `object`, `model`, `system_fingerprint`, `role`, `finish_reason`: names, not text."""
SHORT_FIELDS = ("id", "object", "model", "system_fingerprint")
TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "refusal", "text")
TIMING_NUMBERS = frozenset((
    "gateway_ms", "template_ms", "tokenize_ms", "queue_ms", "prefill_ms", "decode_ms",
    "ttft_ms", "e2e_ms", "cached_tokens", "routing_ms", "retry_ms", "prompt_ms",
    "predicted_ms", "cache_n", "prompt_n", "predicted_n", "time_in_queue", "arrival_time",
    "first_scheduled_time", "first_token_time", "last_token_time", "finished_time"))
"""Keys of `timings` and `metrics` (at any depth) that are read as numbers
(`lifeline.bench.stages.normalize`)."""
TIMING_TABLES = ("timings", "metrics", "backend", "state")
USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


class BadAnswer(ValueError):
    """Why an answer is malformed, naming the field."""


def check_chunk(data: dict[str, Any], choices: int) -> None:
    """One event of a stream (an error event is the caller's to handle)."""
    _check(data, choices, "delta")


def check_whole(data: Any, choices: int, chat: bool) -> None:
    """A whole (non-streaming) answer."""
    if not isinstance(data, dict):
        raise BadAnswer("the answer is not a JSON object")
    if "error" in data:
        raise BadAnswer("the answer is an error")
    if not isinstance(data.get("choices"), list):
        raise BadAnswer("the answer has no `choices` list")
    _check(data, choices, "message" if chat else None)


def _check(data: dict[str, Any], choices: int, part: str | None) -> None:
    for key in SHORT_FIELDS:
        _short(data.get(key), key)
    created = data.get("created")
    if created is not None and not _number(created):
        raise BadAnswer("`created` is not a number")
    listed = data.get("choices")
    if listed is not None:
        if not isinstance(listed, list):
            raise BadAnswer("`choices` is not a list")
        if len(listed) > choices:
            raise BadAnswer(f"{len(listed)} choices where the request asked for {choices}")
        for i, choice in enumerate(listed):
            _choice(choice, f"choices[{i}]", choices, part)
    usage = data.get("usage")
    if usage is not None:
        _usage(usage)
    for key in ("timings", "metrics"):
        if data.get(key) is not None:
            _timings(data[key], key, 1)


def _choice(choice: Any, where: str, choices: int, part: str | None) -> None:
    if not isinstance(choice, dict):
        raise BadAnswer(f"`{where}` is not an object")
    index = choice.get("index", 0)
    if not _count(index) or index >= choices:
        raise BadAnswer(f"`{where}.index` is not an index below {choices}")
    _short(choice.get("finish_reason"), f"{where}.finish_reason")
    if not isinstance(choice.get("text"), str | None):
        raise BadAnswer(f"`{where}.text` is not a string")
    inner = choice.get(part) if part else None
    if inner is None:
        return
    if not isinstance(inner, dict):
        raise BadAnswer(f"`{where}.{part}` is not an object")
    for key in TEXT_FIELDS:
        if not isinstance(inner.get(key), str | None):
            raise BadAnswer(f"`{where}.{part}.{key}` is not a string")
    _short(inner.get("role"), f"{where}.{part}.role")
    calls = inner.get("tool_calls")
    if calls is not None and not (isinstance(calls, list)
                                  and all(isinstance(c, dict) for c in calls)):
        raise BadAnswer(f"`{where}.{part}.tool_calls` is not a list of objects")


def _usage(usage: Any) -> None:
    if not isinstance(usage, dict):
        raise BadAnswer("`usage` is not an object")
    for key in USAGE_COUNTS:
        if usage.get(key) is not None and not _count(usage[key]):
            raise BadAnswer(f"`usage.{key}` is not a count")
    details = usage.get("prompt_tokens_details")
    if details is not None:
        if not isinstance(details, dict):
            raise BadAnswer("`usage.prompt_tokens_details` is not an object")
        if details.get("cached_tokens") is not None and not _count(details["cached_tokens"]):
            raise BadAnswer("`usage.prompt_tokens_details.cached_tokens` is not a count")


def _timings(table: Any, where: str, depth: int) -> None:
    if not isinstance(table, dict):
        raise BadAnswer(f"`{where}` is not an object")
    if depth > 4:
        return
    for key, value in table.items():
        if key in TIMING_NUMBERS and value is not None and not _number(value):
            raise BadAnswer(f"`{where}.{key}` is not a number")
        if key in TIMING_TABLES and value is not None:
            _timings(value, f"{where}.{key}", depth + 1)


def _short(value: Any, where: str) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise BadAnswer(f"`{where}` is not a string")
    if len(value) > MAX_FIELD_CHARS:
        raise BadAnswer(f"`{where}` is longer than {MAX_FIELD_CHARS} characters")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
