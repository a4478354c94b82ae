"""SentencePiece-style BPE over a scored vocabulary, as llama.cpp's `llm_tokenizer_spm` does it."""
from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence

HEAPIFY_MAX = 1 << 14
"""Texts of more characters build their merge heap by pushes, not one `heapify`."""


def score_ranks(scores: Sequence[float]) -> array:
    """Each token's place among the vocabulary's scores, best first; equal scores share a place.
    Comparing places orders pairs as comparing scores does, ties included."""
    place = {s: i for i, s in enumerate(sorted(set(scores), reverse=True))}
    return array("I", (place[s] for s in scores))


def spm_merge(text: str, vocab: dict[str, int], ranks: Sequence[int]) -> list[str]:
    """The symbols `text` ends up as: start from characters, and keep merging the adjacent pair
    whose concatenation is the best-scored vocabulary entry (ties: the leftmost pair).

    A candidate pair is one int, (place, left, size) in bit fields, not a tuple: ints compare
    faster and the collector does not track them (a long text's hundreds of thousands of
    tuples made full collections that held the GIL for 100 ms and more)."""
    syms = list(text)
    n = len(syms)
    if n < 2:
        return syms
    bits = n.bit_length()
    mask = (1 << bits) - 1
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap: list[int] = []
    pop, push, get = heapq.heappop, heapq.heappush, vocab.get
    # one heapify of a long text's pairs is one C call that holds the GIL throughout (the
    # server's event loop with it); pushes let other threads run between them
    short = n <= HEAPIFY_MAX
    add = heap.append if short else (lambda item: push(heap, item))
    for i in range(n - 1):
        token_id = get(syms[i] + syms[i + 1])
        if token_id is not None:
            add((ranks[token_id] << bits | i) << bits | 2)
    if short:
        heapq.heapify(heap)
    while heap:
        key = pop(heap)
        left, size = key >> bits & mask, key & mask
        right = nxt[left]
        a = syms[left]
        if not a or right < 0:
            continue
        b = syms[right]
        if len(a) + len(b) != size:
            continue
        merged = syms[left] = a + b
        syms[right] = ""
        after = nxt[left] = nxt[right]
        if after >= 0:
            prv[after] = left
        before = prv[left]
        if before >= 0 and (token_id := get(syms[before] + merged)) is not None:
            push(heap, (ranks[token_id] << bits | before) << bits
                 | len(syms[before]) + len(merged))
        if after >= 0 and (token_id := get(merged + syms[after])) is not None:
            push(heap, (ranks[token_id] << bits | left) << bits | len(merged) + len(syms[after]))
    out, i = [], 0
    while i >= 0:
        out.append(syms[i])
        i = nxt[i]
    return out
