"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral): the Llama-family decoder whose
feed-forward, on its MoE layers, is a router over SwiGLU experts.

The router picks ``top_k`` experts per token (softmax, then top-k, renormalised where the
config says: ``kernels.moe.route_softmax_topk``); the experts run grouped by expert over the
packed batch (``kernels.moe``). Expert weights are stacked parameters, ``experts_gate_up``
``[experts, 2 * inter, hidden]`` and ``experts_down`` ``[experts, hidden, inter]``; the loader
stacks the checkpoint's per-expert tensors into them (``ModelFamily.expert_weights``).
LoRA adapters apply to the attention projections only: the experts take none.
"""

from __future__ import annotations

import torch
from torch import nn

from backend.model.architecture import ModelArchitecture
from backend.model.llama import MLP, CausalLM
from kernels.moe import moe_reference, route_softmax_topk


class SparseMoE(nn.Module):
    def __init__(self, arch: ModelArchitecture, layer: int = 0) -> None:
        super().__init__()
        assert arch.moe is not None
        moe = arch.moe
        self.layer = layer
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = nn.Linear(arch.hidden_size, moe.num_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, arch.hidden_size))
        self.experts_down = nn.Parameter(torch.empty(moe.num_experts, arch.hidden_size, moe.intermediate_size))
        self.layer_ops = None   # the fused SiLU x up of dense MLPs does not apply here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_softmax_topk(self.gate(x), self.top_k, self.renormalize)
        return moe_reference(x, weights, ids, self.experts_gate_up, self.experts_down)


class MoECausalLM(CausalLM):
    """``CausalLM`` with a ``SparseMoE`` feed-forward on the architecture's MoE layers."""

    def make_mlp(self, arch: ModelArchitecture, layer: int) -> nn.Module:
        return SparseMoE(arch, layer) if arch.is_moe_layer(layer) else MLP(arch, layer)
