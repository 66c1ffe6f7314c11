"""Mixture-of-experts feed-forward over a packed batch: routing, then the experts, grouped.

Each token row goes to ``top_k`` of ``num_experts`` SwiGLU experts and gets the weighted sum
of their outputs. The experts run grouped: the rows routed to one expert are gathered and go
through its weights in one matmul pair, so a step reads each chosen expert's weights once,
however many rows chose it. ``moe_reference`` is the specification, written as transformers
writes its MoE blocks (experts in ascending order, each output scaled by its routing weight
and added into the row), so float32 results match it to the last bit on the same BLAS.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


def route_softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, then the ``top_k`` largest (Mixtral, Qwen-MoE);
    ``renormalize``: the chosen weights rescaled to sum to 1. Returns (weights, expert ids),
    each ``[rows, top_k]``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` largest router logits, then softmax over those k alone, in the logits'
    dtype (gpt-oss; the weights sum to 1 by construction). Returns (weights, expert ids), each
    ``[rows, top_k]``."""
    top, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=top.dtype), ids


def moe_grouped(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``x`` [rows, hidden]; ``weights``/``ids`` [rows, top_k] from routing (weights cast to x's
    dtype, as transformers does); ``expert(e, rows_of_x)`` runs expert ``e`` on the rows routed
    to it, all at once. Returns [rows, hidden]."""
    out = torch.zeros_like(x)
    weights = weights.to(x.dtype)
    for e in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == e)
        h = expert(e, x[rows]) * weights[rows, slot, None]
        # A row picks an expert once: an accumulating put adds exactly as index_add_ would, and
        # index_add_'s CPU kernel opens a parallel region per call, which on a few rows can cost
        # more than the expert itself when the cores are busy.
        out.index_put_((rows,), h.to(x.dtype), accumulate=True)
    return out


def swiglu_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: ``gate_up`` [2 * inter, hidden] (gate rows first), ``down`` [hidden, inter]."""
    h = F.linear(x, gate_up)
    inter = down.shape[-1]
    return F.linear(F.silu(h[:, :inter]) * h[:, inter:], down)


def moe_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """``moe_grouped`` over stacked experts: ``gate_up`` [experts, 2 * inter, hidden], ``down``
    [experts, hidden, inter]."""
    return moe_grouped(x, weights, ids, lambda e, rows: swiglu_expert(rows, gate_up[e], down[e]))


def moe_reference_bf16(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                       down: torch.Tensor) -> torch.Tensor:
    """What kernels/csrc/moe.c computes from bfloat16 operands, spelled out in float32 with its
    roundings: gate|up rounded to bfloat16, SiLU rounded, its product with up rounded (the
    dense MLP's ``silu_and_mul``), the down projection kept in float32, each row's expert outputs
    times their weights summed in float32 in ascending expert order and rounded once. ``x``
    [rows, hidden], ``gate_up`` [experts, 2 * inter, hidden], ``down`` [experts, hidden, inter],
    all bfloat16; ``weights`` float32 [rows, top_k]. Returns bfloat16 [rows, hidden]."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = down.shape[-1]
    for e in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == e)
        h = F.linear(x[rows].float(), gate_up[e].float()).bfloat16().float()
        act = (F.silu(h[:, :inter]).bfloat16().float() * h[:, inter:]).bfloat16().float()
        y = F.linear(act, down[e].float())
        out.index_put_((rows,), y * weights[rows, slot, None].float(), accumulate=True)
    return out.bfloat16()
