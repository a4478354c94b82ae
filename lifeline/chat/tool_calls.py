"""Tool-call parser for the Hermes/Qwen format: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.

- A block whose body is a JSON object with a string `name` and an object `arguments` (or
  `parameters`; missing means `{}`; a JSON string holding an object is accepted) becomes a
  `ToolCall`; its arguments are re-serialized as a JSON string, as OpenAI sends them.
- A block with anything else inside (invalid JSON, no name…) is kept as content, verbatim,
  as is an unclosed block at the end of the output (e.g. cut by `max_tokens`): the text is
  never lost.
- Whitespace next to a valid block is dropped, so "Sure.\\n<tool_call>…</tool_call>\\n" leaves
  the content "Sure.".
- Streaming emits each call whole once its end tag arrives (index, id, name and all of its
  arguments in one delta) and never lets tag text into the content: text that could begin a
  start tag, and whitespace that could precede one, are held back until decided."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from lifeline.chat.reasoning import partial_tag_length

_TEXT, _CALL, _AFTER = range(3)


@dataclass(slots=True, frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The arguments object as a JSON string."""


@dataclass(slots=True, frozen=True)
class ToolCallDelta:
    """One OpenAI `delta.tool_calls[]` entry; this parser sends each call whole."""

    index: int
    id: str
    name: str
    arguments: str

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a block body, or None when it is not a valid call."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return data["name"], json.dumps(arguments, ensure_ascii=False)


@dataclass(slots=True)
class ToolCallParser:
    """Splits model output into content and tool calls, one-shot or delta by delta. A
    streamed event is a content string or a `ToolCallDelta`."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"
    calls: list[ToolCall] = field(init=False, default_factory=list)
    """The calls found so far."""
    _state: int = field(init=False, default=_TEXT)
    _pending: str = field(init=False, default="")
    _space: str = field(init=False, default="")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output."""
        parser = ToolCallParser(self.start, self.end)
        events = parser.feed(text) + parser.flush()
        return "".join(e for e in events if isinstance(e, str)), parser.calls

    def feed(self, delta: str) -> list[str | ToolCallDelta]:
        events: list[str | ToolCallDelta] = []
        self._pending += delta
        while self._pending and self._step(events):
            pass
        return [e for e in events if e != ""]

    def flush(self) -> list[str | ToolCallDelta]:
        """Whatever was held back, at the end of the output."""
        text = self._pending
        if self._state == _CALL:
            text = self._space + self.start + text
        elif self._state == _TEXT:
            text = self._space + text
        self._pending = self._space = ""
        self._state = _TEXT
        return [text] if text else []

    def _step(self, events: list[str | ToolCallDelta]) -> bool:
        """Consume what can be decided; False when the rest must wait for more text."""
        text = self._pending
        if self._state == _AFTER:
            self._pending = text.lstrip()
            if self._pending:
                self._state = _TEXT
            return bool(self._pending)
        if self._state == _CALL:
            at = text.find(self.end)
            if at < 0:
                return False
            self._close(text[:at], events)
            self._pending = text[at + len(self.end):]
            return True
        at = text.find(self.start)
        if at >= 0:
            self._emit_text(text[:at], events)
            self._state = _CALL
            self._pending = text[at + len(self.start):]
            return True
        keep = partial_tag_length(text, self.start)
        self._emit_text(text[:len(text) - keep], events)
        self._pending = text[len(text) - keep:]
        return False

    def _emit_text(self, text: str, events: list[str | ToolCallDelta]) -> None:
        """Send `text` but its trailing whitespace, held in case a block follows."""
        text = self._space + text
        kept = text.rstrip()
        events.append(kept)
        self._space = text[len(kept):]

    def _close(self, body: str, events: list[str | ToolCallDelta]) -> None:
        parsed = parse_call(body)
        if parsed is None:
            events.append(self._space + self.start + body + self.end)
            self._space, self._state = "", _TEXT
            return
        call = ToolCall(new_call_id(), *parsed)
        events.append(ToolCallDelta(len(self.calls), call.id, call.name, call.arguments))
        self.calls.append(call)
        self._space, self._state = "", _AFTER
