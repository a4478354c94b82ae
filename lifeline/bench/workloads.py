"""Workloads: prompts of exact token lengths (random, shared-prefix groups) or from a JSONL file.

Exact lengths come from a tokenizer: the server's `/tokenize` (Lifeline, vLLM, SGLang,
llama.cpp) when it answers, else a local one (`--tokenizer`, a GGUF file or HF directory). On
`/v1/completions` a prompt is sent as token ids, so its length is exact by construction; on
chat it is the ids' text (the chat template adds its own tokens, which `usage` reports).
"""
from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from lifeline.bench import conversation
from lifeline.bench.client import BenchClient, BenchRequest

WORDS = (
    "time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part",
    "child", "eye", "woman", "place", "work", "week", "case", "point", "government",
    "company", "number", "group", "problem", "fact", "be", "have", "do", "say", "get", "make",
    "go", "know", "take", "see", "come", "think", "look", "want", "give", "use", "find",
    "tell", "ask", "seem", "feel", "try", "leave", "call", "good", "new", "first", "last",
    "long", "great", "little", "own", "other", "old", "right", "big", "high", "different",
    "small", "large", "next", "early", "young", "important", "few", "public", "bad", "same",
    "able", "river", "stone", "garden", "window", "music", "paper", "summer", "light",
    "winter", "mountain", "ocean", "letter", "market", "story", "bridge", "forest",
)
"""Common English words: random prompts are drawn from them."""


class Tokenizer(Protocol):
    async def encode(self, text: str) -> list[int]: ...
    async def decode(self, ids: list[int]) -> str: ...


class ServerTokenizer:
    """The server's `/tokenize` and `/detokenize` (OpenAI-compatible servers' extension)."""

    def __init__(self, client: BenchClient):
        self.client = client

    async def encode(self, text: str) -> list[int]:
        root = self.client.server_root
        for body in ({"model": self.client.model, "prompt": text, "add_special_tokens": False},
                     {"content": text, "add_special": False}):
            r = await self.client.http.post(root + "/tokenize", json=body)
            tokens = r.json().get("tokens") if r.status_code == 200 else None
            # llama.cpp answers the vLLM-style body with 200 and no tokens: try its own body.
            if tokens or (tokens is not None and not text):
                return [t if isinstance(t, int) else t["id"] for t in tokens]
        raise RuntimeError(f"{root}/tokenize answered {r.status_code} with no tokens")

    async def decode(self, ids: list[int]) -> str:
        root = self.client.server_root
        r = await self.client.http.post(root + "/detokenize",
                                        json={"model": self.client.model, "tokens": ids})
        r.raise_for_status()
        data = r.json()
        return data.get("prompt", data.get("content", ""))


class LocalTokenizer:
    """A Lifeline tokenizer loaded from a GGUF file or HF directory."""

    def __init__(self, path: str | Path):
        from lifeline.tokenizer import load_tokenizer
        self.tk = load_tokenizer(path)

    async def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False)

    async def decode(self, ids: list[int]) -> str:
        return self.tk.decode(ids)


async def pick_tokenizer(client: BenchClient, local: str | None) -> Tokenizer:
    """`--tokenizer` if given, else the server's `/tokenize` (checked with one call)."""
    if local:
        return LocalTokenizer(local)
    tk = ServerTokenizer(client)
    try:
        if await tk.encode("hello world"):
            return tk
    except (httpx.HTTPStatusError, httpx.DecodingError, RuntimeError, KeyError, TypeError,
            ValueError):
        pass  # it answered, but not as a tokenize endpoint; an unreachable server raises
    raise RuntimeError("the server has no /tokenize: pass --tokenizer PATH for exact lengths")


@dataclass(slots=True)
class Lengths:
    """Input and output lengths: `fixed`, `uniform` (± spread × mean) or `normal` (standard
    deviation spread × mean), each at least 1; or `conversation`: (input, output) pairs of
    real requests (`lifeline.bench.conversation`): `pairs` when given (a trace file), else the
    distribution shipped with the package; the means unused."""

    input_tokens: int
    output_tokens: int
    dist: str = "fixed"
    spread: float = 0.0
    pairs: tuple[tuple[int, int], ...] = ()

    DISTS = ("fixed", "uniform", "normal", "conversation")

    def __post_init__(self) -> None:
        if self.dist not in self.DISTS:
            raise ValueError(f"length distribution is one of {', '.join(self.DISTS)}")
        if self.input_tokens < 1 or self.output_tokens < 1 or self.spread < 0:
            raise ValueError("lengths are positive and the spread is non-negative")
        if self.dist == "conversation" and not self.pairs:
            self.pairs = conversation.shipped_pairs()

    def pair(self, rng: random.Random) -> tuple[int, int]:
        """One request's (input, output) lengths."""
        if self.dist == "conversation":
            return conversation.draw(self.pairs, rng)
        return self._draw(rng, self.input_tokens), self._draw(rng, self.output_tokens)

    def _draw(self, rng: random.Random, mean: int) -> int:
        if self.dist == "uniform":
            return max(1, round(rng.uniform(mean * (1 - self.spread), mean * (1 + self.spread))))
        if self.dist == "normal":
            return max(1, round(rng.gauss(mean, mean * self.spread)))
        return mean


async def random_ids(tk: Tokenizer, rng: random.Random, n: int) -> list[int]:
    """`n` token ids of random words, as the tokenizer splits them."""
    ids: list[int] = []
    while len(ids) < n:
        ids += await tk.encode(" " + " ".join(rng.choice(WORDS) for _ in range(n + 8)))
    return ids[:n]


async def random_requests(tk: Tokenizer, lengths: Lengths, count: int, *, chat: bool,
                          seed: int = 0, prefix_groups: int = 0,
                          prefix_tokens: int = 0) -> list[BenchRequest]:
    """`count` requests of random words; with `prefix_groups`, request i shares the first
    `prefix_tokens` tokens with the others of group i mod groups (a common system prompt)."""
    rng = random.Random(seed)
    prefixes = [await random_ids(tk, rng, prefix_tokens) for _ in range(prefix_groups)]
    out = []
    for i in range(count):
        n_in, n_out = lengths.pair(rng)
        prefix = prefixes[i % prefix_groups] if prefixes else []
        ids = prefix + await random_ids(tk, rng, max(1, n_in - len(prefix)))
        prompt: str | list[int] = await tk.decode(ids) if chat else ids
        out.append(BenchRequest(prompt, n_out, len(ids)))
    return out


def jsonl_requests(path: str | Path, default_output_tokens: int) -> list[BenchRequest]:
    """One JSON object a line: `prompt` (text or ids) or `messages`, optional `max_tokens`."""
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        item = json.loads(line)
        max_tokens = int(item.get("max_tokens", item.get("output_tokens", default_output_tokens)))
        if "messages" in item:
            out.append(BenchRequest("", max_tokens, extra={"messages": item["messages"]}))
        else:
            out.append(BenchRequest(item["prompt"], max_tokens))
    return out


def cycle(requests: list[BenchRequest]) -> Iterator[BenchRequest]:
    """The workload repeated as long as the load asks for more."""
    if not requests:
        raise ValueError("the workload is empty")
    while True:
        yield from requests
