"""The decoder layers in one C call (backend/model/cpu_decoder.py, kernels/csrc/decoder.c)
against the Python loop of the same kernels (CausalLM._decoder_fused), its reference: the same
logits and the same K/V caches, to the bit, for every kind of step, with our C projections
inside the call or other projections (oneDNN's, torch's) called back from it, and with LoRA
deltas added in the callback."""

from __future__ import annotations

import contextlib
import gc
import itertools
import weakref

import pytest
import torch

from backend.model import cpu_decoder, llama
from backend.model.architecture import ModelArchitecture
from backend.model.cpu_decoder import CpuDecoder
from backend.model.cpu_linear import (Int8Linear, TorchLinear, native_kernel_available, native_linear,
                                      onednn_packing_available, replace_linears)
from backend.model.llama import AttentionMetadata, CausalLM
from kernels import EVERY_PREFILL, cpu_attention

pytestmark = pytest.mark.usefixtures("fp16_matmuls_off", "prefill_bf16_own")   # see tests/conftest.py

BLOCK_SIZE, NUM_BLOCKS = 4, 16

# name -> (query rows per sequence, tokens already cached per sequence)
STEPS = {
    "mixed": ([6, 1, 1], [3, 5, 7]),          # a prompt chunk over cached tokens and two decodes
    "decodes": ([1, 1, 1, 1], [2, 9, 4, 11]),
    "fresh-prompts": ([5, 7], [0, 0]),
    "one-row": ([1], [0]),
    "fresh-chunk-decode": ([5, 6, 1], [0, 3, 7]),   # a fresh prompt, a chunk over cached tokens, a decode
}


def tiny_model(dtype: torch.dtype, qkv_bias: bool, linear: str = "native") -> CausalLM:
    """A 3-layer model with random weights; ``linear``: ``native`` or ``onednn`` (packed for
    that kernel), ``torch`` (the ``nn.Linear`` modules as built), ``int8`` (weight-only int8,
    ``quantization=int8``), or ``mixed``: our kernel and
    ``TorchLinear`` in turn over the layers' projections, so that each of gate|up and down is
    ours where the other is called back, and both are called back in a third layer."""
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
    if linear == "int8":
        replace_linears(model.model.layers, Int8Linear)
    elif linear == "mixed":
        kinds = itertools.cycle([native_linear, TorchLinear, TorchLinear])
        replace_linears(model.model.layers, lambda weight, bias: next(kinds)(weight, bias))
    elif linear != "torch":
        model.pack_for_cpu(linear)
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


def loop_and_c_results(model: CausalLM, step: str, monkeypatch, lora: object | None = None) -> dict[str, tuple]:
    """The logits and caches of one step (with ``lora`` as its LoRA batch) through the Python
    loop and through the C call."""
    decoder = model.cpu_decoder
    assert isinstance(decoder, CpuDecoder)
    dtype = model.model.embed_tokens.weight.dtype
    meta, tokens = step_metadata(*STEPS[step])
    meta.lora = lora
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
    return results


def assert_same_bits(results: dict[str, tuple]) -> None:
    assert torch.equal(results["c"][0], results["loop"][0])
    for (k_c, v_c), (k_loop, v_loop) in zip(results["c"][1], results["loop"][1]):
        assert torch.equal(k_c, k_loop) and torch.equal(v_c, v_loop)


LINEARS = ["native", "onednn", "torch", "int8", "mixed"]
CALLED_BACK = {"native": 0, "onednn": 3 * 4, "torch": 3 * 4, "int8": 3 * 4, "mixed": 8}   # of the 3 x 4 projections


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qkv_bias", [False, True], ids=["no-bias", "qkv-bias"])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("linear", LINEARS)
def test_c_decoder_gives_the_loops_bits(dtype: torch.dtype, qkv_bias: bool, step: str, linear: str,
                                        monkeypatch) -> None:
    """Our kernels inside the call (``native``), or each projection called back to its module
    (``onednn``, ``torch``, ``int8``, some of ``mixed``): the loop's bits either way."""
    if linear == "onednn" and not onednn_packing_available(dtype):
        pytest.skip(f"NOT RUN: oneDNN's packed {dtype} weights need a CPU this one is not (AVX-512 for bfloat16)")
    model = tiny_model(dtype, qkv_bias, linear)
    assert model.cpu_decoder.external_projections == CALLED_BACK[linear]
    assert_same_bits(loop_and_c_results(model, step, monkeypatch))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("step", ["fresh-prompts", "fresh-chunk-decode", "mixed", "decodes"])
@pytest.mark.parametrize("linear", ["native", "torch"])
def test_sdpa_prompts_are_called_back_with_the_loops_bits(dtype: torch.dtype, step: str, linear: str,
                                                          monkeypatch) -> None:
    """SDPA for every prefill: each layer calls back once for the step's prefills (and not at all
    in a step without one), which torch's SDPA attends, while the C kernels attend the decode
    rows; the loop's bits."""
    model = tiny_model(dtype, False, linear)
    model.sdpa_prompt_min_tokens = EVERY_PREFILL
    spans_seen = []
    real_sdpa = cpu_attention.sdpa_prefill_attention
    monkeypatch.setattr(cpu_decoder, "sdpa_prefill_attention",
                        lambda *args: spans_seen.append([(s.q_start, s.q_end) for s in args[4].sdpa_spans])
                        or real_sdpa(*args))
    assert_same_bits(loop_and_c_results(model, step, monkeypatch))
    query_lens, _ = STEPS[step]
    starts = list(itertools.accumulate(query_lens, initial=0))
    prefills = [(starts[i], starts[i + 1]) for i, n in enumerate(query_lens) if n > 1]
    assert spans_seen == [prefills] * (3 if prefills else 0)


@needs_kernel
def test_sdpa_prompts_change_only_what_rounding_allows() -> None:
    """The same float32 step with SDPA for its prefills and with our kernel: logits equal
    up to the order of float32 sums (a wrong row, head or mask would be far off)."""
    model = tiny_model(torch.float32, False)
    meta, tokens = step_metadata(*STEPS["fresh-chunk-decode"])
    input_ids = torch.randint(0, 300, (tokens,), generator=torch.Generator().manual_seed(2))
    logits = {}
    for min_tokens in (None, EVERY_PREFILL):
        model.sdpa_prompt_min_tokens = min_tokens
        with torch.inference_mode():
            logits[min_tokens] = model(input_ids, meta, caches(torch.float32))
    torch.testing.assert_close(logits[EVERY_PREFILL], logits[None], atol=1e-4, rtol=1e-4)


class StandInLoRA:
    """A step's LoRA batch whose resident adapters adapt ``projections`` (``slots.adapts``)."""

    def __init__(self, projections: tuple[str, ...]) -> None:
        self.slots, self.projections = self, projections

    def adapts(self, projection: str) -> bool:
        return projection in self.projections


ALL_PROJECTIONS = ("qkv", "o", "gate_up", "down")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qkv_bias", [False, True], ids=["no-bias", "qkv-bias"])
@pytest.mark.parametrize("linear", ["native", "torch"])
@pytest.mark.parametrize("step", ["mixed", "decodes"])
@pytest.mark.parametrize("adapted", [ALL_PROJECTIONS, ("qkv", "down")], ids=["all-adapted", "qkv-down-adapted"])
def test_lora_deltas_are_added_in_the_callback(dtype: torch.dtype, qkv_bias: bool, linear: str, step: str,
                                               adapted: tuple[str, ...], monkeypatch) -> None:
    """A step with adapters: every projection they adapt is called back and gets its delta
    there, with the loop's inputs, in the loop's order; the others stay inside C (``native``);
    the same bits. (A stand-in delta: the adapters' own arithmetic is tests/test_lora.py's,
    through the engine.)"""
    model = tiny_model(dtype, qkv_bias, linear)
    calls: dict[str, list] = {"loop": [], "c": []}
    called_back = []
    real_run_projection = CpuDecoder._run_projection
    monkeypatch.setattr(CpuDecoder, "_run_projection",
                        lambda self, layer, which: called_back.append(which) or real_run_projection(self, layer, which))

    def fake_add_lora(out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> None:
        if projection not in adapted:      # as LoRASlots.apply: nothing for an unadapted projection
            return
        calls["loop" if model.cpu_decoder is None else "c"].append((layer, projection, x.clone()))
        out += (x[:, :1].float() * 0.25 * (layer + 1) + len(projection)).to(out.dtype)

    monkeypatch.setattr(llama, "lora_batch", lambda batch: contextlib.nullcontext())
    monkeypatch.setattr(llama, "add_lora", fake_add_lora)
    monkeypatch.setattr(cpu_decoder, "add_lora", fake_add_lora)
    results = loop_and_c_results(model, step, monkeypatch, lora=StandInLoRA(adapted))
    assert_same_bits(results)
    assert [(layer, name) for layer, name, _ in calls["c"]] == [(layer, name) for layer, name, _ in calls["loop"]]
    assert len(calls["c"]) == 3 * len(adapted)
    assert all(torch.equal(x_c, x_loop) for (_, _, x_c), (_, _, x_loop) in zip(calls["c"], calls["loop"]))
    expected_calls = 3 * (len(adapted) if linear == "native" else 4)
    assert len(called_back) == expected_calls


@needs_kernel
def test_c_decoder_runs_the_step(monkeypatch) -> None:
    """The model takes the C call when it applies (the loop is not entered), with or without
    LoRA adapters in the step."""
    model = tiny_model(torch.float32, False)
    meta, tokens = step_metadata(*STEPS["mixed"])
    input_ids = torch.zeros(tokens, dtype=torch.int64)
    loops = []
    real_loop = CausalLM._decoder_fused
    monkeypatch.setattr(CausalLM, "_decoder_fused", lambda self, *args: loops.append(1) or real_loop(self, *args))
    with torch.inference_mode():
        model(input_ids, meta, caches(torch.float32))
        # A step with adapters (lora_batch / add_lora stubbed: no adapter is loaded here).
        monkeypatch.setattr(llama, "lora_batch", lambda batch: contextlib.nullcontext())
        monkeypatch.setattr(cpu_decoder, "add_lora", lambda *args: None)
        meta.lora = StandInLoRA(ALL_PROJECTIONS)
        model(input_ids, meta, caches(torch.float32))
    assert loops == []


@needs_kernel
def test_a_failing_callback_raises_and_the_next_step_runs(monkeypatch) -> None:
    """An exception in a called-back projection stops the C call and is raised from the step
    (C sees only a status); the decoder is usable afterwards."""
    model = tiny_model(torch.float32, False, "torch")
    meta, tokens = step_metadata(*STEPS["decodes"])
    input_ids = torch.zeros(tokens, dtype=torch.int64)
    down = model.model.layers[1].mlp.down_proj
    monkeypatch.setattr(down, "forward", lambda x: (_ for _ in ()).throw(ValueError("down failed")))
    with torch.inference_mode(), pytest.raises(ValueError, match="down failed"):
        model(input_ids, meta, caches(torch.float32))
    monkeypatch.undo()
    with torch.inference_mode():
        logits = model(input_ids, meta, caches(torch.float32))
    assert torch.isfinite(logits).all()


@needs_kernel
def test_a_strided_module_output_is_read_through_the_scratch(monkeypatch) -> None:
    """A called-back module whose output is not contiguous (C reads rows of a fixed stride):
    copied into the scratch, the same bits as the contiguous output."""
    model = tiny_model(torch.float32, True, "torch")
    meta, tokens = step_metadata(*STEPS["mixed"])
    input_ids = torch.randint(0, 300, (tokens,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = model(input_ids, meta, caches(torch.float32))
        for layer in model.model.layers:
            for module in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                real = module.forward
                monkeypatch.setattr(module, "forward", lambda x, real=real: real(x).t().contiguous().t())
        strided = model(input_ids, meta, caches(torch.float32))
    assert torch.equal(strided, expected)


@needs_kernel
def test_a_dropped_decoder_is_freed_at_once() -> None:
    """No reference cycle through the C callback: dropping the decoder frees it (and the caches
    and weights it holds) without waiting for the cyclic garbage collector."""
    model = tiny_model(torch.float32, False, "torch")
    meta, tokens = step_metadata(*STEPS["decodes"])
    with torch.inference_mode():
        model(torch.zeros(tokens, dtype=torch.int64), meta, caches(torch.float32))
    decoder = weakref.ref(model.cpu_decoder)
    gc.disable()
    try:
        model.cpu_decoder = None
        assert decoder() is None
    finally:
        gc.enable()


@needs_kernel
def test_c_decoder_wherever_the_c_layer_ops_run() -> None:
    model = tiny_model(torch.float32, False)
    assert model.cpu_decoder is not None and model.cpu_decoder.external_projections == 0
    model.use_fused_layer_ops(False)
    assert model.cpu_decoder is None                  # torch's small ops: the torch loop
    onednn = CausalLM(model.arch, attention_backend="cpu")
    onednn.pack_for_cpu("onednn")
    onednn.use_fused_layer_ops(True)
    assert onednn.fused_layer_ops == "c" and onednn.cpu_decoder.external_projections == 3 * 4
