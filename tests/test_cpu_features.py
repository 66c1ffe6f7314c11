"""CPU feature detection from /proc/cpuinfo text, with faked flag sets, so the rules that
depend on it are covered on every machine."""

from __future__ import annotations

import pytest
import torch

from backend.config import EngineConfig
from backend.model.cpu_features import CpuFeatures, CpuIsa, detect
from backend.worker.model_runner import auto_dtype, resolve_dtype

AVX2 = ("avx", "avx2", "fma", "f16c")
AVX512 = AVX2 + ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")


@pytest.mark.parametrize("flags, isa, native_bf16", [
    ((), CpuIsa.BASELINE, False),
    (("avx2",), CpuIsa.BASELINE, False),                           # AVX2 without FMA: not enough
    (AVX2, CpuIsa.AVX2, False),                                    # e.g. AMD Zen 2
    (AVX512, CpuIsa.AVX512, False),                                # e.g. Intel Skylake-SP
    (AVX512 + ("avx512_bf16", "avx512_vnni"), CpuIsa.AVX512_BF16, True),   # e.g. AMD Zen 4 / 5
    (AVX512 + ("avx512_bf16", "amx_bf16", "amx_tile"), CpuIsa.AMX_BF16, True),  # Intel Sapphire Rapids
    (AVX2 + ("avx512_bf16",), CpuIsa.AVX2, False),                 # a bf16 flag without AVX-512 proper
])
def test_isa_from_flags(flags: tuple[str, ...], isa: CpuIsa, native_bf16: bool) -> None:
    features = CpuFeatures.of(*flags)
    assert features.isa is isa and features.native_bf16 is native_bf16


def test_parse_cpuinfo_text() -> None:
    text = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512vl avx512dq\n"
    assert CpuFeatures.from_cpuinfo(text).isa is CpuIsa.AVX512
    assert CpuFeatures.from_cpuinfo("no flags here").isa is CpuIsa.BASELINE


def test_this_machine_is_detected() -> None:
    features = detect()
    print(f"this CPU: {features.describe()}")     # named in the test output, whatever it is
    assert isinstance(features.isa, CpuIsa)


@pytest.mark.parametrize("flags, expected", [
    (AVX2, torch.float32),                                          # no bfloat16 arithmetic: widened
    (AVX512, torch.float32),
    (AVX512 + ("avx512_bf16",), torch.bfloat16),                    # bf16 dot products in hardware
    (AVX512 + ("avx512_bf16", "amx_bf16", "amx_tile"), torch.bfloat16),
])
def test_auto_dtype_on_cpu_by_features(flags: tuple[str, ...], expected: torch.dtype) -> None:
    dtype, why = auto_dtype(torch.device("cpu"), CpuFeatures.of(*flags))
    assert dtype == expected
    assert CpuFeatures.of(*flags).describe() in why   # the start-up log names the ISA it decided on


def test_auto_dtype_on_cuda_is_bfloat16() -> None:
    assert auto_dtype(torch.device("cuda"), CpuFeatures.of(*AVX2))[0] == torch.bfloat16


def test_explicit_dtype_wins_and_is_logged() -> None:
    dtype, line = resolve_dtype(EngineConfig(dtype="bfloat16"), torch.device("cpu"))
    assert dtype == torch.bfloat16 and "dtype=bfloat16" in line
    dtype, line = resolve_dtype(EngineConfig(dtype="float32"), torch.device("cpu"))
    assert dtype == torch.float32 and "dtype=float32" in line
