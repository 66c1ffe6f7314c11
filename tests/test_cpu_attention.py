"""The CPU attention path (kernels/cpu_attention.py) against the torch reference
(kernels/reference.py is the spec), through the public dispatch in ``kernels`` that the
engine calls: ``plan_attention`` once per step, then ``reshape_and_cache`` and
``paged_attention`` per layer with that plan.

Batches come from tests/paged_batches.py: permuted block tables, NaN in every cache slot
no sequence owns and in the block that table padding points at, so any read outside a
sequence's own tokens shows up as NaN or a wrong value. Every case draws a fresh seed,
named in its failure message.

float32 decode rows run in the C kernel (kernels/csrc) when it can be built; every
attention test runs twice, once on that path and once with the kernel unavailable (the
batched torch path, which also serves bfloat16).
"""

from __future__ import annotations

import random

import pytest
import torch

import kernels
from kernels import cpu_native
from kernels.reference import paged_attention_reference, reshape_and_cache_reference
from tests.paged_batches import SCENARIOS, SHAPES, TOLERANCES, PagedBatch, make_batch, scenario_specs, shape_id

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]


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
    """Which implementation float32 decode rows take."""
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


def plan_for(batch: PagedBatch, slot_mapping: torch.Tensor | None = None):
    slot_mapping = new_token_slots(batch) if slot_mapping is None else slot_mapping
    return kernels.plan_attention(batch.query_start_loc, batch.seq_lens, batch.block_tables, slot_mapping,
                                  batch.key_cache.shape[1], backend="cpu")


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
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype], msg=lambda m: f"{context}: {m}")


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


@pytest.mark.parametrize("threads", [2, 3])
def test_c_kernel_on_several_threads(threads: int, decode_path: str) -> None:
    """The C kernel splits sequences across OpenMP threads (torch's pool): same results
    with more threads than cores as with one."""
    torch.set_num_threads(threads)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    specs = [(rng.randrange(0, 400), 1) for _ in range(37)]
    batch = make_batch(seed, specs, 12, 2, 64, 16, torch.float32, CPU)
    try:
        check(*attend(batch, plan_for(batch)), torch.float32, f"seed {seed}, {threads} threads, {decode_path}")
    finally:
        torch.set_num_threads(1)
