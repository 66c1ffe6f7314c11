"""gpt-oss (``model_type`` gpt_oss), as transformers' ``GptOssForCausalLM`` computes it, over the
Llama decoder's packed batch and paged KV cache.

What differs from Llama (backend/model/llama.py):

- attention: biases on q/k/v (fused as Llama's) and on o_proj; one learned sink logit per query
  head (``self_attn.sinks``) in every row's softmax denominator, passed to the attention
  backend (``AttentionBackend.attend``'s ``sinks``: in the reference, the Triton kernel and
  the CPU C kernels);
- windowed and full layers alternating as config.json's ``layer_types`` says (without it, as
  transformers: even layers windowed), the KV cache shared as for any mix of windows;
- YaRN RoPE (``rope_type`` yarn: ``yarn_inverse_frequencies``, cos and sin scaled by its
  attention factor), computed as any family's;
- every layer's feed-forward an MoE (``GptOssMoE``): a router with a bias, top-k of its logits
  then softmax over those k (``kernels.moe.route_topk_softmax``), experts with biases and a
  clamped SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, l)``;
- the checkpoint keeps each layer's experts stacked, ``gate_up_proj`` ``[experts, hidden,
  2 * inter]`` with gate and up interleaved (even columns gate, odd up) and ``down_proj``
  ``[experts, inter, hidden]``, plus their biases: ``GptOssCausalLM.remap_checkpoint`` (the
  loader's hook) turns them into our per-expert ``nn.Linear`` weights (transposed, gate rows
  then up rows), so the CPU linear kernels pack them like any projection.

The fused layer ops (residual add + RMSNorm, RoPE + K/V write) apply as on Llama: attention
and the MoE still run their own modules (o_proj's bias and the sinks included). The C layer
loop declines the model (``cpu_decoder.unsupported_reason``: MoE layers, sinks). MXFP4
checkpoints (the published ones) are refused at load (``refuse_quantized_checkpoint``).
LoRA adapters apply to the attention projections; the experts and router take none.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from backend.model.architecture import ModelArchitecture
from backend.model.llama import Attention, CausalLM
from kernels.attention_backend import AttentionBackend
from kernels.moe import moe_grouped, route_topk_softmax


class GptOssAttention(Attention):
    """Llama's attention with a bias on o_proj (config.json's ``attention_bias``, as on q/k/v)
    and the per-head sinks (``Attention.forward`` hands them to the backend)."""

    def __init__(self, arch: ModelArchitecture, attention_backend: AttentionBackend, layer: int) -> None:
        super().__init__(arch, attention_backend, layer)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=arch.qkv_bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))


class GptOssExpert(nn.Module):
    """One expert: ``down((clamp(up, -l, l) + 1) * g * sigmoid(alpha * g))``, ``g = min(gate, l)``,
    gate|up fused (gate rows first) as in the dense MLP, both projections with biases."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float, alpha: float) -> None:
        super().__init__()
        self.intermediate_size, self.limit, self.alpha = intermediate_size, limit, alpha
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=True)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        inter = self.intermediate_size
        # transformers' order of operations (GptOssExperts._apply_gate).
        gate = h[:, :inter].clamp(max=self.limit)
        up = h[:, inter:].clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))


class GptOssMoE(nn.Module):
    """Router (weight and bias) -> top-k logits -> softmax over the k -> the chosen experts,
    grouped by expert over the packed batch (``kernels.moe.moe_grouped``)."""

    def __init__(self, arch: ModelArchitecture, layer: int = 0) -> None:
        super().__init__()
        assert arch.moe is not None
        moe = arch.moe
        self.layer = layer
        self.top_k = moe.top_k
        self.router = nn.Linear(arch.hidden_size, moe.num_experts, bias=True)
        self.experts = nn.ModuleList(GptOssExpert(arch.hidden_size, moe.intermediate_size, moe.swiglu_limit,
                                                  moe.swiglu_alpha) for _ in range(moe.num_experts))
        self.layer_ops = None   # the fused SiLU x up of dense MLPs does not apply here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk_softmax(self.router(x), self.top_k)
        return moe_grouped(x, weights, ids, lambda e, rows: self.experts[e](rows))


# The checkpoint's stacked expert tensors: model.layers.N.mlp.experts.<name>.
_STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")


class GptOssCausalLM(CausalLM):
    """``CausalLM`` with gpt-oss's attention (o_proj bias, sinks) on every layer and its MoE as
    every feed-forward."""

    def __init__(self, arch: ModelArchitecture, attention_backend: AttentionBackend | str = "reference") -> None:
        if arch.moe is None:
            raise ValueError("gpt_oss: config.json names no experts (num_local_experts)")
        super().__init__(arch, attention_backend)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = GptOssAttention(arch, self.attention_backend, i)

    def graph_unsafe_reason(self) -> str | None:
        return "mixture-of-experts routing reads the chosen experts on the host: no graphs"

    def make_mlp(self, arch: ModelArchitecture, layer: int) -> nn.Module:
        return GptOssMoE(arch, layer)

    @staticmethod
    def remap_checkpoint(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors with each layer's stacked experts split into our per-expert
        projections (the loader's hook, before its name mapping): ``gate_up_proj`` ``[E, hidden,
        2 * inter]`` (gate and up interleaved by column) -> ``experts.e.gate_up_proj.weight``
        ``[2 * inter, hidden]`` (gate rows, then up rows) and its bias likewise;
        ``down_proj`` ``[E, inter, hidden]`` -> ``experts.e.down_proj.weight`` ``[hidden, inter]``;
        ``down_proj_bias`` ``[E, hidden]`` -> ``experts.e.down_proj.bias``. Other tensors pass as
        they are."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            match = _STACKED_EXPERTS.match(name)
            if match is None:
                out[name] = tensor
                continue
            prefix, which, bias = match.groups()
            for e, expert in enumerate(tensor.unbind(0)):
                if which == "gate_up_proj":
                    # De-interleave the last dim: even entries gate, odd up.
                    expert = torch.cat((expert[..., ::2], expert[..., 1::2]), dim=-1)
                if not bias:
                    expert = expert.t()             # [in, out] -> nn.Linear's [out, in]
                out[f"{prefix}.{e}.{which}.{'bias' if bias else 'weight'}"] = expert.contiguous()
        return out
