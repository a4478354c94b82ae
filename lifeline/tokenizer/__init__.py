"""Tokenizers: a GGUF file's vocabulary (as llama.cpp runs it) or a Hugging Face tokenizer.json."""
from __future__ import annotations

import os
from pathlib import Path

from lifeline.tokenizer.base import Tokenizer
from lifeline.tokenizer.detokenizer import IncrementalDetokenizer
from lifeline.tokenizer.gguf_tokenizer import GGUFTokenizer, GGUFVocab
from lifeline.tokenizer.hf_tokenizer import HFTokenizer

__all__ = [
    "GGUFTokenizer",
    "GGUFVocab",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Tokenizer",
    "load_tokenizer",
]


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """A `.gguf` file, or a directory holding `tokenizer.json`."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return GGUFTokenizer.from_file(path)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return HFTokenizer(path)
    raise ValueError(f"{path}: neither a .gguf file nor a directory with tokenizer.json")
