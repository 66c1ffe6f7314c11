"""benchmarks/kv_routing.py's bookkeeping without a cluster: the single-cache bound on a
workload's hit rate, and rounds pooled (docs/scaling.md, "Routing by cached blocks")."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.common import DEFAULT_MODEL_DIR
from benchmarks.kv_routing import Request, Result, pooled, single_cache_hit_rate
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
        return {"prefix_hit_rate": hit_rate, "single_cache_hit_rate": 0.7, "wall_s": 2.0, "seed": 1,
                "requests_per_replica": per_replica, "results": results}

    summary = pooled("dynamo-kv", [round_summary(0.6, [0.1, 0.2], {"r0": 2.0, "r1": 0.0}),
                                   round_summary(0.7, [0.3, 0.4, 0.5], {"r0": 1.0, "r1": 2.0})])
    assert summary["prefix_hit_rate"] == pytest.approx(0.65)
    assert summary["requests"] == len(summary["results"]) == 5
    assert summary["requests_per_replica"] == {"r0": 3.0, "r1": 2.0}
    assert summary["ttft_p50_s"] == pytest.approx(0.3)         # over the five requests, not per round
    assert [r["prefix_hit_rate"] for r in summary["rounds"]] == [0.6, 0.7]
    assert all("results" not in r for r in summary["rounds"])
