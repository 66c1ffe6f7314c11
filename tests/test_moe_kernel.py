"""The one-call mixture-of-experts block for bfloat16 on CPU (kernels/csrc/moe.c) against its
specification, ``kernels.moe.moe_reference_bf16`` (the same roundings in float32 torch; only
the matmuls' summation order differs), in every version of the bfloat16 kernels this CPU runs;
and the model's packed experts against the expert-by-expert path they replace."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest
import torch

from backend.model.architecture import ModelArchitecture
from backend.model.cpu_linear import pack_pairs
from backend.model.moe import PackedExperts, SparseMoE
from kernels import cpu_native
from kernels.moe import moe_reference, moe_reference_bf16, route_softmax_topk
from tests.test_linear_bf16 import bf16_kernel, bf16_library  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("fp16_matmuls_off")   # see tests/conftest.py


def packed(weights: torch.Tensor) -> torch.Tensor:
    return torch.stack([pack_pairs(w) for w in weights])


def case(rows: int, hidden: int, inter: int, experts: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).bfloat16()
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).bfloat16()
    # Router logits leaning towards the first experts: some experts get many rows, some none.
    logits = torch.randn(rows, experts, generator=gen) - torch.arange(experts) * 0.3
    weights, ids = route_softmax_topk(logits, top_k, renormalize=True)
    return x, weights.bfloat16().float().contiguous(), ids.contiguous(), gate_up, down


def assert_matches_spec(got: torch.Tensor, x, weights, ids, gate_up, down) -> None:
    """Within a bfloat16 unit or two of the specification: the intermediates are rounded to
    bfloat16, so a matmul summed in another order can round one of them the other way."""
    expected = moe_reference_bf16(x, weights, ids, gate_up, down).float()
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, atol=2 ** -6 * scale, rtol=2 ** -6)
    # and the float32 mathematics it rounds (kernels.moe.moe_reference on the widened operands)
    exact = moe_reference(x.float(), weights, ids, gate_up.float(), down.float())
    torch.testing.assert_close(got.float(), exact, atol=2 ** -4 * scale, rtol=2 ** -4)


# Rows: a decode step's few per expert (1 tile of all rows), over 16 rows for one expert (tiles of
# 8 x 3 panels), a prefill chunk; sizes: partial panels (hidden 40, 2 * inter 72), one panel;
# top_k from 1 to 8; experts left with no rows (the leaning router).
@pytest.mark.parametrize("rows,hidden,inter,experts,top_k", [
    (1, 64, 32, 8, 2), (3, 40, 36, 4, 1), (16, 128, 96, 8, 2), (17, 64, 48, 2, 2), (40, 256, 80, 16, 4),
    (300, 64, 48, 4, 2), (9, 32, 8, 16, 8)])
def test_kernel_matches_its_specification(bf16_library: ctypes.CDLL, rows: int, hidden: int, inter: int,
                                          experts: int, top_k: int) -> None:
    x, weights, ids, gate_up, down = case(rows, hidden, inter, experts, top_k, seed=rows * hidden + top_k)
    got = cpu_native.moe_bf16(x, ids, weights, packed(gate_up), packed(down), inter, library=bf16_library)
    assert_matches_spec(got, x, weights, ids, gate_up, down)


@pytest.mark.parametrize("threads", [1, 3])
def test_kernel_on_any_thread_count(bf16_kernel, threads: int) -> None:
    """The (expert, panel) work is shared out in stretches that end mid-expert."""
    x, weights, ids, gate_up, down = case(21, 64, 40, 6, 2, seed=threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_native.moe_bf16(x, ids, weights, packed(gate_up), packed(down), 40)
    finally:
        torch.set_num_threads(before)
    assert_matches_spec(got, x, weights, ids, gate_up, down)


def test_kernel_rows_from_a_wider_tensor(bf16_kernel) -> None:
    """x read with its row stride (a view of a wider activation buffer)."""
    x, weights, ids, gate_up, down = case(5, 32, 16, 4, 2, seed=7)
    storage = torch.full((5, 40), float("nan")).bfloat16()
    storage[:, 4:36] = x
    got = cpu_native.moe_bf16(storage[:, 4:36], ids, weights, packed(gate_up), packed(down), 16)
    assert_matches_spec(got, x, weights, ids, gate_up, down)


def test_kernel_refuses_an_expert_id_out_of_range(bf16_kernel) -> None:
    x, weights, ids, gate_up, down = case(4, 32, 16, 4, 2, seed=8)
    ids[2, 1] = 4
    with pytest.raises(RuntimeError, match="expert id out of range"):
        cpu_native.moe_bf16(x, ids, weights, packed(gate_up), packed(down), 16)


def moe_block(tmp_path: Path, hidden: int = 64, inter: int = 48, experts: int = 8, top_k: int = 2) -> SparseMoE:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "hidden_size": hidden, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": inter,
        "num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": True, "vocab_size": 100,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 64}))
    torch.manual_seed(3)
    block = SparseMoE(ModelArchitecture.from_folder(tmp_path))
    for p in block.parameters():
        torch.nn.init.normal_(p, std=hidden ** -0.5)
    return block.bfloat16()


def test_packed_experts_replace_the_expert_by_expert_path(bf16_kernel, tmp_path: Path) -> None:
    block = moe_block(tmp_path)
    x = torch.randn(22, 64).bfloat16()   # a packed batch's rows
    with torch.no_grad():
        expected = block(x)
        gate_up = torch.stack([e.gate_up_proj.weight for e in block.experts])
        down = torch.stack([e.down_proj.weight for e in block.experts])
        assert block.pack_experts_for_cpu()
        assert isinstance(block.packed_experts, PackedExperts) and len(block.experts) == 0
        got = block(x)
        weights, ids = route_softmax_topk(block.gate(x), 2, True)
    assert got.shape == expected.shape
    assert_matches_spec(got, x, weights.bfloat16().float(), ids, gate_up, down)
    # and within bfloat16's reach of what transformers' order of roundings gives
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected.float(), atol=2 ** -5 * scale, rtol=2 ** -5)


def test_float32_experts_stay_expert_by_expert(tmp_path: Path) -> None:
    block = moe_block(tmp_path).float()
    assert not block.pack_experts_for_cpu()
    assert block.packed_experts is None and len(block.experts) == 8
