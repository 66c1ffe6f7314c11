"""Triton kernels for LoRA over a packed batch: the fast path of ``lora_shrink_reference`` /
``lora_expand_reference`` (kernels/reference.py holds the layout and the semantics).

The shrink/expand pair of punica's BGMV: one program per (token row, block of output
columns) reads its row's slot from ``slot_ids`` and multiplies by that slot's matrix, so one
launch serves every adapter of the step and the rows of none (slot -1: the program exits at
once, as do those past their adapter's rank: the stacks are padded to the largest
rank, ``slot_ranks`` says each slot's). Nothing depends on which adapters a step holds but the device tensors, so a CUDA
graph captured once replays for any mix: the runner only rewrites ``slot_ids``, and loading
an adapter writes its weights into a slot of the same stacked tensors.

The shrink keeps ``y`` in float32 (``[num_tokens, max_rank]``); the expand adds ``y @ B`` in
float32 to the output row and rounds once. Token rows of one adapter each read its matrices
(from L2 after the first): a long prefill would gain from SGMV's tiling of a segment's rows
into one matrix product, which is left for when a GPU profile says so.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_attention import KernelLaunch

SHRINK_BLOCK_R, SHRINK_BLOCK_K = 16, 128
EXPAND_BLOCK_R, EXPAND_BLOCK_N = 16, 128


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, slot_ptr, rank_ptr, y_ptr, in_features,
    stride_x_token, stride_a_slot, stride_a_rank, stride_y_token,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return  # no adapter: the expand skips this row too
    rank = tl.load(rank_ptr + slot)
    first = tl.program_id(1) * BLOCK_R
    if first >= rank:
        return  # past this adapter's rank (the stacks are padded to the largest)
    ranks = first + tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token * stride_x_token + ks, mask=ks < in_features, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_a_slot + ranks[:, None] * stride_a_rank + ks[None, :],
                    mask=(ranks[:, None] < rank) & (ks[None, :] < in_features), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(y_ptr + token * stride_y_token + ranks, acc, mask=ranks < rank)


@triton.jit
def _lora_expand_kernel(
    y_ptr, b_ptr, slot_ptr, rank_ptr, out_ptr, out_features,
    stride_y_token, stride_b_slot, stride_b_rank, stride_out_token,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    rank = tl.load(rank_ptr + slot)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r_start in range(0, rank, BLOCK_R):
        ranks = r_start + tl.arange(0, BLOCK_R)
        y = tl.load(y_ptr + token * stride_y_token + ranks, mask=ranks < rank, other=0.0)
        b = tl.load(b_ptr + slot * stride_b_slot + ranks[:, None] * stride_b_rank + cols[None, :],
                    mask=(ranks[:, None] < rank) & (cols[None, :] < out_features), other=0.0).to(tl.float32)
        acc += tl.sum(y[:, None] * b, axis=0)
    out_row = out_ptr + token * stride_out_token + cols
    previous = tl.load(out_row, mask=cols < out_features, other=0.0).to(tl.float32)
    tl.store(out_row, (previous + acc).to(out_ptr.dtype.element_ty), mask=cols < out_features)


def shrink_launch(x: torch.Tensor, a_stack: torch.Tensor, slot_ids: torch.Tensor, slot_ranks: torch.Tensor,
                  y: torch.Tensor) -> KernelLaunch:
    num_tokens, in_features = x.shape
    assert x.stride(1) == 1 and a_stack.stride(2) == 1 and y.stride(1) == 1 and y.dtype == torch.float32
    return KernelLaunch(_lora_shrink_kernel, (num_tokens, triton.cdiv(a_stack.shape[1], SHRINK_BLOCK_R)),
                        (x, a_stack, slot_ids, slot_ranks, y, in_features,
                         x.stride(0), a_stack.stride(0), a_stack.stride(1), y.stride(0)),
                        dict(BLOCK_R=SHRINK_BLOCK_R, BLOCK_K=SHRINK_BLOCK_K))


def expand_launch(y: torch.Tensor, b_stack: torch.Tensor, slot_ids: torch.Tensor, slot_ranks: torch.Tensor,
                  out: torch.Tensor) -> KernelLaunch:
    num_tokens, out_features = out.shape
    assert out.stride(1) == 1 and b_stack.stride(2) == 1 and y.stride(1) == 1
    return KernelLaunch(_lora_expand_kernel, (num_tokens, triton.cdiv(out_features, EXPAND_BLOCK_N)),
                        (y, b_stack, slot_ids, slot_ranks, out, out_features,
                         y.stride(0), b_stack.stride(0), b_stack.stride(1), out.stride(0)),
                        dict(BLOCK_R=EXPAND_BLOCK_R, BLOCK_N=EXPAND_BLOCK_N))


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, slot_ids: torch.Tensor, slot_ranks: torch.Tensor,
                y: torch.Tensor | None = None) -> torch.Tensor:
    """``y[t] = a_stack[slot_ids[t]] @ x[t]`` (float32 ``[num_tokens, max_rank]``): only the first
    ``slot_ranks[s]`` (int32 per slot) columns of a row of slot ``s`` are written, none of a row
    of slot -1. ``x`` needs unit column stride; ``y`` may be a preallocated buffer."""
    if y is None:
        y = torch.empty(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        shrink_launch(x, a_stack, slot_ids, slot_ranks, y)()
    return y


def lora_expand(y: torch.Tensor, b_stack: torch.Tensor, slot_ids: torch.Tensor, slot_ranks: torch.Tensor,
                out: torch.Tensor) -> None:
    """``out[t] += y[t, :r] @ b_stack[s, :r]`` in place for rows with a slot ``s``, ``r =
    slot_ranks[s]`` (the rows past it are zero padding)."""
    if out.shape[0]:
        expand_launch(y, b_stack, slot_ids, slot_ranks, out)()
