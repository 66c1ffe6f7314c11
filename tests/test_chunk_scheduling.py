"""Prefill chunks sized to an ITL target, and short prompts passing long ones: the scheduler's
decisions under a fake clock (a step cost model with fixed coefficients), no model needed."""

from __future__ import annotations

import pytest

from backend.core.request import RequestStatus
from backend.core.step_cost import StepCostModel
from tests.test_scheduler import finish_step, make_request, make_scheduler


def clock(step_ms: float = 10.0, token_ms: float = 1.0, pair_us: float = 0.0) -> StepCostModel:
    """A fixed clock: ``step_ms`` per step + ``token_ms`` per token + ``pair_us`` per prefill
    query-key pair."""
    return StepCostModel((step_ms / 1e3, token_ms / 1e3, 0.0, 0.0, pair_us / 1e6, 0.0), learn=False)


def scheduler(cost: StepCostModel | None = None, **overrides):
    config = dict(num_blocks=2048, block_size=4, max_num_batched_tokens=512, max_num_seqs=16,
                  itl_target_ms=100.0, min_prefill_chunk_tokens=8)
    config.update(overrides)
    s = make_scheduler(**config)
    s.cost_model = cost
    return s


def decoding(s, count: int) -> list:
    """``count`` requests past their prefill, decoding."""
    requests = [make_request(3, max_tokens=10_000) for _ in range(count)]
    for r in requests:
        s.add_request(r)
    while any(r.num_output_tokens == 0 for r in requests):
        finish_step(s, s.schedule())
    return requests


def test_chunk_is_the_largest_that_fits_the_target() -> None:
    s = scheduler(clock())
    decodes = decoding(s, 4)
    long = make_request(500)
    s.add_request(long)
    for _ in range(3):
        out = s.schedule()
        # 10 ms + (4 decodes + 86 prompt tokens) x 1 ms = 100 ms
        assert out.num_scheduled_tokens == {**{d.request_id: 1 for d in decodes}, long.request_id: 86}
        assert out.predicted_seconds == pytest.approx(0.100)
        finish_step(s, out)


@pytest.mark.parametrize("multiple, chunk", [(0.0, 29), (4.0, 211)])
def test_on_a_slow_machine_the_target_is_a_multiple_of_the_decodes(multiple: float, chunk: int) -> None:
    # Decodes alone take 70.5 ms (60.5 ms + 10 decodes x 1 ms) of the 100 ms target: by the
    # target alone, prefill would get 29 tokens a step. At least 4x the decodes' time (282 ms),
    # it gets 211.
    s = scheduler(clock(step_ms=60.5), itl_target_decode_multiple=multiple)
    decodes = decoding(s, 10)
    long = make_request(1000)
    s.add_request(long)
    out = s.schedule()
    assert out.num_scheduled_tokens == {**{d.request_id: 1 for d in decodes}, long.request_id: chunk}
    assert out.predicted_seconds <= max(0.100, multiple * 0.0705) + 1e-9


def test_the_decode_multiple_does_not_lift_the_target_on_a_fast_machine() -> None:
    # Decodes alone 14 ms: 4x is 56 ms, under the 100 ms target, which stays the ceiling.
    s = scheduler(clock(), itl_target_decode_multiple=4.0)
    decoding(s, 4)
    long = make_request(500)
    s.add_request(long)
    assert s.schedule().predicted_seconds == pytest.approx(0.100)


def test_chunks_shrink_as_attention_deepens_and_every_step_fits() -> None:
    s = scheduler(clock(step_ms=10, token_ms=0.2, pair_us=0.5))
    decoding(s, 4)
    long = make_request(1500)
    s.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = s.schedule()
        assert out.predicted_seconds <= 0.100 + 1e-9
        chunks.append(out.num_scheduled_tokens[long.request_id])
        finish_step(s, out)
    assert sum(chunks) == 1500
    assert chunks[0] > chunks[-2] and chunks == sorted(chunks[:-1], reverse=True) + chunks[-1:]


def test_without_a_target_the_token_budget_decides() -> None:
    s = scheduler(clock(), itl_target_ms=0.0)
    decodes = decoding(s, 4)
    long = make_request(1000)
    s.add_request(long)
    out = s.schedule()
    assert out.num_scheduled_tokens[long.request_id] == 512 - 4
    assert out.predicted_seconds == pytest.approx(0.010 + 0.512)   # predicted all the same
    assert all(out.num_scheduled_tokens[d.request_id] == 1 for d in decodes)


def test_prefill_advances_by_the_minimum_when_decodes_alone_miss_the_target() -> None:
    # Every step is over the target (no lifting it by the decodes' time: that is the case here).
    s = scheduler(clock(step_ms=150), long_prefill_token_threshold=64, itl_target_decode_multiple=0.0)
    decodes = decoding(s, 2)
    long = make_request(200)
    s.add_request(long)
    out = s.schedule()
    assert out.num_scheduled_tokens[long.request_id] == 8      # admitted: the step had no prefill
    finish_step(s, out)
    short = make_request(20)
    s.add_request(short)
    later = make_request(20)
    s.add_request(later)
    out = s.schedule()
    # The short one first (as the first prefill of the step), the unfinished long one still
    # advances by the minimum; a second admission does not fit.
    assert out.num_scheduled_tokens == {**{d.request_id: 1 for d in decodes}, long.request_id: 8,
                                        short.request_id: 8}
    assert later.status == RequestStatus.WAITING
    steps = 2
    while long.num_output_tokens == 0:          # never starved: done in 200 / 8 steps
        finish_step(s, out)
        out = s.schedule()
        steps += 1
    assert steps <= 200 // 8 + 1


def test_short_prompt_passes_a_long_one_in_the_step() -> None:
    s = scheduler(clock(), itl_target_ms=0.0, max_num_batched_tokens=64, long_prefill_token_threshold=32)
    long = make_request(200)
    s.add_request(long)
    finish_step(s, s.schedule())                 # 64 tokens of it
    short = make_request(20)
    s.add_request(short)
    out = s.schedule()
    assert out.num_scheduled_tokens == {short.request_id: 20, long.request_id: 44}


def test_by_default_long_means_more_than_the_step_can_prefill() -> None:
    # Beside 4 decodes, the 100 ms target leaves room for 86 prompt tokens (10 ms + 1 ms per
    # token): a 300-token prompt is long there, a 40-token one is not and goes first, although
    # it arrived later. Without the decodes, the room is the 512-token budget: arrival order.
    s = scheduler(clock())
    decodes = decoding(s, 4)
    long, short = make_request(300), make_request(40)
    s.add_request(long)
    s.add_request(short)
    out = s.schedule()
    assert out.num_scheduled_tokens == {**{d.request_id: 1 for d in decodes}, short.request_id: 40,
                                        long.request_id: 46}
    assert list(out.num_scheduled_tokens)[4:] == [short.request_id, long.request_id]
    assert out.predicted_seconds == pytest.approx(0.100)

    alone = scheduler(clock())
    long, short = make_request(300), make_request(40)
    alone.add_request(long)
    alone.add_request(short)
    out = alone.schedule()
    assert list(out.num_scheduled_tokens.items()) == [(long.request_id, 300), (short.request_id, 40)]


def test_partial_prefill_limits() -> None:
    s = scheduler(clock(), itl_target_ms=0.0, max_num_batched_tokens=64, long_prefill_token_threshold=32,
                  max_num_partial_prefills=2, max_long_partial_prefills=1)
    long_a, long_b, short_c, short_d = make_request(100), make_request(100), make_request(10), make_request(10)
    for r in (long_a, long_b, short_c, short_d):
        s.add_request(r)
    out = s.schedule()
    # Two prefills at a time, one of them long: B waits for A; C takes the second place, D the next.
    assert out.num_scheduled_tokens == {short_c.request_id: 10, long_a.request_id: 54}
    finish_step(s, out)
    out = s.schedule()
    # A is still mid-prefill (46 tokens left: long), so B still waits; D passes it.
    assert out.num_scheduled_tokens == {short_c.request_id: 1, short_d.request_id: 10, long_a.request_id: 46}
    finish_step(s, out)
    out = s.schedule()
    assert out.num_scheduled_tokens[long_b.request_id] == 64 - 3
    assert long_b.status == RequestStatus.RUNNING


def test_priority_orders_before_length() -> None:
    s = scheduler(clock(), itl_target_ms=0.0, scheduling_policy="priority", max_num_batched_tokens=64,
                  long_prefill_token_threshold=32)
    short_low = make_request(10, priority=5)
    long_high = make_request(100, priority=-1)
    s.add_request(short_low)
    s.add_request(long_high)
    out = s.schedule()
    assert out.num_scheduled_tokens == {long_high.request_id: 64}
    assert short_low.status == RequestStatus.WAITING


def test_static_batching_prefills_its_whole_batch_at_once() -> None:
    s = scheduler(None, batching="static", max_num_seqs=6)
    requests = [make_request(10) for _ in range(6)]
    for r in requests:
        s.add_request(r)
    out = s.schedule()
    assert out.num_scheduled_tokens == {r.request_id: 10 for r in requests}
    assert out.predicted_seconds is None        # no cost model, no prediction


def test_prefix_hit_counts_toward_the_chunk_and_preemption_still_frees_room() -> None:
    # A prefix hit shortens what is left to compute; when blocks run out the latest request is
    # preempted (its row leaves the step's prediction) and the step still fits the target.
    s = scheduler(clock(), num_blocks=40, block_size=4)
    first = make_request(60)
    s.add_request(first)
    while first.num_output_tokens == 0:
        finish_step(s, s.schedule())
    twin = make_request(0)
    twin.prompt_token_ids[:] = first.prompt_token_ids
    twin.token_ids[:] = first.prompt_token_ids
    s.add_request(twin)
    out = s.schedule()
    assert twin.num_cached_tokens == 56 and out.num_scheduled_tokens[twin.request_id] == 4
    finish_step(s, out)
    hog = make_request(100, max_tokens=1)
    s.add_request(hog)
    preempted = False
    for _ in range(40):
        out = s.schedule()
        preempted |= bool(out.preempted)
        assert out.predicted_seconds <= 0.100 + 1e-9
        finish_step(s, out)
        if not s.has_unfinished_requests():
            break
    assert preempted


def test_a_prefill_preempted_for_an_earlier_one_in_the_step_is_skipped() -> None:
    # Beside a decoding stream, two prompts mid-prefill, each advancing by the minimum (8 tokens
    # = 2 blocks) a step. When blocks run out, the high-priority one's chunk preempts the
    # low-priority one, which comes later in the step's order: it must be skipped, not given
    # blocks while it waits.
    # (Both count as short: over the target, a step has no room and every prompt would be long.)
    s = scheduler(clock(step_ms=150), scheduling_policy="priority", num_blocks=13, long_prefill_token_threshold=64,
                  itl_target_decode_multiple=0.0)
    [stream] = decoding(s, 1)
    low = make_request(40, priority=10)
    s.add_request(low)
    out = s.schedule()
    assert out.num_scheduled_tokens == {stream.request_id: 1, low.request_id: 8}
    finish_step(s, out)
    high = make_request(40, priority=0)
    s.add_request(high)
    out = s.schedule()
    assert out.num_scheduled_tokens == {stream.request_id: 1, high.request_id: 8, low.request_id: 8}
    finish_step(s, out)
    finish_step(s, s.schedule())                                   # 12 of 13 blocks in use
    out = s.schedule()
    assert out.preempted == [low] and out.num_scheduled_tokens == {stream.request_id: 1, high.request_id: 8}
    assert low.status == RequestStatus.WAITING and not s.kv_cache.blocks_of(low.request_id)
    s.kv_cache.check_invariants({r.request_id: r for r in s.running})


def test_without_decodes_a_prefill_takes_the_whole_budget() -> None:
    # The target protects generating streams; a prompt alone is not slowed down by it.
    s = scheduler(clock())
    long = make_request(2000)
    s.add_request(long)
    out = s.schedule()
    assert out.num_scheduled_tokens == {long.request_id: 512}
    finish_step(s, out)
    decodes = decoding(s, 1)          # a stream starts: the next chunk fits the 100 ms target again
    out = s.schedule()
    assert out.num_scheduled_tokens[long.request_id] == 100 - 10 - 1
    assert out.num_scheduled_tokens[decodes[0].request_id] == 1


def test_a_short_prompt_leaves_the_long_ones_minimum_inside_the_target() -> None:
    s = scheduler(clock(), long_prefill_token_threshold=100)
    decodes = decoding(s, 4)
    long = make_request(500)
    s.add_request(long)
    finish_step(s, s.schedule())                      # 86 tokens of it (as above)
    short = make_request(90)
    s.add_request(short)
    out = s.schedule()
    # 10 ms + 4 decodes + 78 of the short + the long's minimum 8 = 100 ms, not 108.
    assert out.num_scheduled_tokens == {**{d.request_id: 1 for d in decodes}, short.request_id: 78,
                                        long.request_id: 8}
    assert out.predicted_seconds == pytest.approx(0.100)
