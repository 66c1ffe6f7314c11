"""Mixture-of-experts feed-forward over a packed batch: routing, then the experts, grouped.

Each token row goes to ``top_k`` of ``num_experts`` SwiGLU experts and gets the weighted sum
of their outputs. The experts run grouped: the rows routed to one expert are gathered and go
through its weights in one matmul pair, so a step reads each chosen expert's weights once,
however many rows chose it. ``moe_reference`` is the specification, written as transformers
writes its MoE blocks (experts in ascending order, each output scaled by its routing weight
and added into the row), so float32 results match it to the last bit on the same BLAS.
"""

from __future__ import annotations

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


def moe_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, hidden]; ``weights``/``ids`` [rows, top_k] from routing (weights cast to x's
    dtype, as transformers does); ``gate_up`` [experts, 2 * inter, hidden] (gate rows first);
    ``down`` [experts, hidden, inter]. Returns [rows, hidden]."""
    out = torch.zeros_like(x)
    weights = weights.to(x.dtype)
    inter = down.shape[-1]
    for expert in torch.unique(ids).tolist():
        rows, slot = torch.where(ids == expert)
        h = F.linear(x[rows], gate_up[expert])
        h = F.silu(h[:, :inter]) * h[:, inter:]
        h = F.linear(h, down[expert]) * weights[rows, slot, None]
        out.index_add_(0, rows, h.to(x.dtype))
    return out
