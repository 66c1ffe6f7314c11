"""The bfloat16 kernels of kernels/csrc/linear_bf16.c against the reference, ``F.linear`` on the
widened operands, whose products are the same exact values (only the summation order
differs): the projections (``NativeBf16Linear``, bfloat16 out, rounded once) and the LM head
with float32 logits (``Float32Logits``). The kernels need AVX512_BF16; on a CPU without it
the projection tests are reported NOT RUN and the head's float32-copy path runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.model.cpu_linear import Float32Logits, NativeBf16Linear, PackedLinear, native_linear, pack_pairs
from kernels import cpu_native


@pytest.fixture
def bf16_kernel() -> None:
    if not cpu_native.linear_bf16_available():
        pytest.skip("NOT RUN: the bfloat16 linear kernel needs a CPU with AVX512_BF16 (and gcc to target it)")


def within_one_rounding(got: torch.Tensor, exact: torch.Tensor, in_features: int) -> None:
    """``got`` (bfloat16) is ``exact`` (float32) rounded once: at most one bfloat16 unit away
    (half a unit for the rounding, the rest for a different float32 summation order)."""
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    unit = exact.abs() * 2.0 ** -7
    error = (got.float() - exact).abs()
    assert (error <= unit + 1e-6 * in_features).all(), (error - unit).max()


def test_which_path_runs_here() -> None:
    head = Float32Logits(torch.randn(40, 8).bfloat16())
    kernel = head.packed_weight is not None
    print(f"Float32Logits on this CPU: {'the AVX512_BF16 kernel' if kernel else 'NOT the kernel (no AVX512_BF16): float32 copy'}")
    assert kernel == cpu_native.linear_bf16_available()


def test_pack_pairs_layout() -> None:
    weight = torch.arange(20 * 6, dtype=torch.float32).view(20, 6).bfloat16()
    packed = pack_pairs(weight)                                    # [2 panels, 3 pairs, 16, 2]
    assert packed.shape == (2, 3, 16, 2)
    assert torch.equal(packed[0, 1, 5], weight[5, 2:4])            # column 5, inputs 2 and 3
    assert torch.equal(packed[1, 2, 3], weight[19, 4:6])           # column 16 + 3
    assert (packed[1, :, 4:] == 0).all()                           # padding past 20 columns


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64])
@pytest.mark.parametrize("out_features,in_features", [(16, 2), (49152 // 64, 576), (37, 130)])
def test_float32_logits_match_reference(rows: int, out_features: int, in_features: int) -> None:
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    storage = torch.full((rows, in_features + 6), float("nan")).bfloat16()   # row stride > in_features
    storage[:, :in_features] = torch.randn(rows, in_features, generator=gen).bfloat16()
    x = storage[:, :in_features]
    logits = Float32Logits(weight)(x)
    expected = F.linear(x.float(), weight.float())
    assert logits.dtype == torch.float32 and logits.shape == (rows, out_features)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-5)
    # Far closer than bfloat16 logits could be: that is what the head is for.
    assert (logits - expected).abs().max() < (expected.bfloat16().float() - expected).abs().max() / 10 + 1e-6


@pytest.fixture(params=[1, 3])
def threads(request):
    """torch's (and so the kernels') thread count for one test: one, and more than the panels'
    groups split evenly over."""
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


def test_float32_logits_on_several_threads(threads: int) -> None:
    gen = torch.Generator().manual_seed(threads)
    weight = torch.randn(300, 64, generator=gen).bfloat16()
    x = torch.randn(21, 64, generator=gen).bfloat16()
    torch.testing.assert_close(Float32Logits(weight)(x), F.linear(x.float(), weight.float()), atol=1e-4, rtol=1e-5)


def test_float32_copy_path_where_the_kernel_is_missing(monkeypatch) -> None:
    """What a CPU without AVX512_BF16 runs (covered on every machine)."""
    monkeypatch.setattr(cpu_native, "linear_bf16_available", lambda: False)
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(50, 32, generator=gen).bfloat16()
    x = torch.randn(5, 32, generator=gen).bfloat16()
    head = Float32Logits(weight)
    assert head.packed_weight is None
    torch.testing.assert_close(head(x), F.linear(x.float(), weight.float()), atol=1e-5, rtol=1e-5)


# Row counts cover both tilings (up to 16 rows one tile of all rows x 1 panel, beyond them tiles
# of 8 rows x 3 panels with every shorter last tile); sizes cover one, two and three panels per
# tile, partial panels (37, 20 outputs) and SmolLM2's shapes.
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 12, 15, 16, 17, 18, 19, 20, 21, 22, 23, 64])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (37, 130), (20, 8), (16, 2), (48, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_native_bf16_linear_matches_reference(bf16_kernel, rows: int, out_features: int, in_features: int,
                                              bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * out_features + in_features + bias)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    layer = NativeBf16Linear(weight, b)
    storage = torch.full((rows, in_features + 6), float("nan")).bfloat16()   # row stride > in_features
    storage[:, 3:3 + in_features] = torch.randn(rows, in_features, generator=gen).bfloat16()
    x = storage[:, 3:3 + in_features]
    exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
    within_one_rounding(layer(x), exact, in_features)
    # Leading dimensions are kept.
    assert layer(x.contiguous().view(1, rows, in_features)).shape == (1, rows, out_features)


def test_native_bf16_linear_matches_onednn_on_model_shapes(bf16_kernel) -> None:
    """What the kernel replaces: prepacked oneDNN, also float32 sums rounded once."""
    gen = torch.Generator().manual_seed(3)
    for out_features, in_features in [(960, 576), (3072, 576), (576, 1536)]:
        weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
        x = torch.randn(16, in_features, generator=gen).bfloat16()
        ours, theirs = NativeBf16Linear(weight, None)(x).float(), PackedLinear(weight, None)(x).float()
        unit = theirs.abs() * 2.0 ** -7
        assert ((ours - theirs).abs() <= unit + 1e-5).all()


def test_native_bf16_linear_on_several_threads(bf16_kernel, threads: int) -> None:
    gen = torch.Generator().manual_seed(threads)
    weight = torch.randn(300, 64, generator=gen).bfloat16()
    x = torch.randn(21, 64, generator=gen).bfloat16()
    within_one_rounding(NativeBf16Linear(weight, None)(x), F.linear(x.float(), weight.float()), 64)


def test_native_linear_picks_by_dtype_and_input_size(bf16_kernel) -> None:
    assert isinstance(native_linear(torch.randn(8, 6).bfloat16(), None), NativeBf16Linear)
    assert isinstance(native_linear(torch.randn(8, 5).bfloat16(), None), PackedLinear)   # odd: not in pairs
    with pytest.raises(ValueError, match="even"):
        NativeBf16Linear(torch.randn(8, 5).bfloat16(), None)
