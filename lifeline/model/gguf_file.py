"""A memory-mapped GGUF file: metadata as plain Python values, tensors dequantized to torch."""
from __future__ import annotations

import gc
import mmap
import os
import struct
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from lifeline.model.dequant import SUPPORTED_TYPES, UnsupportedTensorType, dequantize
from lifeline.model.gguf_reader import GGUFReader
from lifeline.model.gguf_reader import Tensor as ReaderTensor

__all__ = ["CorruptGGUF", "GGUFFile", "UnsupportedTensorType"]


class CorruptGGUF(ValueError):
    """A file that is not a whole GGUF file: cut short, or its header or tensor table damaged."""

# Vocabulary-sized arrays: decoding them costs seconds, and the tokenizer reads them itself.
TOKENIZER_ARRAYS = frozenset((
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
))


class GGUFFile:
    """Tensor shapes are in PyTorch order: GGUF's [ne0, ne1] is torch's [ne1, ne0]."""

    def __init__(self, path: str | os.PathLike[str], skip_tokenizer: bool = False):
        """`skip_tokenizer`: step over the vocabulary-sized arrays (`TOKENIZER_ARRAYS`) without
        decoding them, for a caller that has the tokenizer already (lifeline.tokenizer.cache)."""
        self.path = os.fspath(path)
        try:
            self.reader = GGUFReader(self.path,
                                     skip=tuple(TOKENIZER_ARRAYS) if skip_tokenizer else ())
        except (ValueError, IndexError, OverflowError, struct.error, UnicodeDecodeError) as exc:
            raise CorruptGGUF(f"{self.path}: truncated or corrupt GGUF file ({exc})") from None
        if self.reader.byte_order != "<":
            raise ValueError(f"{self.path}: a big-endian GGUF file: its blocks are not in the "
                             "byte order Lifeline's kernels read (convert it little-endian)")
        self.metadata: dict[str, Any] = {
            key: field.contents()
            for key, field in self.reader.fields.items()
            if key not in TOKENIZER_ARRAYS
        }
        self._tensors: dict[str, ReaderTensor] = {t.name: t for t in self.reader.tensors}

    def check(self) -> None:
        """Before any weight is read: every tensor of a type we can compute with
        (`UnsupportedTensorType` names the first that is not, and its type) and every tensor's
        bytes inside the file (`CorruptGGUF` otherwise)."""
        size = os.path.getsize(self.path)
        for name, tensor in self._tensors.items():
            if tensor.tensor_type not in SUPPORTED_TYPES:
                raise UnsupportedTensorType(name, tensor.tensor_type)
            end = int(tensor.data_offset) + int(tensor.n_bytes)
            if end > size:
                raise CorruptGGUF(f"{self.path}: truncated or corrupt GGUF file (tensor "
                                  f"{name!r} ends at byte {end:,}, the file has {size:,})")

    def drop_tokenizer_fields(self) -> None:
        """Forget the reader's parsed vocabulary arrays once the tokenizer has read them:
        `GGUFReader` holds a NumPy view per token string (~0.7 GB on Gemma 3's 262k), and a
        load that kept them through the weights' dequantization peaked that much higher."""
        for key in TOKENIZER_ARRAYS:
            self.reader.fields.pop(key, None)
        gc.collect()

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def _tensor(self, name: str) -> ReaderTensor:
        if name not in self._tensors:
            raise KeyError(f"no tensor {name!r} in {self.path}")
        return self._tensors[name]

    def tensor_type(self, name: str) -> GGMLQuantizationType:
        return self._tensor(name).tensor_type

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensor(name).shape.tolist()))

    def raw(self, name: str) -> tuple[np.ndarray, GGMLQuantizationType, tuple[int, ...]]:
        """The stored bytes (uint8, [..., bytes_per_row], memory-mapped: do not write), type, shape."""
        tensor = self._tensor(name)
        return tensor.data.view(np.uint8), tensor.tensor_type, self.tensor_shape(name)

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        data, qtype, shape = self.raw(name)
        return dequantize(data, qtype, name).reshape(shape).to(dtype)

    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident memory once its tensors are
        read (`MADV_DONTNEED` on the read-only mapping: they stay in the page cache, and a
        later read, such as an embedding row read as stored, faults its page back). Without
        it the whole file, read once to dequantize, counts in the server's RSS for good."""
        mapping = getattr(self.reader.data, "_mmap", None)
        if mapping is not None and hasattr(mapping, "madvise"):
            try:
                mapping.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):
                pass

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, {self.architecture}, {len(self._tensors)} tensors)"
