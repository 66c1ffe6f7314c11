"""Our bfloat16 prefill functions beyond the build's own (kernels/csrc/paged_attention.c: the
float32-FMA one, prefill_task_fma, the float16 one, prefill_task_fp16, and the dot-product one with
P x V in dot products too, prefill_task_dp's PV_DP) against the reference
(kernels/reference.py is the spec), and the start-up choice among them and the build's own
(backend/model/prefill_attention_choice.py, ``choose_bf16_prefill_kernel``).

Batches come from tests/paged_batches.py (permuted block tables, NaN in every slot no sequence
owns and in the block table padding points at), with NaN also in every slot before each
sequence's window where there is one: a read outside what a query may see shows up. The
float32-FMA function is built wherever the compiler targets AVX-512F, the float16 one where it
targets AVX512-FP16, dp-pv where it targets AVX512_BF16; elsewhere their tests are NOT RUN and say
why. A function is selected for
this process around each test and the build's own after.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from backend.config import CPU_PREFILL_BF16_KERNEL_CHOICES, EngineConfig
from backend.model.architecture import ModelArchitecture
from backend.model import prefill_attention_choice as choice_module
from backend.model.cpu_features import detect
from backend.model.prefill_attention_choice import (FMA_MARGIN, choose_bf16_prefill_kernel,
                                                    choose_prefill_attention, kernels_serving)
from kernels import cpu_native
from kernels.cpu_attention import plan_attention_cpu
from kernels.reference import paged_attention_reference
from tests.paged_batches import TOLERANCES, make_batch, shape_id
from tests.test_cpu_attention import CPU_TOLERANCES, poison_before_windows, random_sinks

CPU = torch.device("cpu")
BF16 = torch.bfloat16

needs_kernels = pytest.mark.skipif(cpu_native.load() is None, reason="NOT RUN: the C kernels did not build here")


def built(kernel: str) -> bool:
    library = cpu_native.load()
    if library is None:
        return False
    return bool({"fma": library.prefill_attention_bf16_fma_built, "fp16": library.prefill_attention_bf16_fp16_built,
                 "dp-pv": library.prefill_attention_bf16_dp_pv_built}[kernel]())


needs_fma = pytest.mark.skipif(
    "avx512f" not in detect().flags or not built("fma"),
    reason="NOT RUN: the float32-FMA bfloat16 prefill needs AVX-512F (and the C kernels), which this CPU lacks")
needs_fp16 = pytest.mark.skipif(
    "avx512_fp16" not in detect().flags or not built("fp16"),
    reason="NOT RUN: the float16 bfloat16 prefill needs AVX512-FP16 (and the C kernels), which this CPU lacks")
needs_dp_pv = pytest.mark.skipif(
    "avx512_bf16" not in detect().flags or not built("dp-pv"),
    reason="NOT RUN: the bfloat16 prefill with P x V in dot products needs AVX512_BF16 (and the C kernels), "
           "which this CPU lacks")
NEEDS = {"fma": needs_fma, "fp16": needs_fp16, "dp-pv": needs_dp_pv}
PATHS = {"fma": "avx512-fma", "fp16": "avx512-fp16", "dp-pv": "avx512-dp-pv"}
# The float32-FMA function does the reference's float32 arithmetic in another order: the CPU
# paths' bfloat16 bound. The float16 one rounds the probabilities to float16 and sums products in
# float16 (32 at most): the bound shared with torch's SDPA and the Triton kernel, which round the
# probabilities to bfloat16, and its largest error under 2^-6 of the output's largest magnitude.
# dp-pv rounds the probabilities to bfloat16 as those do: their bound and the same largest error.
KERNEL_TOLERANCES = {"fma": CPU_TOLERANCES[BF16], "fp16": TOLERANCES[BF16], "dp-pv": TOLERANCES[BF16]}
ROUNDED_P_KERNELS = ("fp16", "dp-pv")
FP16_MAX_RELATIVE_ERROR = 2.0 ** -6
# head sizes each serves (others keep the build's own)
SERVES = {"fma": lambda d: (d % 16 == 0 and 32 <= d <= 128) or d == 256,
          "fp16": lambda d: d in (32, 64, 96, 128, 256),
          "dp-pv": lambda d: d in (32, 64, 128)}


@pytest.fixture(autouse=True)
def builds_own_after():
    """Every test leaves the build's own function selected, as the engine finds it."""
    yield
    if cpu_native.load() is not None:
        cpu_native.select_prefill_bf16_kernel("dp")


# (query heads, KV heads, head_dim, block size): GQA groups 1, 2, 3 and 4; head_dim 64, 128 and 80
# (an odd multiple of 16: a half transpose at the end of each key row), 256 (Gemma 2's), 96 and 32
# (the float16 function's other sizes).
SHAPES = [(4, 4, 64, 16), (9, 3, 64, 16), (8, 2, 128, 16), (6, 2, 80, 16), (4, 1, 256, 16), (6, 2, 96, 16),
          (4, 2, 32, 16)]
# (window, sinks, softcap): none; windows of 1, 13 and 37 keys (no multiple of a key block) and
# one longer than every sequence; sinks alone and with a window; soft-capping alone (a cap of 2: the
# scores, ~1.3 wide, are well into tanh's bend) and with both.
CASES = [(None, False, None), (1, False, None), (13, True, None), (37, False, None), ("longer", False, None),
         (None, True, None), (None, False, 2.0), (21, True, 8.0)]


def case_id(case) -> str:
    window, sinks, softcap = case
    return f"window-{window or 'none'}{'-sinks' if sinks else ''}{f'-softcap{softcap:g}' if softcap else ''}"


def prefill_batch(seed: int, shape: tuple[int, int, int, int]):
    """A fresh prompt over 2-3 query tiles (64 queries each) and key blocks (32 keys), a chunk
    over cached context starting mid-block, a short chunk deep in its sequence and a decode row
    (the prefill kernel must leave it alone)."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    rng = random.Random(seed)
    specs = [(0, rng.randrange(70, 160)), (rng.randrange(1, 120), rng.randrange(40, 100)),
             (rng.randrange(150, 230), rng.randrange(2, 12)), (rng.randrange(1, 60), 1)]
    rng.shuffle(specs)
    return make_batch(seed, specs, num_heads, num_kv_heads, head_dim, block_size, BF16, CPU), specs


def run_prefill(batch, plan, scale: float, window: int | None, sinks, softcap) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    cpu_native.paged_prefill_attention(batch.query, out, plan.prefill_starts, plan.prefill_query_lens,
                                       plan.prefill_seq_lens, plan.prefill_tables, batch.key_cache, batch.value_cache,
                                       scale, window=window or 0, sinks=sinks, softcap=softcap or 0.0)
    return out


# Gemma 2's head size (the largest, slowest reference) in fewer cases: plain, window + sinks, capped.
SHAPE_CASES = [(shape, case) for shape in SHAPES for case in CASES
               if shape[2] != 256 or case in (CASES[0], CASES[2], CASES[6])]
KERNEL_SHAPE_CASES = [pytest.param(kernel, shape, case, marks=NEEDS[kernel],
                                   id=f"{kernel}-{shape_id(shape)}-{case_id(case)}")
                      for kernel in ("fma", "fp16", "dp-pv") for shape, case in SHAPE_CASES if SERVES[kernel](shape[2])]


@pytest.mark.parametrize("kernel,shape,case", KERNEL_SHAPE_CASES)
def test_prefill_matches_reference(kernel: str, shape: tuple[int, int, int, int], case) -> None:
    """Prefill rows through the function on 1 and 2 threads: the reference's result within its
    bound (KERNEL_TOLERANCES), no NaN from the slots before the windows, decode rows untouched; a
    window longer than every sequence gives the bits of none."""
    num_heads, _, head_dim, block_size = shape
    window, with_sinks, softcap = case
    seed = random.randrange(1 << 30)
    batch, specs = prefill_batch(seed, shape)
    lens = batch.seq_lens.tolist()
    if window == "longer":
        window = max(lens) + random.Random(seed).randrange(1, 20)
    if window is not None:
        poison_before_windows(batch, window)
    sinks = random_sinks(num_heads, seed) if with_sinks else None
    context = f"{kernel}, seed {seed}, specs {specs}, window {window}, sinks {with_sinks}, softcap {softcap}"
    scale = 1.3 * head_dim ** -0.5
    expected = paged_attention_reference(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                                         batch.seq_lens, batch.block_tables, scale, window, sinks, softcap)
    plan = plan_attention_cpu(batch.query_start_loc, batch.seq_lens, batch.block_tables,
                              torch.zeros(batch.query.shape[0], dtype=torch.int64), block_size)
    prefill_rows = torch.cat([torch.arange(s, e) for s, e in zip(plan.prefill_starts.tolist(),
                                                                  (plan.prefill_starts + plan.prefill_query_lens).tolist())])
    decode_rows = plan.decode_rows
    assert cpu_native.select_prefill_bf16_kernel(kernel) == kernel
    assert cpu_native.prefill_bf16_path(head_dim) == PATHS[kernel]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            actual = run_prefill(batch, plan, scale, window, sinks, softcap)
            torch.testing.assert_close(actual[prefill_rows].float(), expected[prefill_rows].float(),
                                       **KERNEL_TOLERANCES[kernel], msg=lambda m: f"{n} threads, {context}: {m}")
            if kernel in ROUNDED_P_KERNELS:
                error = ((actual[prefill_rows].float() - expected[prefill_rows].float()).abs().max()
                         / expected[prefill_rows].float().abs().max()).item()
                assert error < FP16_MAX_RELATIVE_ERROR, f"{n} threads, {context}: relative error {error:.3g}"
            assert actual[decode_rows].isnan().all(), f"the prefill kernel wrote rows not its own ({context})"
        if case[0] == "longer":
            torch.testing.assert_close(actual, run_prefill(batch, plan, scale, None, sinks, softcap), atol=0, rtol=0,
                                       equal_nan=True, msg=lambda m: f"a window past every sequence changed bits "
                                                                     f"({context}): {m}")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel", [pytest.param(k, marks=NEEDS[k]) for k in ROUNDED_P_KERNELS])
@pytest.mark.parametrize("query_scale,key_scale,value_scale", [(1e5, 1e-5, 1e5), (1e-4, 1e4, 1e-6), (1.0, 1.0, 3e4),
                                                               (1.0, 6.0, 1.0)],
                         ids=["past-float16-max", "under-float16-normals", "value-sums-past-float16", "peaked-scores"])
def test_rounded_probabilities_hold_whatever_the_magnitudes(kernel: str, query_scale: float, key_scale: float,
                                                            value_scale: float) -> None:
    """The float16 function scales queries, K and V by powers of 2 into float16's range: elements
    past float16's largest (65504) or under its smallest normal, and value sums that would pass
    it, give the reference's result within the same relative bound; so do scores 6x wider (a
    score's float16 error grows with its magnitude). dp-pv (bfloat16 probabilities, float32 sums)
    holds the same bound on the same data."""
    seed = random.randrange(1 << 30)
    batch, specs = prefill_batch(seed, (9, 3, 64, 16))
    batch.query.mul_(query_scale)
    batch.key_cache.mul_(key_scale)
    batch.value_cache.mul_(value_scale)
    scale = 64 ** -0.5
    expected = paged_attention_reference(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                                         batch.seq_lens, batch.block_tables, scale)
    plan = plan_attention_cpu(batch.query_start_loc, batch.seq_lens, batch.block_tables,
                              torch.zeros(batch.query.shape[0], dtype=torch.int64), 16)
    keep = torch.ones(batch.query.shape[0], dtype=torch.bool)
    keep[plan.decode_rows] = False
    assert cpu_native.select_prefill_bf16_kernel(kernel) == kernel
    actual = run_prefill(batch, plan, scale, None, None, None)[keep].float()
    reference = expected[keep].float()
    assert actual.isfinite().all(), f"seed {seed}, specs {specs}: non-finite outputs"
    error = ((actual - reference).abs().max() / reference.abs().max()).item()
    assert error < FP16_MAX_RELATIVE_ERROR, f"seed {seed}, specs {specs}: relative error {error:.3g}"


@needs_fp16
@pytest.mark.parametrize("outlier", [2.0 ** 8, 2.0 ** 12])
def test_fp16_tasks_with_a_query_outlier_run_the_fma_function(outlier: float) -> None:
    """A query row with one dimension far above its others (past FP16_QUERY_OUTLIER times their
    RMS) would lose float16 sums' accuracy: its task runs the float32-FMA function instead, so
    with such a dimension in every row the output is the FMA function's, bit for bit, and within
    the CPU paths' bound of the reference; without it the float16 function runs (another output)."""
    seed = random.randrange(1 << 30)
    batch, specs = prefill_batch(seed, (9, 3, 64, 16))
    scale = 64 ** -0.5
    plan = plan_attention_cpu(batch.query_start_loc, batch.seq_lens, batch.block_tables,
                              torch.zeros(batch.query.shape[0], dtype=torch.int64), 16)
    keep = torch.ones(batch.query.shape[0], dtype=torch.bool)
    keep[plan.decode_rows] = False

    def through(kernel: str) -> torch.Tensor:
        assert cpu_native.select_prefill_bf16_kernel(kernel) == kernel
        return run_prefill(batch, plan, scale, None, None, None)[keep]

    assert not torch.equal(through("fp16"), through("fma")), f"seed {seed}: the float16 function did not run"
    batch.query[:, :, 7] *= outlier
    expected = paged_attention_reference(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                                         batch.seq_lens, batch.block_tables, scale)[keep]
    fp16, fma = through("fp16"), through("fma")
    assert torch.equal(fp16, fma), f"seed {seed}, specs {specs}: a task with outlier queries ran float16 sums"
    torch.testing.assert_close(fp16.float(), expected.float(), **CPU_TOLERANCES[BF16], msg=lambda m: f"seed {seed}: {m}")


@needs_fp16
def test_fp16_keeps_a_value_near_bfloat16s_largest_finite() -> None:
    """A value element of 2e38 (a block's power of 2 would be under float32's normals without the
    clamp, and its inverse infinite): every output stays finite, and the dimension holding it
    gives the reference's result in the rows that see it. (The block's other values fall more
    than float16's range, 2^40, below it and become 0: one power of 2 per block is the price.)"""
    torch.manual_seed(0)
    tokens, heads, kv_heads, head_dim, block_size = 20, 3, 1, 64, 16
    blocks = -(-tokens // block_size)
    key_cache = torch.randn(blocks, block_size, kv_heads, head_dim).to(BF16)
    value_cache = torch.randn(blocks, block_size, kv_heads, head_dim).to(BF16)
    value_cache[0, 3, 0, 5] = 2e38
    query = torch.randn(tokens, heads, head_dim).to(BF16)
    table = torch.arange(blocks, dtype=torch.int32).unsqueeze(0)
    starts, lens = torch.tensor([0]), torch.tensor([tokens])
    expected = paged_attention_reference(query, key_cache, value_cache, torch.tensor([0, tokens]), lens, table,
                                         0.125).float()
    assert cpu_native.select_prefill_bf16_kernel("fp16") == "fp16"
    out = torch.full_like(query, float("nan"))
    cpu_native.paged_prefill_attention(query, out, starts, lens, lens, table, key_cache, value_cache, 0.125)
    assert out.float().isfinite().all()
    torch.testing.assert_close(out[3:, :, 5].float(), expected[3:, :, 5], rtol=FP16_MAX_RELATIVE_ERROR, atol=0)


@pytest.mark.parametrize("kernel", [pytest.param(k, marks=NEEDS[k]) for k in ("fma", "fp16", "dp-pv")])
def test_the_selection_is_per_process_and_only_for_sizes_it_serves(kernel: str) -> None:
    """Selected: bfloat16 prefills at the head sizes it serves take it (others, and float32, keep
    their functions, which decode shares); the build's own again after."""
    own = {head_dim: cpu_native.attention_path(BF16, head_dim) for head_dim in (16, 64, 80, 96, 128, 256, 12)}
    assert cpu_native.select_prefill_bf16_kernel(kernel) == kernel
    assert [cpu_native.prefill_bf16_path(d) for d in own] == [PATHS[kernel] if SERVES[kernel](d) else own[d]
                                                              for d in own]
    assert cpu_native.attention_path(BF16, 64) == own[64]        # decode's answer is not the selection's
    assert cpu_native.select_prefill_bf16_kernel("dp") == "dp"
    assert all(cpu_native.prefill_bf16_path(d) == path for d, path in own.items())


def arch(head_dim: int = 64) -> ModelArchitecture:
    return ModelArchitecture(model_type="llama", vocab_size=300, hidden_size=9 * head_dim, intermediate_size=160,
                             num_layers=2, num_heads=9, num_kv_heads=3, head_dim=head_dim, rms_norm_eps=1e-5,
                             rope_theta=10000.0, rope_scaling=None, max_position_embeddings=1024,
                             tie_word_embeddings=True, qkv_bias=False, qk_norm=False, initializer_range=0.2)


class FakeTimer:
    """Stands in for time_bf16_prefill_kernels: given ms and errors (of the kernels it is asked
    to time), and how it was called."""

    def __init__(self, timings: dict[str, float], errors: dict[str, float] | None = None):
        self.timings, self.errors, self.calls, self.kernels = timings, errors, 0, None

    def __call__(self, arch, block_size, kernels):
        self.calls += 1
        self.kernels = kernels
        errors = self.errors or {kernel: 0.0 for kernel in kernels}
        return ({k: ms for k, ms in self.timings.items() if k in kernels},
                {k: error for k, error in errors.items() if k in kernels})


def path_of(kernel: str, head_dim: int = 64) -> str:
    return PATHS.get(kernel) or cpu_native.attention_path(BF16, head_dim)


@pytest.mark.parametrize("forced", ["dp", *(pytest.param(k, marks=NEEDS[k]) for k in ("fma", "fp16", "dp-pv"))])
def test_forcing_each_kernel_works(forced: str) -> None:
    """An explicit choice (EngineConfig.cpu_prefill_bf16_kernel) is taken untimed and selected;
    the model's prefills then run it (the reference's output within its bound either way)."""
    if cpu_native.load() is None:
        pytest.skip("NOT RUN: the C kernels did not build here")
    expected = path_of(forced)
    timer = FakeTimer({"dp": 1.0, "fma": 1.0, "fp16": 1.0, "dp-pv": 1.0})
    chosen = choose_bf16_prefill_kernel(arch(), 16, forced, timer=timer)
    assert chosen.kernel == expected == cpu_native.prefill_bf16_path(64) and timer.calls == 0
    assert f"cpu_prefill_bf16_kernel={forced}" in chosen.why
    cpu_native.select_prefill_bf16_kernel("dp" if forced != "dp" else kernels_serving(64)[-1])   # another one, then
    # through the start-up choice the model runner calls, whose log line names it
    described = choose_prefill_attention("native", BF16, arch(), 16, bf16_kernel=forced).describe()
    assert f"bfloat16 prompts in our {expected} function" in described and timer.calls == 0
    seed = random.randrange(1 << 30)
    batch, specs = prefill_batch(seed, (9, 3, 64, 16))
    plan = plan_attention_cpu(batch.query_start_loc, batch.seq_lens, batch.block_tables,
                              torch.zeros(batch.query.shape[0], dtype=torch.int64), 16)
    rows = plan.decode_rows
    keep = torch.ones(batch.query.shape[0], dtype=torch.bool)
    keep[rows] = False
    expected_out = paged_attention_reference(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                                             batch.seq_lens, batch.block_tables, 0.125)
    torch.testing.assert_close(run_prefill(batch, plan, 0.125, None, None, None)[keep].float(),
                               expected_out[keep].float(), **KERNEL_TOLERANCES.get(forced, CPU_TOLERANCES[BF16]),
                               msg=lambda m: f"seed {seed}: {m}")


@needs_fma
@pytest.mark.parametrize("timings,picked", [({"dp": 2.0, "fma": 1.0}, "fma"), ({"dp": 1.0, "fma": 2.0}, "dp"),
                                            ({"dp": 1.0, "fma": 1.0 / FMA_MARGIN * 1.001}, "dp"),
                                            ({"dp": 1.0, "fma": 1.0 / FMA_MARGIN * 0.99}, "fma")],
                         ids=["fma-faster", "dp-faster", "within-margin", "past-margin"])
def test_auto_takes_the_faster_by_the_margin(timings: dict[str, float], picked: str) -> None:
    timer = FakeTimer(timings)
    chosen = choose_bf16_prefill_kernel(arch(), 16, "auto", timer=timer)
    assert timer.calls == 1 and chosen.kernel == path_of(picked) == cpu_native.prefill_bf16_path(64)
    assert chosen.timings_ms == {k: ms for k, ms in timings.items() if k in timer.kernels}
    assert "timed at start-up" in chosen.why


@needs_dp_pv
@needs_fma
@pytest.mark.parametrize("timings,picked", [({"dp": 2.0, "fma": 2.2, "dp-pv": 1.5}, "dp-pv"),
                                            ({"dp": 2.0, "fma": 1.4, "dp-pv": 1.5}, "fma"),
                                            ({"dp": 2.0, "fma": 2.2, "dp-pv": 2.0 / FMA_MARGIN * 1.001}, "dp")],
                         ids=["dp-pv-fastest", "fma-fastest", "dp-pv-within-margin"])
def test_auto_times_dp_pv_where_built(timings: dict[str, float], picked: str) -> None:
    """With AVX512_BF16, the dot-product function with P x V in dot products is timed beside the
    others and runs where it is the fastest past the margin."""
    timer = FakeTimer(timings)
    chosen = choose_bf16_prefill_kernel(arch(), 16, "auto", timer=timer)
    assert "dp-pv" in timer.kernels
    assert chosen.kernel == path_of(picked) == cpu_native.prefill_bf16_path(64)


@needs_fp16
@pytest.mark.parametrize("timings,picked", [({"dp": 3.0, "fma": 2.0, "fp16": 1.5}, "fp16"),
                                            ({"dp": 3.0, "fma": 1.5, "fp16": 2.0}, "fma"),
                                            ({"dp": 1.0, "fma": 2.0, "fp16": 1.0 / FMA_MARGIN * 1.001}, "dp"),
                                            ({"dp": float("inf"), "fma": 2.0, "fp16": 1.9}, "fp16")],
                         ids=["fp16-fastest", "fma-fastest", "fp16-within-margin", "own-left-out"])
def test_auto_takes_the_fastest_of_three(timings: dict[str, float], picked: str) -> None:
    """With the float16 function built, all three are timed; the fastest runs, another than the
    build's own only past the margin."""
    timer = FakeTimer(timings)
    chosen = choose_bf16_prefill_kernel(arch(), 16, "auto", timer=timer)
    assert timer.kernels[:3] == ("dp", "fma", "fp16")
    assert chosen.kernel == path_of(picked) == cpu_native.prefill_bf16_path(64)


@pytest.mark.parametrize("kernel", [pytest.param(k, marks=NEEDS[k]) for k in ("fma", "fp16", "dp-pv")])
def test_a_wrong_kernel_is_never_chosen(kernel: str, caplog: pytest.LogCaptureFixture) -> None:
    serving = kernels_serving(64)
    timer = FakeTimer({"dp": 2.0}, {k: 0.5 if k == kernel else 0.0 for k in serving})
    with caplog.at_level(logging.WARNING):
        chosen = choose_bf16_prefill_kernel(arch(), 16, "auto", timer=timer)
    assert chosen.kernel == cpu_native.attention_path(BF16, 64) == cpu_native.prefill_bf16_path(64)
    assert f"our {kernel} function computes wrong results" in caplog.text


@needs_fma
def test_the_real_timing_here() -> None:
    """The real timer on this machine: every function serving the model's head size passes the
    check and gets a time; the fastest by the rule is selected and the description names it."""
    serving = kernels_serving(64)            # (selects each in turn: before the choice)
    chosen = choose_bf16_prefill_kernel(arch(), 16, "auto")
    assert set(chosen.timings_ms) == set(serving) >= {"dp", "fma"}
    assert all(0 < ms < 10_000 for ms in chosen.timings_ms.values())
    assert chosen.kernel == cpu_native.prefill_bf16_path(64) == path_of(choice_module.fastest_bf16_kernel(
        chosen.timings_ms))


class NoAvx512Library:
    """A build without AVX-512F, as choose_bf16_prefill_kernel sees it."""

    def __init__(self, path: int):
        self.path = path

    def prefill_attention_bf16_fma_built(self) -> int:
        return 0

    def prefill_attention_bf16_fp16_built(self) -> int:
        return 0

    def prefill_attention_bf16_dp_pv_built(self) -> int:
        return 0

    def prefill_attention_bf16_select(self, kernel: int) -> int:
        return 0

    def prefill_attention_bf16_path(self, head_dim: int) -> int:
        return self.path


@needs_kernels
@pytest.mark.parametrize("choice", ["auto", "fma", "fp16"])
def test_without_avx512f_the_builds_own_runs_untimed(choice: str, monkeypatch: pytest.MonkeyPatch) -> None:
    timer = FakeTimer({"dp": 2.0, "fma": 1.0, "fp16": 0.5})
    monkeypatch.setattr(cpu_native, "load", lambda: NoAvx512Library(1))
    chosen = choose_bf16_prefill_kernel(arch(), 16, choice, timer=timer)
    assert chosen.kernel == "avx2" and timer.calls == 0
    assert ("no AVX-512F" if choice == "auto" else "not served here") in chosen.why


@needs_fma
def test_head_sizes_no_other_serves_keep_the_builds_own_untimed() -> None:
    timer = FakeTimer({"dp": 2.0, "fma": 1.0, "fp16": 0.5})
    chosen = choose_bf16_prefill_kernel(arch(16), 16, "auto", timer=timer)
    assert chosen.kernel == cpu_native.attention_path(BF16, 16) and timer.calls == 0
    assert "not serve head_dim 16" in chosen.why


@needs_fp16
def test_a_head_size_only_fma_serves_times_dp_and_fma() -> None:
    """head_dim 80: the float32-FMA function serves it, the float16 one does not."""
    timer = FakeTimer({"dp": 2.0, "fma": 1.0, "fp16": 0.5})
    chosen = choose_bf16_prefill_kernel(arch(80), 16, "auto", timer=timer)
    assert timer.kernels == ("dp", "fma") and chosen.kernel == "avx512-fma" == cpu_native.prefill_bf16_path(80)


@needs_kernels
def test_unknown_kernel_names_are_refused() -> None:
    # the engine parameter's choices: "auto" and the library's functions (backend.config imports no torch)
    assert CPU_PREFILL_BF16_KERNEL_CHOICES == ("auto", *cpu_native.PREFILL_BF16_KERNELS)
    with pytest.raises(ValueError, match="cpu_prefill_bf16_kernel"):
        choose_bf16_prefill_kernel(arch(), 16, "fastest")
    with pytest.raises(ValueError, match="cpu_prefill_bf16_kernel"):
        EngineConfig(cpu_prefill_bf16_kernel="fastest")


def test_float32_models_make_no_bf16_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """float32 prefills never run the bfloat16 functions: no choice is made, none is logged."""
    monkeypatch.setattr(choice_module, "choose_bf16_prefill_kernel",
                        lambda *args, **kwargs: pytest.fail("chose a bfloat16 kernel for a float32 model"))
    if choice_module.native_kernel_runs(torch.float32):
        assert choose_prefill_attention("native", torch.float32, arch(), 16).bf16_kernel is None
