"""Byte-level BPE over ranked merges, as llama.cpp's `llm_tokenizer_bpe` runs a GGUF file's
`tokenizer.ggml.merges` (tokenizer model 'gpt2').

Text is cut into words first (the pre-tokenizer the file names in `tokenizer.ggml.pre`), each
word's UTF-8 bytes are spelled with GPT-2's printable byte characters, and then adjacent symbols
are merged, lowest merge rank first (ties: the leftmost pair), until no pair has a rank.

The pre-tokenizer follows llama.cpp's hand-written GPT-2 splitter (unicode.cpp) rather than a
regex engine: letters and numbers are Unicode categories L* and N* (Python's `unicodedata`, so a
character assigned after its Unicode version may split differently), whitespace is Unicode's
White_Space property, and ` ?` means the space character alone."""
from __future__ import annotations

import heapq
import unicodedata
from collections.abc import Callable, Iterable
from functools import lru_cache

WHITE_SPACE = frozenset(map(chr, (*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680,
                                  *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F,
                                  0x3000)))
"""Unicode's White_Space property (PropList.txt), what llama.cpp's `\\s` matches."""
CONTRACTIONS = ("'s", "'t", "'m", "'d", "'re", "'ve", "'ll")
WORD_CACHE = 1 << 16
"""Distinct words whose merged tokens a tokenizer remembers."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte, as byte-level BPE vocabularies store them."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {}, 0
    for b in range(256):
        if b in keep:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


LETTER, NUMBER, SPACE, OTHER = 0, 1, 2, 3


@lru_cache(maxsize=1 << 16)
def char_class(ch: str) -> int:
    if ch in WHITE_SPACE:
        return SPACE
    category = unicodedata.category(ch)[0]
    return LETTER if category == "L" else NUMBER if category == "N" else OTHER


def split_gpt2(text: str) -> list[str]:
    """GPT-2's words: `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|
    \\s+(?!\\S)|\\s+`, leftmost alternative first."""
    classes = [char_class(ch) for ch in text]
    words, pos, n = [], 0, len(text)
    while pos < n:
        end = _word_end(text, classes, pos)
        words.append(text[pos:end])
        pos = end
    return words


def _word_end(text: str, classes: list[int], pos: int) -> int:
    n = len(text)
    if text[pos] == "'":
        for contraction in CONTRACTIONS:
            if text.startswith(contraction, pos):
                return pos + len(contraction)
    start = pos + 1 if text[pos] == " " and pos + 1 < n else pos
    kind = classes[start]
    if kind != SPACE:
        end = start + 1
        while end < n and classes[end] == kind:
            end += 1
        return end
    end = pos
    while end < n and classes[end] == SPACE:
        end += 1
    # \s+(?!\S): a run followed by a non-space leaves its last character to the next word
    return end - 1 if end - pos > 1 and end < n else end


def split_numbers(text: str) -> list[str]:
    """`\\p{N}`: every number character a piece of its own, the text between them pieces too."""
    pieces, start = [], 0
    for i, ch in enumerate(text):
        if char_class(ch) == NUMBER:
            if start < i:
                pieces.append(text[start:i])
            pieces.append(ch)
            start = i + 1
    if start < len(text):
        pieces.append(text[start:])
    return pieces


PRE_TOKENIZERS: dict[str, tuple[Callable[[str], list[str]], ...]] = {
    "smollm": (split_numbers, split_gpt2),
}
"""`tokenizer.ggml.pre` -> the splits llama.cpp applies in turn (each to every piece of the
one before). Only those whose detokenization is plain byte decoding are here (llama.cpp's
`clean_spaces` is off for them)."""


def pre_tokenize(text: str, splits: Iterable[Callable[[str], list[str]]]) -> list[str]:
    pieces = [text] if text else []
    for split in splits:
        pieces = [word for piece in pieces for word in split(piece)]
    return pieces


def parse_merges(merges: Iterable[str]) -> dict[tuple[str, str], int]:
    """Each merge 'LEFT RIGHT' (cut at the first space after its first character) -> rank."""
    ranks: dict[tuple[str, str], int] = {}
    for rank, merge in enumerate(merges):
        cut = merge.find(" ", 1)
        pair = (merge[:cut], merge[cut + 1:]) if cut >= 0 else (merge, "")
        ranks.setdefault(pair, rank)
    return ranks


def bpe_merge(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Merge adjacent symbols, lowest rank first and the leftmost pair among equal ranks, as
    long as some adjacent pair has a rank."""
    n = len(symbols)
    if n < 2:
        return symbols
    syms = list(symbols)
    nxt = [*range(1, n), -1]
    prv = list(range(-1, n - 1))
    heap = [(rank, i, syms[i], syms[i + 1]) for i in range(n - 1)
            if (rank := ranks.get((syms[i], syms[i + 1]))) is not None]
    heapq.heapify(heap)
    while heap:
        _, left, left_text, right_text = heapq.heappop(heap)
        right = nxt[left]
        if right < 0 or syms[left] != left_text or syms[right] != right_text:
            continue  # a pair that an earlier merge changed
        syms[left] += syms[right]
        syms[right] = ""
        nxt[left] = nxt[right]
        if nxt[left] >= 0:
            prv[nxt[left]] = left
        for a, b in ((prv[left], left), (left, nxt[left])):
            if a >= 0 and b >= 0 and (rank := ranks.get((syms[a], syms[b]))) is not None:
                heapq.heappush(heap, (rank, a, syms[a], syms[b]))
    return [s for s in syms if s]


class ByteLevelBPE:
    """Words to token ids for one vocabulary; each distinct word is merged once."""

    def __init__(self, ids: dict[str, int], merges: Iterable[str], pre: str):
        if pre not in PRE_TOKENIZERS:
            raise NotImplementedError(f"GGUF BPE pre-tokenizer {pre!r}: only "
                                      f"{', '.join(sorted(PRE_TOKENIZERS))}")
        self._ids = ids
        self._ranks = parse_merges(merges)
        self._splits = PRE_TOKENIZERS[pre]
        self._spell = bytes_to_unicode()
        self.encode_word = lru_cache(maxsize=WORD_CACHE)(self._encode_word)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["encode_word"]  # a cache of this instance's own: rebuilt, empty
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.encode_word = lru_cache(maxsize=WORD_CACHE)(self._encode_word)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in pre_tokenize(text, self._splits):
            ids += self.encode_word(word)
        return ids

    def _encode_word(self, word: str) -> tuple[int, ...]:
        spelled = [self._spell[b] for b in word.encode()]
        ids: list[int] = []
        for sym in bpe_merge(spelled, self._ranks):
            token_id = self._ids.get(sym)
            if token_id is not None:
                ids.append(token_id)
                continue
            # llama.cpp looks each byte of the symbol's text up alone; only ASCII can match
            ids += [t for b in sym.encode()
                    if b < 0x80 and (t := self._ids.get(chr(b))) is not None]
        return tuple(ids)


def byte_decoder() -> dict[str, int]:
    return {ch: b for b, ch in bytes_to_unicode().items()}


def decode_token_text(text: str, decoder: dict[str, int]) -> bytes:
    """A normal token's bytes, as llama.cpp's `llama_decode_text` gives them (a character with
    no byte becomes an `[UNK_BYTE_0x..]` marker)."""
    try:
        return bytes(map(decoder.__getitem__, text))
    except KeyError:
        pass
    out = bytearray()
    for ch in text:
        b = decoder.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += f"[UNK_BYTE_0x{ch.encode().hex()}{text}]".encode()
    return bytes(out)
