"""The float32-FMA version of our bfloat16 linear kernel (kernels/csrc/linear_bf16.c: the packed
bfloat16 weight widened in registers, 512-bit FMAs, for calls of many rows on AVX-512F CPUs)
against the reference the other versions are held to (``F.linear`` on the widened operands:
tests/test_linear_bf16.py), and the start-up choice of the rows it runs from
(backend/model/cpu_linear_tuning.py, ``choose_fma_rows``). Each build holding it that this CPU
can run is tested: over the AVX512_BF16 dot products, and over the AVX2 version (an AVX-512 CPU
without BF16, built with -mno-avx512bf16); a build the CPU cannot run is reported NOT RUN, naming
what it lacks. A build without AVX-512F must not have it (every AVX2 CPU checks that)."""

from __future__ import annotations

import ctypes
import logging
import platform

import pytest
import torch
import torch.nn.functional as F

from backend.model import cpu_linear_tuning
from backend.model.architecture import ModelArchitecture
from backend.model.cpu_features import CpuFeatures, detect
from backend.model.cpu_linear import bf16_fma_built, bf16_fma_rows, pack_pairs, use_bf16_fma_rows
from backend.model.cpu_linear_tuning import (FMA_CANDIDATE_ROWS, FMA_MARGIN, FmaTiming,
                                             choose_cpu_linear, choose_fma_rows, fma_shapes, fma_threshold, time_fma)
from kernels import cpu_native
from tests.test_linear_bf16 import within_one_rounding

pytestmark = pytest.mark.usefixtures("fp16_matmuls_off")   # see tests/conftest.py

NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16")
# build -> (flags added to the engine's, CPU flags it needs, linear_bf16_version of the build).
FMA_BUILDS = {
    "fma-over-avx512-bf16": (NO_AMX, {"avx512f", "avx512_bf16"}, "avx512-bf16"),
    "fma-over-avx2": (NO_AMX + ("-mno-avx512bf16",), {"avx512f", "avx2", "fma"}, "avx2"),
}

AVX2 = CpuFeatures.of("avx2", "fma")
AVX512_BF16 = CpuFeatures.of("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")


def missing(needed: set[str]) -> set[str]:
    return needed - detect().flags if platform.machine() in ("x86_64", "AMD64") else {"an x86 CPU"}


def build(flags: tuple[str, ...]) -> ctypes.CDLL:
    return cpu_native.open_library(cpu_native.build(cflags=cpu_native.CFLAGS + flags))


@pytest.fixture(scope="module", params=list(FMA_BUILDS))
def fma_library(request) -> ctypes.CDLL:
    """A build holding the FMA version, which runs from one row here (restored after)."""
    flags, needed, version = FMA_BUILDS[request.param]
    lacking = missing(needed)
    if lacking:
        pytest.skip(f"NOT RUN: the {request.param} build of the bfloat16 linear kernel needs {sorted(lacking)}, "
                    f"which this CPU lacks")
    library = build(flags)
    assert cpu_native.linear_bf16_version(library) == version and bf16_fma_built(library)
    before = bf16_fma_rows(library)
    yield library
    use_bf16_fma_rows(before, library)


@pytest.fixture(params=[1, 2, 3])
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


def case(rows: int, out_features: int, in_features: int, bias: bool, seed: int):
    """Weights, an x with a row stride past in_features (NaN between rows), a float32 bias or None."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16().float() if bias else None
    storage = torch.full((rows, in_features + 6), float("nan")).bfloat16()
    storage[:, 3:3 + in_features] = torch.randn(rows, in_features, generator=gen).bfloat16()
    return weight, storage[:, 3:3 + in_features], b


def check(library: ctypes.CDLL, rows: int, out_features: int, in_features: int, bias: bool) -> None:
    weight, x, b = case(rows, out_features, in_features, bias, rows * out_features + in_features + bias)
    packed = pack_pairs(weight)
    exact = F.linear(x.float(), weight.float(), b)
    within_one_rounding(cpu_native.linear_bf16(x, packed, out_features, b, library=library), exact, in_features)
    logits = cpu_native.linear_bf16_f32(x, packed, out_features, library=library)
    torch.testing.assert_close(logits, F.linear(x.float(), weight.float()), atol=1e-4 * in_features ** 0.5,
                               rtol=1e-5)


# Rows: every tile height (8-row tiles and each shorter last one), single rows, row blocks;
# sizes: 1-3 panels a tile and partial panels (37, 20, 50 outputs), an odd count of pairs of k
# (130, 578: the kernel takes k in pairs, so k itself is even, as NativeBf16Linear requires), k = 2,
# fewer panel groups than threads (16, 20, 37, 48 outputs: the rows are split) and SmolLM2's shapes.
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 15, 17, 24, 37, 64, 100, 129, 600])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (37, 130), (20, 8), (16, 2),
                                                      (48, 96), (50, 578)])
@pytest.mark.parametrize("bias", [False, True])
def test_fma_matches_reference(fma_library: ctypes.CDLL, rows: int, out_features: int, in_features: int,
                               bias: bool) -> None:
    assert use_bf16_fma_rows(1, fma_library) == 1
    check(fma_library, rows, out_features, in_features, bias)


def test_fma_on_several_threads(fma_library: ctypes.CDLL, threads: int) -> None:
    assert use_bf16_fma_rows(1, fma_library) == 1
    for rows, out_features, in_features in [(300, 3072, 576), (21, 300, 64), (77, 40, 64)]:
        check(fma_library, rows, out_features, in_features, True)


def test_fma_large_rows_across_row_blocks(fma_library: ctypes.CDLL) -> None:
    """More rows than one block's widened copy holds (1 MiB: 170 rows of 1536 k)."""
    assert use_bf16_fma_rows(1, fma_library) == 1
    check(fma_library, 403, 200, 1536, True)


def test_threshold_picks_the_version_by_rows() -> None:
    """Calls of fewer rows than the threshold run the dot products, the others the FMAs. Told apart
    by a bfloat16 denormal weight: vdpbf16ps treats it as zero, an FMA multiplies it."""
    flags, needed, _ = FMA_BUILDS["fma-over-avx512-bf16"]
    lacking = missing(needed)
    if lacking:
        pytest.skip(f"NOT RUN: needs {sorted(lacking)} (the dot products to tell apart), which this CPU lacks")
    library = build(flags)
    before = bf16_fma_rows(library)
    weight = torch.zeros(16, 2, dtype=torch.bfloat16)
    weight.view(torch.int16)[:, 0] = 1                       # 2^-133, a denormal
    packed = pack_pairs(weight)
    try:
        for threshold in (0, 5):
            assert use_bf16_fma_rows(threshold, library) == threshold
            for rows in (1, 4, 5, 9):
                x = torch.full((rows, 2), 2.0 ** 100).bfloat16()
                y = cpu_native.linear_bf16_f32(x, packed, 16, library=library)
                fma = 0 < threshold <= rows
                assert bool((y != 0).all()) == fma and bool((y == 0).all()) != fma, (threshold, rows)
        assert use_bf16_fma_rows(-3, library) == 0 and bf16_fma_rows(library) == 0
    finally:
        use_bf16_fma_rows(before, library)


def test_fma_sums_as_the_dot_products(fma_library: ctypes.CDLL) -> None:
    """The FMAs add each pair's odd k, then its even k: Intel's order for vdpbf16ps. Checked within
    rounding everywhere; printed whether the sums are the dot products' bit for bit."""
    if cpu_native.linear_bf16_version(fma_library) != "avx512-bf16":
        pytest.skip("NOT RUN: the comparison is with the dot products (this build has the AVX2 version)")
    weight, x, b = case(129, 960, 576, True, 1)
    packed = pack_pairs(weight)
    outputs = []
    for threshold in (0, 1):
        use_bf16_fma_rows(threshold, fma_library)
        outputs.append(cpu_native.linear_bf16_f32(x, packed, 960, library=fma_library))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4 * 576 ** 0.5, rtol=1e-5)
    print(f"FMA version bit-identical to the dot products here: {torch.equal(outputs[0], outputs[1])}")


def test_builds_without_avx512f_lack_it() -> None:
    lacking = missing({"avx2", "fma"})
    if lacking:
        pytest.skip(f"NOT RUN: the AVX2 build needs {sorted(lacking)}, which this CPU lacks")
    library = build(("-mno-avx512f",))
    assert not bf16_fma_built(library)
    assert use_bf16_fma_rows(64, library) == 0 and bf16_fma_rows(library) == 0


# ---- the start-up choice
def tiny_arch(hidden: int = 64, intermediate: int = 96) -> ModelArchitecture:
    return ModelArchitecture(model_type="llama", vocab_size=128, hidden_size=hidden, intermediate_size=intermediate,
                             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-5,
                             rope_theta=1e4, rope_scaling=None, max_position_embeddings=256,
                             tie_word_embeddings=True, qkv_bias=False, qk_norm=False, initializer_range=0.02)


@pytest.fixture
def restore_threshold():
    before = bf16_fma_rows()
    yield
    use_bf16_fma_rows(before)


def fake_timer(dot: dict[int, float], fma: dict[int, float], error: float = 0.0):
    calls = []

    def timer(shapes):
        calls.append(shapes)
        return [FmaTiming(r, dot[r], fma[r]) for r in sorted(dot)], error
    timer.calls = calls
    return timer


def test_threshold_is_where_the_fmas_win_from_there_on() -> None:
    def timings(pairs):
        return [FmaTiming(r, d, f) for r, (d, f) in pairs.items()]
    assert fma_threshold(timings({32: (1.0, 2.0), 64: (2.0, 1.0), 128: (4.0, 2.0)})) == 64
    # A win at 32 but a loss at 64: from 128 only.
    assert fma_threshold(timings({32: (2.0, 1.0), 64: (1.0, 2.0), 128: (4.0, 2.0)})) == 128
    assert fma_threshold(timings({32: (1.0, 2.0), 512: (1.0, 1.0)})) == 0          # a tie is no win
    assert fma_threshold(timings({64: (FMA_MARGIN * 1.01, 1.0), 512: (1.0 * FMA_MARGIN * 0.99, 1.0)})) == 0
    assert fma_threshold([]) == 0


def test_choice_is_timed_and_set_where_it_runs(restore_threshold, caplog: pytest.LogCaptureFixture) -> None:
    if not bf16_fma_built():
        pytest.skip("NOT RUN: the engine's build has no FMA version (needs AVX-512F, which this CPU lacks)")
    if cpu_native.linear_bf16_version() in cpu_native.AMX_VERSIONS:
        pytest.skip("NOT RUN: the AMX version is built here (its tiles take these calls): not timed")
    arch = tiny_arch()
    timer = fake_timer({32: 2.0, 64: 4.0, 512: 30.0}, {32: 3.0, 64: 3.0, 512: 15.0})
    choice = choose_cpu_linear("native", torch.bfloat16, arch, features=AVX512_BF16, fma_timer=timer)
    assert choice.path == "native" and choice.fma_min_rows == 64 and bf16_fma_rows() == 64
    assert "float32 FMAs from 64 rows" in choice.why and "512 rows 30.00/15.00 ms" in choice.why
    assert timer.calls == [fma_shapes(arch)]
    # Wrong results: never, and the log says so.
    with caplog.at_level(logging.WARNING):
        rows, note = choose_fma_rows("native", arch, features=AVX512_BF16,
                                     timer=fake_timer({64: 9.0}, {64: 1.0}, error=0.5))
    assert rows == 0 and "wrong results" in note and "float32-FMA version computes wrong results" in caplog.text
    # The configured threshold (EngineConfig.cpu_linear_fma_rows) instead of a timing.
    untimed = fake_timer({}, {})
    choice = choose_cpu_linear("native", torch.bfloat16, arch, features=AVX512_BF16, fma_timer=untimed, fma_rows=96)
    assert choice.fma_min_rows == 96 and bf16_fma_rows() == 96 and "cpu_linear_fma_rows" in choice.why
    assert not untimed.calls
    assert choose_cpu_linear("native", torch.bfloat16, arch, features=AVX512_BF16,
                             fma_timer=untimed, fma_rows=0).fma_min_rows == 0 and bf16_fma_rows() == 0


def test_not_timed_where_it_cannot_run(restore_threshold, monkeypatch: pytest.MonkeyPatch) -> None:
    arch, timer = tiny_arch(), fake_timer({64: 9.0}, {64: 1.0})
    use_bf16_fma_rows(64)
    # No AVX-512 (the machine faked), another path, int8 projections, a float32 model.
    assert choose_fma_rows("native", arch, features=AVX2, timer=timer) == (0, "")
    assert choose_fma_rows("onednn", arch, features=AVX512_BF16, timer=timer) == (0, "")
    assert choose_fma_rows("native", arch, quantization="int8", features=AVX512_BF16, timer=timer) == (0, "")
    choice = choose_cpu_linear("native", torch.float32, arch, features=AVX512_BF16, fma_timer=timer)
    assert choice.fma_min_rows == 0 and "FMA" not in choice.why
    # Where the bfloat16 choice is another path, the FMAs are off for the process (the LM head).
    choice = choose_cpu_linear("torch", torch.bfloat16, arch, features=AVX512_BF16, fma_timer=timer)
    assert choice.fma_min_rows == 0 and bf16_fma_rows() == 0
    # The AMX version built: its tiles take every call of 2 rows and more.
    monkeypatch.setattr(cpu_native, "linear_bf16_version", lambda library=None: "amx-bf16")
    assert choose_fma_rows("native", arch, features=AVX512_BF16, timer=timer) == (0, "")
    assert timer.calls == []


def test_real_timing_picks_a_valid_threshold(restore_threshold, monkeypatch: pytest.MonkeyPatch) -> None:
    """The timing itself, on small shapes here: a threshold among the timed row counts (or 0),
    figures for each, the FMAs' results checked, and the process's threshold as it was."""
    if not bf16_fma_built():
        pytest.skip("NOT RUN: the engine's build has no FMA version (needs AVX-512F, which this CPU lacks)")
    use_bf16_fma_rows(7)
    shapes = [(64, 96), (128, 48)]
    timings, error = time_fma(shapes, rows=(32, 64), rounds=1)
    assert bf16_fma_rows() == 7
    assert [t.rows for t in timings] == [32, 64] and all(t.dot_ms > 0 and t.fma_ms > 0 for t in timings)
    assert error <= cpu_linear_tuning.TOLERANCE[torch.bfloat16]
    assert fma_threshold(timings) in (0, 32, 64)
    if cpu_native.linear_bf16_version() not in cpu_native.AMX_VERSIONS:
        rows, note = choose_fma_rows("native", tiny_arch(), features=detect() if detect().avx512 else AVX512_BF16)
        assert rows in (0, *FMA_CANDIDATE_ROWS) and "float32 FMAs" in note
        print(f"choose_fma_rows on a tiny model here: {note}")


def test_fma_shapes_cut_large_layers() -> None:
    small = tiny_arch()
    assert fma_shapes(small) == [(64, (4 + 2 * 2) * 16), (64, 64), (64, 192), (96, 64)]
    big = tiny_arch(hidden=4096, intermediate=11008)
    for k, n in fma_shapes(big):
        assert n % 48 == 0 and k * n <= cpu_linear_tuning.FMA_MAX_WEIGHTS
