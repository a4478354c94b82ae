"""Cutting text on special tokens before BPE, as llama.cpp's `tokenizer_st_partition` does."""
from __future__ import annotations

import re
from collections.abc import Iterable

_END = ""


class SpecialSplitter:
    """Splits text into raw-text pieces (str) and special token ids (int).

    llama.cpp takes the special tokens longest first (by UTF-8 length) and cuts every piece of text
    on all non-overlapping occurrences of each, left to right. That is not the same as taking the
    longest match at each position, so we follow it exactly, but only for the specials that occur
    in the text at all, found with one pass over a trie."""

    def __init__(self, specials: Iterable[tuple[str, int]]):
        self._ids: dict[str, int] = {}
        self._trie: dict = {}
        for text, token_id in specials:
            self._ids[text] = token_id
            self._insert(text)
        first_chars = "".join(sorted(k for k in self._trie if k != _END))
        self._starts = re.compile(f"[{re.escape(first_chars)}]") if first_chars else None

    def _insert(self, text: str) -> None:
        node = self._trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[_END] = text

    def _occurring(self, text: str) -> set[str]:
        found: set[str] = set()
        if self._starts is None:
            return found
        n = len(text)
        for match in self._starts.finditer(text):
            node, i = self._trie, match.start()
            while i < n and (node := node.get(text[i])) is not None:
                if _END in node:
                    found.add(node[_END])
                i += 1
        return found

    def _order(self, text: str) -> tuple[int, int]:
        # llama.cpp's std::sort leaves ties in an unspecified order; for Gemma no two specials of
        # one length can overlap, so any tie-break gives the same result.
        return -len(text.encode()), self._ids[text]

    def escape(self, text: str) -> str:
        """`text` with every character that is part of a special token's spelling replaced by
        its placeholder (same length), so that no special token can be found in it."""
        spans = self._spans(text)
        if not spans:
            return text
        out, pos = [], 0
        for start, end in spans:
            out += [text[pos:start], _placeholders(text[start:end])]
            pos = end
        out.append(text[pos:])
        return "".join(out)

    def _spans(self, text: str) -> list[tuple[int, int]]:
        """Merged spans of every occurrence of a special, overlapping ones included."""
        spans: list[tuple[int, int]] = []
        if self._starts is None:
            return spans
        n = len(text)
        for match in self._starts.finditer(text):
            node, i, start, end = self._trie, match.start(), match.start(), -1
            while i < n and (node := node.get(text[i])) is not None:
                i += 1
                if _END in node:
                    end = i
            if end < 0:
                continue
            if spans and start <= spans[-1][1]:
                spans[-1] = (spans[-1][0], max(end, spans[-1][1]))
            else:
                spans.append((start, end))
        return spans

    def split(self, text: str) -> list[str | int]:
        pieces: list[str | int] = [text] if text else []
        for special in sorted(self._occurring(text), key=self._order):
            pieces = _cut(pieces, special, self._ids[special])
        return pieces


def _cut(pieces: list[str | int], special: str, token_id: int) -> list[str | int]:
    out: list[str | int] = []
    for piece in pieces:
        if isinstance(piece, int) or special not in piece:
            out.append(piece)
            continue
        for i, part in enumerate(piece.split(special)):
            if i:
                out.append(token_id)
            if part:
                out.append(part)
    return out


# --- special-token text inside request strings ------------------------------------------------
#
# A chat request's strings (message content, names, tool definitions, ...) may spell a special
# token. Before a template renders them, every character covered by such a spelling is replaced
# by a placeholder from Supplementary Private Use Area-B, one character for one, so the rendered
# prompt shows specials only where the template wrote them. When the prompt is encoded, it is cut
# at those specials first and each text piece is mapped back and encoded as plain text.

PLACEHOLDER_OFFSET = 0x100000
_LAST_MAPPED = 0xFFFD
_PLACEHOLDERS = re.compile(f"[{chr(PLACEHOLDER_OFFSET)}-{chr(PLACEHOLDER_OFFSET + _LAST_MAPPED)}]")


def has_placeholders(text: str) -> bool:
    return _PLACEHOLDERS.search(text) is not None


def unescape(text: str) -> str:
    """The characters the placeholders stand for. (A request's own characters of that range come
    back as the character they would stand for: a private-use character is no control token.)"""
    if not has_placeholders(text):
        return text
    return _PLACEHOLDERS.sub(lambda m: chr(ord(m.group()) - PLACEHOLDER_OFFSET), text)


def _placeholders(text: str) -> str:
    return "".join(chr(PLACEHOLDER_OFFSET + ord(ch)) if ord(ch) <= _LAST_MAPPED else ch
                   for ch in text)
