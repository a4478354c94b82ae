"""(prompt, output) length pairs of real conversations, read from a trace file the user gives.

Pairs are kept together so the correlation between prompt and output length survives. The file
is a CSV with `ContextTokens` and `GeneratedTokens` columns — the format of the Azure LLM
inference traces (github.com/Azure/AzurePublicDataset, CC-BY 4.0; Patel et al., "Splitwise",
ISCA 2024) — or JSONL with `input_tokens` and `output_tokens` per line. No trace ships with the
package: the project's rules keep fetched data out of the repository.
"""
from __future__ import annotations

import csv
import json
import random
from pathlib import Path


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


def draw(pairs: tuple[tuple[int, int], ...], rng: random.Random) -> tuple[int, int]:
    """One (prompt tokens, output tokens) pair of the trace."""
    return rng.choice(pairs)
