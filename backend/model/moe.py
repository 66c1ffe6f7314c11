"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral): the Llama-family decoder whose
feed-forward, on its MoE layers, is a router over SwiGLU experts.

The router picks ``top_k`` experts per token (softmax, then top-k, renormalised where the
config says: ``kernels.moe.route_softmax_topk``); the experts run grouped by expert over the
packed batch (``kernels.moe``). Each expert is a module of two linear layers, gate|up fused as in
the dense MLP; the loader maps the checkpoint's per-expert tensors onto them
(``ModelFamily.expert_weights``). With bfloat16 weights on a CPU where our bfloat16 kernels build,
``pack_for_cpu`` stacks each layer's experts into ``PackedExperts`` and the block runs as one C
call (kernels/csrc/moe.c); otherwise each expert's projections are packed like any other
(``CausalLM.pack_for_cpu``) and run expert by expert. With the Triton attention backend (CUDA, or
the interpreter in tests) the experts are stacked and run in Triton (kernels/triton_moe.py).
LoRA adapters apply to the attention projections only: the experts take none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.model.architecture import ModelArchitecture
from backend.model.cpu_linear import pack_pairs
from backend.model.llama import MLP, CausalLM
from kernels import cpu_native
from kernels.attention_backend import AttentionBackendKind
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


class PackedExperts(nn.Module):
    """A layer's SwiGLU experts stacked in the bfloat16 kernels' packed layout, run as one call
    (kernels/csrc/moe.c: rows grouped by expert, each chosen expert's weights read once)."""

    def __init__(self, experts: nn.ModuleList) -> None:
        super().__init__()
        first = experts[0]
        self.intermediate_size = first.intermediate_size
        self.gate_up = self._stack([expert.gate_up_proj.weight for expert in experts])
        self.down = self._stack([expert.down_proj.weight for expert in experts])

    @staticmethod
    def _stack(weights: list[torch.Tensor]) -> torch.Tensor:
        # Filled expert by expert: only one expert's packed copy exists beside the stack.
        first = pack_pairs(weights[0])
        stacked = torch.empty(len(weights), *first.shape, dtype=first.dtype)
        stacked[0] = first
        for e, weight in enumerate(weights[1:], start=1):
            stacked[e] = pack_pairs(weight)
        return stacked

    @staticmethod
    def applies(experts: nn.ModuleList) -> bool:
        """bfloat16 CPU weights of even sizes (the kernel reads k in pairs), and the kernel built."""
        weight = experts[0].gate_up_proj.weight
        return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.shape[1] % 2 == 0
                and experts[0].intermediate_size % 2 == 0 and cpu_native.linear_bf16_available())

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        # The routing weights rounded to the activations' dtype first, as transformers does.
        weights = weights.to(x.dtype).float().contiguous()
        out = cpu_native.moe_bf16(rows, ids.contiguous(), weights, self.gate_up, self.down, self.intermediate_size)
        return out.view(*leading, x.shape[-1])


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
        self.packed_experts: PackedExperts | None = None    # set by pack_experts_for_cpu
        self.stacked_experts: tuple[torch.Tensor, torch.Tensor] | None = None   # set by stack_experts_for_triton

    def pack_experts_for_cpu(self) -> bool:
        """Stack the experts for the one-call kernel where it applies (``PackedExperts.applies``);
        the per-expert modules are then dropped. Returns whether it did."""
        if self.packed_experts is not None or not len(self.experts) or not PackedExperts.applies(self.experts):
            return self.packed_experts is not None
        self.packed_experts = PackedExperts(self.experts)
        self.experts = nn.ModuleList()
        return True

    def stack_experts_for_triton(self) -> None:
        """Stack the experts' weights ([experts, 2 * inter, hidden] and [experts, hidden, inter])
        for the Triton kernel (kernels/triton_moe.py); the per-expert modules are then dropped."""
        if self.stacked_experts is None and len(self.experts):
            self.stacked_experts = (torch.stack([e.gate_up_proj.weight.detach() for e in self.experts]),
                                    torch.stack([e.down_proj.weight.detach() for e in self.experts]))
            self.experts = nn.ModuleList()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_softmax_topk(self.gate(x), self.top_k, self.renormalize)
        if self.packed_experts is not None:
            return self.packed_experts(x, weights, ids)
        if self.stacked_experts is not None:
            from kernels.triton_moe import fused_moe     # imported on first use, as the Triton attention is
            return fused_moe(x, weights, ids, *self.stacked_experts)
        return moe_grouped(x, weights, ids, lambda e, rows: self.experts[e](rows))


class MoECausalLM(CausalLM):
    """``CausalLM`` with a ``SparseMoE`` feed-forward on the architecture's MoE layers."""

    def graph_unsafe_reason(self) -> str | None:
        return "mixture-of-experts routing reads the chosen experts on the host: no graphs"

    def make_mlp(self, arch: ModelArchitecture, layer: int) -> nn.Module:
        return SparseMoE(arch, layer) if arch.is_moe_layer(layer) else MLP(arch, layer)

    def _stack_experts_for_triton(self) -> None:
        """With the Triton attention backend, the experts run in Triton too (kernels/triton_moe.py),
        whether or not the family's other layer ops fuse (Qwen3-MoE's q/k norms keep them apart)."""
        if self.attention_backend.name == AttentionBackendKind.TRITON:
            for module in self.modules():
                if isinstance(module, SparseMoE):
                    module.stack_experts_for_triton()

    def use_fused_layer_ops(self, enabled: bool) -> str | None:
        self._stack_experts_for_triton()
        return super().use_fused_layer_ops(enabled)

    def pack_for_cpu(self, kind: str, onednn_batch_hint: int | None = None) -> None:
        """The experts stacked for the one-call kernel where it applies (before the other
        projections are packed, so that the experts' per-projection packing is never made); with
        the Triton backend (the interpreter on CPU), stacked for it instead."""
        self._stack_experts_for_triton()
        for module in self.modules():
            if isinstance(module, SparseMoE):
                module.pack_experts_for_cpu()
        super().pack_for_cpu(kind, onednn_batch_hint)
