"""Weight formats a loaded model can run in: float32 as loaded, a bf16 or int8 LM head, int8
everywhere (`int8-all`, the command line's default), or every layer from a GGUF file's own
blocks (`gguf`: `_as_stored`, lifeline.model.gguf_rows.GGUFLinear).

The LM head is most of a float32 decode step's bytes and FLOPs (262,144 x 640 for Gemma 3 270M;
see docs/performance.md). `int8-all` also runs every layer projection in int8 with per-row
activation scales (+1.66% perplexity on the essay; with one activation scale per call instead,
57% greedy agreement with float32 and perplexity 20.2 -> 38). Quality and speed of each
format: `benchmarks/weight_formats.py`, recorded in docs/performance.md.

- `bf16`: a bfloat16 copy of the head (oneDNN; fast where the CPU has AVX512-BF16,
  ../shared/PEERS.md found bf16 slower than float32 at batch > 1 on an AVX2 machine without
  it). Its error is mostly the logits' own rounding to bfloat16 (steps of 1/16 between 8 and 16).
- `int8`: fbgemm's int8 GEMM. Weights: int8, one scale per output row. Activations: quantized
  on each call with one scale and offset per row (fbgemm's dynamic linear takes one (scale,
  zero point) per call, so each row is mapped onto [-1, 1] by its own min and max first and the
  logits mapped back, `y = half * W x' + mid * W 1`; all 8 bits where the kernel cannot
  saturate, see `fbgemm_saturates`). The final hidden state has channels 10-20x larger than the
  median one, so int8 logits can be off by ~1 and swap near-top tokens.

A lone row (one decode at batch 1) goes straight to fbgemm, whose per-call scale is then the
row's own: same precision, a tenth of the kernels, but not bit for bit the batched result.
Batches of rows go through oneDNN's int8 GEMM instead where this PyTorch has it and it does not
saturate (`onednn_int8`): the same per-row scales, quantized by us to u8 around 128, and faster
from a few rows up (docs/performance.md). The head keeps one copy (`one_copy`): a second copy of
262,144 rows costs more memory than it saves time; which one is the CPU's (`head_onednn`).
`int8-all` stacks the projections that share an input (the family's `fused` projections, lifeline.model.registry: q/k/v, gate/up) into one GEMM each
(`FusedProjections`) and drops their float32 copies. It also rotates every projection's input
by a block Hadamard matrix before quantizing it (`Int8Linear(rotate=)`; for o_proj the rotation
is folded into the value and output weights; the head's input is rotated too): the essay's
perplexity +1.66% -> -0.04% of float32's, greedy agreement 91.6% -> 95.6% (with the flash
prefill kernel), because a row's few large channels no longer set the scale of all its others.

Both head formats then recompute the `RESCORE_TOP` highest logits of each row from the float32
weight rows (64 x 640 per row, against 262,144 x 640), so every logit that can win is exact;
the others stay approximations. Without it, int8 agrees with float32's argmax at 96% of the essay's
positions and parts from llama.cpp's greedy text at a clear preference on one fixture prompt.
"""
from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lifeline.model.gguf_rows import (
    GGUFLinear,
    StoredEmbedding,
    StoredTensor,
    amx,
    configure_gemm,
    native_bf16,
)
from lifeline.model.layers.linear import FusedProjections
from lifeline.model.registry import family_of

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int8-all", "gguf", "gguf-int8")
RESCORE_TOP = 64
"""Tokens per row whose logits are recomputed in float32."""
ROTATE_BLOCK = 32
"""Hadamard block `int8-all` rotates activations by at run time (`Int8Linear`): on the essay,
32 and 64 measured the same quality (+0.4-0.9% perplexity, 96-97% greedy agreement), 256 no
better, and a block's cost grows with its size (docs/performance.md)."""


BF16_WIDEN_ROWS = 32
"""Rows from which `BF16Linear` widens its weight to float32 slice by slice on a CPU without
native bfloat16 (`bf16_widened`): faster from a few dozen rows, slower for a few
(docs/performance.md, "bf16 head without bf16 arithmetic")."""
BF16_WIDEN_SLICE = 8192
"""Weight rows widened at a time (the float32 temporary is a slice's, not the head's)."""


class BF16Linear(nn.Module):
    """y = W x in bfloat16 (oneDNN), the top `RESCORE_TOP` in float32."""

    def __init__(self, linear: nn.Linear, rescore_top: int = RESCORE_TOP):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.register_buffer("weight_bf16", linear.weight.detach().to(torch.bfloat16))
        self.rescore_top = min(rescore_top, linear.weight.shape[0])
        self.widen_rows = 0 if native_bf16() else BF16_WIDEN_ROWS
        """Batches of this many rows or more take `bf16_widened` (0: never)."""

    def forward(self, x: torch.Tensor, with_argmax: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Logits; `with_argmax`: and their shortlist's proof (`shortlist_argmax`)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1]).float()
        if 0 < self.widen_rows <= x.shape[0] and x.device.type == "cpu" and \
                not torch.compiler.is_compiling():
            y = bf16_widened(x, self.weight_bf16)
        else:
            y = F.linear(x.to(torch.bfloat16), self.weight_bf16).float()
        y, argmax = rescore(y, x, self.weight.__getitem__, self.bias, self.rescore_top,
                            with_argmax)
        y = y.reshape(*shape[:-1], self.weight.shape[0])
        return (y, argmax) if with_argmax else y


def bf16_widened(x: torch.Tensor, weight: torch.Tensor, slice_rows: int = BF16_WIDEN_SLICE
                 ) -> torch.Tensor:
    """`F.linear(x.bfloat16(), weight).float()` for bfloat16 `weight` through float32 GEMMs:
    x rounded to bfloat16 and each slice of the weight widened (exact: a bfloat16 value is a
    float32 one, and so is the product of two), the sums rounded to bfloat16 as oneDNN's are.
    Only the order of the float32 additions differs. Where the CPU lacks bfloat16 arithmetic,
    oneDNN emulates it several times slower than float32 GEMM (`BF16_WIDEN_ROWS`)."""
    xb = x.to(torch.bfloat16).float()
    out = torch.empty(x.shape[0], weight.shape[0])
    for start in range(0, weight.shape[0], slice_rows):
        part = weight[start:start + slice_rows]
        torch.mm(xb, part.float().t(), out=out[:, start:start + part.shape[0]])
    return out.to(torch.bfloat16).float()


class Int8Linear(nn.Module):
    """y = W x through fbgemm's u8 x s8 GEMM (CPU only), the top `RESCORE_TOP` in float32.

    With `rotate` (a power of two dividing the input size), y = (W H)(H x) for H the
    block-diagonal Hadamard matrix of that block size (orthogonal and symmetric, so exact in
    real arithmetic): the rotation spreads a row's outlier channels over its block before the
    activations are quantized (QuaRot, arXiv:2404.00456), and is applied to each call's input."""

    def __init__(self, linear: nn.Linear, rescore_top: int = RESCORE_TOP, rotate: int = 0,
                 stored: StoredTensor | None = None, one_copy: bool = False,
                 batches_only: bool = False):
        """`one_copy`: one copy of the weights, not fbgemm's for lone rows and oneDNN's for
        batches: oneDNN's where `head_onednn()` (lone rows through it too), else fbgemm's (for
        batches too; the head: one copy of its 168 MB on Gemma 3, docs/performance.md).
        `batches_only`: the layer is called with two rows or more (`RowSplitLinear`: another
        copy takes lone rows): oneDNN's copy alone where the CPU has oneDNN's int8 GEMM."""
        super().__init__()
        # the float32 rows are kept only for rescoring, and not at all where the file's own
        # blocks can give them (`stored`: the same values, lifeline.model.gguf_rows)
        self.weight = linear.weight if rescore_top and stored is None else None
        self.stored = stored if rescore_top else None
        self.bias = linear.bias
        self.rotation = hadamard(rotate) if rotate else None
        self.native_rotation = self.rotation is not None and native_hadamard()
        """Whether `rotate_input` runs the fast transform on float32 CPU rows (decided here,
        outside any graph the compiler traces)."""
        self.onednn = onednn_int8() and (not one_copy or batches_only or head_onednn())
        one_copy = one_copy or batches_only
        weight = linear.weight.detach()
        values, scales, row_sums = _quantize_rows(weight, self.rotation)
        # One pack, even of a vocabulary-sized head: packed in row ranges on threads of their
        # own (fbgemm packs on one thread: 2.7 s for Gemma 3's head), its parts' outputs had to
        # be joined on every call, a copy of 16 MB that took 4.9 ms of Gemma 3's 16-user step
        # (docs/performance.md); the pack runs beside the other layers' conversions instead.
        self.packed = None if one_copy and self.onednn else \
            torch.ops.quantized.linear_prepack(_per_channel(values, scales), None)
        self.register_buffer("row_sums", row_sums.unsqueeze(0))
        self.reduce_range = fbgemm_saturates()
        if self.onednn:  # a second copy of the weights, in oneDNN's layout, for batches
            self.onednn_packed = torch.ops.onednn.qlinear_prepack(values, None)
            self.register_buffer("weight_scales", scales.float())
            self.register_buffer("weight_zeros", torch.zeros(len(scales), dtype=torch.long))
        self.rescore_top = min(rescore_top, weight.shape[0])
        self.out_features, self.in_features = weight.shape
        self.register_buffer("compile_handle", None, persistent=False)
        """Set by `lifeline.model.compiled.compile_forward`: compiled code calls fbgemm's GEMM
        with this layer's packed weights through an operator by this handle (Dynamo cannot
        trace fbgemm's packed weights), a one-element tensor so that it is an input of the
        graph, not a constant in it (a graph cached on disk serves another model)."""

    compile_op = None
    """That operator (`lifeline.model.compiled.int8_linear_op()`), set with the handle."""

    def forward(self, x: torch.Tensor, with_argmax: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Logits; `with_argmax`: and their shortlist's proof (`shortlist_argmax`)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1]).float()
        if self.compile_handle is not None and torch.compiler.is_compiling():
            y = self._traced_int8_matmul(x)
        else:
            y = self.int8_matmul(x)
        rows = self.stored.rows if self.stored is not None else (
            self.weight.__getitem__ if self.weight is not None else None)
        y, argmax = rescore(y, x, rows, self.bias, self.rescore_top, with_argmax)
        y = y.reshape(*shape[:-1], self.out_features)
        return (y, argmax) if with_argmax else y

    def int8_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """W x for float32 rows `x` [N, in], biasless and unrescored."""
        if self.onednn and (x.shape[0] > 1 or self.packed is None):
            return self.onednn_matmul(x)
        if self.rotation is not None:
            x = self.rotate_input(x)
        if x.shape[0] == 1:  # one row: fbgemm's own per-call scale is already per row
            return self._fbgemm(x)
        if self.rotation is not None:
            # Rotated rows are near-symmetric around 0: scale each by its largest magnitude
            # alone (no offset term, half the passes over x and y).
            amax = torch.maximum(x.amax(-1, keepdim=True), x.amin(-1, keepdim=True).neg_())
            amax = amax.clamp_min_(1e-12)
            y = self._fbgemm(x / amax)
            return y.mul_(amax)
        # amin + amax, not aminmax: the same values, far faster on the CPU in torch 2.13
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        mid, half = (hi + lo) / 2, ((hi - lo) / 2).clamp_min(1e-12)
        y = self._fbgemm((x - mid).div_(half))
        return y.mul_(half).addmm_(mid, self.row_sums)  # in place: the head's rows are 1 MiB

    def _fbgemm(self, x: torch.Tensor) -> torch.Tensor:
        """fbgemm's GEMM of float32 rows `x` (quantized per call) with the packed weights."""
        return torch.ops.quantized.linear_dynamic(x, self.packed, self.reduce_range)

    def onednn_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`int8_matmul` through oneDNN's u8 x s8 GEMM, which takes plain tensors: the compiler
        traces it whole and fuses the activations' quantization into the ops before it."""
        if self.rotation is not None:
            x = self.rotate_input(x)
        return self._per_row_scaled(x, self._onednn_gemm)

    def _per_row_scaled(self, x: torch.Tensor, gemm: Callable[[torch.Tensor], torch.Tensor]
                        ) -> torch.Tensor:
        """`gemm` (W z for rows z within [-1, 1]) of each row of `x` mapped onto [-1, 1] and
        mapped back: by its largest magnitude where rotated (near-symmetric rows), else by its
        min and max with the offset term. Out of place, for the compiler to fuse; the eager
        fbgemm path in `int8_matmul` writes the same in place."""
        if self.rotation is not None:
            amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-12)
            return gemm(x / amax) * amax
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        mid, half = (hi + lo) / 2, ((hi - lo) / 2).clamp_min(1e-12)
        return gemm((x - mid) / half) * half + mid * self.row_sums

    def _onednn_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """W x for rows `x` within [-1, 1], quantized to 255 levels (u8 1..255, zero point 128)."""
        q = (x * 127).round() + 128
        return torch.ops.onednn.qlinear_pointwise(
            q.to(torch.uint8), 1 / 127, 128, self.onednn_packed, self.weight_scales, self.weight_zeros,
            None, 1.0, 0, torch.float32, "none", [], "")

    def _traced_int8_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """`int8_matmul` as the compiler sees it: rotation and scales in the graph, where the
        scales fuse with the ops around them, and only fbgemm's call behind an operator
        (`lifeline::int8_linear`). The rotation stays a matmul: written as butterflies,
        Inductor fused each output with its 32 inputs' producers and recomputed GeGLU 32 times
        (a slower prefill, docs/performance.md)."""
        if self.onednn and (x.shape[0] > 1 or self.packed is None):
            return self.onednn_matmul(x)
        if self.rotation is not None:
            x = self.rotate_input(x)
        op, handle, out = self.compile_op, self.compile_handle, self.out_features
        if x.shape[0] == 1:
            return op(x, handle, out)
        return self._per_row_scaled(x, lambda z: op(z, handle, out))

    def rotate_input(self, x: torch.Tensor) -> torch.Tensor:
        return rotate_columns(x, self.rotation, self.native_rotation)

    def extra_repr(self) -> str:
        rotate = 0 if self.rotation is None else self.rotation.shape[0]
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"reduce_range={self.reduce_range}, rescore_top={self.rescore_top}, "
                f"rotate={rotate}")


class RowSplitLinear(nn.Module):
    """`gguf-int8`'s projection: one weight in two layouts, each where it runs faster. A lone
    row (one user's decode step) from the GGUF file's own blocks (`GGUFLinear`: the bytes a
    step reads are the file's 4-5 bits a weight, not int8's 8), two rows or more (a batch, a
    prefill) through the int8 GEMM (`Int8Linear`, oneDNN's copy only where the CPU has it).
    Both compute W x (the int8 one rotates its input itself), so the two may alternate within
    a request: its prefill batched, its decode alone. Until `batch` is built (a server's start
    defers it: `apply_weight_format(defer_batches=True)`), batches take `lone` too."""

    def __init__(self, lone: nn.Module, batch: Int8Linear | None = None):
        super().__init__()
        self.lone, self.batch = lone, batch
        self.in_features, self.out_features = lone.in_features, lone.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = 1
        for size in x.shape[:-1]:
            rows = rows * size
        batch = self.batch
        return self.lone(x) if rows == 1 or batch is None else batch(x)


@cache
def hadamard(n: int) -> torch.Tensor:
    """The n x n Hadamard matrix (Sylvester's construction, n a power of two), scaled to be
    orthogonal; it is also symmetric, so it is its own inverse."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard block size must be a power of two, not {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / n ** 0.5).float()


def rotate_columns(x: torch.Tensor, h: torch.Tensor, native: bool | None = None
                   ) -> torch.Tensor:
    """`x @ blockdiag(h, h, ...)`: each consecutive block of x's columns times h, which is
    `hadamard(b)` (every caller's): for float32 rows on the CPU by the fast transform
    (`lifeline_ext::hadamard_rows`) where `native` (None: where built, asked now; compiled code
    passes what its layer decided outside the graph, `Int8Linear.native_rotation`), else as a
    matmul."""
    rows, cols = x.shape
    b = h.shape[0]
    if native is None:
        native = not torch.compiler.is_compiling() and native_hadamard()
    if native and x.dtype == torch.float32 and x.device.type == "cpu":
        return torch.ops.lifeline_ext.hadamard_rows(x, b)
    return torch.matmul(x.reshape(rows, cols // b, b), h).reshape(rows, cols)


@cache
def native_hadamard() -> bool:
    """Whether `lifeline_ext::hadamard_rows` (lifeline/csrc/cpu_ops.cpp) is built, its shape
    registered for the compiler."""
    from lifeline.model.native import native_ops

    if not native_ops() or not hasattr(torch.ops.lifeline_ext, "hadamard_rows"):
        return False

    @torch.library.register_fake("lifeline_ext::hadamard_rows")
    def _(x: torch.Tensor, block: int) -> torch.Tensor:
        return x.new_empty(x.shape)

    return True


def rotation_block(features: int, largest: int = ROTATE_BLOCK) -> int:
    """The largest power-of-two block (at most `largest`, at least 32) dividing `features`,
    or 0 where none does."""
    b = largest
    while b >= 32:
        if features % b == 0:
            return b
        b //= 2
    return 0


def has_shortlist(head: nn.Module) -> bool:
    """Whether `head` rescores a shortlist, so `head(x, with_argmax=True)` proves argmaxes."""
    return isinstance(head, (BF16Linear, Int8Linear)) and head.rescore_top > 0


def rescore(y: torch.Tensor, x: torch.Tensor,
            rows: Callable[[torch.Tensor], torch.Tensor] | None, bias: torch.Tensor | None,
            top: int, with_argmax: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits `y` [B, V] of hidden states `x` [B, H], bias added, with each row's `top` highest
    recomputed exactly from the float32 weight rows `rows(ids)` gives; with `with_argmax`,
    also each row's argmax where the shortlist proves it (`shortlist_argmax`), else None."""
    if bias is not None:
        y += bias
    argmax = None
    if top and rows is not None:
        approx, ids = top_logits(y, top)
        exact = torch.bmm(rows(ids), x.unsqueeze(-1)).squeeze(-1)
        if bias is not None:
            exact = exact + bias[ids]
        y.scatter_(1, ids, exact)
        if with_argmax:
            argmax = shortlist_argmax(approx, ids, exact, y.shape[1])
    return y, argmax


TOP_CHUNK = 128
"""Logits per chunk in `top_logits`' first pass."""


def top_logits(y: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`y.topk(k, dim=-1, sorted=False)` in two passes: each chunk of `TOP_CHUNK` logits'
    maximum, then the top k within the k chunks of highest maxima (every one of the k highest
    logits lies in one of them: a chunk holding one has a maximum at least as high, and at most
    k chunks can; docs/performance.md has what it saves). Everything outside the result is
    still at most its lowest value (`shortlist_argmax`)."""
    rows, vocab = y.shape
    chunks = vocab // TOP_CHUNK
    if vocab % TOP_CHUNK or chunks < 4 * k or not y.is_contiguous():
        return y.topk(k, dim=-1, sorted=False)
    blocks = y.view(rows, chunks, TOP_CHUNK)
    best = blocks.amax(-1).topk(k, dim=-1, sorted=False).indices
    candidates = blocks.gather(1, best.unsqueeze(-1).expand(rows, k, TOP_CHUNK)).view(rows, -1)
    values, pos = candidates.topk(k, dim=-1, sorted=False)
    return values, best.gather(1, pos // TOP_CHUNK) * TOP_CHUNK + pos % TOP_CHUNK


def shortlist_argmax(approx: torch.Tensor, ids: torch.Tensor, exact: torch.Tensor,
                     vocab: int) -> torch.Tensor:
    """Each row's argmax over the rescored logits, from its shortlist alone, or -1 where the
    shortlist cannot prove it: every logit outside the shortlist is at most the lowest
    approximate value inside it, so an exact maximum above that is the row's maximum (ties go
    to the lowest token id, as `argmax` does). Spares greedy decoding a pass over the
    vocabulary (docs/performance.md)."""
    best = exact.amax(-1, keepdim=True)
    token = torch.where(exact == best, ids, vocab).amin(-1)
    return torch.where(best.squeeze(-1) > approx.amin(-1), token, -1)


QUANTIZE_CHUNK_ROWS = 8192
"""Rows quantized at a time: the float32 temporaries of a vocabulary-sized head (its rotated
copy, the quantizer's, the dequantized row sums) are a chunk's, not the whole matrix's (they
were ~2 GB at the start on Gemma 3 270M's 262k x 640 head)."""


def _quantize_rows(weight: torch.Tensor, rotation: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of `weight` (times `rotation`'s block-diagonal Hadamard matrix
    first, where given), chunk by chunk: the int8 values, their float64 scales and each
    row's sum of dequantized values (the activations' zero-point correction)."""
    rows, cols = weight.shape
    values = torch.empty(rows, cols, dtype=torch.int8)
    scales = torch.empty(rows, dtype=torch.float64)
    row_sums = torch.empty(rows, dtype=torch.float32)
    for start in range(0, rows, QUANTIZE_CHUNK_ROWS):
        part = slice(start, min(rows, start + QUANTIZE_CHUNK_ROWS))
        chunk = weight[part].float()
        if rotation is not None:  # rescoring reads the unrotated rows, with the unrotated input
            chunk = rotate_columns(chunk, rotation)
        chunk_scales = (chunk.abs().amax(1).clamp_min(1e-12) / 127).double()
        # torch.quantize_per_channel's arithmetic (round-half-even of value * (1 / float
        # scale)), written out: the same bytes at twice its speed, and no quantized tensor to
        # unpack and dequantize (tests/test_weight_format.py holds the two equal)
        inverse = (1.0 / chunk_scales.float()).unsqueeze(1)
        quantized = (chunk * inverse).round_().clamp_(-128, 127).to(torch.int8)
        values[part] = quantized
        scales[part] = chunk_scales
        row_sums[part] = (quantized.float() * chunk_scales.float().unsqueeze(1)).sum(1)
    return values, scales, row_sums


def _per_channel(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 `values` with one float64 scale a row as the quantized tensor fbgemm's packing
    takes (a view of the same bytes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch deprecates quantized tensors for torchao
        return torch._make_per_channel_quantized_tensor(
            values, scales, torch.zeros(len(scales), dtype=torch.long), 0)


@cache
def onednn_int8() -> bool:
    """Whether oneDNN's int8 GEMM (`onednn::qlinear_pointwise`) exists in this PyTorch and sums
    without saturating on this CPU (the probe of `fbgemm_saturates`: every pair of u8 x s8
    products overflows int16)."""
    if not (hasattr(torch.ops.onednn, "qlinear_pointwise") and torch.backends.mkldnn.is_available()):
        return False
    weight = torch.full((8, 640), 127, dtype=torch.int8)
    try:
        packed = torch.ops.onednn.qlinear_prepack(weight, None)
        for rows in (1, 16):
            x = torch.full((rows, 640), 255, dtype=torch.uint8)
            x[:, 0] = 128
            y = torch.ops.onednn.qlinear_pointwise(
                x, 1.0, 128, packed, torch.ones(8), torch.zeros(8, dtype=torch.long), None, 1.0,
                0, torch.float32, "none", [], "")
            if not torch.allclose(y, torch.full_like(y, 639 * 127.0 * 127), rtol=0.01):
                return False
    except RuntimeError:
        return False
    return True


@cache
def head_onednn() -> bool:
    """Whether a one-copy int8 layer (the head) keeps oneDNN's copy rather than fbgemm's: where
    oneDNN's int8 GEMM exists and runs on AMX tiles; without AMX fbgemm's lone-row GEMV is the
    faster one and batches are even (docs/performance.md)."""
    return onednn_int8() and amx()


@cache
def fbgemm_saturates() -> bool:
    """Whether 8-bit activations overflow fbgemm's kernel on this CPU. Without VNNI it adds
    pairs of u8 x s8 products in int16 (saturating), which is why PyTorch quantizes activations
    to 7 bits on x86 by default (`reduce_range`); with VNNI (vpdpbusd) the sums are int32.
    The probe makes every pair overflow int16: 255 * 127 * 2 > 32767."""
    weight = _per_channel(torch.full((8, 640), 127, dtype=torch.int8), torch.ones(8).double())
    packed = torch.ops.quantized.linear_prepack(weight, None)
    x = torch.ones(16, 640)
    x[:, 0] = 0.0
    for rows in (1, 16):
        y = torch.ops.quantized.linear_dynamic(x[:rows], packed, False)
        if not torch.allclose(y, torch.full_like(y, 639 * 127.0), rtol=0.01):
            return True
    return False


def apply_weight_format(model: nn.Module, fmt: str, defer_batches: bool = False) -> nn.Module:
    """Replace `model.lm_head` in place (embeddings tied to it keep their float32 copy);
    `int8-all` also every projection of every layer (int8 weights, per-row activation scales,
    no float32 rescoring: a layer's outputs are not a ranking), the projections the model's
    family declares fusable stacked into one GEMM each: each call into fbgemm costs more
    than its bytes.

    `defer_batches` (`gguf-int8`): leave the int8 copies for batches to `finish_weight_format`
    (a server's start builds them after `/ready`, in the background: lifeline.engine.
    background_compile); until then a batch runs from the file's blocks, as `gguf` does."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose from {WEIGHT_FORMATS}")
    done = getattr(model, "applied_weight_format", None)
    if done == fmt:  # one loaded model behind two engines (a gateway's two backends)
        return model
    if done is not None:
        raise ValueError(f"this model's weights are already {done}; load it again for {fmt}")
    applied = fmt
    if fmt not in ("gguf", "gguf-int8"):
        from lifeline.model.loader import materialize_weights

        materialize_weights(model)  # float32 layers, where a lazy load left none
    if fmt == "gguf-int8" and not getattr(model, "stored_tensors", None):
        fmt = "int8-all"  # no blocks the kernels read (not a GGUF, or float tensors only)
    head = model.lm_head
    if fmt == "bf16":
        model.lm_head = BF16Linear(head)
    tasks: list[Callable[[], None]] = []
    if fmt in ("int8", "int8-all"):
        if head.weight.device.type != "cpu":
            raise ValueError("int8 weights run on the CPU only (fbgemm)")
        head_rotate = rotation_block(head.in_features) if fmt == "int8-all" else 0
        stored = _stored(model, head)
        if "embed_tokens.weight" in stored:
            model.embed_tokens = StoredEmbedding(stored["embed_tokens.weight"])

        def quantize_head() -> None:
            model.lm_head = Int8Linear(head, rotate=head_rotate,
                                       stored=stored.get("lm_head.weight"), one_copy=True)

        tasks.append(quantize_head)
    if fmt == "int8-all":
        fusable = family_of(model).fused

        def quantize(layer: nn.Module) -> None:
            for parent in layer.children():
                folded = _fold_value_rotation(parent)
                for fused, names in fusable:
                    _fuse(parent, fused, names)
                for name, child in list(parent.named_children()):
                    if type(child) is nn.Linear:
                        rotate = 0 if name in folded else rotation_block(child.in_features)
                        setattr(parent, name, Int8Linear(child, rescore_top=0, rotate=rotate))

        tasks += [partial(quantize, layer) for layer in model.layers]
    elif fmt in ("gguf", "gguf-int8"):
        later: list[Callable[[], None]] | None = [] if defer_batches else None
        tasks += _as_stored(model, batches=fmt == "gguf-int8", later=later)
        if later:
            model.deferred_weights = DeferredWeights(later)
    _on_threads(lambda task: task(), tasks)
    if fmt != "fp32":
        model.applied_weight_format = applied
    return model


class DeferredWeights:
    """The weight format's conversions left for later (`apply_weight_format(defer_batches=
    True)`), run once by whichever caller comes first (`finish_weight_format`)."""

    def __init__(self, tasks: list[Callable[[], None]]):
        self.tasks = tasks
        self.seconds: float | None = None
        self._lock = threading.Lock()
        self._cancelled = False

    def cancel(self) -> None:
        """Skip the conversions not yet begun (a server stopping within its start: the
        interpreter must not exit under a conversion, which aborts it). Batches keep taking
        the file's blocks where their copy was not built."""
        self._cancelled = True

    def run(self) -> float:
        """Run the conversions (once: a later call waits for the first) and hand the float32
        copies they replace back to the system; the seconds they took."""
        with self._lock:
            if self.seconds is None:
                start = time.perf_counter()
                tasks, self.tasks = self.tasks, []
                _on_threads(lambda task: None if self._cancelled else task(), tasks)
                del tasks  # the float32 weights the tasks held
                release_freed_memory()
                self.seconds = time.perf_counter() - start
            return self.seconds


def pending_weights(model: nn.Module) -> DeferredWeights | None:
    """The conversions `apply_weight_format(defer_batches=True)` left, until they have run."""
    deferred = getattr(model, "deferred_weights", None)
    return deferred if deferred is not None and deferred.seconds is None else None


def finish_weight_format(model: nn.Module) -> float:
    """Run what `apply_weight_format(defer_batches=True)` left (nothing where it left
    nothing); the seconds it took."""
    deferred = getattr(model, "deferred_weights", None)
    return deferred.run() if deferred is not None else 0.0


def _workers() -> int:
    """Threads for the weights' conversion: as many as PyTorch's intra-op pool has (at most the
    CPUs). Quantizing and packing are PyTorch operators that release the GIL, mostly too small
    to split over threads themselves."""
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


def _on_threads(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """`[fn(item) for item in items]`, the items spread over `_workers()` threads (10-15% of a
    server's weight format phase on 2 cores)."""
    workers = min(_workers(), len(items))
    if workers <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(workers, thread_name_prefix="lifeline-weights") as pool:
        return list(pool.map(fn, items))


def _as_stored(model: nn.Module, batches: bool = False,
               later: list[Callable[[], None]] | None = None) -> list[Callable[[], None]]:
    """`gguf`: every projection and the input embedding computed from the GGUF file's own
    blocks (`GGUFLinear`, `StoredEmbedding`), the head as `int8`'s; the projections a family
    fuses are stacked where they share a block type. A tensor the kernels cannot read (a float or
    another block type) keeps its float32 layer.

    `batches` (`gguf-int8`): the same for lone rows, and each projection also quantized to
    int8 for batches (`RowSplitLinear`), a float32 one wholly (as `int8-all`, without folding
    the value rotation: both copies must leave the same values in the KV cache). Returns the
    quantizations still to do (the caller runs them on threads); those of the copies for
    batches go to `later` instead where it is given."""
    head = model.lm_head
    if head.weight.device.type not in ("cpu", "meta"):  # meta: a lazy load's (load_gguf)
        raise ValueError("weights as stored (gguf) run on the CPU only")
    stored = dict(getattr(model, "stored_tensors", None) or {})
    if not stored:
        raise ValueError("weights as stored (gguf) need a GGUF file whose block types the "
                         "kernels read (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K)")
    configure_gemm()
    vocab = _stored(model, head)
    # The head stays int8 with its shortlist rescored from the stored rows (as `int8-all`):
    # the int8 GEMM reads Gemma 3's 262k x 640 head in 6.3 ms where the Q8_0 kernel takes 15.9
    # (docs/performance.md), and its bytes are the size of the file's Q8_0 rows, which
    # the embedding then touches only for the tokens it looks up.
    head_rows = vocab.get("lm_head.weight")

    def quantize_head() -> None:
        float_head = _float_layer(head, head_rows, model.embed_tokens)
        model.lm_head = Int8Linear(float_head, rotate=rotation_block(head.in_features),
                                   stored=head_rows, one_copy=True)

    tasks: list[Callable[[], None]] = []
    batch_tasks = tasks if later is None else later
    if later is not None and head_rows is not None and head.bias is None:
        # 3.4 s of Gemma 3's start on 2 cores: meanwhile the head reads the file's rows
        model.lm_head = GGUFLinear.stack([head_rows])
        later.append(quantize_head)
    else:
        quantize_head()
    if "embed_tokens.weight" in vocab:
        model.embed_tokens = StoredEmbedding(vocab["embed_tokens.weight"])
    fusable = family_of(model).fused
    for i, layer in enumerate(model.layers):
        for parent_name, parent in layer.named_children():
            prefix = f"layers.{i}.{parent_name}."
            for fused, names in fusable:
                parts = [stored.get(prefix + name + ".weight") for name in names]
                linears = [getattr(parent, name, None) for name in names]
                if any(p is None for p in parts) or any(type(lin) is not nn.Linear
                                                        for lin in linears):
                    continue
                if batches:  # one int8 GEMM for a batch, whatever the file's types
                    lone = _stored_runs(parts, linears)
                    projection = _split(lone, partial(_stacked, linears, parts, lone),
                                        batch_tasks)
                elif len({p.qtype for p in parts}) == 1:
                    projection = GGUFLinear.stack(parts, _stacked_bias(linears))
                else:
                    continue
                setattr(parent, fused, FusedProjections(
                    projection, [lin.out_features for lin in linears]))
                for name in names:
                    delattr(parent, name)
            for name, child in list(parent.named_children()):
                part = stored.get(prefix + name + ".weight")
                if type(child) is not nn.Linear:
                    continue
                if part is not None:
                    stored_layer = GGUFLinear.stack([part], child.bias)
                    setattr(parent, name,
                            _split(stored_layer, partial(_float_layer, child, part, stored_layer),
                                   batch_tasks) if batches else stored_layer)
                elif batches:
                    def quantize(parent=parent, name=name, child=child) -> None:
                        setattr(parent, name, Int8Linear(
                            child, rescore_top=0, rotate=rotation_block(child.in_features)))

                    tasks.append(quantize)
    for module in model.modules():  # a repacked layer holds its own copy: the file's pages go
        if isinstance(module, GGUFLinear) and module.qtype != module.stored_qtype:
            for part in module.parts:
                part.release_pages()
        if isinstance(module, GGUFLinear):
            module.parts = ()
    model.stored_tensors = {}  # the layers hold what they use
    model.lazy_weights = {}  # those left lazy are dequantized by the tasks that need them
    return tasks


def _stacked_bias(linears: list[nn.Linear]) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias.detach() if lin.bias is not None
                      else torch.zeros(lin.out_features) for lin in linears])


def _stored_runs(parts: list[StoredTensor], linears: list[nn.Linear]) -> nn.Module:
    """One layer over `parts`' rows: one `GGUFLinear` where they share a block type, else one
    per run of parts that do (Gemma 3's Q4_K_M: q and k Q5_0, v Q8_0 in half the layers),
    their outputs concatenated."""
    runs: list[list[int]] = []
    for i, part in enumerate(parts):
        if runs and parts[runs[-1][0]].qtype == part.qtype:
            runs[-1].append(i)
        else:
            runs.append([i])
    layers = [GGUFLinear.stack([parts[i] for i in run], _stacked_bias([linears[i] for i in run]))
              for run in runs]
    return layers[0] if len(layers) == 1 else ConcatLinear(layers)


class ConcatLinear(nn.Module):
    """Layers of the same input, their outputs concatenated (`_stored_runs`)."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.in_features = layers[0].in_features
        self.out_features = sum(layer.out_features for layer in layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(x) for layer in self.layers], dim=-1)


def _split(lone: nn.Module, linear: Callable[[], nn.Linear], tasks: list[Callable[[], None]]
           ) -> RowSplitLinear:
    """`lone` for lone rows, and a task that quantizes `linear()` to int8 for batches."""
    split = RowSplitLinear(lone)

    def quantize() -> None:
        float_layer = linear()
        split.batch = Int8Linear(float_layer, rescore_top=0,
                                 rotate=rotation_block(float_layer.in_features), batches_only=True)

    tasks.append(quantize)
    return split


def _stored(model: nn.Module, head: nn.Module) -> dict[str, StoredTensor]:
    """The model's vocabulary tensors as the GGUF file stores them (`load_gguf`), by parameter
    name, where they hold the values now in the float32 parameters: the head's rows are the
    embedding's where the two are tied."""
    stored = dict(getattr(model, "stored_tensors", None) or {})
    embed = getattr(model, "embed_tokens", None)
    if embed is None or getattr(embed, "weight", None) is None:
        stored.pop("embed_tokens.weight", None)
    elif head.weight is embed.weight and "embed_tokens.weight" in stored:
        stored["lm_head.weight"] = stored["embed_tokens.weight"]
    if embed is not None and getattr(embed, "weight", None) is not None and \
            embed.weight.device.type not in ("cpu", "meta"):
        return {}
    return stored


FOLD_BLOCK = 256
"""Hadamard block folded into the value and output weights: free at run time, so as large as
a head allows."""


def _fold_value_rotation(attn: nn.Module) -> set[str]:
    """Rotate each head's values by a Hadamard matrix inside the weights: v_proj's rows of every
    KV head become H W_v, o_proj's columns of every query head W_o H. Attention mixes values
    linearly, so each head's output arrives rotated and o_proj's input needs no rotation at run
    time (the KV cache holds rotated values). Returns the names of the layers that need none."""
    v, o = getattr(attn, "v_proj", None), getattr(attn, "o_proj", None)
    head_dim = getattr(attn, "head_dim", 0)
    if type(v) is not nn.Linear or type(o) is not nn.Linear:
        return set()
    b = rotation_block(head_dim, FOLD_BLOCK)
    if not b:
        return set()
    h = hadamard(b)
    v.weight = nn.Parameter(rotate_columns(v.weight.detach().T.contiguous(), h).T.contiguous(),
                            requires_grad=False)
    if v.bias is not None:
        v.bias = nn.Parameter(rotate_columns(v.bias.detach().unsqueeze(0), h).squeeze(0),
                              requires_grad=False)
    o.weight = nn.Parameter(rotate_columns(o.weight.detach(), h), requires_grad=False)
    return {"o_proj"}


def _fuse(parent: nn.Module, fused: str, names: tuple[str, ...]) -> None:
    """Replace `parent`'s float32 projections `names` by one int8 GEMM over their stacked rows
    (weight scales are per row, so stacking changes no weight's quantization)."""
    parts = [getattr(parent, name, None) for name in names]
    if not all(type(part) is nn.Linear for part in parts):
        return
    stacked = _stacked(parts)
    rotate = rotation_block(stacked.in_features)
    setattr(parent, fused, FusedProjections(Int8Linear(stacked, rescore_top=0, rotate=rotate),
                                            [part.out_features for part in parts]))
    for name in names:
        delattr(parent, name)


def _float_weight(linear: nn.Linear, stored: StoredTensor | None, lone: nn.Module | None
                  ) -> torch.Tensor:
    """`linear`'s float32 weight: as loaded, or dequantized from `stored` where a lazy load
    left it in the file's blocks (`load_gguf(lazy=True)`); their pages then leave the
    process's memory again where `lone` holds a copy of them rather than the file's view."""
    if not linear.weight.is_meta:
        return linear.weight.detach()
    weight = stored.dequantized()
    in_place = any(isinstance(m, GGUFLinear) and m.raw.data_ptr() == stored.raw.data_ptr()
                   for m in (lone.modules() if lone is not None else ()))
    if not in_place:
        stored.release_pages()
    return weight


def _float_layer(linear: nn.Linear, stored: StoredTensor, lone: nn.Module) -> nn.Linear:
    """`linear` with its float32 weight (`_float_weight`)."""
    if linear.weight.is_meta:
        linear.weight = nn.Parameter(_float_weight(linear, stored, lone), requires_grad=False)
    return linear


def _stacked(parts: list[nn.Linear], stored: list[StoredTensor] | None = None,
             lone: nn.Module | None = None) -> nn.Linear:
    """One float32 layer over `parts`' rows (their biases stacked, zeros for a part without);
    a part a lazy load left in the file's blocks is dequantized from `stored` (`_float_weight`)."""
    weight = torch.cat([_float_weight(part, stored[i] if stored else None, lone)
                        for i, part in enumerate(parts)])
    # made on the meta device: a real one would draw random weights only to drop them
    stacked = nn.Linear(weight.shape[1], weight.shape[0],
                        bias=any(part.bias is not None for part in parts), device="meta")
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    if stacked.bias is not None:
        stacked.bias = nn.Parameter(torch.cat([
            part.bias.detach() if part.bias is not None else weight.new_zeros(part.out_features)
            for part in parts]), requires_grad=False)
    return stacked


def release_freed_memory() -> None:
    """Collect what a weight format left unreferenced (the float32 copies it replaced) and hand
    the allocator's free pages back to the system (glibc's `malloc_trim`): the float32
    weights were freed into the heap, which keeps them resident otherwise (1.3 GB of
    Gemma 3 270M's heap after `int8-all`). Nothing where the C library has no such call."""
    import gc

    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Hand the C allocator's free pages back to the system (glibc's `malloc_trim(0)`, every
    arena): the steps' large temporaries (a prefill's activations, a batch's logits) are freed
    into the heap, which keeps them resident otherwise. Nothing where the C library has no
    such call."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass
