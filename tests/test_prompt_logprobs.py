"""``prompt_logprobs`` (vLLM's): the logprob of each prompt token given the ones before it and
the top-n at each position, equal to transformers' log_softmax of the prompt in float32 within
1e-4 at every position, whatever the engine does to the prompt (chunked prefill, preemption,
speculative drafts afterwards, a prefix-cache hit it must not take, n > 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend import Engine, EngineConfig, SamplingParams
from backend.engine.parallel_sampling import child_id, child_params
from backend.errors import InvalidRequestError
from tests.conftest import FIXED_BUDGET

TOP_N = 3
CONFIGS = {
    "default": dict(num_kv_blocks=256, **FIXED_BUDGET),
    "chunked": dict(block_size=16, num_kv_blocks=256, max_num_batched_tokens=32, max_num_seqs=8, **FIXED_BUDGET),
    # 12 blocks of 16 tokens for two ~90-token requests: one is preempted and recomputed
    "preemption": dict(block_size=16, num_kv_blocks=12, max_num_batched_tokens=64, max_num_seqs=8, **FIXED_BUDGET),
    "speculative": dict(num_kv_blocks=256, speculative_method="ngram", num_speculative_tokens=3,
                        speculative_max_batch_size=64, **FIXED_BUDGET),
}


@pytest.fixture(scope="module")
def prompts(prose_ids: list[int]) -> list[list[int]]:
    return [prose_ids[10:95], prose_ids[300:387]]


@pytest.fixture(scope="module")
def expected(hf_model, prompts) -> list[torch.Tensor]:
    """transformers' log_softmax at every prompt position, float32."""
    with torch.no_grad():
        return [torch.log_softmax(hf_model(torch.tensor([p])).logits[0].float(), dim=-1) for p in prompts]


def assert_matches(prompt_logprobs, prompt: list[int], expected: torch.Tensor) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        row, entry = expected[i - 1], prompt_logprobs[i]
        ours = entry[prompt[i]]
        assert abs(ours.logprob - row[prompt[i]].item()) < 1e-4, i
        assert ours.rank == 1 + int((row > row[prompt[i]]).sum()) or abs(ours.logprob - row.max().item()) < 1e-4, i
        top_values, top_ids = row.topk(TOP_N)
        ranked = {token: e for token, e in entry.items() if e.rank <= TOP_N}
        assert len(entry) in (TOP_N, TOP_N + 1), i     # the top-n, plus the prompt token when not among them
        for rank, (token, value) in enumerate(zip(top_ids.tolist(), top_values.tolist()), 1):
            if token in ranked:      # a near tie may swap two neighbours' order
                assert abs(ranked[token].logprob - value) < 1e-4, (i, rank)
        assert abs(min(e.logprob for e in ranked.values()) - top_values[-1].item()) < 1e-4, i


@pytest.mark.parametrize("config", list(CONFIGS))
def test_prompt_logprobs_match_transformers(model_dir: Path, prompts, expected, config: str) -> None:
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", **CONFIGS[config]))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=TOP_N))
    for output, prompt, exp in zip(outputs, prompts, expected):
        assert_matches(output.prompt_logprobs, prompt, exp)
    if config == "preemption":
        assert engine.scheduler.num_preemptions > 0, "the configuration did not preempt"
    engine.check_invariants()
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_prefix_cache_hit_is_not_taken(model_dir: Path, prompts, expected) -> None:
    """The prompt's blocks are cached by a first request; the one asking for prompt logprobs
    computes every position anyway (and says it read nothing from the cache)."""
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=256, enable_prefix_caching=True,
                                 **FIXED_BUDGET))
    warm = engine.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0))[0]
    again = engine.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert again.num_cached_tokens > 0, "the cache did not hold the prompt"
    asked = engine.generate([prompts[0]], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP_N))[0]
    assert asked.num_cached_tokens == 0
    assert_matches(asked.prompt_logprobs, prompts[0], expected[0])
    assert asked.token_ids == warm.token_ids


def test_n_completions_share_one_computation(model_dir: Path, prompts, expected) -> None:
    """n = 2 (as the serving loop fans it out): child 0 alone computes the prompt's logprobs; child
    1 still shares the prompt's blocks through the prefix cache."""
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=256,
                                 enable_prefix_caching=True, **FIXED_BUDGET))
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=1, n=2, prompt_logprobs=0)
    for i in range(2):
        engine.add_request(child_id("p", i), prompts[1], child_params(params, i))
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            finals[output.request_id] = output
    assert sorted(finals) == ["p/0", "p/1"]
    assert finals["p/1"].prompt_logprobs is None and finals["p/1"].num_cached_tokens > 0
    assert_matches_rank_zero(finals["p/0"].prompt_logprobs, prompts[1], expected[1])


def assert_matches_rank_zero(prompt_logprobs, prompt: list[int], expected: torch.Tensor) -> None:
    """prompt_logprobs=0: the prompt token's entry alone."""
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert list(prompt_logprobs[i]) == [prompt[i]]
        assert abs(prompt_logprobs[i][prompt[i]].logprob - expected[i - 1][prompt[i]].item()) < 1e-4


def test_not_asked_costs_nothing(model_dir: Path, prompts) -> None:
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=256, **FIXED_BUDGET))
    assert engine.generate([prompts[0]], SamplingParams(max_tokens=2))[0].prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 21, 2.5, "3", True])
def test_out_of_range_is_refused_by_name(value) -> None:
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
