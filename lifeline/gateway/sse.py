"""Server-sent events as a backend streams them: whole events out of arbitrary chunks, each
kept as its exact bytes (the gateway passes them on unchanged) with its JSON read once.

The work a stream costs is bounded whatever the upstream sends: each byte is searched for the
end of its event once (the search resumes where the previous chunk's stopped, never from the
start of a buffer that grows), an event may hold at most `max_event_bytes` (past that, or data
that is not a JSON object, the stream is malformed: `BadStream`), and the JSON of a large event
is read in the preparing thread (`lifeline.gateway.bodies`)."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from lifeline.gateway import bodies

MAX_EVENT_BYTES = 1 << 20
"""An event's bytes, terminator included, unless the backend says otherwise."""


class BadStream(ValueError):
    """The upstream's stream is not one the gateway relays (too large an event, not JSON)."""


@dataclass(slots=True)
class Event:
    raw: bytes
    """The event as received, its blank-line terminator included."""
    data: dict[str, Any] | None
    """The JSON of its `data:` lines (None for a comment, an empty event or `[DONE]`)."""
    done: bool = False
    """`data: [DONE]`."""

    @property
    def error(self) -> bool:
        return self.data is not None and "error" in self.data


class EventSplitter:
    """Bytes in, complete events out (line ends normalised to `\\n`), in work proportional to
    the bytes fed: `scanned` counts the bytes every search looked at."""

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES):
        self.max_event_bytes = max_event_bytes
        self.buffer = bytearray()
        self.searched = 0
        """Bytes at the buffer's start already searched for the end of an event."""
        self.carried_cr = False
        """The last chunk ended in `\\r`, held back: it may be half of a `\\r\\n`."""
        self.scanned = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        if self.carried_cr:
            chunk, self.carried_cr = b"\r" + chunk, False
        if chunk.endswith(b"\r"):
            chunk, self.carried_cr = chunk[:-1], True
        chunk = chunk.replace(b"\r\n", b"\n")
        buffer = self.buffer
        start = max(self.searched - 1, 0)  # a "\n" that ended the last chunk may pair with one
        buffer += chunk
        out: list[bytes] = []
        pos = 0
        while True:
            begin = max(start, pos)
            end = buffer.find(b"\n\n", begin)
            if end < 0:
                self.scanned += len(buffer) - begin
                break
            self.scanned += end + 2 - begin
            if end + 2 - pos > self.max_event_bytes:
                raise self._too_large()
            out.append(bytes(buffer[pos:end + 2]))
            pos = end + 2
        if pos:
            del buffer[:pos]
        self.searched = len(buffer)
        if len(buffer) > self.max_event_bytes:
            raise self._too_large()
        return out

    def _too_large(self) -> BadStream:
        return BadStream(f"an event of more than {self.max_event_bytes} bytes")


async def events(chunks: AsyncIterator[bytes], max_event_bytes: int = MAX_EVENT_BYTES,
                 splitter: EventSplitter | None = None) -> AsyncIterator[Event]:
    """Complete events only: bytes after the last blank line when the stream ends are a torn
    event, and dropped (the caller sees a stream without `[DONE]`)."""
    splitter = splitter or EventSplitter(max_event_bytes)
    async for chunk in chunks:
        for raw in splitter.feed(chunk):
            yield await read(raw)


def _data(raw: bytes) -> bytes | None:
    lines = [line[5:].removeprefix(b" ") for line in raw.split(b"\n")
             if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


async def read(raw: bytes) -> Event:
    """One event; its JSON read in the preparing thread when it is large."""
    text = _data(raw)
    if text is None or not text.strip():
        return Event(raw, None)
    if text.strip() == b"[DONE]":
        return Event(raw, None, True)
    try:
        data = await bodies.decode(text)
    except bodies.BadJSON as exc:
        raise BadStream(f"an event's data is {exc}") from None
    if not isinstance(data, dict):
        raise BadStream("an event's data is not a JSON object")
    return Event(raw, data)


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
    text = data.encode("utf-8") if isinstance(data, str) else bodies.dumps(data)
    return b"data: " + text + b"\n\n"
