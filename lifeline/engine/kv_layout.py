"""How a model's KV cache is split into groups and blocks, from its config alone (no torch), so
the engine and the planner size it the same way.

Groups: full-attention layers hold their whole context; sliding-window layers only their window.
A model with both (Gemma 3) gets two groups with pools of their own; a model whose layers all
slide (Mistral 7B v0.1) one windowed group; any other one full group.

Sizing from a memory budget: the window group needs at most `window + 2 blocks` per running
request plus one step's chunk, whatever the context length, so it gets that much (never more
than its share by layer count) and the global layers get the rest, which is where long contexts
grow. With an explicit block count every group gets that many blocks, so a test's pool is never
smaller than before groups existed.

Sizing by need (no budget, no count; the engine's default): the served context length
`context_tokens` in the global layers, shared by all running requests as llama.cpp's `-c` is,
so one request can always reach its end; the window group as above, never more blocks than the
global one (llama.cpp's iSWA cache: `min(n_ctx, n_swa * n_seq + n_ubatch)`).
"""
from __future__ import annotations

from dataclasses import dataclass

from lifeline.engine.block_manager import BlockManager, KVCacheManager
from lifeline.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class KVGroup:
    name: str
    """'full' or 'sliding'."""
    num_layers: int
    window: int | None
    num_blocks: int
    bytes_per_block: int


@dataclass(frozen=True, slots=True)
class KVLayout:
    block_size: int
    groups: tuple[KVGroup, ...]

    @property
    def hybrid(self) -> bool:
        """Two groups with separate block tables and pools."""
        return len(self.groups) > 1

    @property
    def total_bytes(self) -> int:
        return sum(g.num_blocks * g.bytes_per_block for g in self.groups)

    def group_index(self, layer_type: str) -> int:
        """The group holding a layer of `layer_type` ('full', 'sliding'): its own where the
        layout has one, else the only group."""
        return next((i for i, g in enumerate(self.groups) if g.name == layer_type), 0)

    def manager(self, enable_prefix_caching: bool = True,
                max_chunk_tokens: int | None = None) -> KVCacheManager:
        return KVCacheManager(
            [BlockManager(g.num_blocks, self.block_size, enable_prefix_caching, g.window,
                          max_chunk_tokens) for g in self.groups],
            [g.bytes_per_block for g in self.groups])


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 4, num_layers: int = 1) -> int:
    """K and V of `num_layers` layers for one token (the only place this is computed). With
    multi-head latent attention (DeepSeek-V2/V3) a layer caches one latent and the shared RoPE
    key (`kv_lora_rank + qk_rope_head_dim` values), not a K and a V per head."""
    if cfg.is_mla:
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * dtype_bytes * num_layers
    return 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes * num_layers


def plan_kv(cfg: ModelConfig, block_size: int, *, memory_bytes: int | None = None,
            num_blocks: int | None = None, max_num_seqs: int = 64,
            max_num_batched_tokens: int = 512, dtype_bytes: int = 4,
            sliding_window_kv: bool = True, context_tokens: int | None = None) -> KVLayout:
    """Groups and block counts for `cfg`: `num_blocks` per group if given, else sized to fit
    `memory_bytes`, else by need for `context_tokens` (module docstring).
    `sliding_window_kv=False` treats every layer as global (one group)."""
    if num_blocks is None and memory_bytes is None and context_tokens is None:
        raise ValueError("give num_blocks, memory_bytes or context_tokens")
    per_layer = kv_bytes_per_token(cfg, dtype_bytes) * block_size
    sliding = sum(t == "sliding" for t in cfg.layer_types) if (
        sliding_window_kv and cfg.sliding_window) else 0
    full = cfg.num_layers - sliding
    if num_blocks is None and memory_bytes is None:
        context_blocks = max(1, -(-int(context_tokens) // block_size))
        if sliding == 0 or full == 0:
            window = cfg.sliding_window if sliding else None
            blocks = context_blocks
            if sliding:
                blocks = min(blocks, _window_blocks(cfg, block_size, max_num_seqs,
                                                    max_num_batched_tokens))
            return KVLayout(block_size, (KVGroup("sliding" if sliding else "full",
                                                 cfg.num_layers, window, blocks,
                                                 per_layer * cfg.num_layers),))
        window_blocks = min(context_blocks, _window_blocks(cfg, block_size, max_num_seqs,
                                                           max_num_batched_tokens))
        return KVLayout(block_size, (
            KVGroup("full", full, None, context_blocks, per_layer * full),
            KVGroup("sliding", sliding, cfg.sliding_window, window_blocks, per_layer * sliding)))
    if sliding == 0 or full == 0:
        window = cfg.sliding_window if sliding else None
        name = "sliding" if sliding else "full"
        bpb = per_layer * cfg.num_layers
        blocks = num_blocks or max(1, int(memory_bytes // bpb))
        return KVLayout(block_size, (KVGroup(name, cfg.num_layers, window, blocks, bpb),))
    full_bpb, window_bpb = per_layer * full, per_layer * sliding
    if num_blocks is not None:
        full_blocks = window_blocks = num_blocks
    else:
        window_blocks = _window_blocks(cfg, block_size, max_num_seqs, max_num_batched_tokens)
        share = memory_bytes * sliding // cfg.num_layers // window_bpb
        window_blocks = max(1, int(min(window_blocks, share)))
        full_blocks = max(1, int((memory_bytes - window_blocks * window_bpb) // full_bpb))
    return KVLayout(block_size, (
        KVGroup("full", full, None, full_blocks, full_bpb),
        KVGroup("sliding", sliding, cfg.sliding_window, window_blocks, window_bpb)))


def _window_blocks(cfg: ModelConfig, block_size: int, max_num_seqs: int,
                   max_num_batched_tokens: int) -> int:
    """Blocks the window group needs at most: `window + 2 blocks` per running request plus one
    step's chunk."""
    live = -(-cfg.sliding_window // block_size) + 2
    return max_num_seqs * live + -(-max_num_batched_tokens // block_size)
