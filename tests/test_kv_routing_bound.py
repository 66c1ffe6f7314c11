"""benchmarks/kv_routing.py's bookkeeping without a cluster: the single-cache bound on a
workload's hit rate, and rounds pooled (docs/scaling.md, "Routing by cached blocks")."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.common import DEFAULT_MODEL_DIR
from benchmarks.kv_routing import (Request, Result, parse_args, placed_hit_rate, pooled, single_cache_hit_rate,
                                 spread_sessions_hit_rate, workload)
from loadtest.prompts import PromptFactory


@pytest.fixture(scope="module")
def prompts() -> PromptFactory:
    return PromptFactory.for_model(DEFAULT_MODEL_DIR)


def request(prompts: PromptFactory, text: str, session: str = "s", step: int = 0) -> Request:
    return Request(session, "document", step, text, prompts.count(text))


def test_bound_counts_whole_cached_blocks_and_never_the_last_token(prompts: PromptFactory) -> None:
    rng = np.random.default_rng(0)
    base = prompts.text(64, rng)
    first = request(prompts, prompts.join(base, prompts.text(8, rng)))
    second = request(prompts, prompts.join(base, prompts.text(8, rng)), step=1)
    assert first.prompt_tokens == second.prompt_tokens == 72
    # The second shares four whole blocks of 16 with the first; the first hits nothing.
    assert single_cache_hit_rate(prompts, [[first, second]], 16) == pytest.approx(64 / 144)
    # A prompt that is all whole blocks, sent again: its last block holds the token that must
    # be computed, so three blocks hit, not four.
    again = request(prompts, base)
    assert single_cache_hit_rate(prompts, [[again], [again]], 16) == pytest.approx(48 / 128)
    # Nothing shared: nothing hits, whatever the order of the sessions.
    other = request(prompts, prompts.text(72, rng))
    assert single_cache_hit_rate(prompts, [[first], [other]], 16) == 0.0


def test_rounds_pool_requests_and_average_hit_rates() -> None:
    def round_summary(hit_rate: float, ttfts: list[float], per_replica: dict[str, float]) -> dict:
        results = [Result("s", "document", i, 100, t, t + 0.1, 0).__dict__ for i, t in enumerate(ttfts)]
        return {"prefix_hit_rate": hit_rate, "single_cache_hit_rate": 0.7, "spread_sessions_hit_rate": 0.65,
                "wall_s": 2.0, "seed": 1, "requests_per_replica": per_replica, "results": results}

    summary = pooled("dynamo-kv", [round_summary(0.6, [0.1, 0.2], {"r0": 2.0, "r1": 0.0}),
                                   round_summary(0.7, [0.3, 0.4, 0.5], {"r0": 1.0, "r1": 2.0})])
    assert summary["prefix_hit_rate"] == pytest.approx(0.65)
    assert summary["requests"] == len(summary["results"]) == 5
    assert summary["requests_per_replica"] == {"r0": 3.0, "r1": 2.0}
    assert summary["ttft_p50_s"] == pytest.approx(0.3)         # over the five requests, not per round
    assert [r["prefix_hit_rate"] for r in summary["rounds"]] == [0.6, 0.7]
    assert all("results" not in r for r in summary["rounds"])


def test_each_replica_prefills_what_it_has_not_seen(prompts: PromptFactory) -> None:
    rng = np.random.default_rng(1)
    system = prompts.text(64, rng)
    first = request(prompts, prompts.join(system, prompts.text(8, rng)), session="a")
    second = request(prompts, prompts.join(system, prompts.text(8, rng)), session="b")
    sessions = [[first], [second]]
    # On one replica the second hits the system prompt's four blocks; on two, nothing hits.
    assert placed_hit_rate(prompts, sessions, [0, 0], 16) == pytest.approx(64 / 144)
    assert placed_hit_rate(prompts, sessions, [0, 1], 16) == 0.0
    with pytest.raises(ValueError):
        placed_hit_rate(prompts, sessions, [0], 16)


def test_spreading_sends_each_session_to_the_replica_sent_least(prompts: PromptFactory) -> None:
    rng = np.random.default_rng(2)
    system = prompts.text(64, rng)
    long = [request(prompts, prompts.join(system, prompts.text(64, rng)), session="long")]
    short = [request(prompts, prompts.text(32, rng), session="short")]
    follow = [request(prompts, prompts.join(system, prompts.text(16, rng)), session="follow")]
    # long (128 tokens) to r0, short (32) to r1, then follow to r1, which was sent less: it
    # misses the system prompt that r0 holds.
    assert spread_sessions_hit_rate(prompts, [long, short, follow], 16) == 0.0
    assert single_cache_hit_rate(prompts, [long, short, follow], 16) == pytest.approx(64 / 240)
    # With the short session first, long goes to r1 and follow to r0 (32 < 128): a miss again.
    assert spread_sessions_hit_rate(prompts, [short, long, follow], 16) == 0.0
    # follow twice: both go to r1 (80 < 128), and the second hits the first's four blocks.
    assert spread_sessions_hit_rate(prompts, [long, follow, follow], 16) == pytest.approx(64 / 288)


def test_keeping_each_system_prompt_on_one_replica_reaches_the_single_cache(prompts: PromptFactory) -> None:
    """Sessions under different system prompts share no block, so a routing that sends every
    session of one system prompt to one replica loses nothing against one cache, however the
    prompts are spread; spreading sessions by load prefills a system prompt on both replicas."""
    args = parse_args(["--quick", "--systems", "2", "--conversations", "4"])
    sessions = workload(prompts, args, seed=3)
    systems = [session[0].prompt[:200] for session in sessions]
    by_system = [sorted(set(systems)).index(s) for s in systems]
    assert len(set(by_system)) == 2
    single = single_cache_hit_rate(prompts, sessions, 16)
    assert placed_hit_rate(prompts, sessions, by_system, 16) == pytest.approx(single)
    assert spread_sessions_hit_rate(prompts, sessions, 16) < single
