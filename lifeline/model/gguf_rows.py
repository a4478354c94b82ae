"""Rows of a GGUF tensor read where the file stores them, in its own quantized blocks: the
input embedding and the LM head's exact rescoring (`lifeline.model.weight_format.rescore`)
without a float32 copy of the vocabulary (262,144 x 640 x 4 bytes = 671 MB for Gemma 3 270M,
whose file holds the same rows as 178 MB of Q8_0 blocks).

The file is memory-mapped (`GGUFFile`): a row's pages are read when a token first needs them,
and the kernel (`lifeline_gguf::gguf_get_rows`, lifeline/csrc/gguf_ops.cpp) decodes exactly the
values the dequantizer would (tests/test_gguf_kernels.py), so the rows, and every logit
rescored from them, are the float32 path's own, bit for bit."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from lifeline.model.native import gguf_ops

KERNEL_TYPES = frozenset(GGMLQuantizationType[n] for n in (
    "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))
"""The block types the GGUF kernels decode."""


@dataclass(frozen=True)
class StoredTensor:
    """A 2-D GGUF tensor as its file stores it: `raw` [rows, row_bytes] (uint8, a view of the
    memory-mapped file: never written), its GGML type and its values per row."""
    raw: torch.Tensor
    qtype: int
    cols: int

    @classmethod
    def from_file(cls, data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]
                  ) -> StoredTensor | None:
        """The stored tensor, or None where the kernels cannot read it (a float type, another
        block type, not 2-D, or the kernels not built here)."""
        if qtype not in KERNEL_TYPES or len(shape) != 2 or not gguf_ops():
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only memory map
            raw = torch.from_numpy(data.reshape(shape[0], -1))
        return cls(raw, int(qtype), shape[1])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 rows `ids` (any shape of int64), shaped [*ids.shape, cols]."""
        return torch.ops.lifeline_gguf.gguf_get_rows(self.raw, self.qtype, ids, self.cols)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()


class StoredEmbedding(nn.Module):
    """`nn.Embedding` over a `StoredTensor`: each lookup decodes its rows from the file."""

    def __init__(self, stored: StoredTensor):
        super().__init__()
        register_fakes()
        self.register_buffer("raw", stored.raw, persistent=False)
        self.qtype, self.embedding_dim = stored.qtype, stored.cols
        self.num_embeddings = stored.raw.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.lifeline_gguf.gguf_get_rows(self.raw, self.qtype, ids, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, "
                f"type={GGMLQuantizationType(self.qtype).name} (as stored)")


def _register_fakes() -> None:
    """Shapes for the compiler: the input embedding runs inside the compiled forward."""
    @torch.library.register_fake("lifeline_gguf::gguf_get_rows")
    def _(raw: torch.Tensor, qtype: int, ids: torch.Tensor, cols: int) -> torch.Tensor:
        return raw.new_empty((*ids.shape, cols), dtype=torch.float32)

    @torch.library.register_fake("lifeline_gguf::gguf_linear")
    def _(x: torch.Tensor, raw: torch.Tensor, qtype: int, out_features: int) -> torch.Tensor:
        return x.new_empty((x.shape[0], out_features))


_fakes_registered = False


def register_fakes() -> None:
    """Register the kernels' shape functions once (after the library is loaded)."""
    global _fakes_registered
    if not _fakes_registered and gguf_ops():
        _register_fakes()
        _fakes_registered = True
