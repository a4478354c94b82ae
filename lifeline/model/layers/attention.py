"""Attention over the paged KV cache, for a step that mixes prefill chunks and decodes.

The cache is one preallocated pool per layer, `[num_blocks * block_size, kv_heads, head_dim]`
for K and for V; a request reads its keys and values through its block table. The step's tokens
are flattened: decode tokens first (one per request, attended in one batched call), then each
prefill chunk (one call per request, never per token). A layer's `PagedAttention` reads the pool
and the step's metadata from the forward context (lifeline/model/context.py), in eager and
compiled mode alike; compiled code reaches it through the `lifeline::paged_attention` operator,
because the step's layout (block tables, prefill chunks, a hybrid model's second pool) is Python
data that changes every step, as vLLM's attention operator does.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lifeline.model.context import get_context
from lifeline.model.native import native_ops

NATIVE_DECODE_MAX = 256
"""Decode batches up to this size take `lifeline_ext::decode_attention` (C++, straight from the
paged cache, on every thread) where it is built, faster than gathering the contexts for
PyTorch's flash kernel at every batch measured (docs/performance.md); larger ones take that
path."""

NATIVE_PREFILL_MIN = 64
"""Prefill chunks of at least this many tokens take `lifeline_ext::prefill_attention` where it
is built, faster than PyTorch's flash kernel over expanded heads; shorter ones keep SDPA, where
attention is microseconds a layer either way and where the kernel's other float32 rounding,
moving an int8 rounding step, parted the `int8-all` and `gguf-int8` layers from llama.cpp's
greedy text on a short prompt (docs/performance.md, "Prefill attention in C++")."""


@dataclass(slots=True)
class PrefillSeq:
    start: int
    """Offset of this chunk's first token in the step's flattened tokens."""
    num_tokens: int
    context_len: int
    """Tokens in the cache once this chunk is written (cached prefix + chunk)."""
    slots: torch.Tensor
    """Cache slot of every context position, `[context_len]`."""
    both_ways: tuple[tuple[int, int], ...] = ()
    """Context ranges [a, b) whose positions attend to each other both ways (an image's
    tokens in Gemma 3), in context positions (0: the first position `slots` holds)."""


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    """Cache slot each new token's K and V are written to, `[N]`."""
    num_decodes: int
    decode_slots: torch.Tensor | None = None
    """`[D, L]` cache slots of each decode request's context, padded with slot 0."""
    decode_positions: torch.Tensor | None = None
    """`[D]` position of each decode token."""
    decode_valid: torch.Tensor | None = None
    """`[D, L]` True where the slot holds a real context position."""
    prefills: list[PrefillSeq] = field(default_factory=list)
    masks: dict[tuple[int | None, torch.dtype], torch.Tensor] = field(default_factory=dict)
    """Decode masks per sliding window (None = full) and dtype, built once per step."""
    window_meta: AttentionMetadata | None = None
    """The same step seen through the block table of a hybrid model's sliding-window layers,
    whose KV lives in pools of their own (`KVCacheManager`); None when all layers share one."""

    def to(self, device: torch.device | str) -> AttentionMetadata:
        if torch.device(device).type == "cpu":
            return self
        move = lambda t: None if t is None else t.to(device, non_blocking=True)
        prefills = [PrefillSeq(p.start, p.num_tokens, p.context_len, move(p.slots),
                               p.both_ways) for p in self.prefills]
        window_meta = self.window_meta.to(device) if self.window_meta is not None else None
        return AttentionMetadata(move(self.slot_mapping), self.num_decodes,
                                 move(self.decode_slots), move(self.decode_positions),
                                 move(self.decode_valid), prefills, window_meta=window_meta)

    def decode_mask(self, window: int | None, dtype: torch.dtype = torch.float32
                    ) -> torch.Tensor:
        """Additive `[D, 1, 1, L]` mask (0 or -inf), built once per step and window: a boolean
        mask would be converted by every layer's SDPA call."""
        mask = self.masks.get((window, dtype))
        if mask is None:
            valid = self.decode_valid
            if window is not None:
                length = self.decode_valid.shape[1]
                pos_k = torch.arange(length, device=valid.device).unsqueeze(0)
                valid = valid & (pos_k > self.decode_positions.unsqueeze(1) - window)
            mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
            mask = mask.masked_fill_(~valid, float("-inf"))[:, None, None, :]
            self.masks[window, dtype] = mask
        return mask


class PagedAttention(nn.Module):
    """One layer's attention over its KV pool, both read from the forward context."""

    def __init__(self, layer_idx: int, scale: float, window: int | None):
        super().__init__()
        self.layer_idx, self.scale, self.window = layer_idx, scale, window
        self.compiled_op = torch.ops.lifeline.paged_attention
        """The operator compiled code calls (`compiled_attention_op`, set before tracing)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [N, H, D]; k, v: [N, KVH, D] for the step's new tokens. Returns [N, H, D]."""
        if torch.compiler.is_compiling():
            return self.compiled_op(q, k, v.contiguous(), self.layer_idx, self.scale,
                                    self.window)
        return context_attention(q, k, v, self.layer_idx, self.scale, self.window)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, scale={self.scale:.4g}, window={self.window}"


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                      scale: float, window: int | None) -> torch.Tensor:
    """`paged_attention` over layer `layer`'s pool and the step's metadata, from the forward
    context."""
    context = get_context()
    k_cache, v_cache = context.kv_caches[layer]
    return paged_attention(q, k, v, k_cache, v_cache, context.meta, scale, window)


def _attention_op_meta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                       scale: float, window: int | None) -> torch.Tensor:
    return torch.empty_like(q)


_LIB = torch.library.Library("lifeline", "FRAGMENT")  # Library.impl: cheaper than custom_op
# The layer's index, scale and window are constants of the compiled graph: the same for every
# model of the same configuration, so a graph cached on disk (lifeline.model.compiled) serves
# any of them; the pools are the step's, read from the forward context.
_LIB.define("paged_attention(Tensor q, Tensor k, Tensor v, int layer, float scale, int? window)"
            " -> Tensor")
_LIB.impl("paged_attention", context_attention, "CPU")
_LIB.impl("paged_attention", _attention_op_meta, "Meta")


_native_fake = False


def native_attention() -> bool:
    """Whether `lifeline_ext::paged_attention` (lifeline/csrc/cpu_ops.cpp) is built."""
    global _native_fake
    if not native_ops() or not hasattr(torch.ops.lifeline_ext, "paged_attention"):
        return False
    if not _native_fake:
        torch.library.register_fake("lifeline_ext::paged_attention")(_attention_op_meta)
        _native_fake = True
    return True


def compiled_attention_op():
    """The attention operator for compiled code: `lifeline_ext::paged_attention` where built
    (a decode-only step set by `set_native_decode_step` runs in C++, any other goes on to
    `lifeline::paged_attention`), else the Python operator itself."""
    if native_attention():
        return torch.ops.lifeline_ext.paged_attention
    return torch.ops.lifeline.paged_attention


def set_native_decode_step(meta: AttentionMetadata,
                           kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                           window: int | None) -> bool:
    """Hands a decode-only step of up to `NATIVE_DECODE_MAX` requests on the CPU to
    `lifeline_ext::paged_attention` (the pools, the new tokens' slots, each context's slots and
    masks, for full-attention layers and for layers of sliding `window`), so that a compiled
    layer's attention runs without a call back into Python; the caller clears it after the
    forward (`torch.ops.lifeline_ext.clear_decode_step`). False, and nothing set, for any other
    step."""
    d = meta.num_decodes
    if meta.prefills or not 0 < d <= NATIVE_DECODE_MAX or meta.decode_slots is None or \
            meta.slot_mapping.device.type != "cpu" or not native_attention():
        return False
    full = meta.decode_mask(None).view(d, -1)
    if window is None:
        w_slots, w_decode, w_mask, window = meta.slot_mapping, meta.decode_slots, full, -1
    else:
        wm = meta.window_meta if meta.window_meta is not None else meta
        w_slots, w_decode = wm.slot_mapping, wm.decode_slots
        w_mask = wm.decode_mask(window).view(d, -1)
    torch.ops.lifeline_ext.set_decode_step([t for pair in kv_caches for t in pair],
                                           meta.slot_mapping, meta.decode_slots, full, w_slots,
                                           w_decode, w_mask, window)
    return True


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """The step's keys and values into the pools, in the pools' format (a 16-bit KV cache
    rounds them here, once)."""
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None) -> torch.Tensor:
    """q: [N, H, D]; k, v: [N, KVH, D] for the step's new tokens. Returns [N, H, D]."""
    if window is not None and meta.window_meta is not None:
        meta = meta.window_meta
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    d = meta.num_decodes
    if not meta.prefills:  # a decode-only step: no output buffer to assemble
        return _decode(q, k_cache, v_cache, meta, scale, window)
    out = torch.empty_like(q)
    if d:
        out[:d] = _decode(q[:d], k_cache, v_cache, meta, scale, window)
    for p in meta.prefills:
        rows = slice(p.start, p.start + p.num_tokens)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, p, scale, window)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    mask = meta.decode_mask(window, q.dtype)
    if (num_seqs <= NATIVE_DECODE_MAX and q.device.type == "cpu" and q.dtype == torch.float32
            and native_ops()):
        return torch.ops.lifeline_ext.decode_attention(q, k_cache, v_cache, meta.decode_slots,
                                                       mask.view(num_seqs, -1), scale)
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads
    keys = _gather(k_cache, meta.decode_slots, q.dtype).transpose(1, 2)
    values = _gather(v_cache, meta.decode_slots, q.dtype).transpose(1, 2)
    q = q.view(num_seqs, kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return o.reshape(num_seqs, num_heads, head_dim)


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`cache[slots]` through `index_select`, several times faster than advanced indexing on
    the CPU (docs/performance.md), widened to the activations' `dtype` from a 16-bit cache."""
    flat = slots.reshape(-1)
    rows = cache.index_select(0, flat).view(*slots.shape, *cache.shape[1:])
    return rows.to(dtype)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, p: PrefillSeq, scale: float, window: int | None
             ) -> torch.Tensor:
    past = p.context_len - p.num_tokens
    if past:
        k = _gather(k_cache, p.slots, q.dtype)
        v = _gather(v_cache, p.slots, q.dtype)
    elif k_cache.dtype != q.dtype:  # as the cache will give them back: a prefix-cache hit
        k = k.to(k_cache.dtype).to(q.dtype)  # then reads the same keys as this first pass
        v = v.to(v_cache.dtype).to(q.dtype)
    if not p.both_ways and p.num_tokens >= NATIVE_PREFILL_MIN and native_prefill(q):
        return torch.ops.lifeline_ext.prefill_attention(q, k, v, scale,
                                                        -1 if window is None else window)
    # 4-D [1, H, T, D] inputs: PyTorch's fused (flash) CPU kernel takes only 4-D ones; as 3-D
    # this was the slower math path (bmm + softmax; docs/performance.md, "Prefill attention").
    q_t = q.transpose(0, 1).unsqueeze(0)
    k_t, v_t = _expand_heads(k, q).unsqueeze(0), _expand_heads(v, q).unsqueeze(0)
    if past == 0 and (window is None or p.num_tokens <= window) and not p.both_ways:
        o = F.scaled_dot_product_attention(q_t, k_t, v_t, is_causal=True, scale=scale)
    else:
        mask = _chunk_mask(p.num_tokens, p.context_len, window, q.device, p.both_ways)
        o = F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask, scale=scale)
    o = o.squeeze(0)
    return o.transpose(0, 1)


def native_prefill(q: torch.Tensor) -> bool:
    """Whether `lifeline_ext::prefill_attention` (lifeline/csrc/cpu_ops.cpp: the query heads of
    a KV head stacked, register-tiled, flash style) takes these queries: built, on the CPU,
    float32, a head size it tiles. Where not, PyTorch's flash kernel over expanded K/V does."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or not native_ops():
        return False
    return q.shape[-1] % _prefill_head_multiple() == 0


@functools.cache
def _prefill_head_multiple() -> int:
    """The head sizes the built kernel tiles are the multiples of this (two of its vectors)."""
    return torch.ops.lifeline_ext.prefill_attention_head_multiple()


def _expand_heads(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[T, KVH, D] -> [H, T, D]. Expanded K/V, not `enable_gqa=True`, which measured slower
    (docs/performance.md, "Prefill attention")."""
    group = q.shape[1] // kv.shape[1]
    kv = kv.transpose(0, 1)
    return kv.repeat_interleave(group, dim=0) if group > 1 else kv


def _chunk_mask(num_q: int, num_k: int, window: int | None, device: torch.device,
                both_ways: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """Causal (within the window), or-ed with the ranges that see each other both ways: as
    transformers' Gemma 3, AND(window, OR(causal, same image))."""
    pos_q = torch.arange(num_k - num_q, num_k, device=device).unsqueeze(1)
    pos_k = torch.arange(num_k, device=device).unsqueeze(0)
    mask = pos_k <= pos_q
    for a, b in both_ways:
        mask |= (pos_q >= a) & (pos_q < b) & (pos_k >= a) & (pos_k < b)
    if window is not None:
        mask &= pos_k > pos_q - window
    return mask
