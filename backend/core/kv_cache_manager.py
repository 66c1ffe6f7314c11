"""Maps requests to KV blocks: on-demand allocation, prefix-cache lookup and registration.

The scheduler asks two questions: "how much of this prompt is already cached?"
(``get_computed_blocks``) and "give this request room for N more tokens"
(``allocate_slots``, which fails without side effects when blocks run out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from backend.core.block_pool import BlockPool, KVBlock
from backend.core.kv_cache_utils import cdiv, request_block_hashes
from backend.core.request import Request


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks the KV-cache manager hands out (a prefix hit, the blocks a step writes): the
    scheduler and the engine pass them back, count them or read their ids, and never see the
    pool's bookkeeping (ref counts, hashes, the free queue)."""
    blocks: tuple[KVBlock, ...] = ()

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[KVBlock]:   # for core/ and its tests
        return iter(self.blocks)

    @property
    def block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]


# Stands in a request's block list for a block released out of every layer's sliding window:
# its block-table entry is never read (the kernels start at the window), and it is not the
# pool's (block 0 belongs to whoever holds it).
RELEASED = KVBlock(block_id=0)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 release_window: int | None = None) -> None:
        """``release_window``: no layer reads a key this many positions or more before the query
        (every layer windowed), so blocks wholly before it are released as requests advance."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.release_window = release_window
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_registered: dict[str, int] = {}   # leading blocks of a request already hashed into the cache
        self._num_released: dict[str, int] = {}     # leading blocks of a request released (RELEASED)
        self._block_ids: dict[str, list[int]] = {}  # block_ids_of's answer, until the request's blocks change
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks

    def forget_unwritten(self, groups: Iterable[KVCacheBlocks]) -> None:
        """After a failed step: the prefix-cache entries of those blocks nobody holds any more
        go (the step that was to write their K/V did not)."""
        for group in groups:
            for block in group.blocks:
                if block.ref_count == 0:
                    self.pool.uncache(block)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def blocks_of(self, request_id: str) -> list[KVBlock]:
        """The request's blocks themselves: for core/ and its tests."""
        return self.req_blocks.get(request_id, [])

    def block_ids_of(self, request_id: str) -> list[int]:
        """The request's block table: the same list object for as long as the request's blocks
        stay as they are (the step preparation does not rewrite a row it wrote from this very
        list the step before), a new one once they change. Callers must not modify it."""
        ids = self._block_ids.get(request_id)
        if ids is None:
            blocks = self.req_blocks.get(request_id)
            if blocks is None:
                return []      # holds no blocks: nothing kept for it (free() would not drop it)
            ids = self._block_ids[request_id] = [block.block_id for block in blocks]
        return ids

    def holds_blocks(self, request_id: str) -> bool:
        return bool(self.req_blocks.get(request_id))

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of the request's tokens, in whole blocks. The last token is
        never served from cache: its logits must be computed. A request that asked for prompt
        logprobs reads no cached block: every prompt position's logits must be computed (as in
        vLLM); the blocks it fills are still cached for others."""
        if not self.enable_caching or request.num_computed_tokens > 0 or request.wants_prompt_logprobs:
            return KVCacheBlocks(), 0
        request_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return KVCacheBlocks(tuple(hits)), len(hits) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count a lookup once its request is admitted (a failed admission retries next step
        and must not inflate the hit-rate statistics)."""
        if self.enable_caching:
            self.prefix_queried_tokens += request.num_tokens
            self.prefix_hit_tokens += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: KVCacheBlocks | None = None) -> bool:
        """Make room for ``num_new_tokens`` after the request's computed tokens (and after
        ``computed_blocks``, a prefix hit being attached now). Returns False, changing
        nothing, when there are not enough free blocks."""
        blocks = self.req_blocks.get(request.request_id)
        if not computed and blocks is not None:
            # A running request growing (every decode step): no prefix hit to attach, and a new
            # block only every block_size tokens. The general path below does the same, slower.
            num_tokens = request.num_computed_tokens + num_new_tokens
            num_needed = cdiv(num_tokens, self.block_size) - len(blocks)
            if num_needed > 0:
                if num_needed > self.pool.num_free_blocks:
                    return False
                blocks.extend(self.pool.allocate(num_needed))
                self._block_ids.pop(request.request_id, None)
            if num_tokens // self.block_size > self._num_registered.get(request.request_id, 0):
                self._register_full_blocks(request, num_tokens)   # this step fills a block
            return True
        computed_blocks = list(computed or ())
        blocks = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(computed_blocks)
        # Reviving a free cached block consumes a free-queue entry just like a new block.
        num_revived = sum(1 for b in computed_blocks if b.ref_count == 0)
        if max(num_needed, 0) + num_revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(computed_blocks)
        self._block_ids.pop(request.request_id, None)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(computed_blocks)
        if num_needed > 0:
            blocks.extend(self.pool.allocate(num_needed))
        self._register_full_blocks(request, num_computed + num_new_tokens)
        return True

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Put the blocks that this step fills completely into the prefix cache. Their K/V are
        written in this step's forward pass before any attention reads them, so even a request
        admitted later in the same step may share them."""
        if not self.enable_caching:
            return
        request_block_hashes(request, self.block_size)
        blocks = self.req_blocks[request.request_id]
        start = self._num_registered.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        self.pool.cache_full_blocks(request, blocks, start, end)
        self._num_registered[request.request_id] = max(start, end)

    def release_outside_window(self, request: Request) -> int:
        """Free the request's leading blocks that no later query reads: the next query sits at
        ``num_computed_tokens`` and sees keys after ``num_computed_tokens - release_window``.
        A released block keeps its prefix-cache entry (its K/V are still those of its prefix).
        Returns how many blocks were released."""
        if self.release_window is None:
            return 0
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return 0
        unread = max(0, request.num_computed_tokens - self.release_window + 1) // self.block_size
        start = self._num_released.get(request.request_id, 0)
        if unread <= start:
            return 0
        freed = blocks[start:unread]
        blocks[start:unread] = [RELEASED] * len(freed)
        self._block_ids.pop(request.request_id, None)
        self._num_released[request.request_id] = unread
        self.pool.free(list(reversed(freed)))
        return len(freed)

    def cache_computed_blocks(self, request: Request) -> None:
        """Put the request's full computed blocks into the prefix cache before it ends. A no-op
        for a synchronous engine, which registered each when it was scheduled; under
        async_scheduling the block holding a step's input is not, when that input was still
        on the device then (its hash needs the token)."""
        if request.request_id in self.req_blocks:
            self._register_full_blocks(request, request.num_computed_tokens)

    def free(self, request: Request) -> None:
        blocks = [b for b in self.req_blocks.pop(request.request_id, []) if b is not RELEASED]
        self._block_ids.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        self._num_released.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))
        # Blocks past the computed tokens were registered when they were allocated, because
        # the step's forward pass fills them; a request freed before that pass ran (preempted
        # while the step was being scheduled, or failed in the step) leaves them unwritten,
        # and their hashes must not outlive the missing content.
        for block in blocks[request.num_computed_tokens // self.block_size:]:
            if block.ref_count == 0:
                self.pool.uncache(block)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past the first ``num_tokens`` positions (slots that
        rejected speculative drafts took). Such blocks never held a verified full block, so
        none is in the prefix cache."""
        blocks = self.req_blocks.get(request.request_id, [])
        keep = cdiv(num_tokens, self.block_size)
        if len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            self._block_ids.pop(request.request_id, None)
            self.pool.free(list(reversed(extra)))

    def uncomputed_blocks(self, request: Request) -> KVCacheBlocks:
        """The request's blocks whose K/V this step was to write (not yet valid)."""
        return KVCacheBlocks(tuple(self.blocks_of(request.request_id)[request.num_computed_tokens // self.block_size:]))

    def computed_blocks(self, request: Request) -> KVCacheBlocks:
        """The request's blocks whose K/V it reads as already computed."""
        blocks = self.blocks_of(request.request_id)[:request.num_computed_tokens // self.block_size]
        return KVCacheBlocks(tuple(b for b in blocks if b is not RELEASED))

    def check_invariants(self, live_requests: dict[str, Request]) -> None:
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for request_id, blocks in self.req_blocks.items():
            request = live_requests.get(request_id)
            if request is None:
                raise AssertionError(f"blocks held by unknown or finished request {request_id}")
            if len(blocks) < cdiv(request.num_computed_tokens, self.block_size):
                raise AssertionError(f"{request_id}: {len(blocks)} blocks cannot hold "
                                     f"{request.num_computed_tokens} computed tokens")
            released = self._num_released.get(request_id, 0)
            if any(b is RELEASED for b in blocks[released:]) or any(b is not RELEASED for b in blocks[:released]):
                raise AssertionError(f"{request_id}: released blocks are not exactly its first {released}")
            for block in blocks[released:]:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            if block.ref_count != refs.get(block.block_id, 0):
                raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count}, "
                                     f"held by {refs.get(block.block_id, 0)} requests")
