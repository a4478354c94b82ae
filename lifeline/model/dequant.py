"""Vectorized torch dequantization of GGML tensor bytes (layouts from llama.cpp's ggml-quants.c)."""
from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T


class UnsupportedTensorType(ValueError):
    """A tensor is stored in a GGML type we cannot dequantize."""

    def __init__(self, name: str, qtype: T):
        super().__init__(f"tensor {name!r} has unsupported GGML type {qtype.name}")
        self.name = name
        self.qtype = qtype


def as_torch(data: np.ndarray) -> torch.Tensor:
    """Zero-copy view of a (possibly read-only, memory-mapped) array; never written to."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 scale at byte `start` of each block, as a float32 column."""
    return blocks[:, start:start + 2].view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 2, k]: low nibbles first, then high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def _bits(qh: torch.Tensor, count: int, width: int = 1) -> torch.Tensor:
    """[..., k] bytes -> [..., count, k]: field i holds bits [i*width, (i+1)*width) of each byte."""
    shifts = torch.arange(0, count * width, width, dtype=torch.uint8).view(count, 1)
    return (qh.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:]).reshape(-1, 32).float().sub_(8)
    return q.mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    """d * q + m: an fp16 scale and an fp16 minimum, then 32 unsigned nibbles."""
    q = _nibbles(b[:, 4:]).reshape(-1, 32).float()
    return q.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    high = _bits(b[:, 2:6], 8).transpose(1, 2).reshape(-1, 32)
    q = (_nibbles(b[:, 6:]).reshape(-1, 32) | (high << 4)).float().sub_(16)
    return q.mul_(_f16(b, 0))


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).float().mul_(_f16(b, 0))


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit (scale, min) pairs packed in the 12 scale bytes of Q4_K and Q5_K."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scale = torch.cat((a & 63, (c & 0x0F) | ((a >> 6) << 4)), dim=1)
    minimum = torch.cat((b & 63, (c >> 4) | ((b >> 6) << 4)), dim=1)
    return scale.float(), minimum.float()


def _k_apply(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """d * scale * q - dmin * min over eight 32-value sub-blocks."""
    scale, minimum = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * scale).unsqueeze(-1)
    dm = (_f16(b, 2) * minimum).unsqueeze(-1)
    return q.float().mul_(d).sub_(dm).reshape(-1, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_apply(b, _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    low = _nibbles(b[:, 48:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    return _k_apply(b, low | (_bits(b[:, 16:48], 8) << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    low = _nibbles(b[:, :128].reshape(-1, 2, 64)).reshape(-1, 2, 128)
    high = _bits(b[:, 128:192].reshape(-1, 2, 32), 4, width=2).reshape(-1, 2, 128)
    q = (low | (high << 4)).view(-1, 16, 16).float().sub_(32)
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)
    return q.mul_(d).reshape(-1, 256)


BLOCK_KERNELS: dict[T, Callable[[torch.Tensor], torch.Tensor]] = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q8_0: _q8_0,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}
CHUNK_VALUES = 1 << 22
"""Values dequantized at a time: a vocabulary-sized tensor's temporaries (its blocks widened,
scaled, offset) stay a few chunks of 16 MiB instead of several copies of the whole (~1.4 GB
at the start on Gemma 3 270M's 262k x 640 embedding)."""
FLOAT_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
SUPPORTED_TYPES = frozenset((*FLOAT_TYPES, *BLOCK_KERNELS))


def dequantize(data: np.ndarray, qtype: T, name: str = "<tensor>") -> torch.Tensor:
    """Float32 values of a tensor's data as GGUFReader exposes it (typed for F32/F16, bytes
    [..., bytes_per_row] otherwise), shaped [..., values_per_row]; never a view of `data`."""
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(name, qtype)
    raw = as_torch(np.ascontiguousarray(data).view(np.uint8))
    if qtype in FLOAT_TYPES:
        return raw.view(FLOAT_TYPES[qtype]).to(torch.float32, copy=True)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, row_bytes = raw.shape[:-1], raw.shape[-1]
    per_row = row_bytes // type_size * block_size
    flat = raw.reshape(-1, row_bytes)
    out = torch.empty(flat.shape[0], per_row, dtype=torch.float32)
    step = max(1, CHUNK_VALUES // per_row)
    for start in range(0, flat.shape[0], step):  # the kernels' temporaries are a chunk's
        part = flat[start:start + step]
        out[start:start + step] = BLOCK_KERNELS[qtype](part.reshape(-1, type_size)).view(
            -1, per_row)
    return out.reshape(*rows, per_row)
