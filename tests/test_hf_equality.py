"""Greedy outputs are token-for-token those of Hugging Face transformers, whatever the batch
composition, block size, chunking, prefix hits, preemptions or batching mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend import Engine, EngineConfig, SamplingParams
from backend.core.step_cost import StepCostModel
from tests.conftest import FIXED_BUDGET, hf_greedy, hf_greedy_shared

MAX_NEW_TOKENS = 24
# Very different lengths, 1 to 430 tokens, submitted at once.
PROMPT_LENGTHS = [1, 3, 7, 12, 25, 41, 64, 97, 150, 231, 333, 430]
# Configs about which requests share a step (block size, policy, batching mode, drafts) take the
# prompts up to 231 tokens: 631 prompt tokens instead of 1,394, the same batch kinds, and their
# reference is a slice of the full one. The long two stay where prompt length is the point
# (chunking, whole-prompt steps, preemption, prompt attention, chunks sized to the ITL target).
SHORT_PROMPT_MAX_LEN = 231
SHARED_PREFIX_LEN = 120       # 7.5 blocks of 16: the last shared block is a partial one
# The prefix tests are about reading cached blocks: 12 tokens each (every one of them attends
# over the prefix) halve transformers' one-prompt-at-a-time decode steps for their reference.
SHARED_MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def mixed_prompts(prose_ids: list[int]) -> list[list[int]]:
    # Different offsets so prompts do not share prefixes by accident.
    return [prose_ids[7 * i + 1: 7 * i + 1 + n] for i, n in enumerate(PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def short_prompts(mixed_prompts: list[list[int]]) -> list[list[int]]:
    return [p for p in mixed_prompts if len(p) <= SHORT_PROMPT_MAX_LEN]


@pytest.fixture(scope="module")
def shared_prefix_prompts(prose_ids: list[int]) -> list[list[int]]:
    prefix = prose_ids[:SHARED_PREFIX_LEN]
    return [prefix + prose_ids[500 + 13 * i: 500 + 13 * i + 5 + 9 * i] for i in range(12)]


@pytest.fixture(scope="module")
def hf_mixed(hf_model, mixed_prompts) -> list[list[int]]:
    return hf_greedy_shared(hf_model, mixed_prompts, MAX_NEW_TOKENS)    # test_bf16_agreement's too


@pytest.fixture(scope="module")
def hf_short(hf_mixed, mixed_prompts) -> list[list[int]]:
    return [reference for prompt, reference in zip(mixed_prompts, hf_mixed) if len(prompt) <= SHORT_PROMPT_MAX_LEN]


@pytest.fixture(scope="module")
def hf_shared(hf_model, shared_prefix_prompts) -> list[list[int]]:
    return hf_greedy(hf_model, shared_prefix_prompts, SHARED_MAX_NEW_TOKENS)


def run_engine(config: EngineConfig, prompts: list[list[int]],
               max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[Engine, list[list[int]]]:
    engine = Engine(config)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_new_tokens, temperature=0.0))
    engine.check_invariants()
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, "blocks leaked after all requests finished"
    return engine, [o.token_ids for o in outputs]


def assert_same_tokens(ours: list[list[int]], reference: list[list[int]]) -> None:
    for i, (a, b) in enumerate(zip(ours, reference, strict=True)):
        assert a == b, f"prompt {i}: engine {a} != transformers {b}"


# A fixed token budget (itl_target_ms=0) where the point is the budget, the blocks or the
# policy: the same steps on every machine, and no start-up calibration per config. "block16"
# keeps the default, chunks sized to the ITL target by the calibrated step cost model; the
# ITL_CONFIGS below size them by a fixed clock.
CONFIGS = {
    "block16": dict(block_size=16, num_kv_blocks=512),
    "block4": dict(block_size=4, num_kv_blocks=2048, **FIXED_BUDGET),
    # 430-token prompts against a 48-token budget: every long prompt is prefilled in chunks,
    # interleaved with other requests' decodes.
    "chunked_small_budget": dict(block_size=16, num_kv_blocks=512, max_num_batched_tokens=48, max_num_seqs=8,
                                 **FIXED_BUDGET),
    "no_chunking": dict(block_size=16, num_kv_blocks=512, enable_chunked_prefill=False,
                        max_num_batched_tokens=1024, max_model_len=1024, **FIXED_BUDGET),
    "priority_few_seqs": dict(block_size=16, num_kv_blocks=512, scheduling_policy="priority", max_num_seqs=3,
                              **FIXED_BUDGET),
    "static": dict(block_size=16, num_kv_blocks=512, batching="static", max_num_seqs=5, **FIXED_BUDGET),
    # Prompts (fresh, and chunks over cached context) through torch's SDPA (what
    # cpu_prefill_attention=auto may pick on AVX-512 CPUs).
    "sdpa_prompts": dict(block_size=16, num_kv_blocks=512, cpu_prefill_attention="sdpa", **FIXED_BUDGET),
    # Each step launched before the tokens of the step before are read (their inputs taken on
    # the device), with long prompts chunked among the decodes.
    "async_chunked": dict(block_size=16, num_kv_blocks=512, max_num_batched_tokens=48, max_num_seqs=8,
                          async_scheduling=True, **FIXED_BUDGET),
}
# Speculative decoding (n-gram drafts, verified in the same step) must not change a token. The
# prose prompts repeat themselves, so drafts are proposed and accepted; the batch limit is
# lifted so that every step may carry drafts.
SPEC = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_max_batch_size=64)
SPEC_CONFIGS = {f"{name}+spec": {**CONFIGS[name], **SPEC} for name in ("block16", "block4", "chunked_small_budget")}
SHORT_PROMPT_CONFIGS = {"block4", "priority_few_seqs", "static", *SPEC_CONFIGS}


ASYNC = dict(async_scheduling=True)


def assert_speculated(engine: Engine, config: dict) -> None:
    if config.get("speculative_method") == "ngram":
        assert engine.stats().spec_accepted_tokens > 0, "no draft was accepted"
    if config.get("async_scheduling"):
        assert engine.num_overlapped_steps > 0, "no step overlapped the one before"


@pytest.mark.parametrize("name", list(CONFIGS) + list(SPEC_CONFIGS))
def test_greedy_matches_transformers(name: str, model_dir: Path, mixed_prompts, hf_mixed, short_prompts,
                                     hf_short) -> None:
    config = {**CONFIGS, **SPEC_CONFIGS}[name]
    prompts, reference = (short_prompts, hf_short) if name in SHORT_PROMPT_CONFIGS else (mixed_prompts, hf_mixed)
    engine, ours = run_engine(EngineConfig(model=str(model_dir), **config), prompts)
    assert_same_tokens(ours, reference)
    assert_speculated(engine, config)
    if "cpu_prefill_attention" in config:
        assert engine.runner.prefill_attention.path.value == config["cpu_prefill_attention"]


@pytest.mark.parametrize("spec", [{}, SPEC, ASYNC], ids=["plain", "spec", "async"])
def test_preemption_keeps_tokens_exact(spec: dict, model_dir: Path, mixed_prompts, hf_mixed) -> None:
    # 40 blocks of 16 tokens cannot hold all 12 requests (~1400 prompt tokens): the engine must
    # preempt, recompute, and still produce the very same tokens.
    # The ITL target's chunks, not a fixed budget: with 512-token steps the drafted run
    # finishes without a preemption.
    engine, ours = run_engine(EngineConfig(model=str(model_dir), block_size=16, num_kv_blocks=40,
                                           enable_prefix_caching=False, **spec), mixed_prompts)
    assert engine.stats().num_preemptions > 0
    assert_same_tokens(ours, hf_mixed)
    assert_speculated(engine, spec)


@pytest.mark.parametrize("spec", [{}, SPEC, ASYNC], ids=["plain", "spec", "async"])
def test_preemption_with_prefix_caching(spec: dict, model_dir: Path, mixed_prompts, hf_mixed) -> None:
    engine, ours = run_engine(EngineConfig(model=str(model_dir), block_size=16, num_kv_blocks=40,
                                           max_num_batched_tokens=64, **FIXED_BUDGET, **spec), mixed_prompts)
    assert engine.stats().num_preemptions > 0
    assert_same_tokens(ours, hf_mixed)
    assert_speculated(engine, spec)


@pytest.mark.parametrize("spec", [{}, SPEC, ASYNC], ids=["plain", "spec", "async"])
def test_shared_prefix_hits_cache(spec: dict, model_dir: Path, shared_prefix_prompts, hf_shared) -> None:
    engine, ours = run_engine(EngineConfig(model=str(model_dir), block_size=16, num_kv_blocks=512, **spec),
                              shared_prefix_prompts, SHARED_MAX_NEW_TOKENS)
    first_hits = engine.stats().prefix_cache_hit_tokens
    assert first_hits > 0, f"requests sharing a {SHARED_PREFIX_LEN}-token prefix got no prefix-cache hit"
    assert_same_tokens(ours, hf_shared)
    # A second round finds everything but each prompt's last block cached.
    again = engine.generate(shared_prefix_prompts, SamplingParams(max_tokens=SHARED_MAX_NEW_TOKENS, temperature=0.0))
    assert_same_tokens([o.token_ids for o in again], hf_shared)
    assert all(o.num_cached_tokens >= SHARED_PREFIX_LEN // 16 * 16 for o in again)
    assert engine.stats().prefix_cache_hit_tokens > first_hits
    engine.check_invariants()
    assert_speculated(engine, spec)


def test_shared_prefix_chunked_and_small_blocks(model_dir: Path, shared_prefix_prompts, hf_shared) -> None:
    engine, ours = run_engine(EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=1024,
                                           max_num_batched_tokens=40, max_num_seqs=6, **FIXED_BUDGET),
                              shared_prefix_prompts, SHARED_MAX_NEW_TOKENS)
    assert engine.stats().prefix_cache_hit_tokens > 0
    assert_same_tokens(ours, hf_shared)


def test_requests_joining_mid_flight(model_dir: Path, short_prompts, hf_short) -> None:
    """Requests arriving while others decode (true continuous batching) still match."""
    engine = Engine(EngineConfig(model=str(model_dir), block_size=16, num_kv_blocks=512,
                                 max_num_batched_tokens=128, **FIXED_BUDGET))
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
    results: dict[str, list[int]] = {}
    pending = list(enumerate(short_prompts))
    max_running = 0
    while pending or engine.has_unfinished_requests():
        if pending:  # one new arrival every step
            i, prompt = pending.pop()
            engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.token_ids
        max_running = max(max_running, engine.stats().num_running)
        engine.check_invariants()
    assert max_running > 1
    assert_same_tokens([results[f"r{i}"] for i in range(len(short_prompts))], hf_short)


# Prefill chunks sized to an ITL target by a fixed clock (5 ms a step, 0.25 ms a token, 0.05 us
# a prefill query-key pair): chunk sizes of no particular multiple that shrink as a prompt goes
# deeper, short prompts passing long ones, several prompts mid-prefill at once.
ITL_CLOCK = (0.005, 0.25e-3, 0.0, 0.0, 0.05e-6, 0.0)
ITL = dict(itl_target_ms=40.0, long_prefill_token_threshold=64, max_num_partial_prefills=3,
           min_prefill_chunk_tokens=8)
ITL_CONFIGS = {
    "itl_target": dict(block_size=16, num_kv_blocks=512, **ITL),
    "itl_target_preemption": dict(block_size=16, num_kv_blocks=40, max_num_batched_tokens=96, **ITL),
    "itl_target+spec": dict(block_size=16, num_kv_blocks=512, **ITL, **SPEC),
}


def recording_steps(engine: Engine) -> list[dict[str, int]]:
    """The scheduled tokens of every step the engine runs from now on."""
    steps: list[dict[str, int]] = []
    schedule = engine.scheduler.schedule

    def record():
        out = schedule()
        steps.append(dict(out.num_scheduled_tokens))
        return out

    engine.scheduler.schedule = record
    return steps


@pytest.mark.parametrize("name", list(ITL_CONFIGS))
def test_itl_target_chunking_matches_transformers(name: str, model_dir: Path, mixed_prompts, hf_mixed) -> None:
    config = ITL_CONFIGS[name]
    engine = Engine(EngineConfig(model=str(model_dir), **config), cost_model=StepCostModel(ITL_CLOCK, learn=False))
    steps = recording_steps(engine)
    outputs = engine.generate(mixed_prompts, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
    assert_same_tokens([o.token_ids for o in outputs], hf_mixed)
    engine.check_invariants()
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total
    chunks = [n for step in steps for n in step.values() if n > 1]
    assert any(n % 16 for n in chunks), "every chunk was a multiple of 16: the new chunk shapes were not exercised"
    assert max(sum(1 for n in step.values() if n > 1) for step in steps) >= 2, "never two prefills in one step"
    if "preemption" in name:
        assert engine.stats().num_preemptions > 0
    assert_speculated(engine, config)


def test_itl_target_with_shared_prefix(model_dir: Path, shared_prefix_prompts, hf_shared) -> None:
    engine = Engine(EngineConfig(model=str(model_dir), block_size=16, num_kv_blocks=512, **ITL),
                    cost_model=StepCostModel(ITL_CLOCK, learn=False))
    params = SamplingParams(max_tokens=SHARED_MAX_NEW_TOKENS, temperature=0.0)
    assert_same_tokens([o.token_ids for o in engine.generate(shared_prefix_prompts, params)], hf_shared)
    assert engine.stats().prefix_cache_hit_tokens > 0
    again = engine.generate(shared_prefix_prompts, params)
    assert_same_tokens([o.token_ids for o in again], hf_shared)
    assert all(o.num_cached_tokens >= SHARED_PREFIX_LEN // 16 * 16 for o in again)
    engine.check_invariants()
