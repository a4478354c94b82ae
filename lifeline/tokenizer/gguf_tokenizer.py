"""The tokenizer a GGUF file carries, as llama.cpp runs `tokenizer.ggml.*`: SentencePiece-BPE
over scores (tokenizer model 'llama') or byte-level BPE over ranked merges ('gpt2',
lifeline.tokenizer.bpe)."""
from __future__ import annotations

import itertools
import os
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lifeline.tokenizer.base import Tokenizer
from lifeline.tokenizer.bpe import ByteLevelBPE, byte_decoder, decode_token_text
from lifeline.tokenizer.specials import SpecialSplitter, has_placeholders, unescape
from lifeline.tokenizer.spm import score_ranks, spm_merge

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
END_OF_TURN_TEXTS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|endoftext|>", "<|eom_id|>")
SPACE = "\u2581"
MODELS = ("llama", "gpt2")


@dataclass(slots=True)
class GGUFVocab:
    """What a GGUF file says about its tokenizer (defaults as llama.cpp's for its `model`)."""

    tokens: list[str]
    scores: Sequence[float]
    token_types: Sequence[int]
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unk_token_id: int | None = None
    pad_token_id: int | None = None
    add_bos: bool = True
    add_eos: bool = False
    add_space_prefix: bool = True
    model: str = "llama"
    """'llama' (SentencePiece-BPE) or 'gpt2' (byte-level BPE)."""
    pre: str | None = None
    """The pre-tokenizer of a 'gpt2' vocabulary (`tokenizer.ggml.pre`)."""
    merges: list[str] = field(default_factory=list)
    """A 'gpt2' vocabulary's merges, 'LEFT RIGHT', by rank."""

    def __post_init__(self):
        if self.model not in MODELS:
            raise NotImplementedError(f"GGUF tokenizer model {self.model!r}: only "
                                      f"{', '.join(map(repr, MODELS))}")
        n = len(self.tokens)
        if not self.scores:
            self.scores = [0.0] * n
        if not self.token_types:
            self.token_types = [NORMAL] * n
        if len(self.scores) != n or len(self.token_types) != n:
            raise ValueError(f"{n} tokens but {len(self.scores)} scores, "
                             f"{len(self.token_types)} token types")
        for name in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < n:
                setattr(self, name, None)
        if self.add_bos and self.bos_token_id is None:
            raise ValueError("add_bos_token is set but the vocabulary has no BOS token")

    @classmethod
    def from_reader(cls, reader: Any) -> GGUFVocab:
        """From a GGUF reader that is already open (`lifeline.model.gguf_reader.GGUFReader`, or
        gguf-py's `GGUFReader`: the same fields)."""
        def get(key: str, default: Any = None) -> Any:
            field = reader.fields.get(f"tokenizer.ggml.{key}")
            return default if field is None else field.contents()

        model = get("model", "llama")
        spm = model == "llama"  # llama.cpp's defaults differ: SPM adds a BOS and a space
        return cls(
            tokens=get("tokens"), scores=get("scores", []), token_types=get("token_type", []),
            bos_token_id=get("bos_token_id"), eos_token_id=get("eos_token_id"),
            unk_token_id=get("unknown_token_id"), pad_token_id=get("padding_token_id"),
            add_bos=bool(get("add_bos_token", spm)), add_eos=bool(get("add_eos_token", False)),
            add_space_prefix=bool(get("add_space_prefix", spm)), model=model,
            pre=get("pre"), merges=get("merges", []) if model == "gpt2" else [],
        )


class GGUFTokenizer(Tokenizer):
    """Ids as llama.cpp gives them for `llama_tokenize(text, add_special, parse_special=True)`."""

    def __init__(self, vocab: GGUFVocab):
        self.vocab = vocab
        self.bos_token_id = vocab.bos_token_id
        self.eos_token_id = vocab.eos_token_id
        self.pad_token_id = vocab.pad_token_id
        self.add_bos = vocab.add_bos
        self.vocab_size = len(vocab.tokens)
        self._ids = {text: i for i, text in enumerate(vocab.tokens)}
        # Flat arrays, not lists of Python objects: Gemma 3's 262,144 scores, token types and
        # token bytes took ~25 MB more as lists (docs/performance.md)
        self._ranks = score_ranks(vocab.scores)
        vocab.scores = array("f", vocab.scores)  # float32, as the file stores them
        vocab.token_types = array("B", vocab.token_types)
        self._bpe = (ByteLevelBPE(self._ids, vocab.merges, vocab.pre or "default")
                     if vocab.model == "gpt2" else None)
        normal = _bpe_normal_bytes() if self._bpe else _spm_normal_bytes
        pairs = zip(vocab.tokens, vocab.token_types, strict=True)
        pieces = [_token_bytes(text, kind, normal) for text, kind in pairs]
        self._blob = b"".join(pieces)
        """Every token's bytes, one after another; token i's are `_blob[_ends[i-1]:_ends[i]]`."""
        self._ends = array("Q", itertools.accumulate(map(len, pieces)))
        del pieces
        self._byte_ids = [self._byte_id(b) for b in range(256)]
        types = vocab.token_types
        self.special_token_ids = frozenset(i for i, k in enumerate(types)
                                           if k in (UNKNOWN, CONTROL))
        self.eos_token_ids = frozenset(self._end_of_turn_ids())
        specials = [(vocab.tokens[i], i) for i, k in enumerate(types)
                    if k in (UNKNOWN, CONTROL, USER_DEFINED)]
        self._split_all = SpecialSplitter(specials)
        self._split_user = SpecialSplitter((t, i) for t, i in specials if types[i] == USER_DEFINED)
        self._split_control = SpecialSplitter((t, i) for t, i in specials
                                              if types[i] != USER_DEFINED)

    @classmethod
    def from_gguf_reader(cls, reader: Any) -> GGUFTokenizer:
        return cls(GGUFVocab.from_reader(reader))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> GGUFTokenizer:
        """Through Lifeline's one-pass reader (lifeline.model.gguf_reader; tests/test_gguf_dequant.py
        holds it to gguf-py's field by field): Gemma 3's 262,144-token tokenizer loads in ~1 s,
        where gguf-py's reader took ~20 s (docs/performance.md)."""
        from lifeline.model.gguf_reader import GGUFReader

        return cls.from_gguf_reader(GGUFReader(os.fspath(path)))

    def _byte_id(self, byte: int) -> int | None:
        token_id = self._ids.get(f"<0x{byte:02X}>")
        if token_id is None:
            token_id = self._ids.get(chr(byte), self.vocab.unk_token_id)
        return token_id

    def _end_of_turn_ids(self) -> list[int]:
        ids = [self._ids[t] for t in END_OF_TURN_TEXTS if t in self._ids]
        return ids if self.eos_token_id is None else [self.eos_token_id, *ids]

    def encode(self, text: str, add_special_tokens: bool = True,
               parse_special: bool = True) -> list[int]:
        """With `parse_special=False`, control tokens written in the text are tokenized as text;
        user-defined ones (e.g. '\\n', runs of spaces) are matched whole either way."""
        splitter = self._split_all if parse_special else self._split_user
        return self._encode_pieces(splitter.split(text), add_special_tokens)

    def escape_specials(self, text: str) -> str:
        """`text` (a request's string, before a template renders it) with the spelling of every
        control token replaced by placeholders: see `encode_rendered`."""
        return self._split_control.escape(text)

    def encode_rendered(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A rendered chat prompt: special tokens where the template wrote them; the text between
        them, placeholders mapped back, as text (`parse_special=False`). Without placeholders
        this is `encode(text, add_special_tokens)`."""
        if not has_placeholders(text):
            return self.encode(text, add_special_tokens)
        pieces: list[str | int] = []
        for piece in self._split_all.split(text):
            pieces += [piece] if isinstance(piece, int) else self._split_user.split(unescape(piece))
        return self._encode_pieces(pieces, add_special_tokens)

    def _encode_pieces(self, pieces: list[str | int], add_special_tokens: bool) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens and self.add_bos else []
        prev_special = True
        for piece in pieces:
            if isinstance(piece, int):
                ids.append(piece)
                prev_special = True
                continue
            if self.vocab.add_space_prefix and prev_special:
                piece = " " + piece
            ids += self._bpe.encode(piece) if self._bpe else self._encode_raw(
                piece.replace(" ", SPACE))
            prev_special = False
        if add_special_tokens and self.vocab.add_eos and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids

    def _encode_raw(self, text: str) -> list[int]:
        ids: list[int] = []
        for sym in spm_merge(text, self._ids, self._ranks):
            token_id = self._ids.get(sym)
            if token_id is not None:
                ids.append(token_id)
            else:
                ids += [self._byte_ids[b] for b in sym.encode()]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int], skip_special_tokens: bool = False) -> bytes:
        """llama.cpp's detokenize: with `skip_special_tokens`, a leading BOS and every control
        token are dropped; with `add_space_prefix` the first token loses its leading space."""
        ids = list(ids)
        if skip_special_tokens and ids and ids[0] == self.bos_token_id:
            ids = ids[1:]
        skip = self.special_token_ids if skip_special_tokens else frozenset()
        blob, ends = self._blob, self._ends
        pieces = [b"" if i in skip else blob[ends[i - 1] if i else 0:ends[i]] for i in ids]
        if self.vocab.add_space_prefix and pieces and pieces[0][:1] == b" ":
            pieces[0] = pieces[0][1:]
        return b"".join(pieces)

    def token_to_piece(self, token_id: int) -> str:
        return self.vocab.tokens[token_id]

    def token_to_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise IndexError(f"token id {token_id} out of range")
        return self._blob[self._ends[token_id - 1] if token_id else 0:self._ends[token_id]]

    def token_type(self, token_id: int) -> int:
        return self.vocab.token_types[token_id]


def _spm_normal_bytes(text: str) -> bytes:
    return text.replace(SPACE, " ").encode()


def _bpe_normal_bytes() -> Callable[[str], bytes]:
    decoder = byte_decoder()
    return lambda text: decode_token_text(text, decoder)


def _token_bytes(text: str, token_type: int, normal: Callable[[str], bytes]) -> bytes:
    if token_type == NORMAL:
        return normal(text)
    if token_type == BYTE:
        return bytes([int(text[3:5], 16)])
    if token_type in (UNKNOWN, CONTROL, USER_DEFINED):
        return text.encode()
    return b""  # unused and undefined tokens print nothing in llama.cpp
