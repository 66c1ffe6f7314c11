"""Attention sinks (gpt-oss): one learned logit per query head joins every row's softmax
denominator, its value contributing nothing.

The reference against the definition written out in float64 (with and without a sliding
window); the Triton kernels (the interpreter on CPU) against the reference over the kernel
tests' batch kinds, with and without windows, in float32 and bfloat16, and with split-KV (the
merge adds the sink once); the CPU backend through its C kernels (never the reference;
tests/test_cpu_attention.py checks each build of them). The batches carry NaN wherever a kernel must not read (tests/paged_batches.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels import cpu_attention, cpu_native
from kernels.attention_backend import PackedStep, attention_backend_for
from kernels.reference import paged_attention_reference
from tests.paged_batches import DEVICE, SCENARIOS, TOLERANCES, PagedBatch, make_batch, scenario_specs

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 32, 16


def random_sinks(num_heads: int, seed: int) -> torch.Tensor:
    """Sinks from well below to well above the rows' scores: some heads barely notice theirs,
    some put most of the mass on it."""
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 3.0


def sink_attention_by_definition(batch: PagedBatch, scale: float, sinks: torch.Tensor,
                                 window: int | None) -> torch.Tensor:
    """Each query row over its visible keys, in float64: exp(s - m) / (sum exp(s - m) + exp(sink - m))."""
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    group = NUM_HEADS // NUM_KV_HEADS
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        num_queries = starts[i + 1] - starts[i]
        blocks = batch.block_tables[i, :-(-seq_len // BLOCK_SIZE)].long()
        keys = batch.key_cache[blocks].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len].double()
        values = batch.value_cache[blocks].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len].double()
        for j in range(num_queries):
            pos = seq_len - num_queries + j
            first = 0 if window is None else max(0, pos - window + 1)
            for h in range(NUM_HEADS):
                q = batch.query[starts[i] + j, h].double()
                s = keys[first:pos + 1, h // group] @ q * scale
                m = torch.maximum(s.max(), sinks[h].double())
                e = torch.exp(s - m)
                out[starts[i] + j, h] = (e @ values[first:pos + 1, h // group]) / (e.sum() + torch.exp(sinks[h] - m))
    return out


def reference_of(batch: PagedBatch, scale: float, sinks: torch.Tensor | None, window: int | None) -> torch.Tensor:
    return paged_attention_reference(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                                     batch.seq_lens, batch.block_tables, scale, window, sinks)


@pytest.mark.parametrize("window", [None, 12], ids=["full", "window12"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_reference_equals_the_definition(scenario: str, window: int | None) -> None:
    seed = random.randrange(1 << 20)
    batch = make_batch(seed, scenario_specs(scenario, random.Random(seed), BLOCK_SIZE), NUM_HEADS, NUM_KV_HEADS,
                       HEAD_DIM, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    sinks = random_sinks(NUM_HEADS, seed)
    out = reference_of(batch, 0.2, sinks, window)
    assert not out.isnan().any(), f"seed {seed}"
    torch.testing.assert_close(out.double(), sink_attention_by_definition(batch, 0.2, sinks, window),
                               atol=1e-5, rtol=1e-5, msg=lambda m: f"seed {seed}: {m}")
    # The sinks take mass away from every row: without them the output differs.
    assert not torch.allclose(out, reference_of(batch, 0.2, None, window), atol=1e-3)


def test_a_sink_far_below_the_scores_changes_nothing() -> None:
    batch = make_batch(5, [(30, 1), (0, 20)], NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32,
                       torch.device("cpu"))
    sinks = torch.full((NUM_HEADS,), -1e4)
    torch.testing.assert_close(reference_of(batch, 0.2, sinks, None), reference_of(batch, 0.2, None, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 12], ids=["full", "window12"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_triton_kernel_matches_the_reference(scenario: str, window: int | None, dtype: torch.dtype) -> None:
    from kernels.triton_attention import paged_attention

    seed = random.randrange(1 << 20)
    batch = make_batch(seed, scenario_specs(scenario, random.Random(seed), BLOCK_SIZE), NUM_HEADS, NUM_KV_HEADS,
                       HEAD_DIM, BLOCK_SIZE, dtype)
    sinks = random_sinks(NUM_HEADS, seed).to(DEVICE)
    expected = reference_of(batch, 0.2, sinks, window)
    out = torch.full_like(batch.query, float("nan"))
    paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc, batch.seq_lens,
                    batch.block_tables, 0.2, batch.max_query_len, batch.max_seq_len, out=out, window=window,
                    sinks=sinks)
    assert not out.isnan().any(), f"unwritten or poisoned output (seed {seed})"
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype], msg=lambda m: f"seed {seed}: {m}")


@pytest.mark.parametrize("window", [None, 100], ids=["full", "window100"])
def test_triton_split_kv_adds_the_sink_once(window: int | None) -> None:
    """Decode rows whose keys are split across programs (a window cutting into them or not):
    the merge adds each head's sink once, beside the splits' sums. bfloat16 sinks are read as
    float32."""
    from kernels.triton_attention import LaunchPlan, paged_attention

    batch = make_batch(11, [(299, 1), (129, 1), (40, 1)], NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                       torch.float32)
    for sinks in (random_sinks(NUM_HEADS, 11).to(DEVICE), random_sinks(NUM_HEADS, 12).to(DEVICE, torch.bfloat16)):
        expected = reference_of(batch, 0.2, sinks, window)
        for splits in (1, 2, 3, 7):
            out = paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.query_start_loc,
                                  batch.seq_lens, batch.block_tables, 0.2,
                                  plan=LaunchPlan(16, 1, 32, splits, decode_only=True), window=window, sinks=sinks)
            torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5, msg=lambda m: f"{splits} splits: {m}")


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_every_backend_takes_sinks(backend: str, monkeypatch) -> None:
    """``AttentionBackend.attend(..., sinks=...)``, with and without a window: the cpu backend
    through its C kernels, the reference refused."""
    if backend == "cpu":
        assert cpu_native.load() is not None, "the C kernels must build here (gcc is part of the machine)"
        monkeypatch.setattr(cpu_attention, "paged_attention_reference",
                            lambda *args: pytest.fail("the cpu backend sent a step with sinks to the reference"))
    device = DEVICE if backend == "triton" else torch.device("cpu")
    batch = make_batch(7, [(40, 1), (0, 25), (50, 9)], NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                       torch.float32, device)
    sinks = random_sinks(NUM_HEADS, 7).to(device)
    step = PackedStep(batch.query_start_loc, batch.seq_lens, batch.block_tables,
                      torch.full((batch.query.shape[0],), -1, dtype=torch.int64, device=device),
                      batch.max_query_len, batch.max_seq_len)
    for window in (None, 12):
        out = attention_backend_for(backend, device).attend(batch.query, batch.key_cache, batch.value_cache, step,
                                                            0.2, window=window, sinks=sinks)
        torch.testing.assert_close(out, reference_of(batch, 0.2, sinks, window), atol=2e-5, rtol=2e-5)
