"""Paged KV-cache bookkeeping: fixed-size blocks, hash-chained prefix caching, LRU eviction.

Pure Python over token ids and block ids (no torch, no clock), so the planner can drive it with
a simulated executor. One block table per request serves every layer: a block id names the same
slot range in each layer's K and V pools. Sliding-window layers are accounted like global ones
(a request holds blocks for its whole context); they only *read* the blocks inside their window.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from lifeline.engine.request import Request


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra_key: int = 0) -> int:
    return hash((parent_hash, tuple(token_ids), extra_key))


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0
    """Prompt tokens looked up in the prefix cache."""
    hits: int = 0
    """Of those, tokens found cached."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def compute_hashes(self, req: Request, upto_tokens: int) -> list[int]:
        """Extend `req.block_hashes` to cover every full block among its first `upto_tokens`."""
        hashes = req.block_hashes
        bs = self.block_size
        if (len(hashes) + 1) * bs > upto_tokens:
            return hashes
        tokens = req.all_token_ids
        while (len(hashes) + 1) * bs <= upto_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs], req.extra_hash_key))
        return hashes

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Block ids of the longest cached prefix; at least one prompt token is left to compute
        so the step that finishes the prompt can produce logits."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = self.compute_hashes(req, max_blocks * self.block_size)
        hit: list[int] = []
        for h in hashes[:max_blocks]:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hit.append(block_id)
        self.stats.queries += req.num_tokens
        self.stats.hits += len(hit) * self.block_size
        return hit

    def allocate(self, req: Request, num_new_tokens: int, cached_prefix: Sequence[int] = ()) -> bool:
        """Give `req` blocks for `num_new_tokens` more tokens (after any cached prefix).
        Returns False, changing nothing, when the free pool is too small."""
        total = req.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(req.block_ids) - len(cached_prefix)
        reusable = sum(1 for b in cached_prefix if self.blocks[b].ref_cnt == 0)
        if need > self.num_free_blocks - reusable:
            return False
        for block_id in cached_prefix:
            self._touch(block_id)
        req.block_ids.extend(cached_prefix)
        req.block_ids.extend(self._pop_free() for _ in range(max(need, 0)))
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Register every full, computed block of `req` in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_registered_blocks:
            return
        hashes = self.compute_hashes(req, req.num_computed_tokens)
        for i in range(req.num_registered_blocks, full):
            block, h = self.blocks[req.block_ids[i]], hashes[i]
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                self.cached[h] = block.block_id
        req.num_registered_blocks = full

    def free(self, req: Request) -> None:
        """Release `req`'s blocks; tail blocks go to the front of eviction order."""
        for block_id in reversed(req.block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = None
        req.block_ids = []
        req.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        for block_id in self.free_queue:
            self._forget(self.blocks[block_id])

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            del self.free_queue[block_id]
        block.ref_cnt += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        self._forget(block)
        block.ref_cnt = 1
        return block_id

    def _forget(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
