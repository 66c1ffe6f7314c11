"""Iteration-level scheduler: decides, every step, how many tokens each request computes.

Each step: running requests first (decodes and unfinished prefill chunks), then admission
from the waiting queue, all under a token budget (``max_num_batched_tokens``) and a
sequence cap (``max_num_seqs``). When KV blocks run out, the lowest-priority,
latest-arrived running request is preempted by recompute: its blocks are freed, its
counter reset, and it goes back to the waiting queue (where its early arrival puts it
near the front). ``batching="static"`` is the naive baseline: a new batch is formed only
once every request of the previous one has finished.

Speculative decoding (backend/sample/speculative.py) adds a last phase: a decoding request with a
draft proposal gets its drafts scheduled as extra tokens of its decode, from whatever budget
and free blocks are left (drafts never preempt anyone and are the first thing dropped).
After the step, ``finish_speculation`` moves the counter back over the rejected drafts and
frees the blocks that only they needed.

A waiting request whose constraint is still being built off the engine thread (a grammar
compiling, ``Request.pending_constraint``) is passed over by admission: it keeps its place in
the queue and holds no blocks, and the requests behind it are admitted in policy order. Once
built, the constraint is installed; if it could not be built, the request is finished with
an error (``on_constraint_error`` tells the engine).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

from backend.config import EngineConfig
from backend.core.kv_cache_manager import KVCacheManager
from backend.core.kv_cache_utils import cdiv
from backend.core.request import Request, RequestStatus
from backend.sample.speculative import NgramProposer, can_speculate


@dataclass
class SchedulerOutput:
    # request_id -> number of tokens to compute this step, in batch order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # request_id -> draft tokens scheduled after its last token (counted in num_scheduled_tokens)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class WaitingQueue:
    """Requests ordered by a key: (priority, arrival) or (0, arrival) for FCFS. A preempted
    request keeps its arrival number, so it re-enters ahead of later arrivals."""

    def __init__(self, use_priority: bool) -> None:
        self.use_priority = use_priority
        self._heap: list[tuple[tuple[int, int], Request]] = []

    def key(self, request: Request) -> tuple[int, int]:
        return (request.sampling_params.priority if self.use_priority else 0, request.arrival_seq)

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (self.key(request), request))

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        self._heap = [item for item in self._heap if item[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        return (item[1] for item in sorted(self._heap, key=lambda item: item[0]))


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager,
                 on_constraint_error: Callable[[Request, Exception], None] | None = None) -> None:
        self.config = config
        self.kv_cache = kv_cache
        # Called with a waiting request whose constraint could not be built, after it was
        # finished (FINISHED_ERROR), so that its final output reports why.
        self.on_constraint_error = on_constraint_error
        self.waiting = WaitingQueue(config.scheduling_policy == "priority")
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.proposer = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                       config.num_speculative_tokens)
                         if config.speculative_method == "ngram" else None)

    # ---- queue management -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.push(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Remove a request wherever it is and release its blocks (finish or abort)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache.free(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # ---- the step decision ------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        if self.config.batching == "static" and not self.running:
            self._form_static_batch()

        # 1. Running requests: decodes and unfinished prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining > budget and not self.config.enable_chunked_prefill:
                i += 1  # a whole prefill must fit; later (smaller) requests may still go
                continue
            num_new = min(remaining, budget)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = max(self.running, key=self.waiting.key)
                if self.running.index(victim) < i:
                    i -= 1
                budget += out.num_scheduled_tokens.pop(victim.request_id, 0)
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.num_scheduled_tokens[request.request_id] = num_new
                budget -= num_new
                i += 1

        # 2. Admission from the waiting queue; not in a step that had to preempt (memory is
        #    tight), and never mid-batch under static batching.
        if not out.preempted and self.config.batching == "continuous":
            budget = self._admit(out, budget)

        # 3. Drafts, from what is left.
        if self.proposer is not None and len(self.running) <= self.config.speculative_max_batch_size:
            self._schedule_drafts(out, budget)

        out.requests = [r for r in self.running if r.request_id in out.num_scheduled_tokens]
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        not_ready: list[Request] = []
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._peek_ready(not_ready)
            if request is None:
                break
            computed_blocks, num_hit = self.kv_cache.get_computed_blocks(request)
            remaining = request.num_tokens - num_hit
            if remaining > budget and not self.config.enable_chunked_prefill:
                break  # keep policy order: nothing jumps the queue
            num_new = min(remaining, budget)
            if not self.kv_cache.allocate_slots(request, num_new, computed_blocks):
                break
            self.waiting.pop()
            self.kv_cache.record_prefix_lookup(request, num_hit)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
        self._requeue(not_ready)
        return budget

    def _peek_ready(self, not_ready: list[Request]) -> Request | None:
        """The first waiting request, in policy order, that may be admitted now. Requests
        whose constraint is still being built are moved to ``not_ready`` (``_requeue`` puts
        them back, with their keys: their place in the queue is kept)."""
        while len(self.waiting) > 0:
            request = self.waiting.peek()
            pending = request.pending_constraint
            if pending is None:
                return request
            if not pending.done():
                not_ready.append(self.waiting.pop())
                continue
            request.pending_constraint = None
            try:
                request.constraint = pending.result()
            except Exception as exc:  # noqa: BLE001 - the request's own failure (e.g. its grammar)
                self.finish_request(request, RequestStatus.FINISHED_ERROR)
                if self.on_constraint_error is not None:
                    self.on_constraint_error(request, exc)
                continue
            return request
        return None

    def _requeue(self, requests: list[Request]) -> None:
        for request in requests:
            self.waiting.push(request)

    def _schedule_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Give decoding requests their n-gram drafts as extra tokens of this step. A draft
        never goes past the request's max_tokens (the last token is the bonus one), and gets
        no block that is not free now."""
        assert self.proposer is not None
        for request in self.running:
            if budget <= 0:
                return
            rid = request.request_id
            decoding = (out.num_scheduled_tokens.get(rid) == 1
                        and request.num_computed_tokens == request.num_tokens - 1)
            if not decoding or not can_speculate(request):
                continue
            max_drafts = min(budget, request.max_tokens - request.num_output_tokens - 1)
            drafts = self.proposer.propose(request.token_ids, max_drafts)
            if drafts and request.constraint is not None:   # drafts the constraint rejects cannot be accepted
                drafts = drafts[:request.constraint.num_valid_drafts(drafts)]
            if drafts and self.kv_cache.allocate_slots(request, 1 + len(drafts)):
                out.num_scheduled_tokens[rid] = 1 + len(drafts)
                out.spec_token_ids[rid] = drafts
                budget -= len(drafts)

    def finish_speculation(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """After a step that verified ``num_drafts`` drafts of ``request`` and accepted
        ``num_accepted``: the counter stops after the accepted ones (the K/V written for the
        rejected ones is overwritten when those positions are computed again) and blocks
        that only rejected drafts used go back to the pool."""
        request.num_computed_tokens -= num_drafts - num_accepted
        self.kv_cache.trim(request, request.num_computed_tokens + 1)

    def _form_static_batch(self) -> None:
        """Naive batching: take up to max_num_seqs requests whose *maximum* lengths fit in the
        free KV blocks together (so the batch never preempts), then run them to completion.
        No prefix-cache hits: this is the baseline continuous batching is measured against."""
        reserved = 0
        not_ready: list[Request] = []
        while len(self.running) < self.config.max_num_seqs:
            request = self._peek_ready(not_ready)
            if request is None:
                break
            need = cdiv(request.num_prompt_tokens + request.max_tokens, self.kv_cache.block_size)
            if reserved + need > self.kv_cache.num_free_blocks:
                break
            reserved += need
            self.waiting.pop()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = 0
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        self._requeue(not_ready)

    def preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Send a running request back to the waiting queue, to be recomputed (also used
        when a failed step leaves it depending on K/V that was never written)."""
        self._preempt(request, out)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(request)
        self.add_request(request)

    def update_after_step(self, out: SchedulerOutput, computed: list[Request] | None = None) -> None:
        """Advance each scheduled request's counter by what this step computed (``computed``:
        the requests that did run, when a failure removed some from the step)."""
        for request in out.requests if computed is None else computed:
            request.num_computed_tokens += out.num_scheduled_tokens[request.request_id]
