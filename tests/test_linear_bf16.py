"""The bfloat16 kernels of kernels/csrc/linear_bf16.c against the reference, ``F.linear`` on the
widened operands, whose products are the same exact values (only the summation order
differs): the projections (``NativeBf16Linear``, bfloat16 out, rounded once) and the LM head
with float32 logits (``Float32Logits``). Each version of the kernels that this CPU can run is
built and tested: AMX tiles, AVX512_BF16 dot products, AVX2 widening (built with -mno-avx512f on an
AVX-512 CPU), and the AMX code over emulated tiles; a version the CPU cannot run is reported NOT
RUN, naming what it lacks."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch
import torch.nn.functional as F

from backend.model.cpu_linear import (Float32Logits, NativeBf16Linear, PackedLinear, TorchLinear, native_linear,
                                      onednn_packing_available, pack_pairs)
from backend.model.cpu_features import detect
from kernels import cpu_native

pytestmark = pytest.mark.usefixtures("fp16_matmuls_off")   # see tests/conftest.py

# version -> (flags added to the engine's build, CPU flags it needs). Every build starts from
# -march=native and switches off what the version must not use. "amx-emulated" is the AMX
# version's code over tiles in plain C (kernels/csrc/linear_bf16.c): its blocking, padding,
# grouping and epilogue run on every CPU with AVX2.
KERNEL_VERSIONS = {
    "amx-bf16": ((), {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}),
    "avx512-bf16": (("-mno-amx-tile", "-mno-amx-bf16"), {"avx512f", "avx512_bf16"}),
    "avx2": (("-mno-avx512f",), {"avx2", "fma"}),
    "amx-emulated": (("-mno-avx512f", "-DLINEAR_BF16_EMULATE_AMX"), {"avx2", "fma"}),
}



@pytest.fixture(scope="module", params=list(KERNEL_VERSIONS))
def bf16_library(request) -> ctypes.CDLL:
    """A build of the kernels holding one version of the bfloat16 linear kernel; skipped, naming
    the missing CPU features, only when this CPU cannot run that version."""
    extra_flags, needed = KERNEL_VERSIONS[request.param]
    missing = needed - detect().flags if platform.machine() in ("x86_64", "AMD64") else {"an x86 CPU"}
    if missing:
        pytest.skip(f"NOT RUN: the {request.param} version of the bfloat16 linear kernel needs {sorted(missing)}, "
                    f"which this CPU lacks")
    library = cpu_native.open_library(cpu_native.build(cflags=cpu_native.CFLAGS + extra_flags))
    assert cpu_native.linear_bf16_version(library) == request.param
    # The AMX versions run only once turned on; on real AMX hardware this also fails, rather than
    # testing the dot products under AMX's name, if the OS refuses the process AMX state.
    amx = cpu_native.use_amx(True, library)
    assert amx == request.param.startswith("amx"), \
        f"{request.param}: AMX tiles {'on' if amx else 'off'} ({cpu_native.amx_probe_result(library)})"
    return library


@pytest.fixture
def bf16_kernel() -> None:
    """The engine's own build has a version of the kernel (the layer classes use it)."""
    if not cpu_native.linear_bf16_available():
        pytest.skip("NOT RUN: the bfloat16 linear kernel needs a CPU with AVX512_BF16 or AVX2 + FMA "
                    "(and gcc to target it)")


def within_one_rounding(got: torch.Tensor, exact: torch.Tensor, in_features: int) -> None:
    """``got`` (bfloat16) is ``exact`` (float32) rounded once: at most one bfloat16 unit away
    (half a unit for the rounding, the rest for a different float32 summation order)."""
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    unit = exact.abs() * 2.0 ** -7
    error = (got.float() - exact).abs()
    assert (error <= unit + 1e-6 * in_features).all(), (error - unit).max()


def test_amx_stays_off_until_asked() -> None:
    """The AMX version is opt-in (the engine turns it on with cpu_linear=native): a fresh build
    runs the dot products until asked, and can be turned off again."""
    library = cpu_native.open_library(cpu_native.build(cflags=cpu_native.CFLAGS + KERNEL_VERSIONS["amx-emulated"][0]))
    gen = torch.Generator().manual_seed(11)
    weight, x = torch.randn(64, 64, generator=gen).bfloat16(), torch.randn(5, 64, generator=gen).bfloat16()
    exact = F.linear(x.float(), weight.float())
    packed = pack_pairs(weight)
    tile_products = library.linear_bf16_emulated_tile_products   # test builds only
    tile_products.restype = ctypes.c_int64
    for on, tiles in ((None, 0), (True, 4 * 2), (False, 0)):     # 4 panels x 2 chunks of 32 k, one block
        if on is not None:
            assert cpu_native.use_amx(on, library) == on
        before = tile_products()
        got = cpu_native.linear_bf16_f32(x, packed, 64, library=library)
        torch.testing.assert_close(got, exact, atol=1e-4, rtol=1e-5)
        assert tile_products() - before == tiles


def test_which_path_runs_here() -> None:
    head = Float32Logits(torch.randn(40, 8).bfloat16())
    kernel = head.packed_weight is not None
    version = cpu_native.linear_bf16_version()
    print(f"Float32Logits on this CPU: {f'the {version} kernel' if kernel else 'NOT the kernel: float32 copy'}")
    assert kernel == (version is not None)


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
    """What a CPU without the kernel runs (covered on every machine)."""
    monkeypatch.setattr(cpu_native, "linear_bf16_available", lambda: False)
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(50, 32, generator=gen).bfloat16()
    x = torch.randn(5, 32, generator=gen).bfloat16()
    head = Float32Logits(weight)
    assert head.packed_weight is None
    torch.testing.assert_close(head(x), F.linear(x.float(), weight.float()), atol=1e-5, rtol=1e-5)


# Row counts cover both tilings of the AVX512_BF16 version (up to 16 rows one tile of all rows x
# 1 panel, beyond them tiles of 8 rows x 3 panels with every shorter last tile), the AVX2
# version's (tiles of 4 rows, blocks of 48 rows; up to 32 rows k in blocks of 64, the last one
# partial at 130) and the AMX version's (one row by the dot
# products; blocks of 16 rows, the last one padded; groups of 1, 2 and 4 panels); sizes cover one,
# two and three panels per tile, partial panels (37, 20 outputs), k not a multiple of 32 (the AMX
# build's fallback: 130, 8, 2), an odd count of 32-k chunks (96) and SmolLM2's shapes.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 12, 15, 16, 17, 18, 19, 20, 21, 22, 23, 49, 64, 100])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (37, 130), (20, 8), (16, 2), (48, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_kernel_matches_reference(bf16_library, rows: int, out_features: int, in_features: int,
                                       bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * out_features + in_features + bias)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    packed = pack_pairs(weight)
    storage = torch.full((rows, in_features + 6), float("nan")).bfloat16()   # row stride > in_features
    storage[:, 3:3 + in_features] = torch.randn(rows, in_features, generator=gen).bfloat16()
    x = storage[:, 3:3 + in_features]
    exact = F.linear(x.float(), weight.float(), None if b is None else b.float())
    got = cpu_native.linear_bf16(x, packed, out_features, None if b is None else b.float(), library=bf16_library)
    within_one_rounding(got, exact, in_features)
    # float32 out (the LM head): the same sums, not rounded.
    logits = cpu_native.linear_bf16_f32(x, packed, out_features, library=bf16_library)
    torch.testing.assert_close(logits, F.linear(x.float(), weight.float()), atol=1e-4 * in_features ** 0.5, rtol=1e-5)


def test_native_bf16_linear_keeps_leading_dims(bf16_kernel) -> None:
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(40, 64, generator=gen).bfloat16()
    x = torch.randn(2, 3, 64, generator=gen).bfloat16()
    layer = NativeBf16Linear(weight, None)
    got = layer(x)
    assert got.shape == (2, 3, 40)
    within_one_rounding(got.view(6, 40), F.linear(x.view(6, 64).float(), weight.float()), 64)


def test_bf16_kernel_matches_onednn_on_model_shapes(bf16_library) -> None:
    """What the kernel replaces where oneDNN packs bfloat16: float32 sums rounded once too."""
    if not onednn_packing_available(torch.bfloat16):
        pytest.skip("NOT RUN: oneDNN packs bfloat16 weights only with AVX-512 or AVX-NE-CONVERT, "
                    "which this CPU lacks")
    gen = torch.Generator().manual_seed(3)
    for out_features, in_features in [(960, 576), (3072, 576), (576, 1536)]:
        weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
        x = torch.randn(16, in_features, generator=gen).bfloat16()
        ours = cpu_native.linear_bf16(x, pack_pairs(weight), out_features, None, library=bf16_library).float()
        theirs = PackedLinear(weight, None)(x).float()
        unit = theirs.abs() * 2.0 ** -7
        assert ((ours - theirs).abs() <= unit + 1e-5).all()


def test_bf16_kernel_on_several_threads(bf16_library, threads: int) -> None:
    gen = torch.Generator().manual_seed(threads)
    weight = torch.randn(300, 64, generator=gen).bfloat16()
    x = torch.randn(21, 64, generator=gen).bfloat16()
    got = cpu_native.linear_bf16(x, pack_pairs(weight), 300, None, library=bf16_library)
    within_one_rounding(got, F.linear(x.float(), weight.float()), 64)


def test_native_linear_picks_by_dtype_and_input_size(bf16_kernel) -> None:
    assert isinstance(native_linear(torch.randn(8, 6).bfloat16(), None), NativeBf16Linear)
    odd = native_linear(torch.randn(8, 5).bfloat16(), None)   # odd: not in pairs
    assert isinstance(odd, PackedLinear if onednn_packing_available(torch.bfloat16) else TorchLinear)
    with pytest.raises(ValueError, match="even"):
        NativeBf16Linear(torch.randn(8, 5).bfloat16(), None)
