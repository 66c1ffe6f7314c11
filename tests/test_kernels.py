"""The Triton kernels against the torch reference (kernels/reference.py is the spec).

On a machine without CUDA these run under ``TRITON_INTERPRET=1`` (tests/conftest.py sets
it before anything imports triton); with CUDA they run the compiled kernels. Every case
draws fresh random data: permuted, non-contiguous block tables, context lengths that are
not multiples of the block size, and poison (NaN) everywhere the kernels must not read or
must write: unused cache slots, block-table padding pointing at a NaN block, and the
output buffer itself.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.reference import paged_attention_reference, reshape_and_cache_reference
from kernels.triton_attention import LaunchPlan, paged_attention, plan_launch, reshape_and_cache
from tests.paged_batches import (DEVICE, DTYPES, SCENARIOS, SHAPES, TOLERANCES, PagedBatch, make_batch, scenario_specs,
                                 shape_id)


def run_both(batch: PagedBatch, plan: LaunchPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    scale = batch.query.shape[-1] ** -0.5
    expected = paged_attention_reference(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                                         batch.seq_lens, batch.block_tables, scale)
    poisoned_out = torch.full_like(batch.query, float("nan"))
    actual = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                             batch.seq_lens, batch.block_tables, scale, batch.max_query_len, batch.max_seq_len,
                             plan=plan, out=poisoned_out)
    assert actual.data_ptr() == poisoned_out.data_ptr()
    return actual, expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_paged_attention_matches_reference(dtype: torch.dtype, scenario: str, shape: tuple[int, int, int, int]) -> None:
    num_heads, num_kv_heads, head_dim, block_size = shape
    seed = hash((str(dtype), scenario, shape)) % (2**31) + random.randrange(1 << 20)   # fresh data per run
    specs = scenario_specs(scenario, random.Random(seed), block_size)
    batch = make_batch(seed, specs, num_heads, num_kv_heads, head_dim, block_size, dtype)
    actual, expected = run_both(batch)
    assert not actual.isnan().any(), f"unwritten or poisoned output (seed {seed}, specs {specs})"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype],
                               msg=lambda m: f"seed {seed}, specs {specs}: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(8, 2, 64, 16), (16, 4, 128, 32)], ids=shape_id)
def test_many_sequences_in_one_launch(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    """A continuous-batching step at scale: 40 sequences in one launch (decodes, fresh
    prefills and chunks over cached context, shuffled), so the tile search crosses many
    sequence boundaries."""
    num_heads, num_kv_heads, head_dim, block_size = shape
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    specs = [(rng.randrange(1, 200), 1) for _ in range(30)]
    specs += [(0, rng.randrange(2, 70)) for _ in range(5)]
    specs += [(rng.randrange(1, 150), rng.randrange(2, 40)) for _ in range(5)]
    rng.shuffle(specs)
    batch = make_batch(seed, specs, num_heads, num_kv_heads, head_dim, block_size, dtype)
    actual, expected = run_both(batch)
    assert not actual.isnan().any(), f"seed {seed}"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype], msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_split_kv_decode_matches_reference(dtype: torch.dtype, num_splits: int) -> None:
    """Few sequences with long contexts: the key range is cut into splits and merged. With 7
    splits some splits of the shorter sequences are empty, which the merge must ignore."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    specs = [(rng.randrange(300, 700), 1), (rng.randrange(20, 90), 1)]
    batch = make_batch(seed, specs, 8, 2, 64, 16, dtype)
    plan = LaunchPlan(block_m=16, block_q=1, block_n=64, num_splits=num_splits)
    actual, expected = run_both(batch, plan)
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype], msg=lambda m: f"seed {seed}: {m}")


def test_launch_plan_splits_only_small_long_decodes() -> None:
    # 2 sequences x 2 KV heads on 132 SMs with 8k context: split; 256 sequences: no split.
    assert plan_launch(2, 2, 16, 2, 1, 8192, 132).num_splits > 1
    assert plan_launch(256, 256, 16, 2, 1, 8192, 132).num_splits == 1
    assert plan_launch(2, 2, 16, 2, 1, 200, 132).num_splits == 1      # short context: nothing to split
    assert plan_launch(300, 2, 16, 2, 150, 8192, 132).num_splits == 1  # prefill: tiles fill the GPU
    plan = plan_launch(64, 1, 12, 2, 64, 64, 132)                      # GQA 6: rows = tokens x heads
    assert plan.block_q * 6 <= plan.block_m


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (4, 128, 32), (1, 64, 32), (3, 128, 16)])
def test_reshape_and_cache_matches_reference(dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks, num_tokens = 12, rng.randrange(5, 40)
    # K and V as the model produces them: views into one fused projection (strided rows).
    fused = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen).to(dtype)
    key = fused[:, num_kv_heads * head_dim:2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = fused[:, 2 * num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = rng.sample(range(num_blocks * block_size), num_tokens)
    for i in rng.sample(range(num_tokens), num_tokens // 4):
        slots[i] = -1                                                   # padding: must be skipped
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(4)]
    reshape_and_cache_reference(key, value, caches[0], caches[1], slot_mapping)
    to_device = [c.to(DEVICE) for c in caches[2:]]
    reshape_and_cache(key.to(DEVICE), value.to(DEVICE), to_device[0], to_device[1], slot_mapping.to(DEVICE))
    for expected, actual in zip(caches[:2], to_device):
        # Bit-exact: a copy. NaN where nothing was written, in both.
        torch.testing.assert_close(actual.cpu(), expected, atol=0, rtol=0, equal_nan=True,
                                   msg=lambda m: f"seed {seed}: {m}")
    written = (slot_mapping >= 0).sum().item()
    assert (~caches[0][..., 0, 0].isnan()).sum().item() == written


def test_reshape_and_cache_casts_to_cache_dtype() -> None:
    key = torch.randn(6, 2, 64)
    value = torch.randn(6, 2, 64)
    slot_mapping = torch.tensor([3, -1, 17, 0, 31, 8])
    expected = [torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    actual = [t.clone().to(DEVICE) for t in expected]
    reshape_and_cache_reference(key, value, *expected, slot_mapping)
    reshape_and_cache(key.to(DEVICE), value.to(DEVICE), *actual, slot_mapping.to(DEVICE))
    for e, a in zip(expected, actual):
        assert torch.equal(a.cpu(), e)
