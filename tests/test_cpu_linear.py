"""CPU linear layers (backend/model/cpu_linear.py) against plain ``F.linear``: our C kernel and the
oneDNN-packed weights give the same products, the int8 weight-only layer is its dequantised
matmul, and the engine's greedy tokens do not depend on which linear path serves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backend import Engine, EngineConfig, SamplingParams
from backend.model.cpu_features import CpuFeatures
from backend.model.cpu_linear import (Int8Linear, NativeLinear, PackedLinear, onednn_packing_available, pack_pairs,
                                pack_panels, replace_linears, resolve_cpu_linear)
from kernels import cpu_native

pytestmark = pytest.mark.usefixtures("fp16_matmuls_off")   # see tests/conftest.py


def test_fast_paths_are_available_here() -> None:
    # The CPU default depends on them; a machine without gcc / AVX2 or a torch build without
    # oneDNN would silently fall back to a slower path.
    assert cpu_native.linear_available()
    assert onednn_packing_available()
    with pytest.raises(ValueError, match="AVX2"):
        resolve_cpu_linear("native", torch.float16)
    # Every x86 CPU with AVX2 + FMA builds a version of the bfloat16 kernel.
    assert cpu_native.linear_bf16_available()
    assert resolve_cpu_linear("native", torch.bfloat16) == "native"
    with pytest.raises(ValueError, match="CPU"):
        resolve_cpu_linear("onednn", torch.float32, on_cpu=False)


AVX2 = CpuFeatures.of("avx2", "fma")
AVX512 = CpuFeatures.of("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq")
AVX512_BF16 = CpuFeatures.of(*AVX512.flags, "avx512_bf16")
AMX_BF16 = CpuFeatures.of(*AVX512_BF16.flags, "amx_bf16", "amx_tile")


def bf16_kernel_built_for(features: CpuFeatures) -> str | None:
    """The version of the bfloat16 kernel gcc -march=native builds on a CPU with these flags."""
    if {"avx512_bf16", "amx_bf16", "amx_tile"} <= features.flags:
        return "amx-bf16"
    if "avx512_bf16" in features.flags:
        return "avx512-bf16"
    return "avx2" if features.avx2 else None


# The rule as the machine it describes would run it: which version of the bfloat16 kernel builds
# follows the CPU's flags (gcc -march=native), so it is faked along with them.
@pytest.mark.parametrize("features, dtype, expected", [
    (AVX2, torch.float32, "native"),
    (AVX512, torch.float32, "onednn"),
    (AVX512_BF16, torch.float32, "onednn"),
    (AVX2, torch.bfloat16, "native"),         # the kernel's AVX2 version: docs/benchmarks.md, "bfloat16 on AVX2"
    (AVX512, torch.bfloat16, "native"),       # the same version (AVX-512 without BF16: not measured)
    (AVX512_BF16, torch.bfloat16, "native"),  # our kernel: 1.34x prepacked oneDNN at 16 rows
    (AMX_BF16, torch.bfloat16, "onednn"),     # the rule; auto times our AMX tiles against it (test_cpu_linear_tuning)
    (AVX512_BF16, torch.float16, "torch"),
    (CpuFeatures.of(), torch.bfloat16, "torch"),
])
def test_auto_rule_by_cpu_features_and_dtype(features: CpuFeatures, dtype: torch.dtype, expected: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_native, "linear_bf16_version", lambda: bf16_kernel_built_for(features))
    assert resolve_cpu_linear("auto", dtype, features=features) == expected
    assert resolve_cpu_linear("auto", dtype, on_cpu=False, features=features) == "torch"


@pytest.mark.parametrize("built", [None, "avx2"])
def test_auto_rule_without_the_avx512_bf16_kernel(built: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # AVX512_BF16 flags but no kernel, or only its AVX2 version (no gcc, or a compiler that cannot
    # target AVX512_BF16): oneDNN's bf16 dot products rather than widening.
    monkeypatch.setattr(cpu_native, "linear_bf16_version", lambda: built)
    assert resolve_cpu_linear("auto", torch.bfloat16, features=AVX512_BF16) == "onednn"
    # Without bf16 arithmetic and without the kernel: F.linear.
    assert resolve_cpu_linear("auto", torch.bfloat16, features=AVX2) == ("native" if built else "torch")


def test_onednn_bfloat16_needs_avx512_or_avx_ne_convert() -> None:
    # torch refuses to pack bf16 weights elsewhere (a RuntimeError at load time); the choice is
    # refused at start-up instead, with what it needs.
    assert not onednn_packing_available(torch.bfloat16, AVX2)
    assert onednn_packing_available(torch.bfloat16, AVX512)
    assert onednn_packing_available(torch.bfloat16, CpuFeatures.of("avx2", "fma", "avx_ne_convert"))
    with pytest.raises(ValueError, match="AVX-512"):
        resolve_cpu_linear("onednn", torch.bfloat16, features=AVX2)
    assert resolve_cpu_linear("onednn", torch.bfloat16, features=AVX512) == "onednn"


def test_packed_bfloat16_matches_f_linear() -> None:
    # oneDNN packs bf16 weights on any AVX-512 CPU (emulated without AVX512_BF16); the rule only
    # picks it where the CPU has bf16 dot products. Float32 accumulation either way.
    if not onednn_packing_available(torch.bfloat16):
        pytest.skip("NOT RUN: oneDNN packs bfloat16 weights only with AVX-512 or AVX-NE-CONVERT, "
                    "which this CPU lacks")
    torch.manual_seed(0)
    for rows, k, n in [(1, 576, 1536), (16, 576, 192), (7, 1536, 576)]:
        weight = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        x = torch.randn(rows, k).to(torch.bfloat16)
        expected = F.linear(x.float(), weight.float())
        got = PackedLinear(weight, None)(x).float()
        assert torch.allclose(got, expected, rtol=2e-2, atol=2e-2), (rows, k, n, (got - expected).abs().max())


def test_pack_panels_layout() -> None:
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)   # 20 outputs: 2 panels, 12 padding columns
    packed = pack_panels(weight)
    assert packed.shape == (2, 3, 16)
    assert torch.equal(packed[0, :, 5], weight[5]) and torch.equal(packed[1, :, 3], weight[19])
    assert not packed[1, :, 4:].any()


@pytest.mark.parametrize("out_features", [1, 15, 16, 17, 48, 53])
def test_panels_equal_the_padded_then_transposed_weight(out_features: int) -> None:
    """The packing's single copy against the obvious two: pad to whole panels, then transpose."""
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 6, generator=gen)
    panels = -(-out_features // 16)
    padded = torch.zeros(panels * 16, 6)
    padded[:out_features] = weight
    assert torch.equal(pack_panels(weight), padded.view(panels, 16, 6).transpose(1, 2).contiguous())
    pairs = padded.bfloat16().view(panels, 16, 3, 2).transpose(1, 2).contiguous()
    assert torch.equal(pack_pairs(weight.bfloat16()), pairs)


# Row counts cover every tile height (1-6), how a panel's rows are split into tiles (8: 6 + 2,
# 10: 5 + 5, 13: 6 + 6 + 1, 16: 6 + 5 + 5) and the row blocks of 48; sizes cover partial panels
# (17, 20, 40 outputs), k in blocks of 64 with a partial last one (130) or less than one (33, 8)
# and SmolLM2's shapes.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 10, 13, 16, 49, 100])
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (33, 17), (1536, 20), (130, 40), (8, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_matches_f_linear(rows: int, in_features: int, out_features: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    layer = NativeLinear(weight, b)
    x = torch.randn(rows, in_features, generator=gen)
    tolerance = {"atol": 2e-5 * in_features ** 0.5, "rtol": 1e-5}
    torch.testing.assert_close(layer(x), F.linear(x, weight, b), **tolerance)
    # Rows with a stride (a slice of a wider activation, as SiLU(gate) * up is), and NaN
    # beside them that must not leak in.
    wide = torch.full((rows, 2 * in_features + 3), float("nan"))
    wide[:, 3:3 + in_features] = x
    torch.testing.assert_close(layer(wide[:, 3:3 + in_features]), F.linear(x, weight, b), **tolerance)
    # Leading dimensions are kept.
    assert layer(x.view(1, rows, in_features)).shape == (1, rows, out_features)


@pytest.mark.parametrize("rows", [1, 16, 40])
def test_native_linear_keeps_the_sign_of_a_zero_sum(rows: int) -> None:
    # Products that underflow to -0.0 sum to -0.0, as in float64 rounded to float32; an output
    # written as "sum + 0.0" without a bias would turn it into +0.0.
    weight, x = torch.full((20, 70), 1e-30), torch.full((rows, 70), -1e-30)
    expected = F.linear(x.double(), weight.double()).float()
    assert torch.signbit(expected).all()
    assert torch.signbit(NativeLinear(weight, None)(x)).all()


@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch_size", [None, 16], ids=["no-hint", "packed-for-16-rows"])
def test_packed_linear_matches_f_linear(rows: int, bias: bool, batch_size: int | None) -> None:
    # A weight packed for 16 rows (benchmarks.cpu_linear's onednn-hint) still serves any count.
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(960, 576, generator=gen)
    b = torch.randn(960, generator=gen) if bias else None
    x = torch.randn(rows, 576, generator=gen)
    layer = PackedLinear(weight, b, batch_size=batch_size)
    torch.testing.assert_close(layer(x), F.linear(x, weight, b), atol=1e-4, rtol=1e-5)
    # Non-contiguous input rows (a slice of a wider activation), as the model produces.
    wide = torch.randn(rows, 1152, generator=gen)
    torch.testing.assert_close(layer(wide[:, :576]), F.linear(wide[:, :576], weight, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_its_dequantised_matmul(bias: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(256, 192, generator=gen)
    b = torch.randn(256, generator=gen) if bias else None
    layer = Int8Linear(weight, b)
    dequantised = layer.qweight.float() * layer.scales.float().unsqueeze(1)
    # Per-channel rounding error at most half a step (bf16 scales add their own rounding).
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((dequantised - weight).abs() <= 0.51 * step + 1e-2 * weight.abs()).all()
    x = torch.randn(16, 192, generator=gen)
    expected = F.linear(x.bfloat16().float(), dequantised, b)
    torch.testing.assert_close(layer(x), expected, atol=0.05, rtol=0.02)
    assert layer(x).dtype == torch.float32


def test_replace_linears_replaces_every_linear_below() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4, bias=False), nn.ReLU()))
    assert replace_linears(model, PackedLinear) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


def test_engine_tokens_do_not_depend_on_the_linear_path(model_dir: Path, prose_ids: list[int]) -> None:
    prompts = [prose_ids[:5], prose_ids[40:140], prose_ids[300:331]]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    results = []
    for choice, layer_type in (("native", NativeLinear), ("onednn", PackedLinear), ("torch", nn.Linear)):
        # Prompt attention pinned: on AVX-512 CPUs auto times it per engine, so the three could differ in more
        # than the linear path (the choice's own tokens: test_hf_equality's sdpa_prompts).
        engine = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=128, cpu_linear=choice, itl_target_ms=0.0,
                                     cpu_prefill_attention="native"))
        assert isinstance(engine.runner.model.model.layers[0].mlp.down_proj, layer_type)
        results.append([o.token_ids for o in engine.generate(prompts, params)])
    assert results[0] == results[1] == results[2]
