"""Stop strings over streamed text: never leak one, not even a part that completes later."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class StopResult:
    emit: str
    """Text the client may see now; never taken back."""
    stop_str: str | None = None
    """The stop string that ended generation, if one did."""
    held: int = 0
    """Characters kept back because they may be the start of a stop string."""

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None


class StopChecker:
    """Feed it the text deltas of one request; it says what to emit and when a stop string ends it.

    The stop is the first stop string to complete (the one generation would see first; among those
    completing at the same character, the longest). Without `include_stop_str_in_output` the output
    ends just before it, with it just after; nothing after it is ever emitted (OpenAI semantics).
    Whatever the split into deltas, the concatenated emits (plus `flush()` when generation ends for
    another reason) equal `feed(full_text).emit + flush()` on a fresh checker.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.window = max((len(s) for s in self.stop), default=1) - 1
        self.tail = ""
        self.held = 0
        self.stopped = False

    def feed(self, delta: str) -> StopResult:
        if self.stopped:
            return StopResult("")
        text, old = self.tail + delta, len(self.tail)
        unemitted = old - self.held
        match = self._first_match(text, old)
        if match is not None:
            start, stop_str = match
            end = start + len(stop_str) if self.include_stop_str_in_output else start
            self.tail, self.held, self.stopped = "", 0, True
            return StopResult(text[unemitted:end], stop_str)
        held = 0 if self.include_stop_str_in_output else self._partial_suffix(text)
        self.tail, self.held = text[-self.window:] if self.window else "", held
        return StopResult(text[unemitted : len(text) - held], held=held)

    def flush(self) -> str:
        """The held-back text, released because generation ended for another reason."""
        text = self.tail[-self.held:] if self.held else ""
        self.held = 0
        return text

    def _first_match(self, text: str, old: int) -> tuple[int, str] | None:
        """(start, stop string) of the match ending first, longest on ties; only matches that end
        past `old` can be new, since the text before it held none."""
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            start = text.find(s, max(0, old - len(s) + 1))
            if start < 0:
                continue
            key = (start + len(s), -len(s), s)
            if best is None or key < best:
                best = key
        return None if best is None else (best[0] + best[1], best[2])

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for n in range(min(len(text), self.window), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
