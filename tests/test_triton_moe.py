"""The Triton mixture-of-experts block (kernels/triton_moe.py) against ``kernels.moe``'s
reference: the alignment of assignments by expert, and the block's output in float32 and
bfloat16 over decode-sized and prefill-sized steps (the interpreter on CPU, tests/conftest.py;
the compiled kernel where CUDA is)."""

from __future__ import annotations

import pytest
import torch

from kernels.moe import moe_reference, route_softmax_topk
from kernels.triton_moe import LARGE_BLOCK_M, SMALL_BLOCK_M, align_by_expert, block_m_for, fused_moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routed(rows: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Leaning towards the first experts: uneven runs, and experts with no rows.
    logits = torch.randn(rows, experts, generator=gen) - torch.arange(experts) * 0.4
    weights, ids = route_softmax_topk(logits, top_k, renormalize=True)
    return weights, ids


@pytest.mark.parametrize("rows,experts,top_k,block_m", [(1, 8, 2, 16), (13, 6, 3, 16), (70, 4, 2, 64), (5, 32, 4, 16)])
def test_alignment_sorts_and_pads_each_expert_run(rows: int, experts: int, top_k: int, block_m: int) -> None:
    _, ids = routed(rows, experts, top_k, seed=rows)
    alignment = align_by_expert(ids, experts, block_m)
    flat = ids.reshape(-1)
    sorted_ids = alignment.sorted_ids.tolist()
    total = int(alignment.padded_total)
    assert total % block_m == 0 and len(sorted_ids) >= total
    assert all(a == flat.numel() for a in sorted_ids[total:]), "past the padded total: padding only"
    real = [a for a in sorted_ids[:total] if a < flat.numel()]
    assert sorted(real) == list(range(flat.numel())), "every assignment exactly once"
    for block in range(total // block_m):
        expert = int(alignment.block_expert[block])
        members = [a for a in sorted_ids[block * block_m:(block + 1) * block_m] if a < flat.numel()]
        assert members, "no block is padding alone"
        assert all(int(flat[a]) == expert for a in members)
        assert members == sorted(members), "rows ascending within an expert"
    counts = torch.bincount(flat, minlength=experts)
    assert total == int(((counts + block_m - 1) // block_m * block_m).sum())


def case(rows: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    weights, ids = routed(rows, experts, top_k, seed)
    return [t.to(dtype).to(DEVICE) for t in (x, gate_up, down)] + [weights.to(DEVICE), ids.to(DEVICE)]


# Decode-sized steps (blocks of 16 assignments) and a prefill-sized one (blocks of 64), sizes not a
# multiple of the 64-wide column and k blocks, top_k 1 to 4.
SHAPES = [(1, 64, 32, 8, 2), (6, 40, 24, 4, 1), (11, 96, 80, 8, 4), (200, 32, 48, 4, 2)]


@pytest.mark.parametrize("rows,hidden,inter,experts,top_k", SHAPES)
def test_float32_matches_the_reference(rows: int, hidden: int, inter: int, experts: int, top_k: int) -> None:
    x, gate_up, down, weights, ids = case(rows, hidden, inter, experts, top_k, torch.float32, seed=rows + hidden)
    got = fused_moe(x, weights, ids, gate_up, down)
    expected = moe_reference(x, weights, ids, gate_up, down)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,hidden,inter,experts,top_k", SHAPES[:3])
def test_bfloat16_within_rounding_of_float32(rows: int, hidden: int, inter: int, experts: int, top_k: int) -> None:
    x, gate_up, down, weights, ids = case(rows, hidden, inter, experts, top_k, torch.bfloat16, seed=rows)
    got = fused_moe(x, weights, ids, gate_up, down)
    assert got.dtype == torch.bfloat16
    exact = moe_reference(x.float(), weights, ids, gate_up.float(), down.float())
    scale = exact.abs().max().item()
    torch.testing.assert_close(got.float(), exact, atol=2 ** -5 * scale, rtol=2 ** -5)


def test_block_size_follows_rows_per_expert() -> None:
    assert block_m_for(16 * 4, 32) == SMALL_BLOCK_M      # a decode step: 2 rows an expert
    assert block_m_for(512 * 8, 32) == LARGE_BLOCK_M     # a prefill chunk: 128 an expert


def test_empty_step() -> None:
    x, gate_up, down, weights, ids = case(0, 32, 16, 4, 2, torch.float32, seed=0)
    assert fused_moe(x, weights, ids, gate_up, down).shape == (0, 32)
