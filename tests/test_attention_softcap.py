"""Attention logit soft-capping (Gemma 2): each scaled score ``s`` becomes
``softcap * tanh(s / softcap)`` before the mask, the sinks and the softmax (kernels/reference.py).

- The reference against the definition written out in float64.
- Every build of the CPU C kernels this CPU can run (tests/test_cpu_attention.py's
  ``KERNEL_VERSIONS``; the others are skipped, NOT RUN, naming the CPU features they need), its
  decode and prefill functions (generic, AVX2, AVX512_BF16, as ``attention_path`` names them),
  float32 and bfloat16 caches: decodes, a fresh prompt and a chunk over cached context, GQA,
  against the reference with caps of 50 (Gemma 2's) and 2 (one that bites), with scores large
  enough to saturate the cap, and with a window and sinks together. With no cap (softcap 0 in C)
  the capped entry points give the very bits of the uncapped ones.
- The CPU backend: a capped layer goes to the C kernels and never to SDPA nor to the reference;
  without the C kernels (or in float16) it goes to the reference, cap included. softcap=None
  is the very bits of no argument.
The batches hold NaN wherever a kernel must not read (tests/paged_batches.py).
"""

from __future__ import annotations

import platform
import random

import pytest
import torch

from backend.model.cpu_features import detect
from kernels import EVERY_PREFILL, cpu_attention, cpu_native
from kernels.attention_backend import CpuAttention
from kernels.reference import paged_attention_reference
from tests.paged_batches import PagedBatch, make_batch, shape_id
from tests.test_cpu_attention import (CPU_TOLERANCES, KERNEL_VERSIONS, expected_attention_path, plan_for,
                                      poison_before_windows, random_sinks, refuse, step_of)

pytestmark = pytest.mark.usefixtures("prefill_bf16_own")   # see tests/conftest.py

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
# float32 within 1e-5 of the reference (the cap's vector tanh is within a few ulp of torch's);
# bfloat16 as the other CPU attention tests (one bfloat16 step, float32's absolute bound).
TOLERANCES = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: CPU_TOLERANCES[torch.bfloat16]}
# GQA 4 and 2 at head sizes that take the AVX2 functions (float32, and bfloat16 without
# AVX512_BF16) or the dot-product ones (bfloat16 with it), and head_dim 12, which takes the
# generic functions in every build; block size 16.
SHAPES = [(8, 2, 64, 16), (6, 3, 32, 16), (4, 2, 12, 16)]
# (softcap, window, with sinks, scale factor): no cap; Gemma 2's 50; 2, which bites; 2 with
# scores ~8x larger (tanh saturates: its exp branch and its clamp); 2 with a window and sinks.
CASES = {"none": (None, None, False, 1.0), "cap50": (50.0, None, False, 1.0), "cap2": (2.0, None, False, 1.0),
         "cap2-saturated": (2.0, None, False, 8.0), "cap2-window13-sinks": (2.0, 13, True, 1.0)}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: torch's intra-op threads would mostly wait on each other (as in
    tests/test_cpu_attention.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(KERNEL_VERSIONS))
def kernel_version(request):
    """(name, library) for one build of the C kernels (tests/test_cpu_attention.py's versions);
    skipped, naming the missing CPU features, only where this CPU cannot run it."""
    extra_flags, width, dot_product, needed = KERNEL_VERSIONS[request.param]
    if platform.machine() not in ("x86_64", "AMD64"):
        if request.param != "plain-c":
            pytest.skip(f"NOT RUN: the {request.param} build of the attention kernels needs an x86 CPU, "
                        f"this is {platform.machine()}")
        extra_flags = ()
    missing = needed - detect().flags
    if missing:
        pytest.skip(f"NOT RUN: the {request.param} build of the attention kernels needs CPU features "
                    f"{sorted(missing)}, which this CPU lacks")
    library = cpu_native.open_library(cpu_native.build(cflags=cpu_native.CFLAGS + extra_flags))
    assert library.decode_attention_bf16_vector_width() == width, f"the {request.param} build compiled otherwise"
    assert library.decode_attention_bf16_dot_product() == dot_product, f"the {request.param} build compiled otherwise"
    return request.param, library


def softcap_batch(seed: int, shape: tuple[int, int, int, int], dtype: torch.dtype,
                  window: int | None) -> tuple[PagedBatch, str]:
    """(batch, description): decodes (one with no context, one past several blocks), a fresh
    prompt and a chunk over cached context, both over several query tiles and key blocks; NaN
    before each window where there is one."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    rng = random.Random(seed)
    specs = [(0, 1), (rng.randrange(40, 150), 1), (0, rng.randrange(33, 70)),
             (rng.randrange(1, 90), rng.randrange(2, 50))]
    rng.shuffle(specs)
    batch = make_batch(seed, specs, num_heads, num_kv_heads, head_dim, block_size, dtype, CPU)
    if window is not None:
        poison_before_windows(batch, window)
    return batch, f"seed {seed}, specs {specs}"


def reference(batch: PagedBatch, scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
              softcap: float | None = None) -> torch.Tensor:
    return paged_attention_reference(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                                     batch.seq_lens, batch.block_tables, scale, window, sinks, softcap)


def run_kernels(batch: PagedBatch, library, scale: float, **kwargs) -> torch.Tensor:
    """Decode and prefill rows of the batch through ``library``'s C kernels (``kwargs``:
    window, sinks, softcap as ``cpu_native`` takes them)."""
    plan = plan_for(batch)
    out = torch.full_like(batch.query, float("nan"))
    cpu_native.paged_decode_attention(batch.query, out, plan.decode_rows, plan.decode_seq_lens, plan.decode_tables,
                                      batch.key_cache, batch.value_cache, scale, library=library, **kwargs)
    cpu_native.paged_prefill_attention(batch.query, out, plan.prefill_starts, plan.prefill_query_lens,
                                       plan.prefill_seq_lens, plan.prefill_tables, batch.key_cache,
                                       batch.value_cache, scale, library=library, **kwargs)
    return out


def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, context: str) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, context
    assert not actual.isnan().any(), f"NaN in output: unwritten rows or poison leaked ({context})"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype], msg=lambda m: f"{context}: {m}")


# ---- the reference --------------------------------------------------------------------------------
def test_reference_equals_the_definition() -> None:
    """Per query row, in float64: s = scale q.k, s := c tanh(s / c), then mask, sink and softmax."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 8
    batch = make_batch(3, [(20, 1), (0, 9), (11, 6)], num_heads, num_kv_heads, head_dim, block_size,
                       torch.float32, CPU)
    scale, cap, window = 0.7, 2.0, 5
    sinks = random_sinks(num_heads, 3)
    expected = torch.zeros(batch.query.shape, dtype=torch.float64)
    starts, group = batch.query_start_loc.tolist(), num_heads // num_kv_heads
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        blocks = batch.block_tables[i, :-(-seq_len // block_size)].long()
        keys = batch.key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].double()
        values = batch.value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].double()
        num_queries = starts[i + 1] - starts[i]
        for j in range(num_queries):
            pos = seq_len - num_queries + j
            first = max(0, pos - window + 1)
            for h in range(num_heads):
                s = keys[first:pos + 1, h // group] @ batch.query[starts[i] + j, h].double() * scale
                s = cap * torch.tanh(s / cap)
                m = torch.maximum(s.max(), sinks[h].double())
                e = torch.exp(s - m)
                expected[starts[i] + j, h] = e @ values[first:pos + 1, h // group] / (e.sum() + torch.exp(sinks[h] - m))
    actual = reference(batch, scale, window, sinks, cap)
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)
    # The cap bites at these scores: without it the output differs.
    assert not torch.allclose(actual, reference(batch, scale, window, sinks), atol=1e-3)


# ---- each build of the C kernels ------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_each_kernel_version_caps_the_scores(kernel_version, dtype: torch.dtype, shape: tuple[int, int, int, int],
                                             case: str) -> None:
    """Decode and prefill rows of one step through one build's decode and prefill functions with
    a soft cap (and a window and sinks in one case): the reference's result. The build must run
    the functions its version and the head size call for (the failure message names them)."""
    name, library = kernel_version
    softcap, window, with_sinks, scale_factor = CASES[case]
    head_dim = shape[2]
    path = cpu_native.attention_path(dtype, head_dim, library)
    assert path == expected_attention_path(name, dtype, head_dim), f"the {name} build runs the {path} functions"
    seed = random.randrange(1 << 30)
    batch, context = softcap_batch(seed, shape, dtype, window)
    context = f"{name} build ({path} functions), {case}, {context}"
    scale = scale_factor * 1.3 * head_dim ** -0.5
    sinks = random_sinks(shape[0], seed) if with_sinks else None
    expected = reference(batch, scale, window, sinks, softcap)
    actual = run_kernels(batch, library, scale, window=window or 0, sinks=sinks, softcap=softcap or 0.0)
    check(actual, expected, dtype, context)
    if softcap == 2.0 and window is None:   # the cap changed the result: the check above can fail
        uncapped = reference(batch, scale)
        assert (expected.float() - uncapped.float()).abs().max() > 1e-2, context


@pytest.mark.parametrize("case", ["plain", "window13-sinks"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_each_kernel_version_without_a_cap_is_unchanged(kernel_version, dtype: torch.dtype,
                                                        shape: tuple[int, int, int, int], case: str,
                                                        monkeypatch) -> None:
    """softcap 0 through the capped C entry points (``paged_*_attention_softcap_*``) gives the very
    bits of the entry points without the argument, on 1 and 3 threads; softcap=0.0 in Python
    calls the latter."""
    name, library = kernel_version
    window, sinks = (13, random_sinks(shape[0], 5)) if case == "window13-sinks" else (None, None)
    seed = random.randrange(1 << 30)
    batch, context = softcap_batch(seed, shape, dtype, window)
    scale = 1.3 * shape[2] ** -0.5
    without = run_kernels(batch, library, scale, window=window or 0, sinks=sinks)
    assert torch.equal(without, run_kernels(batch, library, scale, window=window or 0, sinks=sinks, softcap=0.0))
    capped_kernel = cpu_native._with_softcap
    monkeypatch.setattr(cpu_native, "_with_softcap",
                        lambda kernel, softcap: (capped_kernel(kernel, 1.0)[0], (float(softcap),)))
    for threads in (1, 3):
        torch.set_num_threads(threads)
        try:
            capped_entry = run_kernels(batch, library, scale, window=window or 0, sinks=sinks, softcap=0.0)
        finally:
            torch.set_num_threads(1)
        assert torch.equal(without, capped_entry), f"{name} build, {threads} threads, {context}: bits changed"


@pytest.mark.parametrize("softcap", [50.0, 2.0, 0.75])
def test_each_kernel_version_caps_within_a_few_ulp(kernel_version, softcap: float) -> None:
    """The cap alone (``attention_soft_cap``: the decode functions' pass over the scores, whose
    vector tanh the prefill functions use too) over the whole range of scores, both signs, the
    polynomial's and the exponential's sides of |s / softcap| = 0.625, tiny and saturating
    values, a length that leaves a vector tail: within 1e-6 relative of softcap * tanh(s /
    softcap) in float64. Infinities give +-softcap, NaN stays NaN."""
    name, library = kernel_version
    magnitudes = torch.cat([torch.logspace(-30, 3, 3001, dtype=torch.float64),
                            torch.linspace(0.6, 0.65, 101, dtype=torch.float64) * softcap])
    scores = torch.cat([magnitudes, -magnitudes, torch.tensor([0.0, -0.0])]).float()
    assert scores.numel() % 16 and scores.numel() % 8
    capped = scores.clone()
    library.attention_soft_cap(capped.data_ptr(), capped.numel(), softcap)
    exact = softcap * torch.tanh(scores.double() / softcap)
    error = ((capped.double() - exact).abs() / exact.abs().clamp_min(1e-300)).where(exact != 0, capped.double().abs())
    worst = int(error.argmax())
    assert error[worst] <= 1e-6, f"{name} build: s = {scores[worst].item()!r} capped to {capped[worst].item()!r}, " \
                                 f"exactly {exact[worst].item()!r}"
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.5])
    library.attention_soft_cap(special.data_ptr(), special.numel(), softcap)
    assert special[:2].tolist() == [softcap, -softcap] and special[2].isnan(), f"{name} build: {special}"


def test_the_cap_must_be_finite_and_positive() -> None:
    batch, _ = softcap_batch(1, (4, 2, 16, 16), torch.float32, None)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="softcap"):
            run_kernels(batch, cpu_native.load(), 0.25, softcap=bad)


# ---- the CPU backend ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sdpa_min_tokens", [None, EVERY_PREFILL], ids=["native-prefills", "sdpa-prefills"])
def test_the_cpu_backend_sends_capped_layers_to_the_c_kernels(dtype: torch.dtype, sdpa_min_tokens: int | None,
                                                              monkeypatch) -> None:
    """``CpuAttention.attend(..., softcap=...)``: decode and prefill rows go to the C kernels with
    the cap, the prefills the plan sent to SDPA included (SDPA takes no cap); never the reference.
    softcap=None is the very bits of no argument, SDPA prefills and all."""
    assert cpu_native.load() is not None, "the C kernels must build here (gcc is part of the machine)"
    seed = random.randrange(1 << 30)
    batch, context = softcap_batch(seed, (8, 2, 64, 16), dtype, None)
    scale = 1.3 * 64 ** -0.5
    backend = CpuAttention()
    step = step_of(batch)
    plan = backend.plan(step, batch.key_cache.shape[1], sdpa_min_tokens)
    assert bool(plan.sdpa_spans) == (sdpa_min_tokens is not None), context
    args = (batch.query, batch.key_cache, batch.value_cache, step, scale, plan)
    uncapped = backend.attend(*args)
    assert torch.equal(uncapped, backend.attend(*args, softcap=None)), context
    calls = []
    for function in ("paged_decode_attention", "paged_prefill_attention"):
        kernel = getattr(cpu_native, function)
        monkeypatch.setattr(cpu_native, function,
                            lambda *a, kernel=kernel, **kw: calls.append(kw) or kernel(*a, **kw))
    monkeypatch.setattr(cpu_attention, "paged_attention_reference", refuse("the reference"))
    monkeypatch.setattr(cpu_attention, "_prefills_through_sdpa", refuse("SDPA"))
    actual = backend.attend(*args, softcap=2.0)
    check(actual, reference(batch, scale, softcap=2.0), dtype, context)
    assert [kwargs["softcap"] for kwargs in calls] == [2.0, 2.0], f"C kernel calls: {calls} ({context})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_without_the_c_kernels_a_capped_layer_goes_to_the_reference(dtype: torch.dtype, monkeypatch) -> None:
    """No C library (or float16, which it has no kernel for): the reference with the cap, not
    torch's SDPA path (which has none)."""
    if dtype == torch.float32:
        monkeypatch.setattr(cpu_native, "load", lambda: None)
    seed = random.randrange(1 << 30)
    batch, context = softcap_batch(seed, (8, 2, 64, 16), dtype, None)
    scale = 1.3 * 64 ** -0.5
    caps = []
    reference_function = cpu_attention.paged_attention_reference
    monkeypatch.setattr(cpu_attention, "paged_attention_reference",
                        lambda *a: caps.append(a[-1]) or reference_function(*a))
    monkeypatch.setattr(cpu_attention, "_prefills_through_sdpa", refuse("SDPA"))
    backend = CpuAttention()
    step = step_of(batch)
    actual = backend.attend(batch.query, batch.key_cache, batch.value_cache, step, scale,
                            backend.plan(step, batch.key_cache.shape[1], EVERY_PREFILL), softcap=2.0)
    assert caps == [2.0], context
    torch.testing.assert_close(actual, reference_function(batch.query, batch.key_cache, batch.value_cache,
                                                          batch.query_start_loc, batch.seq_lens,
                                                          batch.block_tables, scale, softcap=2.0),
                               atol=0, rtol=0, msg=lambda m: f"{context}: {m}")
