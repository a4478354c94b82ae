"""What a workload's text costs in tokens, against a reference: the tokenizer finding's facts.

The reference (data/text_cost.json, written by scripts/make_text_cost_reference.py) is how many
tokens a character of each script costs in Gemma 3's tokenizer, a vocabulary built for many
languages. A text's reference cost is its characters by script times those rates; a server's
tokenizer that spends 1.5 times that or more splits the text unusually finely (a byte-level
vocabulary on Chinese, an English-only one on Hindi). Digits count as their own kind; spaces
and punctuation count with the script of the letters around them."""
from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cache
from importlib import resources
from typing import Any

SCRIPTS = ("latin", "greek", "cyrillic", "hebrew", "arabic", "devanagari", "thai", "hangul",
           "kana", "han", "digit", "other", "common")
"""`digit`: decimal digits, which many tokenizers split one a token, whatever surrounds them;
`other`: letters of a script not listed; `common`: spaces and punctuation of a text with no
letters."""

_RANGES = (
    (0x0041, 0x024F, "latin"), (0x1E00, 0x1EFF, "latin"), (0xFF21, 0xFF5A, "latin"),
    (0x0370, 0x03FF, "greek"), (0x1F00, 0x1FFF, "greek"),
    (0x0400, 0x052F, "cyrillic"), (0x0590, 0x05FF, "hebrew"),
    (0x0600, 0x06FF, "arabic"), (0x0750, 0x077F, "arabic"), (0xFB50, 0xFDFF, "arabic"),
    (0xFE70, 0xFEFF, "arabic"), (0x0900, 0x097F, "devanagari"), (0x0E00, 0x0E7F, "thai"),
    (0x1100, 0x11FF, "hangul"), (0x3130, 0x318F, "hangul"), (0xAC00, 0xD7AF, "hangul"),
    (0x3040, 0x30FF, "kana"), (0x31F0, 0x31FF, "kana"), (0xFF66, 0xFF9F, "kana"),
    (0x3400, 0x4DBF, "han"), (0x4E00, 0x9FFF, "han"), (0xF900, 0xFAFF, "han"),
    (0x20000, 0x2FFFF, "han"),
)
MAX_SAMPLE_CHARS = 200_000
"""The most text the bench weighs (a sample of the workload's prompts)."""
RAISE_AT = 1.5
"""Tokens per reference token at which the tokenizer becomes a finding."""


def script_of(ch: str) -> str | None:
    """The script of a letter, `digit` for a decimal digit; None for spaces, punctuation and
    symbols."""
    if ch.isdecimal():
        return "digit"
    if not ch.isalpha():
        return None
    code = ord(ch)
    for lo, hi, name in _RANGES:
        if lo <= code <= hi:
            return name
    return "other"


def script_chars(text: str) -> dict[str, int]:
    """Characters by script; a character without a script joins the run before it (or, at
    the start, the first run after it); a text with no letters or digits is all `common`."""
    out: dict[str, int] = {}
    current: str | None = None
    pending = 0
    for ch in text:
        script = script_of(ch)
        if script is None:
            if current is None:
                pending += 1
            else:
                out[current] = out.get(current, 0) + 1
            continue
        if current is None:
            out[script] = out.get(script, 0) + pending
            pending = 0
        current = script
        out[script] = out.get(script, 0) + 1
    if pending:
        out["common"] = out.get("common", 0) + pending
    return out


@cache
def reference() -> dict[str, Any]:
    text = resources.files("lifeline.bench").joinpath("data/text_cost.json").read_text()
    return json.loads(text)


def reference_tokens(text: str) -> float:
    """What `text` costs in the reference tokenizer, estimated from its scripts."""
    rates = reference()["tokens_per_char"]
    return sum(n * rates.get(script, rates["other"]) for script, n in script_chars(text).items())


def words(text: str) -> int:
    return len(text.split())


def sample_texts(texts: Iterable[str], limit: int = MAX_SAMPLE_CHARS) -> list[str]:
    """Distinct non-empty texts, in order, up to `limit` characters in all."""
    out, seen, size = [], set(), 0
    for text in texts:
        if not text or text in seen:
            continue
        if size + len(text) > limit and out:
            break
        seen.add(text)
        out.append(text[:limit])
        size += len(out[-1])
    return out


def text_stats(texts: list[str], tokens: list[int], english_tokens: int | None
               ) -> dict[str, Any] | None:
    """The facts the tokenizer finding reads: the sample's characters, words and tokens on
    the server's tokenizer, its reference cost, the characters' scripts, and the English
    sample's tokens on the same tokenizer (`english_tokens`, None if not measured)."""
    chars = sum(len(t) for t in texts)
    if not chars:
        return None
    ref = reference()
    scripts: dict[str, int] = {}
    for text in texts:
        for script, n in script_chars(text).items():
            scripts[script] = scripts.get(script, 0) + n
    total_tokens = sum(tokens)
    ref_tokens = sum(reference_tokens(t) for t in texts)
    english = ref["english_sample"]
    return {
        "texts": len(texts), "chars": chars, "words": sum(words(t) for t in texts),
        "tokens": total_tokens, "reference_tokens": ref_tokens,
        "ratio": total_tokens / ref_tokens if ref_tokens else None,
        "scripts": {s: n / chars for s, n in sorted(scripts.items(), key=lambda kv: -kv[1])},
        "reference": ref["reference"],
        "english_tokens_per_char": english_tokens / len(english) if english_tokens else None,
        "english_reference_tokens_per_char": ref["english_reference_tokens"] / len(english),
    }
