"""Reasoning parser for the `<think>…</think>` family.

The first start tag opens the reasoning (text before it is content); the first end tag after it
closes it; everything after is content, tags included. Text is kept as the model wrote it
(the newlines around the tags too). With `starts_in_reasoning` the output is taken to begin
inside the reasoning (the prompt ended with the start tag, e.g. `enable_thinking`). A stream
never emits part of a tag: text that could be the beginning of the awaited tag is held back
until it is decided."""
from __future__ import annotations

from dataclasses import dataclass, field

_BEFORE, _REASONING, _AFTER = range(3)


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def opens_reasoning(prompt: str, start: str = "<think>") -> bool:
    """Whether a rendered prompt leaves the model inside a reasoning block."""
    return prompt.rstrip().endswith(start)


@dataclass(slots=True)
class ReasoningParser:
    """Splits model output into (reasoning, content), one-shot or delta by delta."""

    start: str = "<think>"
    end: str = "</think>"
    starts_in_reasoning: bool = False
    _state: int = field(init=False, default=_BEFORE)
    _pending: str = field(init=False, default="")
    _opened: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError("reasoning tags must be non-empty")
        if self.starts_in_reasoning:
            self._state, self._opened = _REASONING, True

    @property
    def in_reasoning(self) -> bool:
        """True while the text fed so far ends inside the reasoning (for counting reasoning
        tokens)."""
        return self._state == _REASONING

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content) of a whole output; reasoning is None when none was opened."""
        parser = ReasoningParser(self.start, self.end, self.starts_in_reasoning)
        reasoning, content = parser.feed(text)
        more_reasoning, more_content = parser.flush()
        return (reasoning + more_reasoning if parser._opened else None,
                content + more_content)

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for the next piece of output; either may be ''."""
        text, self._pending = self._pending + delta, ""
        out = {_BEFORE: [], _REASONING: [], _AFTER: []}
        while text:
            if self._state == _AFTER:
                out[_AFTER].append(text)
                break
            tag = self.start if self._state == _BEFORE else self.end
            at = text.find(tag)
            if at >= 0:
                out[self._state].append(text[:at])
                self._state += 1
                self._opened = True
                text = text[at + len(tag):]
                continue
            keep = partial_tag_length(text, tag)
            out[self._state].append(text[:len(text) - keep])
            self._pending = text[len(text) - keep:]
            break
        return "".join(out[_REASONING]), "".join(out[_BEFORE] + out[_AFTER])

    def flush(self) -> tuple[str, str]:
        """Whatever was held back, at the end of the output."""
        text, self._pending = self._pending, ""
        return (text, "") if self._state == _REASONING else ("", text)
