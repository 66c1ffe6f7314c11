"""Gemma 2's and Gemma 3's text decoders (``model_type`` gemma2, gemma3_text), as transformers'
``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM`` compute them, over the Llama decoder's packed
batch and paged KV cache.

What differs from Llama (backend/model/llama.py), each switch read from config.json into the
architecture (backend/model/architecture.py):

- embeddings times sqrt(hidden_size), the factor first rounded to the weights' dtype;
- RMSNorm scaling by (1 + w), normalised and scaled in float32 and cast once
  (``GemmaRMSNorm``); four a layer: before and after attention, before and after the MLP (the
  "after" ones on the branch, before its residual add), and (Gemma 3) one on each q and k head;
- attention scaled by ``query_pre_attn_scalar ** -0.5`` (``Attention.scale``), its scores
  soft-capped where ``attn_logit_softcapping`` is set (Gemma 2: softcap * tanh(s / softcap),
  in every attention backend);
- GeGLU: ``down(gelu_tanh(gate) * up)`` on our fused gate|up projection;
- windowed layers (``layer_types``; Gemma 3: 5 local : 1 global by default, Gemma 2: every
  other layer); Gemma 3's rotate with their own RoPE base (``rope_local_base_freq``, default
  RoPE), the global ones with ``rope_theta`` and any scaling; cos/sin computed once a step for
  each kind;
- ``final_logit_softcapping``: logits := tanh(logits / c) * c;
- the head tied to the embeddings (transformers' default for the family).

The fused C/Triton layer ops and the C layer loop assume Llama's layer: this model always runs
the torch ops (``use_fused_layer_ops`` returns None); attention still goes through the model's
attention backend (reference, CPU C kernels, Triton), windows included. LoRA adapters on
q/k/v/o and gate/up/down apply as on Llama (the projections are named alike).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.lora.batch import add_lora
from backend.model.architecture import ModelArchitecture
from backend.model.llama import MLP, Attention, AttentionMetadata, CausalLM, RMSNorm, rope_inverse_frequencies
from kernels.attention_backend import AttentionBackend


class GemmaRMSNorm(RMSNorm):
    """``x * rsqrt(mean(x^2) + eps) * (offset + w)``: the weight is the checkpoint's own ``w``
    (Gemma's norms scale by 1 + w). In float32 the one fused op (the same arithmetic); in
    bfloat16 normalised and scaled in float32 and rounded once, as transformers'
    ``Gemma3RMSNorm`` does (Llama's rounds the normalised x first, then multiplies)."""

    def __init__(self, size: int, eps: float, offset: float) -> None:
        super().__init__(size, eps)
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight.float() + self.offset
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, scale, self.eps)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * scale).to(x.dtype)


class GemmaAttention(Attention):
    """Llama's attention with Gemma's q/k norms where the family has them (Gemma 3); its scale
    (query_pre_attn_scalar), window and soft-cap come from the architecture as for any family."""

    def __init__(self, arch: ModelArchitecture, attention_backend: AttentionBackend, layer: int) -> None:
        super().__init__(arch, attention_backend, layer)
        if arch.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, arch.rms_norm_eps, arch.norm_weight_offset)
            self.k_norm = GemmaRMSNorm(self.head_dim, arch.rms_norm_eps, arch.norm_weight_offset)


class GeGLUMLP(MLP):
    """``down(gelu_tanh(gate) * up)`` (``hidden_activation`` gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        add_lora(gate_up, x, self.layer, "gate_up")
        gate, up = gate_up[..., :self.intermediate_size], gate_up[..., self.intermediate_size:]
        act = F.gelu(gate, approximate="tanh").mul_(up)
        out = self.down_proj(act)
        add_lora(out, act, self.layer, "down")
        return out


class GemmaDecoderLayer(nn.Module):
    """transformers' parameter names: the checkpoint maps as Llama's (q/k/v and gate/up fused)."""

    def __init__(self, arch: ModelArchitecture, attention_backend: AttentionBackend, layer: int) -> None:
        super().__init__()

        def norm() -> GemmaRMSNorm:
            return GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_weight_offset)

        self.input_layernorm = norm()
        self.self_attn = GemmaAttention(arch, attention_backend, layer)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = GeGLUMLP(arch, layer)
        self.post_feedforward_layernorm = norm()


class GemmaCausalLM(CausalLM):
    def __init__(self, arch: ModelArchitecture, attention_backend: AttentionBackend | str = "reference") -> None:
        if arch.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma's MLP is GeGLU (gelu_pytorch_tanh), not {arch.hidden_act!r}")
        super().__init__(arch, attention_backend)
        self.model.norm = GemmaRMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_weight_offset)
        # The windowed layers' RoPE where their base is their own (the loader sets it again
        # once the model is on its device, as it does inv_freq).
        own_base = arch.local_rope_theta is not None and any(w is not None for w in arch.layer_windows)
        self.register_buffer("local_inv_freq", rope_inverse_frequencies(arch.local_rope_architecture())
                             if own_base else None, persistent=False)
        self._embedding_scales: dict[torch.dtype, float] = {}

    def make_layer(self, arch: ModelArchitecture, attention_backend: AttentionBackend, layer: int) -> nn.Module:
        return GemmaDecoderLayer(arch, attention_backend, layer)

    def use_fused_layer_ops(self, enabled: bool) -> str | None:
        """None, whatever ``enabled``: the fused C/Triton ops (residual add + RMSNorm, RoPE +
        KV write, SiLU x up) and the C layer loop assume Llama's layer (one norm before each
        branch, w not 1 + w, SiLU); the torch ops run."""
        self.layer_ops = None
        self.cpu_decoder = None
        for layer in self.model.layers:
            layer.self_attn.layer_ops = None
            layer.mlp.layer_ops = None
        return None

    def embedding_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden_size) as transformers applies it: a float32 tensor cast to the embedding
        dtype (bfloat16: sqrt(3072) = 55.43 becomes 55.5); a Python float, so that CUDA graphs
        capture the multiply without a host-to-device copy."""
        scale = self._embedding_scales.get(dtype)
        if scale is None:
            scale = torch.tensor(self.arch.embedding_multiplier, dtype=torch.float32).to(dtype).item()
            self._embedding_scales[dtype] = scale
        return scale

    def local_rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The windowed layers' cos/sin (default RoPE, their own base), as ``rope_cos_sin``."""
        freqs = positions.float().unsqueeze(1) * self.local_inv_freq.float().unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        if self.arch.embedding_multiplier is not None:
            h = h * self.embedding_scale(h.dtype)
        rope = self.rope_cos_sin(meta.positions, h.dtype)
        local_rope = rope if self.local_inv_freq is None else self.local_rope_cos_sin(meta.positions, h.dtype)
        plan = self.attention_backend.plan(meta, kv_caches[0][0].shape[1], self.sdpa_prompt_min_tokens)
        for layer, (key_cache, value_cache) in zip(self.model.layers, kv_caches):
            attn = layer.self_attn
            cos, sin = rope if attn.window is None else local_rope
            h += layer.post_attention_layernorm(attn(layer.input_layernorm(h), cos, sin, key_cache, value_cache,
                                                     meta, plan))
            h += layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        h = self.model.norm(h[meta.logits_indices])
        if self.packed_lm_head is not None:
            logits = self.packed_lm_head(h).float()
        else:
            weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(h, weight).float()
        cap = self.arch.final_logit_softcapping
        if cap is not None:
            # In float32 (transformers: in the model dtype; the same ops in float32).
            logits = torch.tanh(logits / cap) * cap
        return logits
