"""The CPU attention path (kernels/cpu_attention.py) against the torch reference
(kernels/reference.py is the spec), through the public dispatch in ``kernels`` that the
engine calls: ``plan_attention`` once per step, then ``reshape_and_cache`` and
``paged_attention`` per layer with that plan.

Batches come from tests/paged_batches.py: permuted block tables, NaN in every cache slot
no sequence owns and in the block that table padding points at, so any read outside a
sequence's own tokens shows up as NaN or a wrong value. Every case draws a fresh seed,
named in its failure message.

float32 and bfloat16 decode rows run in the C kernel (kernels/csrc) when it can be built;
every attention test runs twice, once on that path and once with the kernel unavailable
(the batched torch path, which also serves float16). The bfloat16 kernel's q.k product has
an AVX-512F, an AVX2 and a plain C version, picked at compile time: the tests at the end
build the library once per version this CPU can run and name the ones it cannot.
"""

from __future__ import annotations

import platform
import random

import pytest
import torch

import kernels
from backend.model.cpu_features import detect
from kernels import EVERY_PREFILL, cpu_attention, cpu_native
from kernels.attention_backend import CpuAttention, PackedStep
from kernels.reference import paged_attention_reference, reshape_and_cache_reference
from tests.paged_batches import SCENARIOS, SHAPES, TOLERANCES, PagedBatch, make_batch, scenario_specs, shape_id

pytestmark = pytest.mark.usefixtures("prefill_bf16_own")   # see tests/conftest.py

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
# Every CPU path computes in float32 and rounds to bfloat16 once, at the end, as the
# reference does: outputs are at most one bfloat16 step (2^-8 to 2^-7 relative) plus
# float32's own summation-order error apart. That error is absolute, not relative: an output
# near zero (a cancelling sum of values ~1) can differ by ~1e-6 in float32, many bfloat16
# steps at that magnitude (CI failed once at 1.3e-6 with atol 1e-6: seed 924413766, prefill,
# h8kv4d128bs32), so atol is float32's bound. The shared bfloat16 bound (TOLERANCES: atol
# 3e-2) is far looser, made for the Triton kernel, which also rounds the softmax
# probabilities to bfloat16.
CPU_TOLERANCES = {**TOLERANCES, torch.bfloat16: dict(atol=TOLERANCES[torch.float32]["atol"], rtol=2 ** -7)}
# torch's SDPA in bfloat16 rounds the softmax probabilities to bfloat16, as the Triton kernel does:
# the shared bound.
SDPA_TOLERANCES = {torch.float32: CPU_TOLERANCES[torch.float32], torch.bfloat16: TOLERANCES[torch.bfloat16]}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: on a loaded machine torch's intra-op threads mostly wait on
    each other (the whole file ran ~10x slower with 2 threads on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, params=["c-kernel", "torch"])
def decode_path(request, monkeypatch):
    """Which implementation float32 and bfloat16 decode rows take."""
    if request.param == "c-kernel":
        assert cpu_native.load() is not None, "the C decode kernel must build here (gcc is part of the machine)"
    else:
        monkeypatch.setattr(cpu_native, "load", lambda: None)
    return request.param


def new_token_slots(batch: PagedBatch) -> torch.Tensor:
    """Cache slots of each sequence's new tokens (its last ``n_i`` positions), packed."""
    block_size = batch.key_cache.shape[1]
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    slots = []
    for i, seq_len in enumerate(lens):
        for pos in range(seq_len - (starts[i + 1] - starts[i]), seq_len):
            slots.append(int(batch.block_tables[i, pos // block_size]) * block_size + pos % block_size)
    return torch.tensor(slots, dtype=torch.int64)


def plan_for(batch: PagedBatch, slot_mapping: torch.Tensor | None = None, sdpa_min_tokens: int | None = None):
    slot_mapping = new_token_slots(batch) if slot_mapping is None else slot_mapping
    return kernels.plan_attention(batch.query_start_loc, batch.seq_lens, batch.block_tables, slot_mapping,
                                  batch.key_cache.shape[1], backend="cpu", sdpa_min_tokens=sdpa_min_tokens)


def attend(batch: PagedBatch, plan, key_cache=None, value_cache=None, query=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cpu output, reference output) for the batch, optionally with other caches / query."""
    query = batch.query if query is None else query
    key_cache = batch.key_cache if key_cache is None else key_cache
    value_cache = batch.value_cache if value_cache is None else value_cache
    # Not SDPA's default scale (1/sqrt(head_dim)), so a dropped ``scale=`` shows.
    args = (query, key_cache, value_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
            1.3 * query.shape[-1] ** -0.5)
    actual = kernels.paged_attention(*args, batch.max_query_len, batch.max_seq_len, backend="cpu", plan=plan)
    return actual, paged_attention_reference(*args)


def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, context: str) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, context
    assert not actual.isnan().any(), f"NaN in output: poison leaked ({context})"
    torch.testing.assert_close(actual.float(), expected.float(), **CPU_TOLERANCES[dtype],
                               msg=lambda m: f"{context}: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scenario", ["prefill", "chunked", "mixed"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("sdpa_min_tokens", [EVERY_PREFILL, 24])
def test_sdpa_for_prefills_matches_reference(dtype: torch.dtype, scenario: str, shape: tuple[int, int, int, int],
                                             sdpa_min_tokens: int) -> None:
    """Prefills (fresh, or over cached context) of ``sdpa_min_tokens`` new tokens and more go to
    torch's SDPA, every other prefill stays in the C kernel's arrays; together the reference's
    result."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    seed = random.randrange(1 << 30)
    specs = scenario_specs(scenario, random.Random(seed), block_size)
    batch = make_batch(seed, specs, num_heads, num_kv_heads, head_dim, block_size, dtype, CPU)
    plan = plan_for(batch, sdpa_min_tokens=sdpa_min_tokens)
    starts = batch.query_start_loc.tolist()
    to_sdpa = [n > 1 and n >= sdpa_min_tokens for _, n in specs]
    assert [(span.q_start, span.q_end, span.slots.numel(), span.mask is None) for span in plan.sdpa_spans] == [
        (starts[i], starts[i + 1], context + n, context == 0)
        for i, ((context, n), sdpa) in enumerate(zip(specs, to_sdpa)) if sdpa], f"seed {seed}, specs {specs}"
    to_c = sum(1 for (_, n), sdpa in zip(specs, to_sdpa) if n > 1 and not sdpa)
    assert (0 if plan.prefill_starts is None else plan.prefill_starts.numel()) == to_c
    actual, expected = attend(batch, plan)
    assert not actual.isnan().any(), f"NaN in output: poison leaked (seed {seed}, specs {specs})"
    torch.testing.assert_close(actual.float(), expected.float(), **SDPA_TOLERANCES[dtype],
                               msg=lambda m: f"seed {seed}, specs {specs}: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_paged_attention_matches_reference(dtype: torch.dtype, scenario: str, shape: tuple[int, int, int, int]) -> None:
    num_heads, num_kv_heads, head_dim, block_size = shape
    seed = random.randrange(1 << 30)
    specs = scenario_specs(scenario, random.Random(seed), block_size)
    batch = make_batch(seed, specs, num_heads, num_kv_heads, head_dim, block_size, dtype, CPU)
    check(*attend(batch, plan_for(batch)), dtype, f"seed {seed}, specs {specs}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("planned", [True, False], ids=["plan", "no-plan"])
def test_many_sequences_in_one_step(dtype: torch.dtype, planned: bool) -> None:
    """30 decodes, 5 fresh prefills and 5 chunks over cached context (one of 2 tokens, the
    smallest that is not a decode), shuffled, in one call (without a plan, paged_attention
    builds its own)."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    specs = [(rng.randrange(1, 200), 1) for _ in range(30)]
    specs += [(0, rng.randrange(2, 70)) for _ in range(5)]
    specs += [(rng.randrange(1, 150), rng.randrange(2, 40)) for _ in range(4)] + [(rng.randrange(1, 150), 2)]
    rng.shuffle(specs)
    batch = make_batch(seed, specs, 12, 2, 64, 16, dtype, CPU)
    check(*attend(batch, plan_for(batch) if planned else None), dtype, f"seed {seed}, specs {specs}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_plan_serves_every_layer(dtype: torch.dtype) -> None:
    """One step's plan, reused for two layers with their own caches and queries (same block
    tables), then for the first layer again: each output matches the reference."""
    seed = random.randrange(1 << 30)
    specs = scenario_specs("mixed", random.Random(seed), 16)
    batch = make_batch(seed, specs, 8, 2, 64, 16, dtype, CPU)
    gen = torch.Generator().manual_seed(seed)
    fresh = lambda t: torch.randn(t.shape, generator=gen).to(dtype) + t * 0     # new values, same NaN slots
    layers = [(batch.query, batch.key_cache, batch.value_cache),
              (fresh(batch.query), fresh(batch.key_cache), fresh(batch.value_cache))]
    plan = plan_for(batch)
    for layer in (0, 1, 0):
        query, key_cache, value_cache = layers[layer]
        check(*attend(batch, plan, key_cache, value_cache, query), dtype, f"seed {seed}, layer {layer}, specs {specs}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_decodes_of_very_different_lengths(dtype: torch.dtype, block_size: int) -> None:
    """Short decodes padded up to a 700-token one in the same step: padding must be masked."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    specs = [(0, 1), (1, 1), (700, 1), (rng.randrange(2, 50), 1), (rng.randrange(100, 400), 1)]
    rng.shuffle(specs)
    batch = make_batch(seed, specs, 8, 2, 128, block_size, dtype, CPU)
    check(*attend(batch, plan_for(batch)), dtype, f"seed {seed}, specs {specs}")


@pytest.mark.parametrize("others", ["decodes", "mixed"])
def test_sequence_without_new_tokens(others: str) -> None:
    """Sequences with no query rows this step (query_start_loc repeats) are skipped: first,
    somewhere in the middle and last in the batch."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    specs = [(rng.randrange(1, 60), 1) for _ in range(3)] + [(rng.randrange(1, 60), 0)]
    if others == "mixed":
        specs += [(0, rng.randrange(2, 30)), (rng.randrange(16, 60), rng.randrange(2, 20))]
    rng.shuffle(specs)
    specs = [(rng.randrange(1, 60), 0)] + specs + [(rng.randrange(1, 60), 0)]
    batch = make_batch(seed, specs, 8, 4, 64, 16, torch.float32, CPU)
    check(*attend(batch, plan_for(batch)), torch.float32, f"seed {seed}, specs {specs}")


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "padding"])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (1, 128, 32), (3, 128, 16)])
def test_reshape_and_cache_matches_reference(dtype: torch.dtype, cache_dtype: torch.dtype, padding: bool,
                                             num_kv_heads: int, head_dim: int, block_size: int) -> None:
    """Bit-exact copies (cast to the cache dtype) of K/V that are strided views into one
    fused projection; slots < 0 are padding and are skipped."""
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks, num_tokens = 12, rng.randrange(5, 40)
    width = num_kv_heads * head_dim
    fused = torch.randn(num_tokens, 3 * width, generator=gen).to(dtype)
    key = fused[:, width:2 * width].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, 2 * width:].view(num_tokens, num_kv_heads, head_dim)
    slots = rng.sample(range(num_blocks * block_size), num_tokens)
    for i in rng.sample(range(num_tokens), num_tokens // 4 if padding else 0):
        slots[i] = -1
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    # The step's metadata: one sequence of num_tokens new tokens over every block.
    plan = kernels.plan_attention(torch.tensor([0, num_tokens]), torch.tensor([num_tokens]),
                                  torch.arange(num_blocks).unsqueeze(0), slot_mapping, block_size, backend="cpu")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    expected = [torch.full(shape, float("nan"), dtype=cache_dtype) for _ in range(2)]
    actual = [t.clone() for t in expected]
    reshape_and_cache_reference(key, value, *expected, slot_mapping)
    kernels.reshape_and_cache(key, value, *actual, slot_mapping, backend="cpu", plan=plan)
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e, atol=0, rtol=0, equal_nan=True, msg=lambda m: f"seed {seed}: {m}")
    assert (~expected[0][..., 0, 0].isnan()).sum().item() == (slot_mapping >= 0).sum().item(), f"seed {seed}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scenario", ["mixed", "decode"])
def test_write_then_read_in_one_step(dtype: torch.dtype, scenario: str) -> None:
    """A layer's step as the model runs it: Q, K and V are views of one fused projection; the
    new tokens' K/V are written into the cache (their slots hold NaN until then), then
    attention reads them back through the same plan. Same as the reference functions."""
    seed = random.randrange(1 << 30)
    specs = scenario_specs(scenario, random.Random(seed), 16)
    num_heads, num_kv_heads, head_dim = 8, 2, 64
    batch = make_batch(seed, specs, num_heads, num_kv_heads, head_dim, 16, dtype, CPU)
    slot_mapping = new_token_slots(batch)
    for cache in (batch.key_cache, batch.value_cache):
        cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = float("nan")
    gen = torch.Generator().manual_seed(seed)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    fused = torch.randn(len(slot_mapping), sum(sizes), generator=gen).to(dtype)
    query, key, value = (t.view(len(slot_mapping), -1, head_dim) for t in fused.split(sizes, dim=-1))
    ref_caches = [batch.key_cache.clone(), batch.value_cache.clone()]
    reshape_and_cache_reference(key, value, *ref_caches, slot_mapping)
    plan = plan_for(batch, slot_mapping)
    kernels.reshape_and_cache(key, value, batch.key_cache, batch.value_cache, slot_mapping, backend="cpu", plan=plan)
    for e, a in zip(ref_caches, (batch.key_cache, batch.value_cache)):
        torch.testing.assert_close(a, e, atol=0, rtol=0, equal_nan=True, msg=lambda m: f"seed {seed}: {m}")
    actual, _ = attend(batch, plan, query=query)
    _, expected = attend(batch, plan, *ref_caches, query=query)
    check(actual, expected, dtype, f"seed {seed}, specs {specs}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("threads", [2, 3])
def test_c_kernel_on_several_threads(dtype: torch.dtype, threads: int, decode_path: str) -> None:
    """The C kernel splits sequences across OpenMP threads (torch's pool): same results
    with more threads than cores as with one."""
    torch.set_num_threads(threads)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    specs = [(rng.randrange(0, 400), 1) for _ in range(37)]
    batch = make_batch(seed, specs, 12, 2, 64, 16, dtype, CPU)
    try:
        check(*attend(batch, plan_for(batch)), dtype, f"seed {seed}, {threads} threads, {decode_path}")
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_which_dtypes_take_the_c_kernel(dtype: torch.dtype, decode_path: str, monkeypatch) -> None:
    """float32 and bfloat16 decode rows go to the C kernel whenever it is built; float16 has
    no C kernel and takes the torch path (and still matches the reference)."""
    calls = []
    kernel = cpu_native.paged_decode_attention
    monkeypatch.setattr(cpu_native, "paged_decode_attention",
                        lambda *args, **kwargs: calls.append(args) or kernel(*args, **kwargs))
    seed = random.randrange(1 << 30)
    specs = scenario_specs("decode", random.Random(seed), 16)
    batch = make_batch(seed, specs, 8, 2, 64, 16, dtype, CPU)
    check(*attend(batch, plan_for(batch)), dtype, f"seed {seed}, specs {specs}")
    expected = decode_path == "c-kernel" and dtype in (torch.float32, torch.bfloat16)
    assert len(calls) == expected, f"{dtype} decode rows on the {decode_path} path: {len(calls)} C kernel calls"


# ---- each compiled version of the bfloat16 q.k product, called directly -------------------


# version -> (flags the library is built with, floats per vector it must report, whether its
# bfloat16 decode takes the AVX512_BF16 dot-product path, CPU flags needed). Every build starts
# from -march=native and switches off what the version must not use.
KERNEL_VERSIONS = {
    "avx512-bf16": ((), 16, True, {"avx512f", "avx512_bf16"}),
    "avx512f": (("-mno-avx512bf16",), 16, False, {"avx512f"}),
    "avx2": (("-mno-avx512f",), 8, False, {"avx2", "fma"}),
    "plain-c": (("-mno-avx2",), 1, False, set()),
}

def expected_attention_path(version: str, dtype: torch.dtype, head_dim: int) -> str:
    """Which decode and prefill functions a build of ``version`` must run (one rule for both, as
    ``cpu_native.attention_path`` names them): the AVX512_BF16 ones for bfloat16 at head sizes 32,
    64 and 128, the AVX2 ones (every build with AVX2 + FMA, AVX-512 ones included) at head sizes
    that are a multiple of 8, the generic ones for everything else."""
    if version == "avx512-bf16" and dtype == torch.bfloat16 and head_dim in (32, 64, 128):
        return "avx512-bf16"
    if version != "plain-c" and head_dim % 8 == 0:
        return "avx2"
    return "generic"


@pytest.fixture(scope="module", params=list(KERNEL_VERSIONS))
def kernel_version(request):
    """(name, library) for one version of the C kernels, built for it; skipped, naming the
    missing CPU features, only when this CPU cannot run that version."""
    extra_flags, width, dot_product, needed = KERNEL_VERSIONS[request.param]
    if platform.machine() not in ("x86_64", "AMD64"):
        # Elsewhere the engine's own build has no vector version: it is the plain C one.
        if request.param != "plain-c":
            pytest.skip(f"NOT RUN: the {request.param} version of the bfloat16 decode kernel needs an x86 CPU, "
                        f"this is {platform.machine()}")
        extra_flags = ()
    missing = needed - detect().flags
    if missing:
        pytest.skip(f"NOT RUN: the {request.param} version of the bfloat16 decode kernel needs CPU features "
                    f"{sorted(missing)}, which this CPU lacks")
    library = cpu_native.open_library(cpu_native.build(cflags=cpu_native.CFLAGS + extra_flags))
    assert library.decode_attention_bf16_vector_width() == width, (
        f"the {request.param} build compiled the {library.decode_attention_bf16_vector_width()}-wide version")
    assert library.decode_attention_bf16_dot_product() == dot_product, (
        f"the {request.param} build {'lacks' if dot_product else 'has'} the AVX512_BF16 dot-product path")
    return request.param, library


# These call a build of the C kernel directly: only the decode_path fixture's "c-kernel"
# case applies (it asserts that the engine's own build loads).
c_kernel_only = pytest.mark.parametrize("decode_path", ["c-kernel"], indirect=True)


@c_kernel_only
def test_the_engine_build_uses_the_widest_version_the_cpu_has() -> None:
    library = cpu_native.load()
    flags = detect().flags
    expected = 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= flags else 1
    assert library.decode_attention_bf16_vector_width() == expected
    assert library.decode_attention_bf16_dot_product() == ({"avx512f", "avx512_bf16"} <= flags)
    version = ("avx512-bf16" if {"avx512f", "avx512_bf16"} <= flags else "avx512f" if "avx512f" in flags
               else "avx2" if {"avx2", "fma"} <= flags else "plain-c")
    for dtype in DTYPES:
        path = cpu_native.attention_path(dtype, 64, library)
        assert path == expected_attention_path(version, dtype, 64), (
            f"{dtype} attention at head_dim 64 runs the {path} functions on this {version} CPU")


def direct_decode(batch: PagedBatch, library, scale: float) -> torch.Tensor:
    """The decode rows through ``library``'s kernel; every other output row stays NaN."""
    plan = plan_for(batch)
    out = torch.full_like(batch.query, float("nan"))
    cpu_native.paged_decode_attention(batch.query, out, plan.decode_rows, plan.decode_seq_lens, plan.decode_tables,
                                      batch.key_cache, batch.value_cache, scale, library=library)
    return out


# SHAPES plus head sizes that are not a multiple of the vector width (a vector loop and a
# scalar tail: 40 = 2 x 16 + 8, 72 = 4 x 16 + 8, 12 < 16), block sizes 8 and 1, and for the
# dot-product path head_dim 32 and groups of 3 (SmolLM2's 9 heads over 3 KV heads).
ODD_SHAPES = [(6, 2, 40, 16), (4, 1, 72, 8), (3, 3, 12, 16), (4, 2, 64, 1), (6, 2, 32, 8), (9, 3, 64, 16)]


@c_kernel_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + ODD_SHAPES, ids=shape_id)
def test_each_kernel_version_matches_reference(kernel_version, dtype: torch.dtype,
                                               shape: tuple[int, int, int, int]) -> None:
    """Decode batches (NaN in every slot no sequence owns) through one build of the kernel,
    on 1 and 3 threads. The build must run the function its version and the head size call for
    (the failure message names it)."""
    name, library = kernel_version
    num_heads, num_kv_heads, head_dim, block_size = shape
    path = cpu_native.attention_path(dtype, head_dim, library)
    assert path == expected_attention_path(name, dtype, head_dim), f"the {name} build runs the {path} functions"
    name = f"{name} build ({path} decode)"
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    # One empty context, one past several blocks (and the prefetch distance), and random ones.
    specs = [(0, 1), (rng.randrange(40, 200), 1)] + [(rng.randrange(1, 90), 1) for _ in range(rng.randrange(1, 6))]
    rng.shuffle(specs)
    batch = make_batch(seed, specs, num_heads, num_kv_heads, head_dim, block_size, dtype, CPU)
    scale = 1.3 * head_dim ** -0.5
    expected = paged_attention_reference(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                                         batch.seq_lens, batch.block_tables, scale)
    for threads in (1, 3):
        torch.set_num_threads(threads)
        try:
            actual = direct_decode(batch, library, scale)
        finally:
            torch.set_num_threads(1)
        check(actual, expected, dtype, f"{name}, {threads} threads, seed {seed}, specs {specs}")


@c_kernel_only
@pytest.mark.parametrize("head_dim", [72, 64])   # 64: the AVX512_BF16 dot-product path where built
def test_each_kernel_version_rounds_to_nearest_even(kernel_version, head_dim: int) -> None:
    """A case with one right answer: with q = 0 both tokens of a context weigh exactly 1/2,
    so the float32 result is (v0 + v1) / 2 rounded once, whatever the order of operations,
    and the kernel's output must have the very bits of torch's ``.to(bfloat16)`` of it.
    About half of these sums fall between two bfloat16 values, a fifth exactly half-way (ties to even)."""
    name, library = kernel_version
    seed = random.randrange(1 << 30)
    specs = [(1, 1)] * 24
    batch = make_batch(seed, specs, 4, 2, head_dim, 16, torch.bfloat16, CPU)
    batch.query.zero_()
    block_size, num_kv_heads = batch.key_cache.shape[1], batch.key_cache.shape[2]
    actual = direct_decode(batch, library, 0.125)
    for i in range(len(specs)):
        block = int(batch.block_tables[i, 0])
        v = batch.value_cache[block, :2].float()                       # tokens 0 and 1: [2, kv_heads, head_dim]
        expected = ((v[0] + v[1]) / 2).repeat_interleave(4 // num_kv_heads, dim=0).to(torch.bfloat16)
        assert torch.equal(actual[i].view(torch.int16), expected.view(torch.int16)), (
            f"{name} build, seed {seed}, sequence {i}: not rounded to nearest even")


@c_kernel_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + ODD_SHAPES, ids=shape_id)
def test_each_prefill_kernel_version_matches_reference(kernel_version, dtype: torch.dtype,
                                                       shape: tuple[int, int, int, int]) -> None:
    """Prefill rows (fresh prompts and chunks over a cached context, several query tiles and
    key blocks, decode rows left to NaN) through one build of the prefill kernel, on 1 and 3
    threads. The build must run the task function its version and the head size call for
    (the failure message names it)."""
    name, library = kernel_version
    num_heads, num_kv_heads, head_dim, block_size = shape
    path = cpu_native.attention_path(dtype, head_dim, library)
    assert path == expected_attention_path(name, dtype, head_dim), f"the {name} build runs the {path} functions"
    name = f"{name} build ({path} prefill)"
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    specs = [(0, rng.randrange(2, 80)), (rng.randrange(1, 120), rng.randrange(2, 70)), (rng.randrange(1, 40), 1)]
    rng.shuffle(specs)
    batch = make_batch(seed, specs, num_heads, num_kv_heads, head_dim, block_size, dtype, CPU)
    scale = 1.3 * head_dim ** -0.5
    expected = paged_attention_reference(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                                         batch.seq_lens, batch.block_tables, scale)
    plan = plan_for(batch)
    prefill_rows = torch.cat([torch.arange(span.q_start, span.q_end) for span in plan.torch_plan.prefills])
    for threads in (1, 3):
        torch.set_num_threads(threads)
        out = torch.full_like(batch.query, float("nan"))
        try:
            cpu_native.paged_prefill_attention(batch.query, out, plan.prefill_starts, plan.prefill_query_lens,
                                               plan.prefill_seq_lens, plan.prefill_tables, batch.key_cache,
                                               batch.value_cache, scale, library=library)
        finally:
            torch.set_num_threads(1)
        check(out[prefill_rows], expected[prefill_rows], dtype, f"{name}, {threads} threads, seed {seed}, specs {specs}")
        decode_rows = torch.tensor([i for i in range(out.shape[0]) if i not in set(prefill_rows.tolist())])
        assert out[decode_rows].isnan().all(), "the prefill kernel wrote rows that are not its own"


# ---- sliding windows and attention sinks -------------------------------------------------------
# A query at position p with a window of W keys sees keys p - W + 1 .. p; a sink is one more
# logit per query head in every row's softmax, with no value (kernels/reference.py). The KV
# blocks wholly before a sequence's window may have been released by the engine, so the kernels
# must not read before the window at all: the batches below hold NaN in every slot before the
# first key each sequence's first query sees.

# GQA 4, 3, 1 and 8; head sizes for each function (bfloat16: 64, 32, 128 the dot-product ones
# where built, 12 the generic ones; float32: 12 generic, the rest AVX2 where built); block sizes
# 16, 8 and 32.
WINDOW_SHAPES = [(8, 2, 64, 16), (9, 3, 32, 8), (3, 3, 12, 16), (8, 1, 128, 32)]
# Windows: one key; 13 and 37 (no multiple of a block size); 16 (a multiple of 8 and 16 but
# not 32); one sequence's whole length; longer than every sequence. None: sinks alone.
WINDOW_CASES = [(window, with_sinks) for window in (None, 1, 13, 16, 37, "equal", "longer")
                for with_sinks in (False, True) if window is not None or with_sinks]


def window_case_id(case: tuple[int | str | None, bool]) -> str:
    window, with_sinks = case
    return f"window-{window or 'none'}{'-sinks' if with_sinks else ''}"


def poison_before_windows(batch: PagedBatch, window: int) -> int:
    """NaN in every cache slot before the first key each sequence's first query sees (whole
    released blocks, and the slots before the window in its first block: the kernels start at
    the window's first key). Returns how many slots were poisoned."""
    block_size = batch.key_cache.shape[1]
    starts = batch.query_start_loc.tolist()
    poisoned = 0
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        context_len = seq_len - (starts[i + 1] - starts[i])
        for pos in range(max(0, context_len - window + 1)):
            block = int(batch.block_tables[i, pos // block_size])
            batch.key_cache[block, pos % block_size] = float("nan")
            batch.value_cache[block, pos % block_size] = float("nan")
            poisoned += 1
    return poisoned


def random_sinks(num_heads: int, seed: int) -> torch.Tensor:
    """float32 sinks of the scores' size, one far above them (it takes nearly all the mass) and
    one far below (it takes none)."""
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2
    sinks[0], sinks[-1] = 25.0, -30.0
    return sinks


def windowed_batch(seed: int, shape: tuple[int, int, int, int], dtype: torch.dtype,
                   case: tuple[int | str | None, bool]) -> tuple[PagedBatch, int | None, torch.Tensor | None, str]:
    """(batch, window, sinks, description): decodes (one with no context, one past several
    blocks and the prefetch distance), a fresh prompt and a chunk over cached context (query
    rows starting mid-sequence), both over several query tiles and key blocks; NaN before each
    window."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    rng = random.Random(seed)
    specs = [(0, 1), (rng.randrange(40, 200), 1), (rng.randrange(1, 90), 1), (0, rng.randrange(2, 80)),
             (rng.randrange(1, 120), rng.randrange(2, 70))]
    rng.shuffle(specs)
    window, with_sinks = case
    lens = [c + n for c, n in specs]
    if window == "equal":
        window = rng.choice(lens)
    elif window == "longer":
        window = max(lens) + rng.randrange(1, 20)
    batch = make_batch(seed, specs, num_heads, num_kv_heads, head_dim, block_size, dtype, CPU)
    if window is not None:
        poison_before_windows(batch, window)
    sinks = random_sinks(num_heads, seed) if with_sinks else None
    return batch, window, sinks, f"seed {seed}, specs {specs}, window {window}, sinks {with_sinks}"


@c_kernel_only
@pytest.mark.parametrize("case", WINDOW_CASES, ids=window_case_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", WINDOW_SHAPES, ids=shape_id)
def test_each_kernel_version_takes_windows_and_sinks(kernel_version, dtype: torch.dtype,
                                                     shape: tuple[int, int, int, int],
                                                     case: tuple[int | str | None, bool]) -> None:
    """Decode and prefill rows of one step through one build's decode and prefill kernels with a
    window and / or sinks, on 1 and 3 threads: the reference's result, and no NaN from the
    slots before the windows. A window longer than every sequence gives the very bits of no
    window."""
    name, library = kernel_version
    head_dim = shape[2]
    name = f"{name} build ({cpu_native.attention_path(dtype, head_dim, library)} functions)"
    seed = random.randrange(1 << 30)
    batch, window, sinks, context = windowed_batch(seed, shape, dtype, case)
    scale = 1.3 * head_dim ** -0.5
    expected = paged_attention_reference(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                                         batch.seq_lens, batch.block_tables, scale, window, sinks)
    plan = plan_for(batch)

    def run(window: int | None) -> torch.Tensor:
        out = torch.full_like(batch.query, float("nan"))
        c_window = 0 if window is None else window
        cpu_native.paged_decode_attention(batch.query, out, plan.decode_rows, plan.decode_seq_lens,
                                          plan.decode_tables, batch.key_cache, batch.value_cache, scale,
                                          library=library, window=c_window, sinks=sinks)
        cpu_native.paged_prefill_attention(batch.query, out, plan.prefill_starts, plan.prefill_query_lens,
                                           plan.prefill_seq_lens, plan.prefill_tables, batch.key_cache,
                                           batch.value_cache, scale, library=library, window=c_window, sinks=sinks)
        return out

    for threads in (1, 3):
        torch.set_num_threads(threads)
        try:
            actual = run(window)
        finally:
            torch.set_num_threads(1)
        check(actual, expected, dtype, f"{name}, {threads} threads, {context}")
    if case[0] == "longer":
        assert torch.equal(actual, run(None)), f"{name}: a window past every sequence changed bits ({context})"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_poison_before_windows_would_show(dtype: torch.dtype) -> None:
    """The check above can fail: attending every key of the same batches (no window) reads the
    NaN put before the windows."""
    seed = random.randrange(1 << 30)
    batch, window, sinks, context = windowed_batch(seed, (8, 2, 64, 16), dtype, (13, False))
    scale = 64 ** -0.5
    assert paged_attention_reference(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                                     batch.seq_lens, batch.block_tables, scale).isnan().any(), context
    out = CpuAttention().attend(batch.query, batch.key_cache, batch.value_cache, step_of(batch), scale)
    assert out.isnan().any(), f"without a window the C kernels read every key ({context})"


def step_of(batch: PagedBatch) -> PackedStep:
    return PackedStep(batch.query_start_loc, batch.seq_lens, batch.block_tables,
                      torch.full((batch.query.shape[0],), -1, dtype=torch.int64), batch.max_query_len,
                      batch.max_seq_len)


def refuse(what: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"{what} was called")
    return refused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("sdpa_min_tokens", [None, EVERY_PREFILL], ids=["native-prefills", "sdpa-prefills"])
@pytest.mark.parametrize("case", [(13, False), (None, True), (37, True)], ids=window_case_id)
def test_the_cpu_backend_attends_windows_and_sinks(dtype: torch.dtype, sdpa_min_tokens: int | None,
                                                   case: tuple[int | None, bool], decode_path: str,
                                                   monkeypatch) -> None:
    """``CpuAttention.attend`` with a window and / or sinks: float32 and bfloat16 steps go to the
    C kernels whenever they are built (never to the reference), prefills the plan sent to SDPA
    included (SDPA takes no sinks, and a window mask would still read the slots before the
    window); float16 and steps without the C library go through the reference."""
    native = decode_path == "c-kernel" and dtype in (torch.float32, torch.bfloat16)
    calls = []
    for function in ("paged_decode_attention", "paged_prefill_attention"):
        kernel = getattr(cpu_native, function)
        monkeypatch.setattr(cpu_native, function,
                            lambda *args, kernel=kernel, **kwargs: calls.append(kwargs) or kernel(*args, **kwargs))
    if native:
        monkeypatch.setattr(cpu_attention, "paged_attention_reference", refuse("the reference"))
        monkeypatch.setattr(cpu_attention, "_prefills_through_sdpa", refuse("SDPA"))
    seed = random.randrange(1 << 30)
    batch, window, sinks, context = windowed_batch(seed, (8, 2, 64, 16), dtype, case)
    scale = 1.3 * 64 ** -0.5
    backend = CpuAttention()
    step = step_of(batch)
    plan = backend.plan(step, batch.key_cache.shape[1], sdpa_min_tokens)
    assert bool(plan.sdpa_spans) == (sdpa_min_tokens is not None), context
    actual = backend.attend(batch.query, batch.key_cache, batch.value_cache, step, scale, plan, window, sinks)
    expected = paged_attention_reference(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                                         batch.seq_lens, batch.block_tables, scale, window, sinks)
    check(actual, expected, dtype, f"{decode_path}, {context}")
    assert len(calls) == (2 if native else 0), f"{len(calls)} C kernel calls ({decode_path}, {dtype})"
    for kwargs in calls:
        assert kwargs["window"] == (window or 0) and (kwargs["sinks"] is None) == (sinks is None)
