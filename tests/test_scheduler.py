"""Scheduler decisions, checked without a model: the scheduler only talks to the KV-cache
manager, so each step's decision can be inspected directly."""

from __future__ import annotations

import itertools

from backend.config import EngineConfig
from backend.core.kv_cache_manager import KVCacheManager
from backend.core.request import Request, RequestStatus
from backend.core.scheduler import Scheduler
from backend.core.scheduler_output import SchedulerOutput
from backend.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(prompt_len: int, max_tokens: int = 8, priority: int = 0, first_token: int = 0) -> Request:
    n = next(_ids)
    return Request(request_id=f"r{n}", prompt_token_ids=[first_token + i % 50 + n * 100 for i in range(prompt_len)],
                   sampling_params=SamplingParams(max_tokens=max_tokens, priority=priority),
                   arrival_seq=n, arrival_time=0.0, max_tokens=max_tokens, eos_token_ids=frozenset())


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **overrides) -> Scheduler:
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, **overrides)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, config.enable_prefix_caching))


def finish_step(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """What the engine does after the forward pass: advance counters, append a token to every
    request that caught up, finish those at max_tokens."""
    scheduler.update_after_step(out)
    for request in out.requests:
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(7)
            if request.num_output_tokens >= request.max_tokens:
                scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH)


def test_step_mixes_decodes_with_a_prefill_chunk() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, max_num_seqs=4)
    short = make_request(3)
    scheduler.add_request(short)
    finish_step(scheduler, scheduler.schedule())          # short prefilled, now decoding
    long = make_request(40)
    scheduler.add_request(long)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {short.request_id: 1, long.request_id: 15}
    finish_step(scheduler, out)
    assert long.num_computed_tokens == 15 and long.num_output_tokens == 0  # a chunk does not sample
    out = scheduler.schedule()
    assert out.num_scheduled_tokens[short.request_id] == 1
    assert out.num_scheduled_tokens[long.request_id] == 15
    assert out.total_num_tokens <= 16


def test_token_budget_and_sequence_cap_hold() -> None:
    scheduler = make_scheduler(num_blocks=256, max_num_batched_tokens=20, max_num_seqs=3)
    for length in (5, 9, 13, 2, 30):
        scheduler.add_request(make_request(length))
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        assert out.total_num_tokens <= 20
        assert len(scheduler.running) <= 3
        finish_step(scheduler, out)
    assert scheduler.kv_cache.num_free_blocks == 256


def test_priority_policy_admits_lower_value_first() -> None:
    scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
    bulk = make_request(4, priority=5)
    premium = make_request(4, priority=-1)
    scheduler.add_request(bulk)
    scheduler.add_request(premium)
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == [premium.request_id]


def test_fcfs_ignores_priority() -> None:
    scheduler = make_scheduler(scheduling_policy="fcfs", max_num_seqs=1)
    first = make_request(4, priority=5)
    second = make_request(4, priority=-1)
    scheduler.add_request(first)
    scheduler.add_request(second)
    assert list(scheduler.schedule().num_scheduled_tokens) == [first.request_id]


def test_preemption_picks_lowest_priority_latest_arrival_and_requeues_it() -> None:
    # 6 blocks of 4 tokens. Three requests of 8 prompt tokens fill them exactly; the first
    # decode needs a 7th block, so somebody must be preempted.
    scheduler = make_scheduler(num_blocks=6, scheduling_policy="priority", max_num_batched_tokens=64)
    a, b, c = make_request(8, priority=0), make_request(8, priority=1), make_request(8, priority=0)
    for r in (a, b, c):
        scheduler.add_request(r)
    finish_step(scheduler, scheduler.schedule())
    assert scheduler.kv_cache.num_free_blocks == 0
    out = scheduler.schedule()
    # b has the worst priority (highest value) although c arrived later.
    assert [r.request_id for r in out.preempted] == [b.request_id]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert scheduler.kv_cache.blocks_of(b.request_id) == []
    assert set(out.num_scheduled_tokens) == {a.request_id, c.request_id}
    assert scheduler.num_preemptions == 1


def test_preempted_request_resumes_and_recomputes_everything() -> None:
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=64, enable_prefix_caching=False)
    a, b, c = make_request(8, max_tokens=3), make_request(8, max_tokens=3), make_request(8, max_tokens=3)
    for r in (a, b, c):
        scheduler.add_request(r)
    preempted: list[str] = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        preempted += [r.request_id for r in out.preempted]
        finish_step(scheduler, out)
    assert preempted and preempted[0] == c.request_id    # FCFS: the latest arrival goes first
    for r in (a, b, c):
        assert r.num_output_tokens == 3
    assert scheduler.kv_cache.num_free_blocks == 6


def test_static_batching_admits_nobody_mid_batch() -> None:
    scheduler = make_scheduler(num_blocks=256, batching="static", max_num_seqs=4)
    first = [make_request(4, max_tokens=m) for m in (2, 6)]
    for r in first:
        scheduler.add_request(r)
    finish_step(scheduler, scheduler.schedule())
    late = make_request(4, max_tokens=2)
    scheduler.add_request(late)
    steps_before_late_runs = 0
    while True:
        out = scheduler.schedule()
        if late.request_id in out.num_scheduled_tokens:
            break
        assert any(r.status == RequestStatus.RUNNING for r in first)
        finish_step(scheduler, out)
        steps_before_late_runs += 1
    # The late request waited until the 6-token request (the batch's longest) was done.
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in first)
    assert steps_before_late_runs == 5


def test_continuous_batching_admits_mid_flight() -> None:
    scheduler = make_scheduler(num_blocks=256, max_num_seqs=4)
    long = make_request(4, max_tokens=20)
    scheduler.add_request(long)
    finish_step(scheduler, scheduler.schedule())
    late = make_request(4)
    scheduler.add_request(late)
    out = scheduler.schedule()
    assert set(out.num_scheduled_tokens) == {long.request_id, late.request_id}


def test_no_chunking_waits_for_a_whole_prefill_to_fit() -> None:
    scheduler = make_scheduler(num_blocks=256, enable_chunked_prefill=False, max_num_batched_tokens=64,
                               max_num_seqs=8)
    a, b = make_request(40), make_request(40)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {a.request_id: 40}   # b does not fit the remaining 24 whole


def test_failed_admission_does_not_inflate_prefix_stats() -> None:
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    hog = make_request(15, max_tokens=1)
    scheduler.add_request(hog)
    scheduler.schedule()                     # hog takes all 4 blocks
    blocked = make_request(6)
    scheduler.add_request(blocked)
    for _ in range(5):
        out = scheduler.schedule()           # blocked retries admission every step
        assert blocked.request_id not in out.num_scheduled_tokens
    assert scheduler.kv_cache.prefix_queried_tokens == 15
