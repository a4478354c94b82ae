"""A Hugging Face tokenizer directory (`tokenizer.json` and its configs), run by `tokenizers`."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Encoding
from tokenizers import Tokenizer as BackendTokenizer

from lifeline.tokenizer.base import Tokenizer
from lifeline.tokenizer.bpe import byte_decoder
from lifeline.tokenizer.gguf_tokenizer import END_OF_TURN_TEXTS, SPACE
from lifeline.tokenizer.specials import SpecialSplitter, has_placeholders, unescape

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class HFTokenizer(Tokenizer):
    """Encodes and decodes as transformers' `PreTrainedTokenizerFast` does for the same files.

    BOS/EOS are added by `tokenizer.json`'s post-processor alone, as transformers 5 does: an
    `add_bos_token` in tokenizer_config.json does not change it, and `add_bos` reports what the
    post-processor does. `clean_up_tokenization_spaces` is not applied (it would make streamed
    text unstable)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._tk = BackendTokenizer.from_file(str(self.path / "tokenizer.json"))
        config = _read_json(self.path / "tokenizer_config.json")
        model = _read_json(self.path / "config.json")
        generation = _read_json(self.path / "generation_config.json")
        self.bos_token_id = self._special_id(config.get("bos_token"), model.get("bos_token_id"))
        eos_ids = [*_id_list(self._special_id(config.get("eos_token"), None)),
                   *_id_list(generation.get("eos_token_id")), *_id_list(model.get("eos_token_id"))]
        self.eos_token_id = eos_ids[0] if eos_ids else None
        self.pad_token_id = self._special_id(config.get("pad_token"), model.get("pad_token_id"))
        self.add_bos = self._adds_bos()
        self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)
        added = self._tk.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        self.special_token_ids = frozenset(i for i, t in added.items() if t.special)
        self._split_special = SpecialSplitter((t.content, i) for i, t in added.items()
                                              if t.special)
        self._tk_text = BackendTokenizer.from_str(self._tk.to_str())
        self._tk_text.encode_special_tokens = True
        turn_ids = [i for t in END_OF_TURN_TEXTS if (i := self._tk.token_to_id(t)) is not None]
        self.eos_token_ids = frozenset(eos_ids + turn_ids)
        self._byte_level = "ByteLevel" in json.dumps(json.loads(self._tk.to_str()).get("decoder"))
        self._byte_decoder = byte_decoder()

    def _special_id(self, token: Any, fallback: Any) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        token_id = self._tk.token_to_id(token) if isinstance(token, str) else None
        fallbacks = _id_list(fallback)
        return fallbacks[0] if token_id is None and fallbacks else token_id

    def _adds_bos(self) -> bool:
        ids = self._tk.encode("a", add_special_tokens=True).ids
        return self.bos_token_id is not None and ids[:1] == [self.bos_token_id] \
            and len(ids) > len(self._tk.encode("a", add_special_tokens=False).ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def escape_specials(self, text: str) -> str:
        """`text` (a request's string, before a template renders it) with the spelling of every
        special token replaced by placeholders: see `encode_rendered`."""
        return self._split_special.escape(text)

    def encode_rendered(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A rendered chat prompt: special tokens where the template wrote them; the text between
        them, placeholders mapped back, encoded with `encode_special_tokens` (specials as text).
        Without placeholders this is `encode(text, add_special_tokens)`. (On this path an added
        token's lstrip/rstrip is not applied.)"""
        if not has_placeholders(text):
            return self.encode(text, add_special_tokens)
        parts = []
        for piece in self._split_special.split(text):
            if isinstance(piece, int):
                parts.append(self._tk.encode(self._tk.id_to_token(piece),
                                             add_special_tokens=False))
            else:
                parts.append(self._tk_text.encode(unescape(piece), add_special_tokens=False))
        merged = Encoding.merge(parts, growing_offsets=True)
        return self._tk.post_process(merged, None, add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_piece(self, token_id: int) -> str:
        return self._tk.id_to_token(token_id)

    def token_to_bytes(self, token_id: int) -> bytes:
        piece = self._tk.id_to_token(token_id)
        if token_id in self._added_ids:
            return piece.encode()
        if self._byte_level and all(ch in self._byte_decoder for ch in piece):
            return bytes(self._byte_decoder[ch] for ch in piece)
        if match := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace(SPACE, " ").encode()


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []
