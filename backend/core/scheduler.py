"""Iteration-level scheduler: decides, every step, how many tokens each request computes.

Each step, under a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``):

1. every running decode gets its token;
2. prefill chunks (unfinished ones, then admissions from the waiting queue) share what is
   left, ordered by (priority, long?, arrival): a prompt longer than
   ``long_prefill_token_threshold`` (by default, longer than one step can prefill) goes after
   the shorter ones of its priority, and at most
   ``max_num_partial_prefills`` requests are mid-prefill at a time, at most
   ``max_long_partial_prefills`` of them long (vLLM's names and meanings), so short prompts
   pass a long one instead of waiting for its whole prefill;
3. with ``itl_target_ms`` > 0 and streams decoding, each chunk is the largest that keeps the
   step's predicted time (backend/core/step_cost.py) under the target (itl_target_ms, or
   ``itl_target_decode_multiple`` times the decodes' own time where that is more), so a long prompt no
   longer freezes the streams decoding beside it (a step without decodes has no inter-token
   latency to protect and uses the whole budget); an unfinished prefill still advances by at least
   ``min_prefill_chunk_tokens`` every step (it is never starved), as does the first
   admission of a step without any prefill. ``itl_target_ms=0`` is the fixed token budget.

When KV blocks run out, the lowest-priority, latest-arrived running request is preempted by
recompute: its blocks are freed, its counter reset, and it goes back to the waiting queue
(where its early arrival puts it near the front). ``batching="static"`` is the naive
baseline: a new batch is formed only once every request of the previous one has finished.

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

from typing import Callable, Iterator

from backend.config import EngineConfig
from backend.core.kv_cache_manager import KVCacheManager
from backend.core.kv_cache_utils import cdiv
from backend.core.request import Request, RequestStatus
from backend.core.request_queue import WaitingQueue
from backend.core.scheduler_output import SchedulerOutput
from backend.core.step_cost import ZERO, Features, StepCostModel, add, largest_fitting, row_features, sub
from backend.sample.bad_words import generated_tail
from backend.sample.speculative import NgramProposer, can_speculate


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager,
                 on_constraint_error: Callable[[Request, Exception], None] | None = None,
                 cost_model: StepCostModel | None = None) -> None:
        self.config = config
        self.kv_cache = kv_cache
        # Called with a waiting request whose constraint could not be built, after it was
        # finished (FINISHED_ERROR), so that its final output reports why.
        self.on_constraint_error = on_constraint_error
        # The step-time predictor (backend/core/step_cost.py), fitted by the engine's
        # calibration run. Prefill chunks are sized to it when itl_target_ms > 0.
        self.cost_model = cost_model
        self.waiting = WaitingQueue(config.scheduling_policy == "priority")
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.proposer = (NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                       config.num_speculative_tokens)
                         if config.speculative_method == "ngram" else None)

    def _step_target(self, out: SchedulerOutput) -> float | None:
        """The predicted-time ceiling this step's prefill chunks and drafts are sized to, given
        its decodes (``out``), or None (fixed token budget). ``itl_target_ms``, but at least
        ``itl_target_decode_multiple`` times the decodes' own predicted time: on a CPU where a
        step's decodes take half the target, the target alone left prefill few tokens a step,
        fewer than the prompts arriving needed, so prompts queued (a higher TTFT, and every
        prompt over those few tokens counted as long; docs/benchmarks.md, "The AVX2-only check")."""
        config = self.config
        if config.itl_target_ms <= 0 or self.cost_model is None:
            return None
        target = config.itl_target_ms / 1e3
        if config.itl_target_decode_multiple > 0 and out.num_scheduled_tokens:
            target = max(target, config.itl_target_decode_multiple * self.cost_model.predict(out.features))
        return target

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
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.kv_cache.cache_computed_blocks(request)   # what a follow-up turn may reuse
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

        if self.kv_cache.release_window is not None:
            # Blocks that slid out of every layer's window go back to the pool before this
            # step allocates (counters are settled here: drafts rejected last step are undone).
            for request in self.running:
                self.kv_cache.release_outside_window(request)

        # 1. Every running decode gets its token (preempting others when blocks run out).
        partial_prefills: list[Request] = []
        for request in list(self.running):
            if request.status != RequestStatus.RUNNING:
                continue   # preempted as a victim of an earlier request in this loop
            if request.num_pending_tokens and request.num_output_tokens + request.num_pending_tokens >= request.max_tokens:
                continue   # async_scheduling: its last token is on the device; it ends once that is read
            if request.num_tokens + request.num_pending_tokens - request.num_computed_tokens > 1:
                partial_prefills.append(request)
            elif budget > 0 and self._allocate_running(request, 1, out):
                budget -= 1
        partial_prefills = [r for r in partial_prefills if r.status == RequestStatus.RUNNING]
        budget = self.config.max_num_batched_tokens - out.total_num_tokens

        # 2. Prefill chunks: unfinished ones and admissions from the waiting queue (not in a
        #    step that had to preempt: memory is tight; never mid-batch under static batching).
        admit = not out.preempted and self.config.batching == "continuous"
        # The ITL target protects streams that are generating: a step without a decode has no
        # inter-token latency to keep, and its prefill takes the whole token budget.
        target = self._step_target(out)
        self._schedule_prefills(out, partial_prefills, admit, target if out.num_scheduled_tokens else None)
        budget = self.config.max_num_batched_tokens - out.total_num_tokens

        # 3. Drafts, from what is left.
        if self.proposer is not None and len(self.running) <= self.config.speculative_max_batch_size:
            self._schedule_drafts(out, budget, target)

        out.requests = [r for r in self.running if r.request_id in out.num_scheduled_tokens]
        if self.cost_model is not None:
            out.predicted_seconds = self.cost_model.predict(out.features)
        return out

    def _row(self, request: Request, num_new: int, num_computed: int | None = None) -> Features:
        computed = request.num_computed_tokens if num_computed is None else num_computed
        return row_features(num_new, computed, computed + num_new >= request.num_tokens)

    def _add(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        out.num_scheduled_tokens[request.request_id] = num_new
        out.features = add(out.features, self._row(request, num_new))

    def _allocate_running(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Room for ``num_new`` more tokens of a running request, preempting the lowest-priority,
        latest-arrived running requests while blocks are short; False if the request itself
        had to go. Scheduled on success."""
        while not self.kv_cache.allocate_slots(request, num_new):
            victim = max(self.running, key=self.waiting.key)
            scheduled = out.num_scheduled_tokens.pop(victim.request_id, 0)
            if scheduled:
                out.features = sub(out.features, self._row(victim, scheduled))
            self._preempt(victim, out)
            if victim is request:
                return False
        self._add(out, request, num_new)
        return True

    def _schedule_prefills(self, out: SchedulerOutput, partial_prefills: list[Request], admit: bool,
                           target: float | None) -> None:
        """Prefill chunks for this step, in the order (priority, long?, arrival): a prompt
        longer than ``long_prefill_token_threshold`` comes after shorter ones of its priority,
        so it never takes a step's whole budget while they wait. At most
        ``max_num_partial_prefills`` requests prefill at a time, at most
        ``max_long_partial_prefills`` of them long (static batching: no limits). With a
        ``target`` (seconds) each chunk is the largest whose step still fits it; an unfinished
        prefill always advances by at least ``min_prefill_chunk_tokens``, and so does the first
        admission of a step that has no prefill yet: nothing starves."""
        if not partial_prefills and not (admit and len(self.waiting)):
            return                   # no prefill to place (most decode steps): skip the threshold's search
        config = self.config
        limited = config.batching == "continuous"
        threshold = self._long_prefill_threshold(out, target)
        candidates: list[tuple[tuple[int, bool, int], Request, bool]] = []   # (order, request, waiting?)
        num_long = 0
        for request in partial_prefills:
            long = request.num_tokens - request.num_computed_tokens > threshold
            num_long += long
            candidates.append((self._order(request, long), request, False))
        num_prefills = len(partial_prefills)
        if admit:
            num_seqs = len(self.running)
            loras = self._running_loras()
            for request in self._ready_waiting():
                if num_seqs >= config.max_num_seqs or (limited and num_prefills >= config.max_num_partial_prefills):
                    break
                if not self._lora_fits(request, loras):
                    continue   # its adapter waits for a slot; requests behind it may pass
                _, num_hit = self.kv_cache.get_computed_blocks(request)
                long = request.num_tokens - num_hit > threshold
                if limited and long and num_long >= config.max_long_partial_prefills:
                    continue   # waits for a long prefill to finish; shorter ones behind it may pass
                num_seqs += 1
                num_prefills += 1
                num_long += long
                candidates.append((self._order(request, long), request, True))
        candidates.sort(key=lambda candidate: candidate[0])

        # The minimum chunks the unfinished prefills will take whatever the target says, held
        # back from what the requests before them in the order may use, so that a short prompt
        # passing a long one does not push the step past the target by the long one's minimum.
        minimum = {r.request_id: self._row(r, min(config.min_prefill_chunk_tokens,
                                                  r.num_tokens - r.num_computed_tokens)) for r in partial_prefills}
        held_back = ZERO
        for row in minimum.values():
            held_back = add(held_back, row)
        has_prefill = False
        for _, request, waiting in candidates:
            if not waiting:
                held_back = sub(held_back, minimum[request.request_id])
            budget = config.max_num_batched_tokens - out.total_num_tokens
            if budget <= 0:
                break
            if waiting:
                if not admit:
                    continue
                # Looked up again: an allocation earlier in this step may have evicted a block
                # that was cached when the request was classified.
                computed_blocks, num_hit = self.kv_cache.get_computed_blocks(request)
            elif request.status != RequestStatus.RUNNING:
                continue             # preempted to make room for a request before it
            else:
                computed_blocks, num_hit = None, request.num_computed_tokens
            remaining = request.num_tokens - num_hit
            if remaining > budget and not config.enable_chunked_prefill:
                if waiting:
                    admit = False    # keep policy order: nothing jumps the queue
                continue             # a whole prefill must fit; later (smaller) requests may still go
            num_new = self._fit_chunk(request, num_hit, min(remaining, budget), add(out.features, held_back), target)
            floor = min(config.min_prefill_chunk_tokens, remaining, budget)
            if not config.enable_chunked_prefill and num_new < remaining:
                num_new = remaining if (not waiting or not has_prefill) else 0
            elif num_new < floor and (not waiting or not has_prefill):
                num_new = floor      # minimum progress, whatever the target says
            if num_new < floor:
                continue             # no time left for it in this step
            if not waiting:
                has_prefill |= self._allocate_running(request, num_new, out)
                continue
            if not self.kv_cache.allocate_slots(request, num_new, computed_blocks):
                admit = False        # memory is short: no later admission either
                continue
            self.waiting.remove(request)
            self.kv_cache.record_prefix_lookup(request, num_hit)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add(out, request, num_new)
            has_prefill = True

    def _running_loras(self) -> set[int]:
        return {r.lora_id for r in self.running if r.lora_id is not None}

    def _lora_fits(self, request: Request, loras: set[int]) -> bool:
        """True (and its adapter counted in ``loras``) unless it would be adapter number
        max_loras + 1 among the running requests."""
        if request.lora_id is None or request.lora_id in loras:
            return True
        if len(loras) >= self.config.max_loras:
            return False
        loras.add(request.lora_id)
        return True

    def _order(self, request: Request, long: bool) -> tuple[int, bool, int]:
        priority, arrival = self.waiting.key(request)
        return (priority, long, arrival)

    def _long_prefill_threshold(self, out: SchedulerOutput, target: float | None) -> int:
        """Prompt tokens (still to compute) above which a prefill counts as long in this step:
        ``long_prefill_token_threshold`` when set, else what one step can prefill, so that the
        prompts a step can finish go before those it cannot (shortest first, in two classes).
        That is the token budget, or under the ITL target the most tokens a new prompt may
        compute beside this step's decodes (``out``) without passing the target: on a CPU
        where a decode step takes a quarter of the target, ~100 tokens, far fewer than the
        budget, so a 512-token prompt no longer holds back the 64-token ones behind it."""
        config = self.config
        if config.long_prefill_token_threshold:
            return config.long_prefill_token_threshold
        if target is None:
            return config.max_num_batched_tokens
        room = config.max_num_batched_tokens - out.total_num_tokens
        fitting = largest_fitting(self.cost_model, room, target,
                                  lambda n: add(out.features, row_features(n, 0, True)))
        return max(fitting, config.min_prefill_chunk_tokens)

    def _fit_chunk(self, request: Request, num_computed: int, max_new: int, features: Features,
                   target: float | None) -> int:
        """The most tokens (<= ``max_new``) this request can compute in a step that already has
        ``features`` without its predicted time passing ``target``; 0 when none fits."""
        if target is None:
            return max_new
        return largest_fitting(self.cost_model, max_new, target,
                               lambda num_new: add(features, self._row(request, num_new, num_computed)))

    def _ready_waiting(self) -> Iterator[Request]:
        """Waiting requests that may be admitted now, in policy order. A request whose constraint
        is still being built is passed over (it keeps its place); one whose build finished gets
        its constraint installed, or is finished with the error. (The queue's iterator walks a
        copy, so requests may leave the queue meanwhile.)"""
        for request in self.waiting:
            pending = request.pending_constraint
            if pending is not None:
                if not pending.done():
                    continue
                request.pending_constraint = None
                try:
                    request.constraint = pending.result()
                except Exception as exc:  # noqa: BLE001 - the request's own failure (e.g. its grammar)
                    self.finish_request(request, RequestStatus.FINISHED_ERROR)
                    if self.on_constraint_error is not None:
                        self.on_constraint_error(request, exc)
                    continue
            yield request

    def _schedule_drafts(self, out: SchedulerOutput, budget: int, target: float | None) -> None:
        """Give decoding requests their n-gram drafts as extra tokens of this step. A draft
        never goes past the request's max_tokens (the last token is the bonus one), gets no
        block that is not free now, and does not push the step past ``target`` (seconds)."""
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
            if drafts and request.bad_words is not None:    # nor can a draft that completes a bad word
                generated = generated_tail(request.token_ids, request.num_prompt_tokens, request.bad_words.context)
                drafts = drafts[:request.bad_words.num_valid_drafts(generated, drafts)]
            without = sub(out.features, self._row(request, 1))
            while drafts and target is not None and self.cost_model is not None and \
                    self.cost_model.predict(add(without, self._row(request, 1 + len(drafts)))) > target:
                drafts = drafts[:-1]
            if drafts and self.kv_cache.allocate_slots(request, 1 + len(drafts)):
                out.num_scheduled_tokens[rid] = 1 + len(drafts)
                out.features = add(without, self._row(request, 1 + len(drafts)))
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
        loras = self._running_loras()
        for request in self._ready_waiting():
            if len(self.running) >= self.config.max_num_seqs:
                break
            if not self._lora_fits(request, loras):
                continue
            need = cdiv(request.num_prompt_tokens + request.max_tokens, self.kv_cache.block_size)
            if reserved + need > self.kv_cache.num_free_blocks:
                break
            reserved += need
            self.waiting.remove(request)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = 0
            request.status = RequestStatus.RUNNING
            self.running.append(request)

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
