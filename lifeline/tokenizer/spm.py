"""SentencePiece-style BPE over a scored vocabulary, as llama.cpp's `llm_tokenizer_spm` does it."""
from __future__ import annotations

import heapq
from collections.abc import Sequence

HEAPIFY_MAX = 1 << 14
"""Texts of more characters build their merge heap by pushes, not one `heapify`."""


def spm_merge(text: str, vocab: dict[str, int], neg_scores: Sequence[float]) -> list[str]:
    """The symbols `text` ends up as: start from characters, and keep merging the adjacent pair
    whose concatenation is the best-scored vocabulary entry (ties: the leftmost pair)."""
    syms = list(text)
    n = len(syms)
    if n < 2:
        return syms
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap: list[tuple[float, int, int, int]] = []
    pop, push, get = heapq.heappop, heapq.heappush, vocab.get
    # one heapify of a long text's pairs is one C call that holds the GIL throughout (the
    # server's event loop with it); pushes let other threads run between them
    add = heap.append if n <= HEAPIFY_MAX else lambda item: push(heap, item)
    for i in range(n - 1):
        token_id = vocab.get(syms[i] + syms[i + 1])
        if token_id is not None:
            add((neg_scores[token_id], i, i + 1, 2))
    heapq.heapify(heap)
    while heap:
        _, left, right, size = pop(heap)
        a, b = syms[left], syms[right]
        if not a or not b or len(a) + len(b) != size:
            continue
        merged = syms[left] = a + b
        syms[right] = ""
        after = nxt[left] = nxt[right]
        if after >= 0:
            prv[after] = left
        before = prv[left]
        if before >= 0 and (token_id := get(syms[before] + merged)) is not None:
            push(heap, (neg_scores[token_id], before, left, len(syms[before]) + len(merged)))
        if after >= 0 and (token_id := get(merged + syms[after])) is not None:
            push(heap, (neg_scores[token_id], left, after, len(merged) + len(syms[after])))
    out, i = [], 0
    while i >= 0:
        out.append(syms[i])
        i = nxt[i]
    return out
