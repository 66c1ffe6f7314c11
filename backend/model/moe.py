"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral): the Llama-family decoder whose
feed-forward, on its MoE layers, is a router over SwiGLU experts.

The router picks ``top_k`` experts per token (softmax, then top-k, renormalised where the
config says: ``kernels.moe.route_softmax_topk``); the experts run grouped by expert over the
packed batch (``kernels.moe``). Each expert is a module of two linear layers, gate|up fused as in
the dense MLP, so the CPU linear kernels pack them like any other projection
(``CausalLM.pack_for_cpu``); the loader maps the checkpoint's per-expert tensors onto them
(``ModelFamily.expert_weights``).
LoRA adapters apply to the attention projections only: the experts take none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.model.architecture import ModelArchitecture
from backend.model.llama import MLP, CausalLM
from kernels.moe import moe_grouped, route_softmax_topk


class Expert(nn.Module):
    """One SwiGLU expert: ``down(SiLU(gate) * up)``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        inter = self.intermediate_size
        return self.down_proj(F.silu(h[:, :inter]) * h[:, inter:])


class SparseMoE(nn.Module):
    def __init__(self, arch: ModelArchitecture, layer: int = 0) -> None:
        super().__init__()
        assert arch.moe is not None
        moe = arch.moe
        self.layer = layer
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = nn.Linear(arch.hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(arch.hidden_size, moe.intermediate_size) for _ in range(moe.num_experts))
        self.layer_ops = None   # the fused SiLU x up of dense MLPs does not apply here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_softmax_topk(self.gate(x), self.top_k, self.renormalize)
        return moe_grouped(x, weights, ids, lambda e, rows: self.experts[e](rows))


class MoECausalLM(CausalLM):
    """``CausalLM`` with a ``SparseMoE`` feed-forward on the architecture's MoE layers."""

    def graph_unsafe_reason(self) -> str | None:
        return "mixture-of-experts routing reads the chosen experts on the host: no graphs"

    def make_mlp(self, arch: ModelArchitecture, layer: int) -> nn.Module:
        return SparseMoE(arch, layer) if arch.is_moe_layer(layer) else MLP(arch, layer)
