"""Property-based tests of the paged KV cache: ``BlockPool`` and ``KVCacheManager``.

The state machine drives ``KVCacheManager`` the way ``backend/core/scheduler.py`` does (admission
with a prefix-cache lookup, chunked prefill, decode steps, preemption, finishing) and keeps
a small *model* next to it:

* ``content``: for every block, the token prefix whose K/V the block holds (what a real
  forward pass would have written there). It lets the tests check that a prefix hit serves
  K/V of exactly the right tokens, not just a block with a matching hash.
* ``lru``: the free queue, least recently used first, so every allocation can be checked to
  evict in LRU order.

Tokens come from a tiny vocabulary (0..3) so that prompts collide and prefix hits are common.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from collections.abc import Sequence

import hypothesis.strategies as st
from hypothesis import assume, event, given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from backend.core.block_pool import BlockPool, KVBlock
from backend.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from backend.core.kv_cache_utils import cdiv, hash_block
from backend.core.request import Request
from backend.sampling_params import SamplingParams

VOCAB = st.integers(0, 3)
FOREIGN_TOKEN = 9          # never drawn from VOCAB: a "hog" request made of it shares no prefix
_arrival = itertools.count()


# ---- helpers ---------------------------------------------------------------------------------

def make_request(tokens: Sequence[int]) -> Request:
    """A request with the fields the engine requires; only the tokens matter to the KV cache."""
    seq = next(_arrival)
    return Request(request_id=f"req-{seq:08d}", prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(), arrival_seq=seq, arrival_time=float(seq),
                   max_tokens=16, eos_token_ids=frozenset())


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of the full blocks of ``tokens`` (what ``Request.block_hashes`` must be)."""
    out: list[bytes] = []
    for i in range(len(tokens) // block_size):
        out.append(hash_block(out[-1] if out else None, list(tokens[i * block_size:(i + 1) * block_size])))
    return out


def free_queue_order(pool: BlockPool) -> list[int]:
    """Block ids in the pool's free queue, least recently used first (white-box read)."""
    return list(pool._free_queue)


def ids(blocks: Sequence[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def admit_whole_prompt(kv: KVCacheManager, request: Request) -> int:
    """Scheduler-style admission of the whole prompt in one step; returns the hit length."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    request.num_computed_tokens = num_hit
    request.num_computed_tokens += request.num_tokens - num_hit   # the step ran
    return num_hit


def test_a_block_table_is_the_same_list_until_its_blocks_change() -> None:
    """block_ids_of hands out one list while the request's blocks stay as they are (the step
    preparation skips rewriting a row it wrote from that list) and a new, right one after each
    kind of change: a block added, blocks trimmed (rejected drafts), blocks released outside a
    sliding window, the request freed."""
    kv = KVCacheManager(16, 4, enable_caching=True, release_window=8)
    request = make_request(range(10))
    admit_whole_prompt(kv, request)                      # 10 tokens: 3 blocks
    table = kv.block_ids_of(request.request_id)
    assert table == ids(kv.blocks_of(request.request_id)) and len(table) == 3
    assert kv.allocate_slots(request, 1)                 # token 11 fits the third block
    assert kv.block_ids_of(request.request_id) is table
    request.append_token(10)
    request.num_computed_tokens += 1
    assert kv.allocate_slots(request, 2)                 # tokens 12-13: a fourth block
    grown = kv.block_ids_of(request.request_id)
    assert grown is not table and grown == ids(kv.blocks_of(request.request_id)) and len(grown) == 4
    kv.trim(request, request.num_computed_tokens)        # the two slots were rejected drafts
    trimmed = kv.block_ids_of(request.request_id)
    assert trimmed is not grown and trimmed == ids(kv.blocks_of(request.request_id)) and len(trimmed) == 3
    for token in range(11, 16):
        request.append_token(token)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
    before = kv.block_ids_of(request.request_id)
    assert kv.release_outside_window(request) > 0        # 16 computed, window 8: leading blocks go
    released = kv.block_ids_of(request.request_id)
    assert released is not before and released == ids(kv.blocks_of(request.request_id))
    kv.free(request)
    assert kv.block_ids_of(request.request_id) == []


# ---- 1. stateful model of the KV cache manager -------------------------------------------------

class KVCacheMachine(RuleBasedStateMachine):
    """Random interleavings of admission, chunked prefill, decode, preemption, finish and
    over-allocation. After every operation: the manager's own invariants, ref counts equal
    the number of live holders, free + in-use == total, cached hashes are unique and match
    the K/V content of their block, the free queue is in model LRU order, and every live
    request's blocks hold exactly that request's tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager | None = None
        self.live: dict[str, Request] = {}
        self.waiting: dict[str, Request] = {}      # never admitted yet, or preempted
        self.token_lists: list[list[int]] = []     # earlier prompts/sequences to reuse as prefixes
        self.content: dict[int, tuple[int, ...]] = {}
        self.lru: list[int] = []

    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(1, 12),
                enable_caching=st.sampled_from([True, True, True, False]))
    def setup(self, block_size: int, num_blocks: int, enable_caching: bool) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching)
        self.lru = list(range(num_blocks))
        self.content = {i: () for i in range(num_blocks)}

    # -- model-checked primitives --

    def _snapshot(self, request: Request) -> tuple:
        kv = self.kv
        pool = kv.pool
        rids = sorted(set(self.live) | {request.request_id})
        return (pool.num_free_blocks, free_queue_order(pool), pool.num_cached_blocks,
                [(b.ref_count, b.block_hash) for b in pool.blocks],
                sorted(kv.req_blocks), {rid: ids(kv.blocks_of(rid)) for rid in rids},
                request.num_computed_tokens, request.num_tokens)

    def _allocate(self, request: Request, num_new: int, hits: KVCacheBlocks) -> bool:
        """``allocate_slots`` checked against the model: it succeeds exactly when the new blocks
        plus revived cached blocks fit in the free queue, fails without any side effect
        otherwise, takes new blocks in LRU order and never writes into a shared block."""
        kv = self.kv
        bs = kv.block_size
        rid = request.request_id
        before = list(kv.blocks_of(rid))
        snap = self._snapshot(request)
        num_computed = request.num_computed_tokens + len(hits) * bs
        need_new = max(cdiv(num_computed + num_new, bs) - len(before) - len(hits), 0)
        revived = [b for b in hits if b.ref_count == 0]
        expect_ok = need_new + len(revived) <= kv.num_free_blocks

        ok = kv.allocate_slots(request, num_new, hits)
        event("allocate_slots " + ("ok" if ok else "failed") + (" with revival" if revived else ""))
        assert ok == expect_ok, (need_new, len(revived), kv.num_free_blocks)
        if not ok:
            assert self._snapshot(request) == snap, "failed allocate_slots changed state"
            return False

        after = kv.blocks_of(rid)
        assert len(after) == len(before) + len(hits) + need_new
        assert all(x is y for x, y in zip(after, before + list(hits)))
        fresh = after[len(before) + len(hits):]
        for block in revived:
            self.lru.remove(block.block_id)
        assert ids(fresh) == self.lru[:need_new], "new blocks not taken in LRU order"
        del self.lru[:need_new]
        if any(b.block_hash is not None for b in fresh):
            event("allocation evicted a cached block")
        for block in fresh:
            assert block.ref_count == 1
            self.content[block.block_id] = ()
        # The step's forward pass writes K/V for positions [num_computed, num_computed + num_new).
        end = num_computed + num_new
        for i in range(num_computed // bs, cdiv(end, bs)):
            block = after[i]
            assert block.ref_count == 1, f"step writes into shared block {block.block_id}"
            new = tuple(request.token_ids[:min((i + 1) * bs, end)])
            old = self.content[block.block_id]
            assert new[:len(old)] == old, f"step overwrites K/V of block {block.block_id}"
            self.content[block.block_id] = new
        return True

    def _free(self, request: Request) -> None:
        """``free`` drops one reference per block, tail-first into the LRU queue."""
        blocks = list(self.kv.blocks_of(request.request_id))
        self.kv.free(request)
        for block in reversed(blocks):
            if block.ref_count == 0:
                self.lru.append(block.block_id)
        assert self.kv.blocks_of(request.request_id) == []

    def _check_prefix_hit(self, request: Request, hits: KVCacheBlocks, num_hit: int) -> None:
        """A hit is whole blocks, never the last token, serves K/V of exactly the request's
        prefix, and is maximal: the next block is genuinely not in the cache."""
        kv = self.kv
        bs = kv.block_size
        assert num_hit == len(hits) * bs
        assert num_hit <= request.num_tokens - 1, "the last prompt token was served from cache"
        if not kv.enable_caching:
            assert len(hits) == 0
            return
        assert request.block_hashes == chain_hashes(request.token_ids, bs)
        for i, block in enumerate(hits):
            assert block.block_hash == request.block_hashes[i]
            assert self.content[block.block_id] == tuple(request.token_ids[:(i + 1) * bs]), \
                f"prefix hit on block {block.block_id} serves K/V of other tokens"
        if len(hits) < (request.num_tokens - 1) // bs:
            missing = request.block_hashes[len(hits)]
            target = tuple(request.token_ids[:(len(hits) + 1) * bs])
            assert all(b.block_hash != missing for b in kv.pool.blocks), "lookup stopped early"
            assert not any(b.block_hash is not None and self.content[b.block_id] == target
                           for b in kv.pool.blocks), "a registered block held the next prefix"

    def _admit(self, request: Request, data: st.DataObject) -> None:
        """Mimic ``Scheduler._admit``: lookup, allocate the (possibly chunked) rest, set the
        counter to the hit, then let the step run."""
        hits, num_hit = self.kv.get_computed_blocks(request)
        self._check_prefix_hit(request, hits, num_hit)
        event("admission with prefix hit" if hits else "admission without hit")
        remaining = request.num_tokens - num_hit
        num_new = data.draw(st.one_of(st.just(remaining), st.integers(1, remaining)), label="chunk")
        if not self._allocate(request, num_new, hits):
            self.waiting[request.request_id] = request
            return
        self.waiting.pop(request.request_id, None)
        request.num_computed_tokens = num_hit
        self.live[request.request_id] = request
        self._check_all(settled=False)        # between scheduling and the forward pass
        request.num_computed_tokens += num_new

    def _check_all(self, settled: bool = True) -> None:
        kv = self.kv
        pool = kv.pool
        bs = kv.block_size
        kv.check_invariants(self.live)
        holders: Counter[int] = Counter()
        for rid, request in self.live.items():
            blocks = kv.blocks_of(rid)
            assert len({id(b) for b in blocks}) == len(blocks), f"{rid} holds a block twice"
            need = cdiv(request.num_computed_tokens, bs)
            assert len(blocks) >= need
            if settled:
                assert len(blocks) == need, "blocks allocated beyond the computed tokens"
            holders.update(ids(blocks))
            for i, block in enumerate(blocks[:need]):
                n = min((i + 1) * bs, request.num_computed_tokens)
                have = self.content[block.block_id]
                assert have[:n] == tuple(request.token_ids[:n]), \
                    f"{rid} block {i} (id {block.block_id}) holds K/V of other tokens"
                if settled:
                    assert len(have) == n
        for rid in self.waiting:
            assert kv.blocks_of(rid) == [], f"waiting request {rid} holds blocks"
        for rid in [*self.live, *self.waiting]:   # the block table handed out is never stale
            assert kv.block_ids_of(rid) == ids(kv.blocks_of(rid)), f"{rid}: stale block table"
        for block in pool.blocks:
            assert block.ref_count == holders[block.block_id], \
                f"block {block.block_id}: ref_count {block.ref_count} vs {holders[block.block_id]} holders"
        in_use = sum(1 for b in pool.blocks if b.ref_count > 0)
        assert pool.num_free_blocks + in_use == pool.num_blocks
        assert free_queue_order(pool) == self.lru
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        assert len({b.block_hash for b in hashed}) == len(hashed) == pool.num_cached_blocks
        assert pool.num_cached_free_blocks == sum(1 for b in hashed if b.ref_count == 0)
        if not kv.enable_caching:
            assert not hashed
        for block in hashed:
            have = self.content[block.block_id]
            assert pool.get_cached_block(block.block_hash) is block
            assert have and len(have) % bs == 0, f"partial block {block.block_id} registered"
            assert chain_hashes(have, bs)[-1] == block.block_hash, \
                f"block {block.block_id} registered under a hash of other tokens"

    # -- rules --

    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        """A new request: a fresh random prompt, or an earlier sequence's prefix plus new tokens."""
        if self.token_lists and data.draw(st.booleans(), label="reuse prefix"):
            base = data.draw(st.sampled_from(self.token_lists), label="base")
            k = data.draw(st.integers(0, len(base)), label="prefix len")
            tokens = base[:k] + data.draw(st.lists(VOCAB, max_size=6), label="suffix")
        else:
            tokens = data.draw(st.lists(VOCAB, min_size=1, max_size=12), label="prompt")
        tokens = tokens or [0]
        request = make_request(tokens)
        self.token_lists.append(list(tokens))
        self._admit(request, data)
        self._check_all()

    @rule(data=st.data())
    def readmit(self, data: st.DataObject) -> None:
        """Retry admission of a waiting request (never admitted for lack of blocks, or preempted)."""
        if not self.waiting:   # nothing to act on: admit a new request instead
            return self.add_request(data)
        request = self.waiting[data.draw(st.sampled_from(list(self.waiting)), label="waiting")]
        self._admit(request, data)
        self._check_all()

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """A prefill chunk or a decode step: catch the counter up with the token list."""
        if not self.live:   # nothing to act on: admit a new request instead
            return self.add_request(data)
        request = self.live[data.draw(st.sampled_from(list(self.live)), label="running")]
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(data.draw(VOCAB, label="sampled"))   # previous step's output
        pending = request.num_tokens - request.num_computed_tokens
        num_new = data.draw(st.integers(1, pending), label="num_new")
        if self._allocate(request, num_new, []):
            request.num_computed_tokens += num_new
        self._check_all()

    @rule(data=st.data())
    def over_allocate(self, data: st.DataObject) -> None:
        """Asking for one block more than is free fails and changes nothing."""
        if not self.live:   # nothing to act on: admit a new request instead
            return self.add_request(data)
        kv = self.kv
        request = self.live[data.draw(st.sampled_from(list(self.live)), label="running")]
        capacity = (len(kv.blocks_of(request.request_id)) + kv.num_free_blocks) * kv.block_size
        num_new = capacity - request.num_computed_tokens + data.draw(st.integers(1, 5), label="excess")
        assert not self._allocate(request, num_new, [])
        self._check_all()

    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """Preemption by recompute: free the blocks, reset the counter, back to waiting."""
        if not self.live:   # nothing to act on: admit a new request instead
            return self.add_request(data)
        request = self.live.pop(data.draw(st.sampled_from(list(self.live)), label="victim"))
        self._free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting[request.request_id] = request
        self.token_lists.append(list(request.token_ids))
        self._check_all()

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """Finish a running request or abort a waiting one (which holds no blocks)."""
        if not (self.live or self.waiting):   # nothing to act on: admit a new request instead
            return self.add_request(data)
        rid = data.draw(st.sampled_from(list(self.live) + list(self.waiting)), label="finish")
        request = self.live.pop(rid, None) or self.waiting.pop(rid)
        self._free(request)
        self.token_lists.append(list(request.token_ids))
        self._check_all()

    @invariant()
    def invariants_hold(self) -> None:
        if self.kv is not None:
            self._check_all()

    def teardown(self) -> None:
        if self.kv is None:
            return
        for request in list(self.live.values()):
            self._free(request)
        self.live.clear()
        self._check_all()
        assert self.kv.pool.num_free_blocks == self.kv.pool.num_blocks
        assert all(b.ref_count == 0 for b in self.kv.pool.blocks)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---- 2. prefix-hit correctness -----------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(block_size=st.integers(1, 4), k=st.integers(0, 4), data=st.data())
def test_prefix_hit_after_free_reuses_blocks(block_size: int, k: int, data: st.DataObject) -> None:
    """A (k shared full blocks, then its own tail) is freed; B sharing exactly those k*bs tokens hits
    min(k, (len(B)-1)//bs) blocks, and they are A's very blocks."""
    bs = block_size
    shared = data.draw(st.lists(VOCAB, min_size=k * bs, max_size=k * bs))
    tail_a = data.draw(st.lists(VOCAB, min_size=0 if k else 1, max_size=bs))
    suffix_b = data.draw(st.lists(VOCAB, min_size=0 if k else 1, max_size=2 * bs))
    if tail_a and suffix_b:     # B diverges from A right after the shared blocks
        suffix_b[0] = (tail_a[0] + 1) % 4
    a, b = make_request(shared + tail_a), make_request(shared + suffix_b)
    kv = KVCacheManager(cdiv(a.num_tokens, bs) + cdiv(b.num_tokens, bs), bs, enable_caching=True)

    assert admit_whole_prompt(kv, a) == 0
    a_blocks = list(kv.blocks_of(a.request_id))
    kv.free(a)
    assert kv.pool.num_cached_blocks == kv.pool.num_cached_free_blocks == a.num_tokens // bs

    hits, num_hit = kv.get_computed_blocks(b)
    expected = min(k, (b.num_tokens - 1) // bs)
    assert num_hit == expected * bs
    assert [h is x for h, x in zip(hits, a_blocks)] == [True] * expected and len(hits) == expected
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    b.num_computed_tokens = num_hit
    assert ids(kv.blocks_of(b.request_id)[:expected]) == ids(a_blocks[:expected])
    kv.check_invariants({b.request_id: b})


@settings(max_examples=60, deadline=None)
@given(block_size=st.integers(1, 4), m=st.integers(1, 4), data=st.data())
def test_block_aligned_fully_cached_prompt_recomputes_last_block(block_size: int, m: int,
                                                                 data: st.DataObject) -> None:
    """A prompt of exactly m full blocks, all cached, hits (m-1) blocks: the last token's
    logits must be computed, so its whole block is recomputed."""
    bs = block_size
    prompt = data.draw(st.lists(VOCAB, min_size=m * bs, max_size=m * bs))
    kv = KVCacheManager(m + data.draw(st.integers(0, 2)), bs, enable_caching=True)
    a = make_request(prompt)
    admit_whole_prompt(kv, a)
    a_blocks = list(kv.blocks_of(a.request_id))
    kv.free(a)
    assert kv.pool.num_cached_blocks == m

    b = make_request(prompt)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == (m - 1) * bs == b.num_tokens - bs
    assert all(h is x for h, x in zip(hits, a_blocks)) and len(hits) == m - 1
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    b.num_computed_tokens = b.num_tokens
    kv.check_invariants({b.request_id: b})
    assert len(kv.blocks_of(b.request_id)) == m
    # every full block of the prompt is still findable in the cache
    for i, h in enumerate(chain_hashes(prompt, bs)):
        assert kv.pool.get_cached_block(h) is not None, f"block {i} lost from the cache"


@settings(max_examples=60, deadline=None)
@given(block_size=st.integers(1, 4), prompt=st.lists(VOCAB, min_size=1, max_size=12))
def test_no_hits_when_caching_disabled(block_size: int, prompt: list[int]) -> None:
    """With prefix caching off nothing is registered and nothing is ever hit."""
    kv = KVCacheManager(2 * cdiv(len(prompt), block_size), block_size, enable_caching=False)
    a = make_request(prompt)
    admit_whole_prompt(kv, a)
    kv.free(a)
    b = make_request(prompt)
    assert kv.get_computed_blocks(b) == (KVCacheBlocks(), 0)
    assert kv.pool.num_cached_blocks == 0


@settings(max_examples=60, deadline=None)
@given(block_size=st.integers(1, 4), m=st.integers(1, 3), data=st.data())
def test_prefix_hit_requires_identical_history(block_size: int, m: int, data: st.DataObject) -> None:
    """Block j of B has the same tokens as block j of A but a different block 0: the chained
    hash differs, so B gets no hit at all (K/V depend on everything before a block)."""
    bs = block_size
    head_a = data.draw(st.lists(VOCAB, min_size=bs, max_size=bs))
    head_b = data.draw(st.lists(VOCAB, min_size=bs, max_size=bs))
    assume(head_a != head_b)
    rest = data.draw(st.lists(VOCAB, min_size=m * bs, max_size=m * bs))
    kv = KVCacheManager(2 * (m + 2), bs, enable_caching=True)
    a = make_request(head_a + rest + [0])
    admit_whole_prompt(kv, a)
    kv.free(a)
    b = make_request(head_b + rest + [0])
    assert kv.get_computed_blocks(b) == (KVCacheBlocks(), 0)
    assert not set(b.block_hashes) & set(a.block_hashes)


# ---- 3. LRU eviction ---------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(block_size=st.integers(1, 4), spare=st.integers(0, 3), data=st.data())
def test_lru_eviction_is_tail_first_per_request(block_size: int, spare: int,
                                                data: st.DataObject) -> None:
    """Free A then C: eviction takes never-used blocks, then A's blocks tail-first, then C's.
    Evicted hashes are gone; surviving blocks of A stay a usable chain prefix."""
    bs = block_size
    prompt_a = [0] + data.draw(st.lists(VOCAB, min_size=bs, max_size=3 * bs))
    prompt_c = [1] + data.draw(st.lists(VOCAB, min_size=0, max_size=3 * bs))
    a, c = make_request(prompt_a), make_request(prompt_c)
    num_blocks = cdiv(a.num_tokens, bs) + cdiv(c.num_tokens, bs) + spare
    kv = KVCacheManager(num_blocks, bs, enable_caching=True)
    admit_whole_prompt(kv, a)
    admit_whole_prompt(kv, c)
    a_blocks, c_blocks = list(kv.blocks_of(a.request_id)), list(kv.blocks_of(c.request_id))
    untouched = [i for i in range(num_blocks) if i not in set(ids(a_blocks + c_blocks))]
    first, second = (a_blocks, c_blocks) if data.draw(st.booleans()) else (c_blocks, a_blocks)
    kv.free(a if first is a_blocks else c)
    kv.free(c if first is a_blocks else a)
    lru = untouched + ids(first[::-1]) + ids(second[::-1])
    assert free_queue_order(kv.pool) == lru

    num_evict = data.draw(st.integers(1, num_blocks))
    hog = make_request([FOREIGN_TOKEN] * (num_evict * bs))
    assert admit_whole_prompt(kv, hog) == 0
    assert ids(kv.blocks_of(hog.request_id)) == lru[:num_evict]
    evicted = set(lru[:num_evict])
    for blocks, req in ((a_blocks, a), (c_blocks, c)):
        for i, h in enumerate(req.block_hashes):
            found = kv.pool.get_cached_block(h)
            if blocks[i].block_id in evicted:
                assert found is None, "evicted block's hash still in the cache"
            else:
                assert found is blocks[i]
    kv.check_invariants({hog.request_id: hog})

    # Tail-first eviction leaves A's surviving cached blocks as a prefix of its chain.
    a2 = make_request(prompt_a)
    hits, num_hit = kv.get_computed_blocks(a2)
    survivors = 0
    while survivors < len(a.block_hashes) and a_blocks[survivors].block_id not in evicted:
        survivors += 1
    assert all(blk.block_id in evicted for blk in a_blocks[survivors:len(a.block_hashes)])
    assert len(hits) == min(survivors, (a2.num_tokens - 1) // bs)
    assert all(h is x for h, x in zip(hits, a_blocks))


@settings(max_examples=60, deadline=None)
@given(block_size=st.integers(1, 4), m=st.integers(2, 4), data=st.data())
def test_evicted_head_block_stops_the_chain(block_size: int, m: int, data: st.DataObject) -> None:
    """If the head block is evicted while later blocks stay cached, a lookup misses at the
    head and stops there: the later (still cached) blocks are not served."""
    bs = block_size
    prompt = data.draw(st.lists(VOCAB, min_size=m * bs, max_size=m * bs)) + [0]
    kv = KVCacheManager(m + 1, bs, enable_caching=True)
    a = make_request(prompt)
    admit_whole_prompt(kv, a)
    blocks = list(kv.blocks_of(a.request_id))
    kv.free(a)
    pool = kv.pool
    # Re-reference the non-head blocks so block 0 becomes the LRU cached block.
    pool.touch(blocks[1:])
    pool.free(blocks[:0:-1])
    order = free_queue_order(pool)
    assert order.index(blocks[0].block_id) < min(order.index(b.block_id) for b in blocks[1:m])
    before_cached = pool.num_cached_blocks
    victims = pool.allocate(order.index(blocks[0].block_id) + 1)
    assert victims[-1] is blocks[0]
    assert blocks[0].block_hash is None and pool.get_cached_block(a.block_hashes[0]) is None
    assert pool.num_cached_blocks == before_cached - 1
    assert pool.get_cached_block(a.block_hashes[1]) is blocks[1]
    b = make_request(prompt)
    assert kv.get_computed_blocks(b) == (KVCacheBlocks(), 0)
    pool.free(victims)
    pool.check_invariants()


@settings(max_examples=60, deadline=None)
@given(block_size=st.integers(1, 4), m=st.integers(1, 3), spare=st.integers(0, 2), data=st.data())
def test_revival_counts_against_free_blocks(block_size: int, m: int, spare: int,
                                            data: st.DataObject) -> None:
    """Reviving cached-free blocks consumes free-queue entries: when hits + new blocks exceed
    the free blocks, allocate_slots fails and nothing (ref counts, queue order, cache) moves."""
    bs = block_size
    prompt = data.draw(st.lists(VOCAB, min_size=m * bs, max_size=m * bs))
    extra = data.draw(st.lists(VOCAB, min_size=1, max_size=(spare + 1) * bs))
    kv = KVCacheManager(m + 1 + spare, bs, enable_caching=True)
    a = make_request(prompt + [0])
    admit_whole_prompt(kv, a)
    kv.free(a)
    hog = make_request([FOREIGN_TOKEN] * (spare + 1) * bs)   # leaves exactly m free (A's cached) blocks
    admit_whole_prompt(kv, hog)
    assert kv.num_free_blocks == m
    b = make_request(prompt + extra)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == m * bs
    pool = kv.pool
    snap = (free_queue_order(pool), [(x.ref_count, x.block_hash) for x in pool.blocks])
    assert not kv.allocate_slots(b, b.num_tokens - num_hit, hits)   # needs m revived + >= 1 new
    assert (free_queue_order(pool), [(x.ref_count, x.block_hash) for x in pool.blocks]) == snap
    assert kv.blocks_of(b.request_id) == [] and b.request_id not in kv.req_blocks
    kv.free(hog)
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits)
    b.num_computed_tokens = num_hit
    assert all(x is y for x, y in zip(kv.blocks_of(b.request_id), hits))
    kv.check_invariants({b.request_id: b})


# ---- 4. shared blocks --------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(block_size=st.integers(1, 4), m=st.integers(1, 3), data=st.data())
def test_live_requests_share_prefix_blocks(block_size: int, m: int, data: st.DataObject) -> None:
    """B admitted while A runs shares A's registered prefix blocks (same objects, ref_count 2);
    freeing A leaves them at ref_count 1 and out of the free queue."""
    bs = block_size
    shared = data.draw(st.lists(VOCAB, min_size=m * bs, max_size=m * bs))
    prompt_a = shared + data.draw(st.lists(VOCAB, max_size=2 * bs))
    prompt_b = shared + data.draw(st.lists(VOCAB, min_size=1, max_size=2 * bs))
    a, b = make_request(prompt_a), make_request(prompt_b)
    kv = KVCacheManager(cdiv(a.num_tokens, bs) + cdiv(b.num_tokens, bs), bs, enable_caching=True)
    pool = kv.pool
    admit_whole_prompt(kv, a)
    a_blocks = list(kv.blocks_of(a.request_id))

    common = 0
    while (common < len(prompt_a) // bs and
           prompt_a[common * bs:(common + 1) * bs] == prompt_b[common * bs:(common + 1) * bs]):
        common += 1
    expected = min(common, (len(prompt_b) - 1) // bs)
    assert expected >= m
    assert admit_whole_prompt(kv, b) == expected * bs
    b_blocks = list(kv.blocks_of(b.request_id))
    shared_blocks = a_blocks[:expected]
    assert all(x is y for x, y in zip(b_blocks, shared_blocks))
    assert not set(ids(b_blocks[expected:])) & set(ids(a_blocks))
    assert all(x.ref_count == 2 for x in shared_blocks)
    kv.check_invariants({a.request_id: a, b.request_id: b})

    kv.free(a)
    queue = set(free_queue_order(pool))
    assert all(x.ref_count == 1 and x.block_id not in queue for x in shared_blocks)
    assert all(x.ref_count == 0 and x.block_id in queue for x in a_blocks[expected:])
    assert kv.num_free_blocks == pool.num_blocks - len(b_blocks)
    kv.check_invariants({b.request_id: b})

    kv.free(b)
    assert kv.num_free_blocks == pool.num_blocks
    for i, x in enumerate(shared_blocks):
        assert pool.get_cached_block(a.block_hashes[i]) is x
    kv.check_invariants({})


# ---- 5. hash chaining --------------------------------------------------------------------------

PARENTS = st.one_of(st.none(), st.binary(min_size=1, max_size=16).map(lambda b: hashlib.sha256(b).digest()))
TOKENS = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=8)


@settings(max_examples=100, deadline=None)
@given(p1=PARENTS, p2=PARENTS, tokens=TOKENS)
def test_hash_block_depends_on_parent(p1: bytes | None, p2: bytes | None, tokens: list[int]) -> None:
    """The same tokens under different parents hash differently; the hash is deterministic."""
    assume(p1 != p2)
    assert hash_block(p1, tokens) != hash_block(p2, tokens)
    assert hash_block(p1, tokens) == hash_block(p1, list(tokens))
    assert len(hash_block(p1, tokens)) == 32


@settings(max_examples=100, deadline=None)
@given(parent=PARENTS, t1=TOKENS, t2=TOKENS)
def test_hash_block_depends_on_tokens(parent: bytes | None, t1: list[int], t2: list[int]) -> None:
    """Different token lists under the same parent hash differently."""
    assume(t1 != t2)
    assert hash_block(parent, t1) != hash_block(parent, t2)


@settings(max_examples=60, deadline=None)
@given(block_size=st.integers(1, 4), tokens=st.lists(VOCAB, min_size=1, max_size=16))
def test_request_block_hashes_are_chained(block_size: int, tokens: list[int]) -> None:
    """A request's block hashes are the chain over its full blocks, extended as tokens grow."""
    kv = KVCacheManager(16, block_size, enable_caching=True)
    r = make_request(tokens)
    kv.get_computed_blocks(r)
    assert r.block_hashes == chain_hashes(tokens, block_size)
    for _ in range(block_size):
        r.append_token(1)
    kv.get_computed_blocks(r)
    assert r.block_hashes == chain_hashes(r.token_ids, block_size)
