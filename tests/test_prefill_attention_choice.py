"""The start-up choice of the kernel for prompts' attention on CPU
(backend/model/prefill_attention_choice.py): the rule with faked CPU features and a faked clock,
so it is covered on every machine, and one real timing here."""

from __future__ import annotations

import logging

import pytest
import torch

from backend.config import EngineConfig
from backend.model.architecture import ModelArchitecture
from backend.model.cpu_features import CpuFeatures
from backend.model.prefill_attention_choice import (CONTEXT_TOKENS, NATIVE_MARGIN, PROMPT_LENGTHS, TOLERANCE, choose_prefill_attention,
                                                    native_kernel_runs, sdpa_threshold)
from kernels import EVERY_PREFILL, PrefillAttention

AVX2 = CpuFeatures.of("avx2", "fma")
AVX512 = CpuFeatures.of("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq")
AMX = CpuFeatures.of(*AVX512.flags, "avx512_bf16", "amx_bf16", "amx_tile")
ARCH = ModelArchitecture(model_type="llama", vocab_size=300, hidden_size=96, intermediate_size=160, num_layers=2,
                         num_heads=6, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                         rope_scaling=None, max_position_embeddings=1024, tie_word_embeddings=True, qkv_bias=False,
                         qk_norm=False, initializer_range=0.2)

needs_kernel = pytest.mark.skipif(not native_kernel_runs(torch.float32),
                                  reason="NOT RUN: our C prefill kernel did not build here")


NATIVE, SDPA = PrefillAttention.NATIVE, PrefillAttention.SDPA


def ladder(ours: list[float | None], sdpa: list[float | None],
           sdpa_over_context: list[float | None] | None = None) -> dict[tuple[int, int], dict[PrefillAttention, float]]:
    """Timings at PROMPT_LENGTHS over each of CONTEXT_TOKENS (None: that path left out); over
    cached context SDPA takes ``sdpa_over_context`` where given."""
    timings = {}
    for context in CONTEXT_TOKENS:
        sdpa_here = sdpa if context == 0 or sdpa_over_context is None else sdpa_over_context
        for length, o, s in zip(PROMPT_LENGTHS, ours, sdpa_here, strict=True):
            timings[length, context] = {path: ms for path, ms in ((NATIVE, o), (SDPA, s)) if ms is not None}
    return timings


class FakeTimer:
    """Stands in for time_prefill_attention: given figures, and whether it was called."""

    def __init__(self, timings: dict, errors: dict[PrefillAttention, float] | None = None):
        self.timings, self.errors, self.calls = timings, errors or {NATIVE: 0.0, SDPA: 0.0}, 0

    def __call__(self, arch, dtype, block_size):
        self.calls += 1
        return self.timings, dict(self.errors)


OURS = [0.1, 0.2, 0.5, 1.5, 5.0]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_auto_without_avx512_is_ours_untimed(dtype: torch.dtype) -> None:
    timer = FakeTimer(ladder(OURS, [0.01] * 5))
    choice = choose_prefill_attention("auto", dtype, ARCH, 16, features=AVX2, timer=timer)
    assert choice.path is NATIVE and choice.sdpa_min_tokens is None and timer.calls == 0
    assert "measured rule" in choice.why


# SDPA's ms at PROMPT_LENGTHS (32 ... 512) against OURS -> the shortest prompt it gets (None: none).
LADDERS = {
    "wins-everywhere": ([0.05, 0.1, 0.2, 0.5, 1.0], 32),
    "wins-from-128": ([0.3, 0.4, 0.4, 1.0, 2.0], 128),
    "wins-only-at-512": ([0.3, 0.4, 0.6, 1.6, 2.0], 512),
    "loses-at-512": ([0.05, 0.1, 0.2, 0.5, 4.8], None),      # within the margin at 512: ours everywhere
    "not-monotonic": ([0.05, 0.4, 0.2, 0.5, 1.0], 128),      # loses at 64: not below it either
}


@needs_kernel
@pytest.mark.parametrize("features", [AVX512, AMX], ids=["avx512", "amx"])
@pytest.mark.parametrize("ladder_name", list(LADDERS))
def test_auto_with_avx512_is_timed_and_sdpa_gets_the_prompts_it_wins(features: CpuFeatures,
                                                                     ladder_name: str) -> None:
    sdpa, expected = LADDERS[ladder_name]
    timer = FakeTimer(ladder(OURS, sdpa))
    choice = choose_prefill_attention("auto", torch.bfloat16, ARCH, 16, features=features, timer=timer)
    assert timer.calls == 1 and choice.sdpa_min_tokens == expected
    assert choice.path is (NATIVE if expected is None else SDPA)
    assert "512 tokens over 0: native 5.00" in choice.why and choice.timings_ms == timer.timings


def test_sdpa_must_win_over_cached_context_too() -> None:
    """A prefill length goes to SDPA only where it wins both fresh and over cached context."""
    wins_fresh = [0.05, 0.1, 0.2, 0.5, 1.0]
    assert sdpa_threshold(ladder(OURS, wins_fresh, [0.05, 0.1, 0.2, 1.6, 1.0])) == 512
    assert sdpa_threshold(ladder(OURS, wins_fresh, [0.05, 0.1, 0.2, 0.5, 5.0])) is None


def test_the_margin_decides_a_close_race() -> None:
    just_outside = [ms / NATIVE_MARGIN * 1.01 for ms in OURS]
    just_inside = [ms / NATIVE_MARGIN * 0.99 for ms in OURS]
    assert sdpa_threshold(ladder(OURS, just_outside)) is None
    assert sdpa_threshold(ladder(OURS, just_inside)) == PROMPT_LENGTHS[0]


@needs_kernel
def test_a_wrong_path_is_never_chosen(caplog: pytest.LogCaptureFixture) -> None:
    """The timer leaves out a path whose output failed the check; the choice says so in the log."""
    timer = FakeTimer(ladder(OURS, [None] * 5), {NATIVE: 0.0, SDPA: 10 * TOLERANCE[torch.bfloat16]})
    with caplog.at_level(logging.WARNING):
        choice = choose_prefill_attention("measure", torch.bfloat16, ARCH, 16, features=AVX2, timer=timer)
    assert choice.path is NATIVE and choice.sdpa_min_tokens is None
    assert "sdpa computes wrong results" in caplog.text
    # Ours left out: SDPA takes every fresh prompt.
    assert sdpa_threshold(ladder([None] * 5, [1.0] * 5)) == EVERY_PREFILL
    with pytest.raises(RuntimeError, match="no prefill attention computes correct results"):
        choose_prefill_attention("measure", torch.float32, ARCH, 16, timer=FakeTimer(ladder([None] * 5, [None] * 5)))


@needs_kernel
@pytest.mark.parametrize("choice,min_tokens", [("native", None), ("sdpa", EVERY_PREFILL)])
def test_an_explicit_choice_is_taken_as_given(choice: str, min_tokens: int | None) -> None:
    timer = FakeTimer(ladder(OURS, [0.01] * 5))
    chosen = choose_prefill_attention(choice, torch.float32, ARCH, 16, features=AMX, timer=timer)
    assert chosen.path is PrefillAttention(choice) and chosen.sdpa_min_tokens == min_tokens and timer.calls == 0


def test_no_effect_off_the_cpu_backend_or_without_our_kernel() -> None:
    timer = FakeTimer(ladder(OURS, [0.01] * 5))
    off = choose_prefill_attention("sdpa", torch.float32, ARCH, 16, cpu_attention=False, timer=timer)
    float16 = choose_prefill_attention("measure", torch.float16, ARCH, 16, features=AMX, timer=timer)
    assert off.sdpa_min_tokens is float16.sdpa_min_tokens is None and timer.calls == 0


def test_unknown_choices_are_refused() -> None:
    with pytest.raises(ValueError, match="cpu_prefill_attention"):
        choose_prefill_attention("fastest", torch.float32, ARCH, 16)
    with pytest.raises(ValueError, match="cpu_prefill_attention"):
        EngineConfig(cpu_prefill_attention="fastest")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_measure_times_both_paths_at_every_length_here(dtype: torch.dtype) -> None:
    """The real timer on this machine: both paths pass the check and get a time at each length."""
    choice = choose_prefill_attention("measure", dtype, ARCH, 16)
    assert sorted(choice.timings_ms) == [(n, c) for n in PROMPT_LENGTHS for c in CONTEXT_TOKENS]
    assert all(set(paths) == set(PrefillAttention) and all(0 < ms < 10_000 for ms in paths.values())
               for paths in choice.timings_ms.values())
