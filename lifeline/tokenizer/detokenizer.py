"""Streaming text out of a stream of token ids, never showing half a character."""
from __future__ import annotations

from collections.abc import Sequence

from lifeline.tokenizer.base import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Each `step` returns the text the new ids add. The deltas, with `flush()` at the end, add up
    to `tokenizer.decode(all_ids, skip_special_tokens)`.

    Only a short window is decoded per step, as in vLLM: `prefix_offset..read_offset` holds tokens
    already shown (context, so a SentencePiece space or a byte sequence decodes as it will in the
    whole text), `read_offset..` the ones not shown yet. Text ending in U+FFFD is an incomplete
    UTF-8 sequence and is held back until a later token completes it."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def step(self, new_token_ids: Sequence[int]) -> str:
        self.token_ids.extend(new_token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever was held back (an incomplete character shows as U+FFFD, as in `decode`)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        shown = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, len(self.token_ids))
        if len(window) <= len(shown) or (window.endswith(_REPLACEMENT) and not final):
            return ""
        delta = window[len(shown):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start == end:
            return ""
        return self.tokenizer.decode(self.token_ids[start:end], self.skip_special_tokens)
