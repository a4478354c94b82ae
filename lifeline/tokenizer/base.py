"""The tokenizer contract every backend (GGUF vocabulary, tokenizer.json) fulfils."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


class Tokenizer(ABC):
    """Text to ids and back. Ids that end a generation are in `eos_token_ids`."""

    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: frozenset[int]
    pad_token_id: int | None
    add_bos: bool
    vocab_size: int
    special_token_ids: frozenset[int]

    @abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids for `text`; with `add_special_tokens` a BOS is prepended when the model wants one.
        Special tokens written in the text (e.g. `<start_of_turn>`) become their single ids."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids`. Invalid UTF-8 becomes U+FFFD."""

    @abstractmethod
    def token_to_piece(self, token_id: int) -> str:
        """The vocabulary entry as stored (e.g. '▁the', '<0x0A>')."""

    @abstractmethod
    def token_to_bytes(self, token_id: int) -> bytes:
        """The bytes this token contributes to decoded text (specials: their text)."""
