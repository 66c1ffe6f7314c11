"""The decoder layers in one C call (backend/model/cpu_decoder.py, kernels/csrc/decoder.c)
against the Python loop of the same kernels (CausalLM._decoder_fused), its reference: the same
logits and the same K/V caches, to the bit, for every kind of step."""

from __future__ import annotations

import contextlib

import pytest
import torch

from backend.model import llama
from backend.model.architecture import ModelArchitecture
from backend.model.cpu_decoder import CpuDecoder
from backend.model.cpu_linear import native_kernel_available
from backend.model.llama import AttentionMetadata, CausalLM

BLOCK_SIZE, NUM_BLOCKS = 4, 16

# name -> (query rows per sequence, tokens already cached per sequence)
STEPS = {
    "mixed": ([6, 1, 1], [3, 5, 7]),          # a prompt chunk over cached tokens and two decodes
    "decodes": ([1, 1, 1, 1], [2, 9, 4, 11]),
    "fresh-prompts": ([5, 7], [0, 0]),
    "one-row": ([1], [0]),
}


def tiny_model(dtype: torch.dtype, qkv_bias: bool) -> CausalLM:
    arch = ModelArchitecture(model_type="qwen2" if qkv_bias else "llama", vocab_size=300, hidden_size=96,
                             intermediate_size=160, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16,
                             rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
                             tie_word_embeddings=True, qkv_bias=qkv_bias, qk_norm=False, initializer_range=0.2)
    torch.manual_seed(0)
    model = CausalLM(arch, attention_backend="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape) * (0.2 if not name.endswith("norm.weight") else 1.0))
    model = model.to(dtype=dtype)
    model.inv_freq = model.inv_freq.float()
    model.pack_for_cpu("native")
    assert model.use_fused_layer_ops(True) == "c"
    return model


def step_metadata(query_lens: list[int], cached: list[int]) -> tuple[AttentionMetadata, int]:
    """A packed step: sequence i has cached[i] tokens in the cache and query_lens[i] new ones;
    its blocks are consecutive from 4 * i."""
    tables = torch.tensor([[4 * i + b for b in range(4)] for i in range(len(query_lens))], dtype=torch.int32)
    positions, slots, starts = [], [], [0]
    for i, (n, c) in enumerate(zip(query_lens, cached)):
        for p in range(c, c + n):
            positions.append(p)
            slots.append(int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE)
        starts.append(starts[-1] + n)
    seq_lens = [n + c for n, c in zip(query_lens, cached)]
    meta = AttentionMetadata(positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
                             query_start_loc=torch.tensor(starts, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
                             logits_indices=torch.tensor(starts[1:]) - 1, max_query_len=max(query_lens),
                             max_seq_len=max(seq_lens))
    return meta, starts[-1]


def caches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, 16, generator=gen).to(dtype),
             torch.randn(NUM_BLOCKS, BLOCK_SIZE, 2, 16, generator=gen).to(dtype)) for _ in range(3)]


needs_kernel = pytest.mark.skipif(not native_kernel_available(torch.float32),
                                  reason="NOT RUN: our C linear kernel needs AVX2 + FMA, which this CPU lacks")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qkv_bias", [False, True], ids=["no-bias", "qkv-bias"])
@pytest.mark.parametrize("step", list(STEPS))
def test_c_decoder_gives_the_loops_bits(dtype: torch.dtype, qkv_bias: bool, step: str, monkeypatch) -> None:
    model = tiny_model(dtype, qkv_bias)
    decoder = model.cpu_decoder
    assert isinstance(decoder, CpuDecoder)
    meta, tokens = step_metadata(*STEPS[step])
    input_ids = torch.randint(0, 300, (tokens,), generator=torch.Generator().manual_seed(2))
    loops = []
    real_loop = CausalLM._decoder_fused
    monkeypatch.setattr(CausalLM, "_decoder_fused", lambda self, *args: loops.append(1) or real_loop(self, *args))
    results = {}
    for name, which in (("loop", None), ("c", decoder)):
        model.cpu_decoder = which
        kv = caches(dtype)
        with torch.inference_mode():
            logits = model(input_ids, meta, kv)
        results[name] = (logits, kv)
    model.cpu_decoder = decoder
    assert loops == [1], "the C run fell back to the loop: the comparison would be of the loop with itself"
    assert torch.equal(results["c"][0], results["loop"][0])
    for (k_c, v_c), (k_loop, v_loop) in zip(results["c"][1], results["loop"][1]):
        assert torch.equal(k_c, k_loop) and torch.equal(v_c, v_loop)


@needs_kernel
def test_c_decoder_runs_the_step(monkeypatch) -> None:
    """The model takes the C call when it applies (the loop is not entered), and the loop when
    the step has LoRA adapters (their deltas go between the kernels)."""
    model = tiny_model(torch.float32, False)
    meta, tokens = step_metadata(*STEPS["mixed"])
    input_ids = torch.zeros(tokens, dtype=torch.int64)
    loops = []
    real_loop = CausalLM._decoder_fused
    monkeypatch.setattr(CausalLM, "_decoder_fused", lambda self, *args: loops.append(1) or real_loop(self, *args))
    with torch.inference_mode():
        model(input_ids, meta, caches(torch.float32))
        assert loops == []
        # A step with adapters: the loop (lora_batch / add_lora stubbed: no adapter is loaded here).
        monkeypatch.setattr(llama, "lora_batch", lambda batch: contextlib.nullcontext())
        monkeypatch.setattr(llama, "add_lora", lambda *args: None)
        meta.lora = object()
        model(input_ids, meta, caches(torch.float32))
        assert loops == [1]


@needs_kernel
def test_c_decoder_only_where_every_piece_is_a_c_kernel() -> None:
    model = tiny_model(torch.float32, False)
    assert model.cpu_decoder is not None
    model.use_fused_layer_ops(False)
    assert model.cpu_decoder is None                  # torch's small ops: the torch loop
    onednn = CausalLM(model.arch, attention_backend="cpu")
    onednn.pack_for_cpu("onednn")
    onednn.use_fused_layer_ops(True)
    assert onednn.fused_layer_ops == "c" and onednn.cpu_decoder is None   # oneDNN projections
