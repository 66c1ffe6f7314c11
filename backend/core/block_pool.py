"""The pool of KV-cache blocks: ref counts, an LRU free queue and the prefix-cache index.

Every block is created once. A block with ``ref_count == 0`` sits in the free queue;
if it still carries a ``block_hash`` it is a *cached* block: a prefix hit revives it
(takes it out of the queue), and popping it for new use evicts its hash. Blocks are
freed tail-first so the least reusable blocks (ends of sequences) are evicted first.

Every change to the prefix cache goes through here (``cache_full_blocks``, eviction in
``allocate``, ``uncache``, ``reset_prefix_cache``), so this is where KV-cache events are
reported (backend/core/kv_events.py), when a recorder is attached.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backend.core.kv_events import KVEventRecorder
    from backend.core.request import Request


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None   # set once the block is full and registered in the prefix cache


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order is LRU order: popitem(last=False) gives the eviction candidate.
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}
        # Told every block stored in and dropped from the prefix cache (kv_events.record_events
        # attaches it). None, the default, leaves each path below one test of it.
        self.events: KVEventRecorder | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or free-but-revivable)."""
        return len(self._cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self._cached.values() if b.ref_count == 0)

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Pop ``num_blocks`` least-recently-used free blocks, evicting their cached content."""
        if num_blocks > len(self._free_queue):
            raise RuntimeError(f"asked for {num_blocks} blocks, only {len(self._free_queue)} free")
        out = []
        evicted: list[bytes] = []
        for _ in range(num_blocks):
            _, block = self._free_queue.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                if self.events is not None:
                    evicted.append(block.block_hash)
                block.block_hash = None
            block.ref_count = 1
            out.append(block)
        if evicted and self.events is not None:
            self.events.blocks_removed(evicted)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving those that were free."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free_queue[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue's tail
        in the given order (callers pass them tail-first)."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_queue[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: bytes) -> bool:
        """Register a full block under its chained hash; True if it is new in the cache. If
        another block already holds the same content (two requests computed it concurrently),
        keep the existing entry."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def cache_full_blocks(self, request: Request, blocks: list[KVBlock], start: int, end: int) -> None:
        """Register the request's blocks ``start``..``end - 1`` (full ones) under its block
        hashes. Those new in the cache are reported as stored (blocks a prefix hit brought, or
        that another block already holds, are not news)."""
        stored = [i for i in range(start, end) if self.cache_block(blocks[i], request.block_hashes[i])]
        if stored and self.events is not None:
            self.events.blocks_stored(request, stored)

    def uncache(self, block: KVBlock) -> None:
        """Drop a block's prefix-cache entry (its K/V will not be what the hash says)."""
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.blocks_removed([block.block_hash])
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            block.block_hash = None
        self._cached.clear()
        if self.events is not None:
            self.events.all_cleared()

    def check_invariants(self) -> None:
        free_ids = set(self._free_queue)
        if len(free_ids) != len(self._free_queue):
            raise AssertionError("free queue holds a block twice")
        for block in self.blocks:
            if block.ref_count < 0:
                raise AssertionError(f"block {block.block_id} has ref_count {block.ref_count}")
            if (block.ref_count == 0) != (block.block_id in free_ids):
                raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count} but "
                                     f"{'in' if block.block_id in free_ids else 'not in'} the free queue")
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise AssertionError(f"block {block.block_id} carries a hash the cache index lacks")
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"cache index entry points at block {block.block_id} with another hash")
