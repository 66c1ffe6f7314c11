"""Sliding-window attention: the query at position p sees keys p - W + 1 .. p.

- Kernels: the Triton kernels (the interpreter on CPU) and the CPU backend (its C kernels, never
  the reference) against the reference, whose window is checked against full attention masked
  by hand; block-table entries before every window point at a NaN-filled block and must not be
  read.
- Models: tiny Mistral (a window on every layer) and Qwen2 (windows on the layers its
  ``layer_types`` name) equal transformers float32 token for token with prompts and outputs
  longer than the window, chunked, preempted, over prefix hits and through the Triton kernels.
- Memory: under a window on every layer, the KV blocks a long generation holds stay bounded
  by the window, not by its length.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend import Engine, EngineConfig, SamplingParams
from kernels import cpu_attention, cpu_native
from kernels.attention_backend import PackedStep, attention_backend_for
from kernels.reference import paged_attention_reference
from tests.conftest import FIXED_BUDGET, hf_greedy
from tests.test_hf_equality import assert_same_tokens
from tests.tiny_models import compositions, prefix_hit_greedy, save_tiny_model

WINDOW = 16
NEW_TOKENS = 24


# ---- kernels -------------------------------------------------------------------------------------
def packed_batch(query_lens: list[int], seq_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, window: int, seed: int = 0):
    """Random queries and caches; each sequence's blocks wholly before its first query's window
    point at block 0, which holds NaN."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_blocks = 1 + sum(-(-s // block_size) for s in seq_lens)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    key_cache[0] = value_cache[0] = float("nan")
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    next_block = 1
    for i, (n, s) in enumerate(zip(query_lens, seq_lens)):
        first_read = max(0, s - n - window + 1) // block_size
        for b in range(-(-s // block_size)):
            if b >= first_read:
                tables[i, b] = next_block
            next_block += 1
    starts = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    return query, key_cache, value_cache, starts, torch.tensor(seq_lens, dtype=torch.int32), tables


def full_attention_masked(query, key_cache, value_cache, starts, seq_lens, tables, scale, window):
    """Every key gathered and the window applied as a mask (NaN blocks replaced by zeros)."""
    key_cache, value_cache = key_cache.nan_to_num(0.0), value_cache.nan_to_num(0.0)
    out = torch.empty_like(query)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    for i, s in enumerate(seq_lens.tolist()):
        q0, q1 = int(starts[i]), int(starts[i + 1])
        k = key_cache[tables[i, :-(-s // block_size)].long()].reshape(-1, num_kv_heads, key_cache.shape[3])[:s]
        v = value_cache[tables[i, :-(-s // block_size)].long()].reshape(-1, num_kv_heads, key_cache.shape[3])[:s]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", query[q0:q1], k) * scale
        q_pos = torch.arange(q1 - q0).unsqueeze(1) + s - (q1 - q0)
        k_pos = torch.arange(s).unsqueeze(0)
        scores.masked_fill_((k_pos > q_pos) | (k_pos <= q_pos - window), float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


BATCHES = {
    "decodes": ([1, 1, 1, 1], [3, 17, 40, 95]),
    "prefills": ([5, 40, 70], [5, 40, 70]),
    "chunks_over_context": ([12, 33, 1], [60, 50, 33]),
}


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_windowed_attention_matches_masked_full_attention(batch: str, backend: str, monkeypatch) -> None:
    if backend == "cpu":
        assert cpu_native.load() is not None, "the C kernels must build here (gcc is part of the machine)"
        monkeypatch.setattr(cpu_attention, "paged_attention_reference",
                            lambda *args: pytest.fail("the cpu backend sent a windowed step to the reference"))
    query_lens, seq_lens = BATCHES[batch]
    query, key_cache, value_cache, starts, lens, tables = packed_batch(query_lens, seq_lens, 8, 8, 2, 32, WINDOW)
    expected = full_attention_masked(query, key_cache, value_cache, starts, lens, tables, 0.2, WINDOW)
    step = PackedStep(query_start_loc=starts, seq_lens=lens, block_tables=tables,
                      slot_mapping=torch.full((query.shape[0],), -1, dtype=torch.int64),
                      max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    out = attention_backend_for(backend, torch.device("cpu")).attend(query, key_cache, value_cache, step, 0.2,
                                                                     window=WINDOW)
    assert not out.isnan().any(), "a block before the window was read"
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    # Without a window the NaN blocks would be read: the check above can fail.
    if backend == "reference" and batch != "prefills":
        assert paged_attention_reference(query, key_cache, value_cache, starts, lens, tables, 0.2).isnan().any()


def test_triton_split_kv_with_a_window() -> None:
    """Decode rows whose key range is split across programs, the window cutting into it."""
    from kernels.triton_attention import LaunchPlan, paged_attention

    query, key_cache, value_cache, starts, lens, tables = packed_batch([1, 1], [300, 130], 16, 8, 2, 32, 100)
    expected = full_attention_masked(query, key_cache, value_cache, starts, lens, tables, 0.2, 100)
    for splits in (2, 3, 7):
        out = paged_attention(query, key_cache, value_cache, starts, lens, tables, 0.2,
                              plan=LaunchPlan(16, 1, 32, splits, decode_only=True), window=100)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


# ---- models --------------------------------------------------------------------------------------
def make_tiny_windowed(kind: str, folder: Path, tokenizer_dir: Path):
    """``mistral``: a 16-key window on every layer; ``qwen2``: on layers 1 and 2 of 3."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1, initializer_range=0.25,
                  tie_word_embeddings=False, sliding_window=WINDOW)
    if kind == "mistral":
        config, cls = MistralConfig(**common), MistralForCausalLM
    else:
        config, cls = Qwen2Config(use_sliding_window=True, max_window_layers=1, **common), Qwen2ForCausalLM
    torch.manual_seed({"mistral": 20, "qwen2": 21}[kind])
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
    return save_tiny_model(model, folder, tokenizer_dir)


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def tiny_windowed(request, tmp_path_factory, tokenizer_dir: Path):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, make_tiny_windowed(request.param, folder, tokenizer_dir)


@pytest.fixture(scope="module")
def prompts(prose_ids: list[int]) -> list[list[int]]:
    return [prose_ids[3 * i + 4: 3 * i + 4 + n] for i, n in enumerate([1, 7, 15, 16, 17, 40, 90, 160])]


@pytest.fixture(scope="module")
def reference(tiny_windowed, prompts) -> list[list[int]]:
    return hf_greedy(tiny_windowed[2], prompts, NEW_TOKENS)


def test_the_windows_reach_the_layers(tiny_windowed) -> None:
    from backend.model.architecture import ModelArchitecture

    kind, folder, _ = tiny_windowed
    arch = ModelArchitecture.from_folder(folder)
    expected = (WINDOW,) * 3 if kind == "mistral" else (None, WINDOW, WINDOW)
    assert arch.layer_windows == expected
    assert arch.release_window == (WINDOW if kind == "mistral" else None)


COMPOSITIONS = compositions(preemption_blocks=60)


@pytest.mark.parametrize("composition", sorted(COMPOSITIONS))
def test_greedy_matches_transformers(tiny_windowed, prompts, reference, composition: str) -> None:
    engine = Engine(EngineConfig(model=str(tiny_windowed[1]), dtype="float32", **COMPOSITIONS[composition]))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert_same_tokens([o.token_ids for o in outputs], reference)
    engine.check_invariants()
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total, "KV blocks leaked"
    if composition == "preemption" and tiny_windowed[0] == "qwen2":
        assert engine.scheduler.num_preemptions > 0, "the composition preempted nobody"


def test_prefix_hits_match_transformers(tiny_windowed, prose_ids: list[int]) -> None:
    shared = [prose_ids[:40] + prose_ids[700 + 9 * i: 700 + 9 * i + 2 + 3 * i] for i in range(5)]
    expected = hf_greedy(tiny_windowed[2], shared, NEW_TOKENS)
    assert_same_tokens(prefix_hit_greedy(tiny_windowed[1], shared, 40, NEW_TOKENS, block_size=8, num_kv_blocks=256),
                       expected)


def test_triton_kernels_match_transformers(tiny_windowed, prompts) -> None:
    short = [p for p in prompts if len(p) <= 40]
    expected = hf_greedy(tiny_windowed[2], short, 12)
    engine = Engine(EngineConfig(model=str(tiny_windowed[1]), dtype="float32", attention_backend="triton",
                                 block_size=8, num_kv_blocks=128, **FIXED_BUDGET))
    outputs = engine.generate(short, SamplingParams(max_tokens=12, temperature=0.0))
    assert_same_tokens([o.token_ids for o in outputs], expected)
    engine.check_invariants()


def test_kv_usage_of_a_long_generation_is_bounded_by_the_window(tiny_windowed, prose_ids: list[int]) -> None:
    """A 300-token generation: with a window on every layer the request never holds more than
    the window's blocks plus one step's; with a full-attention layer it holds them all."""
    kind, folder, _ = tiny_windowed
    block_size, budget = 4, 16
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", block_size=block_size, num_kv_blocks=256,
                                 max_num_batched_tokens=budget, max_num_seqs=4, enable_prefix_caching=False,
                                 **FIXED_BUDGET))
    engine.add_request("long", prose_ids[:40], SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True))
    most_held = 0
    while engine.has_unfinished_requests():
        engine.step()
        most_held = max(most_held, engine.stats().kv_blocks_total - engine.stats().kv_blocks_free)
        engine.check_invariants()
    bound = -(-(WINDOW + budget) // block_size) + 1
    if kind == "mistral":
        assert most_held <= bound, f"held {most_held} blocks, the window needs {bound}"
    else:
        assert most_held == -(-340 // block_size)
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total
