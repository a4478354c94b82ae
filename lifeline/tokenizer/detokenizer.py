"""Streaming text out of a stream of token ids, never showing half a character."""
from __future__ import annotations

import codecs
from collections.abc import Sequence

from lifeline.tokenizer.base import Tokenizer

# The byte after an incomplete UTF-8 sequence of one byte that may continue it, by lead byte
# (Unicode table 3-7); after two or three bytes any continuation byte may.
_SECOND = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
_CONTINUATION = (0x80, 0xBF)

_LEADING_SKIPPED_KEPT = 2
"""Skipped special tokens before the first shown one that stay in the windows. Where they are
can change how the first text decodes (llama.cpp drops a leading BOS and then strips the next
token's space; any other first token keeps it): two are enough to tell every case apart."""


def _continues(pending: bytes, byte: int) -> bool:
    """Whether `byte` extends `pending`, an incomplete but valid UTF-8 sequence."""
    low, high = _SECOND.get(pending[0], _CONTINUATION) if len(pending) == 1 else _CONTINUATION
    return low <= byte <= high


class IncrementalDetokenizer:
    """Each `step` returns the text the new ids add. The deltas, with `flush()` at the end, add up
    to `tokenizer.decode(all_ids, skip_special_tokens)`.

    Text is decoded in short windows, as in vLLM: `prefix_offset..read_offset` holds tokens
    already shown (context, so a SentencePiece space decodes as it will in the whole text),
    `read_offset..cut` the ones shown now. The cut is the last token boundary where no UTF-8
    sequence is pending: the tokens' bytes (`token_to_bytes`) run through a UTF-8 decoder, and a
    boundary counts once the bytes before it decode for good (a character or a U+FFFD that no later
    byte can change). Tokens after the cut, at most one incomplete sequence's worth, wait
    undecoded.

    Skipped special tokens add no text, so once text has begun they stay out of the windows
    (`_window`), and a window starts at one only where the text does: they can neither make a
    window long nor start one (a window that started with a skipped BOS would drop it and strip
    the next token's space, which the whole text keeps).
    So every token is decoded a bounded number of times, whatever the output: a run of stray
    continuation bytes, or of specials, costs the same per token as plain text."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self.token_ids: list[int] = []
        self._window: list[int] = []  # token_ids less the skipped specials that cannot matter
        self._leading_skipped = 0
        self._parts: list[str] = []
        self._prefix_offset = 0  # offsets into _window
        self._read_offset = 0
        self._shown = 0  # length of the decoded text of prefix_offset..read_offset
        self._cut = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def step(self, new_token_ids: Sequence[int]) -> str:
        for token_id in new_token_ids:
            self._scan(token_id)
        return self._emit(self._cut)

    def flush(self) -> str:
        """Whatever was held back (an incomplete character shows as U+FFFD, as in `decode`)."""
        return self._emit(len(self._window))

    def _scan(self, token_id: int) -> None:
        """Append `token_id`, moving the cut to the last boundary no later byte can move."""
        self.token_ids.append(token_id)
        if token_id in self._skip:
            if len(self._window) > self._leading_skipped or \
                    self._leading_skipped >= _LEADING_SKIPPED_KEPT:
                return
            self._leading_skipped += 1
            data = b""
        else:
            data = self.tokenizer.token_to_bytes(token_id)
        pending = self._utf8.getstate()[0]
        if not pending or (data and not _continues(pending, data[0])):
            self._cut = len(self._window)
        self._window.append(token_id)
        self._utf8.decode(data)
        if not self._utf8.getstate()[0]:
            self._cut = len(self._window)

    def _emit(self, cut: int) -> str:
        if cut <= self._read_offset:
            return ""
        window = self._decode(self._prefix_offset, cut)
        delta = window[self._shown:]
        # the next window starts where this one's new tokens did, unless that is one of the
        # leading skipped specials: a window may start at one only where the text does
        prefix = self._read_offset if self._read_offset >= self._leading_skipped else 0
        self._shown = len(window) if prefix == self._prefix_offset else \
            len(self._decode(prefix, cut))
        self._prefix_offset, self._read_offset = prefix, cut
        self._parts.append(delta)
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start == end:
            return ""
        return self.tokenizer.decode(self._window[start:end], self.skip_special_tokens)
