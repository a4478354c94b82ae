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
    row_order: torch.Tensor | None = None
    """Where the model's rows are not the file's order (Llama's q/k, which llama.cpp's converter
    interleaves for its RoPE): model row i is file row `row_order[i]`. Layer weights only."""

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

    def dequantized(self) -> torch.Tensor:
        """The whole tensor in float32, rows in the model's order: the dequantizer's values."""
        ids = self.row_order if self.row_order is not None else torch.arange(self.raw.shape[0])
        return self.rows(ids)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def release_pages(self) -> None:
        """Drop this tensor's file pages from the process's resident memory (`MADV_DONTNEED`
        on the read-only mapping: they stay in the page cache, and a later read faults them
        back), once a repacked copy holds its values. Nothing where the call is missing."""
        import ctypes
        import mmap

        page = mmap.PAGESIZE
        start = self.raw.data_ptr() // page * page
        end = self.raw.data_ptr() + self.raw.numel()
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                         ctypes.c_int(mmap.MADV_DONTNEED))
        except (AttributeError, OSError):
            pass

    def in_model_order(self) -> torch.Tensor:
        """`raw` with its rows in the model's order: the file's own view where they are, else a
        copy of the quantized bytes (never of float values)."""
        return self.raw if self.row_order is None else self.raw[self.row_order].contiguous()


class GGUFLinear(nn.Module):
    """`nn.Linear` computed straight from a GGUF tensor's quantized blocks
    (`lifeline_gguf::gguf_linear`, lifeline/csrc/gguf_ops.cpp): the activations quantized to
    int8 in blocks of 32 (llama.cpp's Q8_0 for activations) and dotted with the blocks as
    stored, or, from `GEMM_MIN_ROWS` rows (a prefill, a large batch), the weight decoded into a
    transient buffer for PyTorch's GEMM (`configure_gemm`). The weight's bytes are the file's
    (a view of its memory map) or, for stacked or reordered rows, a copy of them; Q4_0, Q4_1,
    Q4_K and Q5_0 are repacked, eight rows interleaved (`lifeline_gguf::gguf_repack`: the
    same values in a layout whose one-row product runs at the memory's pace, where the dot
    kernels spend ~10 cycles of scalar scale work a block), unless `repack=False`."""

    def __init__(self, raw: torch.Tensor, qtype: int, in_features: int,
                 bias: torch.Tensor | None = None, repack: bool = True):
        super().__init__()
        register_fakes()
        self.out_features = raw.shape[0]
        self.stored_qtype = int(qtype)
        """The GGML type of the file's blocks (`qtype` is the repacked layout's where repacked)."""
        packed = torch.ops.lifeline_gguf.gguf_repacked_type(qtype) if repack else -1
        if packed >= 0:
            raw, qtype = torch.ops.lifeline_gguf.gguf_repack(raw, qtype, in_features), packed
        self.register_buffer("raw", raw, persistent=False)
        self.qtype, self.in_features = int(qtype), in_features
        self.bias = bias

    @classmethod
    def stack(cls, parts: list[StoredTensor], bias: torch.Tensor | None = None) -> GGUFLinear:
        """One layer over several stored tensors' rows (q/k/v, gate/up: the same input), which
        must share a block type."""
        raws = [part.in_model_order() for part in parts]
        raw = raws[0] if len(raws) == 1 else torch.cat(raws)
        layer = cls(raw, parts[0].qtype, parts[0].cols, bias)
        layer.parts = tuple(parts)  # the file's tensors, until the weight format releases them
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.lifeline_gguf.gguf_linear(
            x.reshape(-1, shape[-1]).float().contiguous(), self.raw, self.qtype, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        layout = "as stored" if self.qtype == self.stored_qtype else "8 rows interleaved"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={GGMLQuantizationType(self.stored_qtype).name} ({layout})")


GEMM_MIN_ROWS_AMX = 8
"""Rows from which a GGUF product decodes its weight for PyTorch's bfloat16 GEMM on a CPU with
AMX (measured on Sapphire Rapids, docs/performance.md)."""
GEMM_MIN_ROWS = 32
"""The same on any other CPU (bfloat16 where it has AVX512-BF16, float32 where not), whose
decoded GEMM is slower: the kernels reading the blocks win up to here (measured on an AVX-512
AMD EPYC, docs/performance.md)."""


def amx() -> bool:
    """Whether this CPU has AMX tiles (oneDNN's int8 and bfloat16 GEMMs run on them)."""
    return torch.cpu._is_amx_tile_supported()


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX512-BF16), as /proc/cpuinfo
    says; False where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def configure_gemm(min_rows: int | None = None, bf16: bool | None = None) -> tuple[int, bool]:
    """Set when GGUF products take the GEMM road (`GGUFLinear`): by default in bfloat16 where
    the CPU has native bfloat16, float32 where not, from `GEMM_MIN_ROWS_AMX` rows where it has
    AMX, `GEMM_MIN_ROWS` where not; `min_rows=0` never. Returns what was set."""
    if bf16 is None:
        bf16 = native_bf16()
    if min_rows is None:
        min_rows = GEMM_MIN_ROWS_AMX if bf16 and amx() else GEMM_MIN_ROWS
    torch.ops.lifeline_gguf.gguf_set_gemm(min_rows, bf16)
    return min_rows, bf16


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
