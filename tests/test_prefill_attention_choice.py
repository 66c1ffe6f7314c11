"""The start-up choice of the kernel for fresh prompts' attention on CPU
(backend/model/prefill_attention_choice.py): the rule with faked CPU features and a faked clock,
so it is covered on every machine, and one real timing here."""

from __future__ import annotations

import logging

import pytest
import torch

from backend.config import EngineConfig
from backend.model.architecture import ModelArchitecture
from backend.model.cpu_features import CpuFeatures
from backend.model.prefill_attention_choice import (NATIVE_MARGIN, TOLERANCE, choose_prefill_attention,
                                                    native_kernel_runs)
from kernels import PrefillAttention

AVX2 = CpuFeatures.of("avx2", "fma")
AVX512 = CpuFeatures.of("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq")
AMX = CpuFeatures.of(*AVX512.flags, "avx512_bf16", "amx_bf16", "amx_tile")
ARCH = ModelArchitecture(model_type="llama", vocab_size=300, hidden_size=96, intermediate_size=160, num_layers=2,
                         num_heads=6, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                         rope_scaling=None, max_position_embeddings=1024, tie_word_embeddings=True, qkv_bias=False,
                         qk_norm=False, initializer_range=0.2)

needs_kernel = pytest.mark.skipif(not native_kernel_runs(torch.float32),
                                  reason="NOT RUN: our C prefill kernel did not build here")


class FakeTimer:
    """Stands in for time_prefill_attention: given figures, and whether it was called."""

    def __init__(self, timings: dict[PrefillAttention, float], errors: dict[PrefillAttention, float] | None = None):
        self.timings, self.errors, self.calls = timings, errors or {path: 0.0 for path in timings}, 0

    def __call__(self, arch, dtype, block_size):
        self.calls += 1
        return dict(self.timings), dict(self.errors)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_auto_without_avx512_is_ours_untimed(dtype: torch.dtype) -> None:
    timer = FakeTimer({PrefillAttention.NATIVE: 9.0, PrefillAttention.SDPA: 1.0})
    choice = choose_prefill_attention("auto", dtype, ARCH, 16, features=AVX2, timer=timer)
    assert choice.path is PrefillAttention.NATIVE and timer.calls == 0 and "measured rule" in choice.why


@needs_kernel
@pytest.mark.parametrize("features", [AVX512, AMX], ids=["avx512", "amx"])
@pytest.mark.parametrize("sdpa_ms,expected", [(1.0, PrefillAttention.SDPA), (9.5, PrefillAttention.NATIVE),
                                              (10.0 / NATIVE_MARGIN * 1.01, PrefillAttention.NATIVE)])
def test_auto_with_avx512_is_timed_and_sdpa_must_win_clearly(features: CpuFeatures, sdpa_ms: float,
                                                             expected: PrefillAttention) -> None:
    timer = FakeTimer({PrefillAttention.NATIVE: 10.0, PrefillAttention.SDPA: sdpa_ms})
    choice = choose_prefill_attention("auto", torch.bfloat16, ARCH, 16, features=features, timer=timer)
    assert timer.calls == 1 and choice.path is expected
    assert "native 10.00 ms" in choice.why and choice.timings_ms == timer.timings


@needs_kernel
def test_a_wrong_path_is_never_chosen(caplog: pytest.LogCaptureFixture) -> None:
    """The timer leaves out a path whose output failed the check; the choice says so in the log."""
    timer = FakeTimer({PrefillAttention.NATIVE: 10.0},
                      {PrefillAttention.NATIVE: 0.0, PrefillAttention.SDPA: 10 * TOLERANCE[torch.bfloat16]})
    with caplog.at_level(logging.WARNING):
        choice = choose_prefill_attention("measure", torch.bfloat16, ARCH, 16, features=AVX2, timer=timer)
    assert choice.path is PrefillAttention.NATIVE
    assert "sdpa computes wrong results" in caplog.text
    with pytest.raises(RuntimeError, match="no prefill attention computes correct results"):
        choose_prefill_attention("measure", torch.float32, ARCH, 16, timer=FakeTimer({}))


@needs_kernel
@pytest.mark.parametrize("choice", ["native", "sdpa"])
def test_an_explicit_choice_is_taken_as_given(choice: str) -> None:
    timer = FakeTimer({PrefillAttention.NATIVE: 1.0, PrefillAttention.SDPA: 9.0})
    chosen = choose_prefill_attention(choice, torch.float32, ARCH, 16, features=AMX, timer=timer)
    assert chosen.path is PrefillAttention(choice) and timer.calls == 0


def test_no_effect_off_the_cpu_backend_or_without_our_kernel() -> None:
    timer = FakeTimer({PrefillAttention.SDPA: 1.0})
    off = choose_prefill_attention("sdpa", torch.float32, ARCH, 16, cpu_attention=False, timer=timer)
    float16 = choose_prefill_attention("measure", torch.float16, ARCH, 16, features=AMX, timer=timer)
    assert off.path is float16.path is PrefillAttention.NATIVE and timer.calls == 0


def test_unknown_choices_are_refused() -> None:
    with pytest.raises(ValueError, match="cpu_prefill_attention"):
        choose_prefill_attention("fastest", torch.float32, ARCH, 16)
    with pytest.raises(ValueError, match="cpu_prefill_attention"):
        EngineConfig(cpu_prefill_attention="fastest")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_measure_times_both_paths_here(dtype: torch.dtype) -> None:
    """The real timer on this machine: both paths pass the check and get a time."""
    choice = choose_prefill_attention("measure", dtype, ARCH, 16)
    assert set(choice.timings_ms) == set(PrefillAttention)
    assert all(0 < ms < 10_000 for ms in choice.timings_ms.values())
