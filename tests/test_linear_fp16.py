"""The float16 version of our bfloat16 linear kernel (kernels/csrc/linear_bf16.c: each row of x
scaled by a power of 2, operands narrowed to float16, 512-bit float16 FMAs summing FP16_KC pairs
of k, float32 after that; AVX512-FP16 builds, for calls of as many rows as the start-up timing
or ``cpu_linear_fp16_rows`` says) against the float64 product of the same bfloat16 operands. Its sums are not the float32
versions': each product and partial sum is rounded to float16 (11 significant bits), so the
check is the rounding-error bound of such a sum plus a bound on the overall relative error that
a kernel dropping or doubling terms cannot meet. A build the CPU cannot run is reported NOT RUN;
a build without AVX512-FP16 must not have the version (it answers 0 when asked for it). Also:
the logits' entry never runs it, the start-up choice of its threshold (fake clocks), and the
engine turning it on only where every weight is in its range."""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch

from backend import Engine, EngineConfig
from backend.model import cpu_linear_tuning
from backend.model.cpu_features import detect
from backend.model.cpu_linear import bf16_fp16_built, bf16_fp16_rows, pack_pairs, use_bf16_fp16_rows
from backend.model.cpu_linear_tuning import FP16_MARGIN, Fp16Timing, choose_fp16_rows, fp16_threshold
from backend.worker import model_runner
from kernels import cpu_native
from tests.test_linear_fma import threads  # noqa: F401 - the fixture (1-3 torch threads), reused

NO_AMX = ("-mno-amx-tile", "-mno-amx-bf16")
KC = 32                      # the kernel's FP16_KC: products summed in float16 before float32
UNIT = 2.0 ** -11            # float16's unit roundoff
# Measured on SmolLM2's projections: 8.4e-4 (docs/benchmarks.md, "Float16 matmuls"); a kernel
# that drops the odd k of each pair is at ~0.7.
MAX_RELATIVE_L2 = 3e-3


def missing(needed: set[str]) -> set[str]:
    return needed - detect().flags if platform.machine() in ("x86_64", "AMD64") else {"an x86 CPU"}


@pytest.fixture(scope="module")
def fp16_library() -> ctypes.CDLL:
    lacking = missing({"avx512f", "avx512bw", "avx512_fp16"})
    if lacking:
        pytest.skip(f"NOT RUN: the float16 version of the bfloat16 linear kernel needs {sorted(lacking)}, "
                    f"which this CPU lacks")
    library = cpu_native.open_library(cpu_native.build(cflags=cpu_native.CFLAGS + NO_AMX))
    assert use_bf16_fp16_rows(1, library) == 1
    yield library
    use_bf16_fp16_rows(0, library)


def case(rows: int, out_features: int, in_features: int, seed: int, row_scales: list[float] | None = None):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.1).bfloat16()
    storage = torch.full((rows, in_features + 6), float("nan")).bfloat16()
    x = torch.randn(rows, in_features, generator=gen)
    if row_scales is not None:
        x *= torch.tensor(row_scales)[:rows, None]
    storage[:, 3:3 + in_features] = x.bfloat16()
    return weight, storage[:, 3:3 + in_features]


def check(library: ctypes.CDLL, weight: torch.Tensor, x: torch.Tensor) -> None:
    out_features, in_features = weight.shape
    packed = pack_pairs(weight)
    exact = x.double() @ weight.double().T
    got = cpu_native.linear_bf16_f32(x, packed, out_features, library=library).double()
    assert torch.isfinite(got).all()
    # Summation of KC products in float16 (each product and sum rounded), then float32.
    magnitude = x.double().abs() @ weight.double().abs().T
    assert ((got - exact).abs() <= (KC + 2) * UNIT * magnitude + 1e-30).all()
    if exact.norm() > 0:
        assert (got - exact).norm() / exact.norm() <= MAX_RELATIVE_L2
    bias = torch.randn(out_features).bfloat16().float()
    rounded = cpu_native.linear_bf16(x, packed, out_features, bias, library=library).float()
    with_bias = got.float() + bias
    assert ((rounded - with_bias).abs() <= with_bias.abs() * 2.0 ** -8 + 1e-6).all()


def products_float16_rounds() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight and x whose products (1 + 2^-7)^2 need 15 significant bits: float32 sums give
    the exact product (returned third), float16 ones do not."""
    weight = torch.full((16, 4), 1.0 + 2.0 ** -7).bfloat16()
    x = torch.full((3, 4), 1.0 + 2.0 ** -7).bfloat16()
    return weight, x, x.float() @ weight.float().T


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, 64, 129, 600])
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (50, 578), (48, 96), (96, 2)])
def test_fp16_within_its_rounding_of_the_exact_product(fp16_library: ctypes.CDLL, rows: int, out_features: int,
                                                       in_features: int) -> None:
    check(fp16_library, *case(rows, out_features, in_features, rows * out_features + in_features))


def test_fp16_on_several_threads(fp16_library: ctypes.CDLL, threads: int) -> None:
    for rows, out_features, in_features in [(300, 3072, 576), (21, 300, 64), (77, 96, 64)]:
        check(fp16_library, *case(rows, out_features, in_features, rows))


def test_rows_of_any_magnitude_neither_overflow_nor_vanish(fp16_library: ctypes.CDLL) -> None:
    """float16 overflows past 65504 and loses precision under 6e-5: each row is scaled by a
    power of 2 first, so rows of 1e5 and of 1e-6, and a row of zeros, come out as exact as any."""
    scales = [1e5, 1e-6, 0.0, 1.0, 3e4, 1e-3, 1e6, 7.0, 1e-8]
    check(fp16_library, *case(9, 200, 576, 7, scales))


def test_fewer_panel_groups_than_threads_run_another_version(fp16_library: ctypes.CDLL) -> None:
    """16 outputs are one panel group: on one thread the float16 version runs, with 2 it declines
    and the call runs the dot products (or float32 FMAs). Told apart by products that float16
    rounds ((1 + 2^-7)^2 needs 15 significant bits) and float32 holds."""
    previous = torch.get_num_threads()
    weight, x, exact = products_float16_rounds()
    try:
        for count, float16 in ((1, True), (2, False)):
            torch.set_num_threads(count)
            got = cpu_native.linear_bf16_f32(x, pack_pairs(weight), 16, library=fp16_library)
            assert torch.equal(got, exact) != float16, count
    finally:
        torch.set_num_threads(previous)


def test_a_build_without_avx512_fp16_has_no_float16_version() -> None:
    if platform.machine() not in ("x86_64", "AMD64") or missing({"avx2", "fma"}):
        pytest.skip("NOT RUN: needs an x86 CPU with AVX2 + FMA to build our kernel")
    library = cpu_native.open_library(cpu_native.build(cflags=cpu_native.CFLAGS + NO_AMX + ("-mno-avx512fp16",)))
    assert use_bf16_fp16_rows(1, library) == 0


def test_the_logits_entry_never_runs_the_float16_version(fp16_library: ctypes.CDLL) -> None:
    """The LM head's float32 logits (``Float32Logits``) go through ``linear_bf16_logits``: with
    the float16 version on from one row, the float32 entry runs it and the logits' does not."""
    previous = torch.get_num_threads()
    weight, x, exact = products_float16_rounds()
    try:
        torch.set_num_threads(1)
        assert not torch.equal(cpu_native.linear_bf16_f32(x, pack_pairs(weight), 16, library=fp16_library), exact)
        assert torch.equal(cpu_native.linear_bf16_logits(x, pack_pairs(weight), 16, library=fp16_library), exact)
    finally:
        torch.set_num_threads(previous)


def timings(pairs: dict[int, tuple[float, float]]) -> list[Fp16Timing]:
    return [Fp16Timing(rows, without, with_fp16) for rows, (without, with_fp16) in pairs.items()]


def test_the_threshold_is_where_it_wins_by_its_margin_at_every_count_above() -> None:
    assert fp16_threshold(timings({32: (1.0, 1.0), 64: (2.0, 1.5), 512: (8.0, 6.0)})) == 64
    assert fp16_threshold(timings({32: (1.0, 0.5), 64: (1.0, 1.0), 512: (8.0, 6.0)})) == 512
    assert fp16_threshold(timings({64: (FP16_MARGIN * 0.99, 1.0), 512: (FP16_MARGIN * 1.01, 1.0)})) == 512
    assert fp16_threshold(timings({64: (2.0, 1.0), 512: (FP16_MARGIN * 0.99, 1.0)})) == 0
    assert fp16_threshold([]) == 0


def test_the_start_up_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timed where the projections run our kernel unquantized, the version is built and no AMX
    version is; forced by ``cpu_linear_fp16_rows``; never where it computes wrong results (the
    machine faked: the kernel's version and whether the float16 one is built)."""
    from tests.test_linear_fma import tiny_arch

    monkeypatch.setattr(cpu_linear_tuning, "bf16_fp16_built", lambda: True)
    monkeypatch.setattr(cpu_native, "linear_bf16_version", lambda library=None: "avx512-bf16")
    calls = []

    def timer(error: float):
        def timed(shapes):
            calls.append(shapes)
            return timings({32: (1.0, 1.0), 64: (2.0, 1.2), 512: (16.0, 9.0)}), error
        return timed

    arch = tiny_arch()
    rows, note = choose_fp16_rows("native", arch, timer=timer(1e-3))
    assert rows == 64 and "from 64 rows" in note and "64 rows 2.00/1.20 ms" in note
    assert choose_fp16_rows("native", arch, timer=timer(0.5)) == (0, "float16 matmuls never (wrong results here: "
                                                                       "error 0.5)")
    calls.clear()
    assert choose_fp16_rows("native", arch, timer=timer(1e-3), forced=96)[0] == 96
    assert choose_fp16_rows("native", arch, timer=timer(1e-3), forced=0)[0] == 0
    assert choose_fp16_rows("onednn", arch, timer=timer(1e-3)) == (0, "")
    assert choose_fp16_rows("native", arch, "int8", timer=timer(1e-3)) == (0, "")
    assert not calls
    monkeypatch.setattr(cpu_native, "linear_bf16_version", lambda library=None: "amx-bf16")
    assert choose_fp16_rows("native", arch, timer=timer(1e-3)) == (0, "")
    monkeypatch.setattr(cpu_native, "linear_bf16_version", lambda library=None: "avx512-bf16")
    monkeypatch.setattr(cpu_linear_tuning, "bf16_fp16_built", lambda: False)
    assert choose_fp16_rows("native", arch, timer=timer(1e-3)) == (0, "")


def test_the_engine_turns_it_on_only_where_every_weight_is_in_range(model_dir, monkeypatch: pytest.MonkeyPatch
                                                                    ) -> None:
    """Forced from 64 rows: on (where built, without AMX) for SmolLM2, whose weights are far under the limit;
    off, and said, for a model with a weight over it (the limit lowered here). Where no float16
    version runs (no AVX512-FP16, or AMX tiles), off and said why, both times."""
    config = EngineConfig(model=str(model_dir), dtype="bfloat16", num_kv_blocks=64, itl_target_ms=0.0,
                          cpu_linear="native", cpu_linear_fp16_rows=64)
    if not cpu_native.linear_bf16_available():
        pytest.skip("NOT RUN: our bfloat16 kernel does not build here")
    try:
        engine = Engine(config)
        # (an AMX build's tiles take these calls: there it stays off, as the FMAs do)
        expected = 64 if bf16_fp16_built() and cpu_native.linear_bf16_version() not in cpu_native.AMX_VERSIONS else 0
        assert engine.runner.bf16_fp16_rows == expected and bf16_fp16_rows() == expected
        # asked for: the log says from how many rows, or why not (no version to run here)
        said = "float16 matmuls from 64 rows" if expected else "float16 matmuls: off ("
        assert any(note.startswith(said) for note in engine.runner.startup_notes), engine.runner.startup_notes
        monkeypatch.setattr(model_runner, "FP16_WEIGHT_MAX", 1e-3)
        engine = Engine(config)
        assert engine.runner.bf16_fp16_rows == 0 and bf16_fp16_rows() == 0
        # where a version would run, the weight check is why it does not
        reason = "> 0.001" if expected else "float16 matmuls: off ("
        assert any(reason in note for note in engine.runner.startup_notes), engine.runner.startup_notes
    finally:
        use_bf16_fp16_rows(0)
