"""A mixture-of-experts block in Triton (CUDA; the interpreter in tests): the fast path of
``kernels.moe.moe_reference`` for stacked experts.

The (row, choice) assignments of a step are sorted by expert and each expert's run is padded
to a multiple of ``BLOCK_M`` (``align_by_expert``: torch operations on the device). One launch of
``_grouped_matmul_kernel`` then multiplies every block of ``BLOCK_M`` assignments by its
expert's weights (one program per block of assignments and block of output columns): a step
reads each chosen expert's weights once per block of its rows, however the rows are spread
over the batch. Per layer: gate|up from the rows of x (bfloat16 out), SiLU x up in place
(``triton_layer_ops.silu_and_mul``), down from those activations (float32 out, scaled by each
assignment's routing weight), then each row's ``top_k`` outputs summed in float32 and rounded
once.

The grid is sized for the worst case (every active expert's run padded), and a program past
the padded total exits at once, so nothing is read back to the host between routing and the
output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_attention import KernelLaunch
from kernels.triton_layer_ops import silu_and_mul

BLOCK_N, BLOCK_K = 64, 64
SMALL_BLOCK_M, LARGE_BLOCK_M = 16, 64   # assignments per block: a decode step's few rows per expert; prefill


@triton.jit
def _grouped_matmul_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, padded_total_ptr, route_weight_ptr,
    num_assignments, n, k, stride_a_row, stride_w_expert, stride_w_n, stride_out_row,
    ROWS_PER_A_ROW: tl.constexpr, MUL_ROUTE_WEIGHT: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[a, cols] = a_rows[a // ROWS_PER_A_ROW] @ w[expert of a].T (x route_weight[a]) for the
    block of sorted assignments ``program_id(0)`` and the output columns ``program_id(1)``."""
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(padded_total_ptr):
        return   # past every expert's padded run: the grid is sized for the worst case
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_ids_ptr + slots).to(tl.int64)
    valid = assignment < num_assignments          # padding carries num_assignments
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    a_rows = assignment // ROWS_PER_A_ROW
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, k, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        k_valid = ks < k
        a = tl.load(a_ptr + a_rows[:, None] * stride_a_row + ks[None, :], mask=valid[:, None] & k_valid[None, :],
                    other=0.0)
        w = tl.load(w_ptr + expert * stride_w_expert + cols[None, :] * stride_w_n + ks[:, None],
                    mask=col_valid[None, :] & k_valid[:, None], other=0.0)
        if DOT_IN_FP32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if MUL_ROUTE_WEIGHT:
        acc = acc * tl.load(route_weight_ptr + assignment, mask=valid, other=0.0)[:, None]
    tl.store(out_ptr + assignment[:, None] * stride_out_row + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & col_valid[None, :])


@dataclass(frozen=True)
class ExpertAlignment:
    """The step's assignments (row * top_k + choice) in expert order, each expert's run padded to
    ``block_m`` with ``num_assignments``; ``block_expert[b]`` is block b's expert;
    ``padded_total`` ([1], on the device) where the padded runs end."""
    sorted_ids: torch.Tensor      # int32 [num_blocks * block_m]
    block_expert: torch.Tensor    # int32 [num_blocks]
    padded_total: torch.Tensor    # int64 [1]
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def block_m_for(num_assignments: int, num_experts: int) -> int:
    """Blocks of 16 assignments while an expert averages that few rows (decode), 64 beyond."""
    return SMALL_BLOCK_M if num_assignments <= SMALL_BLOCK_M * num_experts else LARGE_BLOCK_M


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertAlignment:
    """Sort ``ids`` [rows, top_k]'s assignments by expert (stable: rows ascending within an
    expert) and pad each expert's run to a multiple of ``block_m``, on ``ids``' device with no
    host sync; the buffers are sized for every active expert padded."""
    flat = ids.reshape(-1).long()
    num_assignments, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(num_assignments, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of]
    capacity = triton.cdiv(num_assignments + min(num_experts, num_assignments) * (block_m - 1), block_m) * block_m
    sorted_ids = torch.full((capacity,), num_assignments, dtype=torch.int32, device=device)
    sorted_ids[(padded_end - padded)[expert_of] + rank] = order.int()
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertAlignment(sorted_ids, block_expert.int(), padded_end[-1:], block_m)


def grouped_matmul_launch(a: torch.Tensor, rows_per_a_row: int, w: torch.Tensor, out: torch.Tensor,
                          alignment: ExpertAlignment, route_weights: torch.Tensor | None = None) -> KernelLaunch:
    """``out[i] = a[i // rows_per_a_row] @ w[expert of i].T`` for every assignment i
    (x ``route_weights[i]`` where given): ``a`` [.., k] and ``w`` [experts, n, k] with unit
    column stride, ``out`` [assignments, n]."""
    num_experts, n, k = w.shape
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1 and a.shape[1] == k
    dot_in_fp32 = a.dtype == torch.float32 or a.device.type == "cpu"   # as triton_attention._dot_in_fp32 says
    return KernelLaunch(
        _grouped_matmul_kernel, (alignment.num_blocks, triton.cdiv(n, BLOCK_N)),
        (a, w, out, alignment.sorted_ids, alignment.block_expert, alignment.padded_total,
         route_weights if route_weights is not None else out, out.shape[0], n, k, a.stride(0), w.stride(0),
         w.stride(1), out.stride(0)),
        dict(ROWS_PER_A_ROW=rows_per_a_row, MUL_ROUTE_WEIGHT=route_weights is not None, DOT_IN_FP32=dot_in_fp32,
             BLOCK_M=alignment.block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K),
        dict(num_warps=4))


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor) -> torch.Tensor:
    """Drop-in for ``kernels.moe.moe_reference``: ``x`` [rows, hidden], routing ``weights`` and
    ``ids`` [rows, top_k], ``gate_up`` [experts, 2 * inter, hidden] (gate rows first), ``down``
    [experts, hidden, inter]. Returns [rows, hidden] in x's dtype."""
    rows, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    num_assignments = rows * top_k
    if rows == 0:
        return torch.empty_like(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    alignment = align_by_expert(ids, num_experts, block_m_for(num_assignments, num_experts))
    h = torch.empty(num_assignments, two_inter, dtype=x.dtype, device=x.device)
    grouped_matmul_launch(x, top_k, gate_up, h, alignment)()
    silu_and_mul(h, inter)      # the gate half of each row becomes the down projection's input
    # The routing weights rounded to the activations' dtype first, as transformers does.
    route_weights = weights.to(x.dtype).float().reshape(-1).contiguous()
    y = torch.empty(num_assignments, hidden, dtype=torch.float32, device=x.device)
    grouped_matmul_launch(h[:, :inter], 1, down, y, alignment, route_weights)()
    return y.view(rows, top_k, hidden).sum(dim=1).to(x.dtype)
