"""Server-sent events as a backend streams them: whole events out of arbitrary chunks, each
kept as its exact bytes (the gateway passes them on unchanged) with its JSON read once."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Event:
    raw: bytes
    """The event as received, its blank-line terminator included."""
    data: dict[str, Any] | None
    """The JSON of its `data:` lines (None for a comment, `[DONE]` or text that is not JSON)."""
    done: bool = False
    """`data: [DONE]`."""

    @property
    def error(self) -> bool:
        return self.data is not None and "error" in self.data


async def events(chunks: AsyncIterator[bytes]) -> AsyncIterator[Event]:
    """Complete events only: bytes after the last blank line when the stream ends are a torn
    event, and dropped (the caller sees a stream without `[DONE]`)."""
    buffer = b""
    async for chunk in chunks:
        buffer = (buffer + chunk).replace(b"\r\n", b"\n")
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            raw, buffer = buffer[:end + 2], buffer[end + 2:]
            yield parse(raw)


def parse(raw: bytes) -> Event:
    lines = [line[5:].removeprefix(b" ") for line in raw.split(b"\n")
             if line.startswith(b"data:")]
    if not lines:
        return Event(raw, None)
    text = b"\n".join(lines)
    if text.strip() == b"[DONE]":
        return Event(raw, None, True)
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return Event(raw, None)
    return Event(raw, data if isinstance(data, dict) else None)


def has_output(data: dict[str, Any]) -> bool:
    """Whether a chunk carries output (text, reasoning, a tool call) or ends a choice."""
    for choice in data.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning",
                                          "tool_calls")):
                return True
        elif choice.get("text"):
            return True
        if choice.get("finish_reason"):
            return True
    return False


def encode(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                         separators=(",", ":"))
    return f"data: {text}\n\n".encode()
