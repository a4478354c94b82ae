"""Paged KV-cache bookkeeping: fixed-size blocks, hash-chained prefix caching, LRU eviction,
and sliding-window layers that give back the blocks their window has left behind.

Pure Python over token ids and block ids (no torch, no clock), so the planner can drive it with
a simulated executor.

A `BlockManager` keeps one pool of blocks for one group of layers: a block id names the same
slot range in each of the group's K and V pools. A model whose layers all attend the same way
needs one group. A hybrid model (Gemma 3: five sliding-window layers to one global) gets two,
tied together by `KVCacheManager`: the global layers hold blocks for the whole context; the
sliding layers (`window` set) hold only the blocks their window still reads, so their share of a
long context stays constant (docs/architecture.md, "KV cache groups").
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from lifeline.engine.request import Request
from lifeline.media.inputs import image_block_keys

NULL_BLOCK = -1
"""Table entry of a window block given back (or never needed, after a prefix-cache hit)."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


ROOT_HASH = hashlib.sha256(b"lifeline prefix cache, first block").digest()
"""The parent of a request's first block."""


def hash_chain(parent: bytes | None, token_ids: Sequence[int], block_size: int,
               extra_key: bytes = b"", block_keys: Sequence[bytes] | None = None
               ) -> list[bytes]:
    """SHA-256 digests of the full blocks of `token_ids`, each over its parent's digest and its
    own token ids (little-endian uint32). A prefix-cache hit rests on them, so two different
    chains of blocks must never share a digest, as they could with Python's `hash()`.

    `parent` None: the first block is the request's first, and `extra_key` (its cache salt)
    goes into it, length-prefixed, so every later block inherits it through the chain.
    `block_keys[i]`, where given, goes into block i's digest after its tokens (the hashes of
    the images whose tokens the block holds: lifeline.media.inputs.image_block_keys)."""
    count = len(token_ids) // block_size
    if count == 0:
        return []
    data = struct.pack(f"<{count * block_size}I", *token_ids[:count * block_size])
    width = 4 * block_size
    digests = []
    if parent is None:
        head = hashlib.sha256(ROOT_HASH)
        head.update(len(extra_key).to_bytes(8, "little"))
        head.update(extra_key)
        head.update(data[:width])
        if block_keys:
            head.update(block_keys[0])
        parent = head.digest()
        digests.append(parent)
    sha256 = hashlib.sha256
    for start in range(width * len(digests), len(data), width):
        key = block_keys[start // width] if block_keys else b""
        parent = sha256(parent + data[start:start + width] + key).digest()
        digests.append(parent)
    return digests


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """The digest of one block (see `hash_chain`)."""
    return hash_chain(parent, token_ids, len(token_ids), extra_key)[0]


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """A request's block tables, one per cache group, in the groups' order (vLLM's
    `KVCacheBlocks`). The lists are the manager's own: read them before the step's update."""

    block_ids: tuple[list[int], ...]


@dataclass(slots=True)
class _Table:
    """What one group keeps for one request."""
    block_ids: list[int] = field(default_factory=list)
    num_registered: int = 0
    """Leading blocks already offered to the prefix cache."""


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0
    """Prompt tokens looked up in the prefix cache."""
    hits: int = 0
    """Of those, tokens found cached."""


class BlockManager:
    """One group of layers, holding each request's block table for that group. `window` is
    the group's sliding window (None: full attention)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, max_chunk_tokens: int | None = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self._tables: dict[str, _Table] = {}
        self.max_chunk_tokens = max_chunk_tokens
        """The most tokens one step computes for a request (the scheduler's token budget);
        bounds the live blocks of a window group."""
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
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

    def block_table(self, req: Request) -> list[int]:
        """`req`'s table in this group (empty when it holds none)."""
        table = self._tables.get(req.request_id)
        return table.block_ids if table is not None else []

    def get_blocks(self, req: Request) -> KVCacheBlocks:
        return KVCacheBlocks((self.block_table(req),))

    def _table(self, req: Request) -> _Table:
        table = self._tables.get(req.request_id)
        if table is None:
            table = self._tables[req.request_id] = _Table()
        return table

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def capacity_tokens(self) -> float:
        """The longest context one request can hold alone. A window group gives back what its
        window left behind, so it is unbounded once it holds a window plus a chunk."""
        pool = self.num_blocks * self.block_size
        if self.window is not None and self.max_chunk_tokens is not None:
            live = self.blocks_needed(self.window + self.max_chunk_tokens) + 2
            if live <= self.num_blocks:
                return float("inf")
        return pool

    def first_live_block(self, next_position: int) -> int:
        """The first block a query at `next_position` (or later) still reads: all of them
        for full attention; for a window, the block of position `next_position - window + 1`."""
        if self.window is None:
            return 0
        return max(0, (next_position - self.window + 1) // self.block_size)

    def compute_hashes(self, req: Request, upto_tokens: int) -> list[bytes]:
        """Extend `req.block_hashes` to cover every full block among its first `upto_tokens`."""
        hashes = req.block_hashes
        bs = self.block_size
        done, full = len(hashes), upto_tokens // bs
        if full <= done:
            return hashes
        tokens = _token_range(req, done * bs, full * bs)
        keys = image_block_keys(req.images, bs, done, full - done) if req.images else None
        hashes.extend(hash_chain(hashes[-1] if hashes else None, tokens, bs,
                                 req.extra_hash_key, keys))
        return hashes

    def prefix_hashes(self, req: Request) -> list[bytes]:
        """Hashes of the blocks a prefix hit may cover: at least one prompt token is left to
        compute, so the step that finishes the prompt can produce logits."""
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self.compute_hashes(req, max_blocks * self.block_size)[:max_blocks]

    def valid_hits(self, hashes: Sequence[bytes]) -> list[bool]:
        """`valid[m]`: a hit of the first m blocks is usable, i.e. every block a query at
        position `m * block_size` reads is cached (m = 0 always is)."""
        valid = [True] + [False] * len(hashes)
        run = 0
        for j, h in enumerate(hashes):
            run = run + 1 if h in self.cached else 0
            m = j + 1
            if self.window is None and run < m:
                break
            valid[m] = run >= m - self.first_live_block(m * self.block_size)
        return valid

    def prefix_table(self, hashes: Sequence[bytes], m: int) -> list[int]:
        """The table entries of a valid hit of m blocks (`NULL_BLOCK` before the window)."""
        first = self.first_live_block(m * self.block_size)
        return [NULL_BLOCK] * first + [self.cached[h] for h in hashes[first:m]]

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Table entries of the longest usable cached prefix."""
        if not self.enable_prefix_caching:
            return []
        hashes = self.prefix_hashes(req)
        valid = self.valid_hits(hashes)
        m = max(i for i, ok in enumerate(valid) if ok)
        self.stats.queries += req.num_tokens
        self.stats.hits += m * self.block_size
        return self.prefix_table(hashes, m)

    def can_allocate(self, req: Request, num_new_tokens: int,
                     cached_prefix: Sequence[int] = ()) -> bool:
        need, reusable = self._need(req, num_new_tokens, cached_prefix)
        return need <= self.num_free_blocks - reusable

    def allocate(self, req: Request, num_new_tokens: int, cached_prefix: Sequence[int] = ()) -> bool:
        """Give `req` blocks for `num_new_tokens` more tokens (after any cached prefix).
        Returns False, changing nothing, when the free pool is too small."""
        need, reusable = self._need(req, num_new_tokens, cached_prefix)
        if need > self.num_free_blocks - reusable:
            return False
        self.take(req, need, cached_prefix)
        return True

    def take(self, req: Request, need: int, cached_prefix: Sequence[int] = ()) -> None:
        """Append the cached prefix and `need` fresh blocks to `req`'s table (`_need` said
        they fit)."""
        table = self._table(req).block_ids
        if cached_prefix:
            for block_id in cached_prefix:
                if block_id != NULL_BLOCK:
                    self._touch(block_id)
            table.extend(cached_prefix)
        if need > 0:
            table.extend(self._pop_free() for _ in range(need))

    def _need(self, req: Request, num_new_tokens: int, cached_prefix: Sequence[int]
              ) -> tuple[int, int]:
        """Fresh blocks `req` needs for `num_new_tokens` more tokens after `cached_prefix`,
        and how many of the prefix's blocks sit in the free pool (a hit takes them out)."""
        entry = self._tables.get(req.request_id)
        held = len(entry.block_ids) if entry is not None else 0
        if not cached_prefix:  # every step of a running request
            total = req.num_computed_tokens + num_new_tokens
            return -(-total // self.block_size) - held, 0
        total = req.num_computed_tokens + len(cached_prefix) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - held - len(cached_prefix)
        reusable = sum(1 for b in cached_prefix
                       if b != NULL_BLOCK and self.blocks[b].ref_cnt == 0)
        return need, reusable

    def commit(self, req: Request) -> None:
        """After a step computed tokens of `req`: register its full blocks in the prefix cache,
        then give back the window blocks no later query reads (they stay cached until
        evicted, so a later request with the same prefix can still hit them)."""
        entry = self._table(req)
        table = entry.block_ids
        if self.enable_prefix_caching:
            self._register(req, entry)
        if self.window is not None:
            for j in range(self.first_live_block(req.num_computed_tokens)):
                block_id = table[j]
                if block_id != NULL_BLOCK:
                    table[j] = NULL_BLOCK
                    self._release(block_id)

    def _register(self, req: Request, entry: _Table) -> None:
        full = req.num_computed_tokens // self.block_size
        done = entry.num_registered
        if full <= done:
            return
        table = entry.block_ids
        hashes = self.compute_hashes(req, req.num_computed_tokens)
        for i in range(done, full):
            if table[i] == NULL_BLOCK:
                continue
            block, h = self.blocks[table[i]], hashes[i]
            if block.block_hash is None and h not in self.cached:
                block.block_hash = h
                self.cached[h] = block.block_id
        entry.num_registered = full

    def free(self, req: Request) -> None:
        """Release `req`'s blocks; tail blocks go to the front of eviction order."""
        entry = self._tables.pop(req.request_id, None)
        if entry is None:
            return
        for block_id in reversed(entry.block_ids):
            if block_id != NULL_BLOCK:
                self._release(block_id)

    def num_blocks_held(self, req: Request) -> int:
        return sum(1 for b in self.block_table(req) if b != NULL_BLOCK)

    def _release(self, block_id: int) -> None:
        """A block no request holds any more: one the prefix cache keeps goes to the back of
        the free queue (evicted last); one it does not to the front, to be written again
        before a block never written is: the pools hold memory only where they were written
        (`model_runner.kv_pool`), so the process grows with the cache's use, not its size."""
        block = self.blocks[block_id]
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free_queue[block_id] = None
            if block.block_hash is None:
                self.free_queue.move_to_end(block_id, last=False)

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


def _token_range(req: Request, start: int, end: int) -> list[int]:
    """`req.all_token_ids[start:end]` without copying the whole of a long prompt."""
    prompt, n = req.prompt_token_ids, req.num_prompt_tokens
    if end <= n:
        return prompt[start:end]
    return prompt[start:n] + req.output_token_ids[max(start - n, 0):end - n]


class KVCacheManager:
    """Several groups of layers as one KV cache for the scheduler: a request is admitted only
    if every group can hold it, a prefix hit counts only as far as every group has it cached,
    and a step's blocks are taken from every group or from none.

    `bytes_per_block[g]` is what one block of group g occupies (K and V of all its layers), so
    `bytes_in_use` is the KV memory the requests hold now, the figure docs/moe.md sets beside
    the formula."""

    def __init__(self, groups: Sequence[BlockManager], bytes_per_block: Sequence[int]):
        if not groups or len(groups) != len(bytes_per_block):
            raise ValueError("one bytes_per_block per group")
        if len({g.block_size for g in groups}) != 1:
            raise ValueError("every group must use the same block size")
        self.groups = list(groups)
        self.bytes_per_block = list(bytes_per_block)
        self.block_size = groups[0].block_size
        self.enable_prefix_caching = groups[0].enable_prefix_caching
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return sum(g.num_free_blocks for g in self.groups)

    @property
    def usage(self) -> float:
        """Fraction of the KV memory in use (groups weighted by their bytes)."""
        total = sum(g.num_blocks * b for g, b in zip(self.groups, self.bytes_per_block))
        free = sum(g.num_free_blocks * b for g, b in zip(self.groups, self.bytes_per_block))
        return 1.0 - free / total

    def bytes_in_use(self) -> int:
        return sum((g.num_blocks - g.num_free_blocks) * b
                   for g, b in zip(self.groups, self.bytes_per_block))

    def bytes_held(self, req: Request) -> int:
        return sum(g.num_blocks_held(req) * b for g, b in zip(self.groups, self.bytes_per_block))

    def capacity_tokens(self) -> float:
        return min(g.capacity_tokens() for g in self.groups)

    def get_blocks(self, req: Request) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(g.block_table(req) for g in self.groups))

    def find_cached_prefix(self, req: Request) -> list[tuple[int, ...]]:
        """One entry per hit block: its table entry in each group."""
        if not self.enable_prefix_caching:
            return []
        hashes = self.groups[0].prefix_hashes(req)
        valid = [g.valid_hits(hashes) for g in self.groups]
        m = max(i for i in range(len(hashes) + 1) if all(v[i] for v in valid))
        self.stats.queries += req.num_tokens
        self.stats.hits += m * self.block_size
        return list(zip(*(g.prefix_table(hashes, m) for g in self.groups)))

    def allocate(self, req: Request, num_new_tokens: int,
                 cached_prefix: Sequence[tuple[int, ...]] = ()) -> bool:
        per_group = ([[entry[g] for entry in cached_prefix] for g in range(len(self.groups))]
                     if cached_prefix else [()] * len(self.groups))
        needs = []
        for g, p in zip(self.groups, per_group):
            need, reusable = g._need(req, num_new_tokens, p)
            if need > g.num_free_blocks - reusable:
                return False
            needs.append(need)
        for g, p, need in zip(self.groups, per_group, needs):
            g.take(req, need, p)
        return True

    def commit(self, req: Request) -> None:
        for g in self.groups:
            g.commit(req)

    def free(self, req: Request) -> None:
        for g in self.groups:
            g.free(req)
