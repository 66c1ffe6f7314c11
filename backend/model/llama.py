"""Llama-family decoder (llama, mistral, qwen2, qwen3, phi3) over a packed batch with a paged KV cache.

One forward computes every scheduled token of every request at once; attention reads K/V
only from the paged cache, through the model's ``AttentionBackend`` object
(kernels/attention_backend.py). q/k/v and gate/up projections are fused (fewer, larger
matmuls); ``backend.model.loader`` fills them from a checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_native
from kernels.attention_backend import AttentionBackend, AttentionPlan, as_attention_backend
from backend.lora.batch import add_lora, lora_batch
from backend.lora.slots import LoRABatch
from backend.model.architecture import ModelArchitecture
from backend.model.cpu_decoder import CpuDecoder
from backend.model.cpu_linear import Float32Logits, linear_maker, replace_linears


def rope_inverse_frequencies(arch: ModelArchitecture, long: bool = False) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim / 2], float32. LongRoPE has two sets: its short
    factors' (``long=False``) and its long factors' (``long=True``; see ``CausalLM.rope_cos_sin``
    for which positions use which); the other types have one and ignore ``long``."""
    dim = arch.head_dim
    # On the CPU even inside a ``torch.device("meta")`` block (the loader's): arithmetic on meta
    # tensors runs through torch's Python decompositions, whose first call imports torch._dynamo
    # (a noticeable part of every engine start).
    base_powers = arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    inv_freq = 1.0 / base_powers
    scaling = arch.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "longrope":
        # Each frequency divided by its factor, in transformers' order of operations.
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu")
        return 1.0 / (factors * base_powers)
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    if rope_type == "yarn":
        return yarn_inverse_frequencies(arch.rope_theta, dim, base_powers, scaling)
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3, longrope, yarn)")


def yarn_inverse_frequencies(base: float, dim: int, base_powers: torch.Tensor, scaling: dict) -> torch.Tensor:
    """YaRN's inverse frequencies [dim / 2] from ``base_powers`` = base ** (2i / dim) (float32)
    and the settings ``yarn_scaling_of`` resolved (backend/model/architecture.py): each frequency
    blended between itself (extrapolation: the fast ones) and itself / factor (interpolation: the
    slow ones) by a linear ramp over the dimensions that turn between ``beta_fast`` and
    ``beta_slow`` times within ``original_max_position_embeddings``. transformers'
    ``_compute_yarn_parameters`` operation for operation; its attention factor scales cos and sin
    (``CausalLM.rope_cos_sin``)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        """The dimension whose frequency turns ``rotations`` times within ``original`` positions."""
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001               # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation_share = 1 - ramp
    extrapolated = 1.0 / base_powers
    interpolated = 1.0 / (factor * base_powers)
    return interpolated * (1 - extrapolation_share) + extrapolated * extrapolation_share


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # One fused op, the same arithmetic as below for float32 inputs (tested).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 and scale in the input dtype, exactly as transformers does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (halves rotated, HF layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


@dataclass
class AttentionMetadata:
    """Describes one packed step (see kernels/reference.py for the layout)."""
    positions: torch.Tensor         # [num_tokens] absolute position of each token
    slot_mapping: torch.Tensor      # [num_tokens] cache slot each new K/V is written to
    query_start_loc: torch.Tensor   # [num_seqs + 1] cu_seqlens of the queries
    seq_lens: torch.Tensor          # [num_seqs] context + new tokens
    block_tables: torch.Tensor      # [num_seqs, max_blocks] block ids; entries past a sequence's blocks are unread
    logits_indices: torch.Tensor    # rows whose next-token logits are needed
    max_query_len: int              # host-side bounds: kernels pick launch shapes without a device sync
    max_seq_len: int
    lora: LoRABatch | None = None   # each token row's LoRA adapter slot (backend/lora/slots.py)


class Attention(nn.Module):
    def __init__(self, arch: ModelArchitecture, attention_backend: AttentionBackend, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer                           # for LoRA: which layer's adapter weights apply
        self.attention_backend = attention_backend   # the model's (CausalLM)
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.scale = self.head_dim ** -0.5 if arch.attention_scale is None else arch.attention_scale
        self.window = arch.window_of(layer)        # sliding window of keys, None: every key
        self.sinks: nn.Parameter | None = None     # a softmax sink logit per query head (gpt_oss.py)
        self.softcap = arch.attn_logit_softcapping  # scores soft-capped (Gemma 2), None: not
        self.layer_ops: ModuleType | None = None   # set by CausalLM.use_fused_layer_ops

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata,
                plan: AttentionPlan | None = None) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        add_lora(qkv, x, self.layer, "qkv")
        if self.layer_ops is not None:
            # RoPE on q and k in place and the K/V cache write, in one pass (C or Triton).
            self.layer_ops.rope_and_cache(qkv, cos, sin, meta.slot_mapping, key_cache, value_cache, self.num_heads,
                                          self.num_kv_heads, self.head_dim)
            q = qkv[:, :self.q_size].view(-1, self.num_heads, self.head_dim)
        else:
            q = self._rope_and_cache(qkv, cos, sin, key_cache, value_cache, meta, plan)
        o = self.attention_backend.attend(q, key_cache, value_cache, meta, self.scale, plan, self.window, self.sinks,
                                          self.softcap)
        o = o.reshape(-1, self.q_size)
        out = self.o_proj(o)
        add_lora(out, o, self.layer, "o")
        return out

    def _rope_and_cache(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, meta: AttentionMetadata,
                        plan: AttentionPlan | None) -> torch.Tensor:
        """The torch path (the reference of the fused one): q/k norms, RoPE, K/V written to the
        cache. Returns q [tokens, num_heads, head_dim]."""
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            # q and k rotated as one tensor of num_heads + num_kv_heads heads: half the ops.
            qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads,
                                                                     self.head_dim), cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        else:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(-1, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(-1, self.num_kv_heads, self.head_dim))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.attention_backend.write_kv(k, v, key_cache, value_cache, meta.slot_mapping, plan)
        return q


class MLP(nn.Module):
    def __init__(self, arch: ModelArchitecture, layer: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)
        self.layer_ops: ModuleType | None = None   # set by CausalLM.use_fused_layer_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        add_lora(gate_up, x, self.layer, "gate_up")
        # Slices, not .split(): the same views for a fraction of the Python cost.
        gate, up = gate_up[..., :self.intermediate_size], gate_up[..., self.intermediate_size:]
        if self.layer_ops is not None and gate_up.dim() == 2:
            self.layer_ops.silu_and_mul(gate_up, self.intermediate_size)   # gate := SiLU(gate) * up, one pass
            act = gate
        else:
            # In place on the projection's own output: no extra activations allocated.
            act = F.silu(gate, inplace=True).mul_(up)
        out = self.down_proj(act)
        add_lora(out, act, self.layer, "down")
        return out


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchitecture, attention_backend: AttentionBackend, layer: int,
                 mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, attention_backend, layer)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = mlp


class CausalLM(nn.Module):
    """Parameter names mirror transformers' (``model.layers.N...``), except the fused
    ``qkv_proj`` / ``gate_up_proj``, so checkpoints map with a small rename table."""

    def __init__(self, arch: ModelArchitecture, attention_backend: AttentionBackend | str = "reference") -> None:
        """``attention_backend``: the object the model runner resolved (``attention_backend_for``),
        or a resolved backend's name."""
        super().__init__()
        self.arch = arch
        # One stateless object shared by every layer.
        attention_backend = as_attention_backend(attention_backend)
        self.attention_backend = attention_backend
        self.model = nn.Module()
        # Given its weight, nn.Embedding skips its random init (on meta tensors, another import
        # of torch._dynamo; see rope_inverse_frequencies): the loader fills the weight anyway.
        self.model.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                               _weight=torch.empty(arch.vocab_size, arch.hidden_size))
        self.model.layers = nn.ModuleList(self.make_layer(arch, attention_backend, i) for i in range(arch.num_layers))
        self.model.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.packed_lm_head: nn.Module | None = None   # set by pack_for_cpu
        self.layer_ops: ModuleType | None = None        # set by use_fused_layer_ops
        self.cpu_decoder: CpuDecoder | None = None      # set by use_fused_layer_ops: the C layer loop
        # With the cpu backend, prefills of at least this many new tokens go to torch's SDPA
        # (None: none; the model runner's start-up choice, backend/model/prefill_attention_choice.py).
        self.sdpa_prompt_min_tokens: int | None = None
        self.register_buffer("inv_freq", rope_inverse_frequencies(arch), persistent=False)
        # LongRoPE (rope_cos_sin): the long factors' frequencies, for the positions from
        # long_rope_from on, and the factor scaling cos and sin; None, None and 1 otherwise.
        scaling = arch.rope_scaling or {}
        longrope = scaling.get("rope_type") == "longrope"
        self.register_buffer("long_inv_freq", rope_inverse_frequencies(arch, long=True) if longrope else None,
                             persistent=False)
        self.long_rope_from: int | None = int(scaling["original_max_position_embeddings"]) if longrope else None
        self.rope_attention_factor = float(scaling["attention_factor"]) if longrope else 1.0
        if scaling.get("rope_type") == "yarn":      # YaRN's attention factor (yarn_inverse_frequencies)
            self.rope_attention_factor = float(scaling["attention_factor"])

    def make_layer(self, arch: ModelArchitecture, attention_backend: AttentionBackend, layer: int) -> nn.Module:
        """One decoder layer: a family's hook (backend/model/gemma.py)."""
        return DecoderLayer(arch, attention_backend, layer, self.make_mlp(arch, layer))

    def graph_unsafe_reason(self) -> str | None:
        """Why a CUDA graph cannot capture this model's forward (it syncs with the host), or None."""
        return None

    def make_mlp(self, arch: ModelArchitecture, layer: int) -> nn.Module:
        """The feed-forward of one layer: a family's hook (backend/model/moe.py)."""
        return MLP(arch, layer)

    def rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [tokens, head_dim] of each token's position, computed in float32 as
        transformers does. LongRoPE picks per position: the short factors below
        original_max_position_embeddings, the long ones from it on (transformers switches a whole
        forward to the long ones once its last position reaches it: docs/models.md), both with
        cos and sin scaled by the attention factor."""
        inv_freq = self.inv_freq.float().unsqueeze(0)
        if self.long_inv_freq is not None:
            # No host sync and no shape change: CUDA graphs capture it like the rest.
            inv_freq = torch.where(positions.unsqueeze(1) >= self.long_rope_from,
                                   self.long_inv_freq.float().unsqueeze(0), inv_freq)
        freqs = positions.float().unsqueeze(1) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.rope_attention_factor != 1.0:
            cos, sin = cos * self.rope_attention_factor, sin * self.rope_attention_factor
        return cos.to(dtype), sin.to(dtype)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Returns float32 logits for the rows in ``meta.logits_indices``."""
        with lora_batch(meta.lora):
            return self._forward(input_ids, meta, kv_caches)

    def _forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos_sin(meta.positions, h.dtype)
        # Gather indices etc. derived from the block tables once per step, reused by every layer.
        plan = self.attention_backend.plan(meta, kv_caches[0][0].shape[1], self.sdpa_prompt_min_tokens)
        if self.layer_ops is not None:
            # All layers in one C call where it applies; the Python loop of the same kernels
            # otherwise.
            if not (self.cpu_decoder is not None
                    and self.cpu_decoder.run(h, cos, sin, meta, kv_caches, plan, meta.lora)):
                self._decoder_fused(h, cos, sin, meta, kv_caches, plan)
        else:
            for layer, (key_cache, value_cache) in zip(self.model.layers, kv_caches):
                h += layer.self_attn(layer.input_layernorm(h), cos, sin, key_cache, value_cache, meta, plan)
                h += layer.mlp(layer.post_attention_layernorm(h))
        h = self.model.norm(h[meta.logits_indices])
        if self.packed_lm_head is not None:
            return self.packed_lm_head(h).float()
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, weight).float()

    def _decoder_fused(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], plan: AttentionPlan | None,
                       ) -> None:
        """The layer loop above with each residual add fused into the next RMSNorm (one pass
        each, C or Triton: ``self.layer_ops``); ``h`` ends as the same residual stream."""
        layers = self.model.layers
        eps = self.arch.rms_norm_eps
        add_rms_norm = self.layer_ops.add_rms_norm
        x = torch.empty_like(h)      # the normed input of the next projection, rewritten in place
        add_rms_norm(h, None, layers[0].input_layernorm.weight, x, eps)
        for i, (layer, (key_cache, value_cache)) in enumerate(zip(layers, kv_caches)):
            attn = layer.self_attn(x, cos, sin, key_cache, value_cache, meta, plan)
            add_rms_norm(h, attn, layer.post_attention_layernorm.weight, x, eps)
            mlp = layer.mlp(x)
            if i + 1 < len(layers):
                add_rms_norm(h, mlp, layers[i + 1].input_layernorm.weight, x, eps)
            else:
                h += mlp

    def use_fused_layer_ops(self, enabled: bool) -> str | None:
        """Fuse RMSNorm with the residual add, RoPE with the K/V cache write and the MLP's SiLU
        with its product where they apply (no q/k norm), as the attention backend's ``layer_ops``
        has them: in C (kernels/csrc/layer_ops.c) with the ``cpu`` backend, in float32 or bfloat16,
        the C library built; in Triton (kernels/triton_layer_ops.py) with the ``triton`` one.
        Returns which (``"c"``, ``"triton"``) or None: the torch ops above run, the reference of
        both. With the C ops, the layer loop itself runs in C too (``self.cpu_decoder``,
        backend/model/cpu_decoder.py; projections other than our C kernel are called back from it)."""
        weight = self.model.embed_tokens.weight
        ops = None
        if enabled and not self.arch.qk_norm:
            ops = self.attention_backend.layer_ops(weight.dtype, weight.device)
        self.layer_ops = ops
        for layer in self.model.layers:
            layer.self_attn.layer_ops = ops
            layer.mlp.layer_ops = ops
        # With the C ops, the layer loop itself runs in C.
        self.cpu_decoder = CpuDecoder.for_model(self)
        return self.fused_layer_ops

    @property
    def fused_layer_ops(self) -> str | None:
        """Which fused layer ops run: ``"c"``, ``"triton"``, or None (the torch ops)."""
        if self.layer_ops is None:
            return None
        return "c" if self.layer_ops is cpu_native else "triton"

    def pack_for_cpu(self, kind: str, onednn_batch_hint: int | None = None) -> None:
        """Repack every projection and the LM head for a CPU kernel (backend/model/cpu_linear.py):
        ``native`` (ours) or ``onednn`` (packed for ``onednn_batch_hint`` rows where given). A
        tied head keeps the embedding table for lookups and gets a packed copy for logits."""
        self.cpu_decoder = None          # it holds the old projections: use_fused_layer_ops makes a new one
        make = linear_maker(kind, onednn_batch_hint)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # A bfloat16 head still gives float32 logits (Float32Logits says why).
        self.packed_lm_head = Float32Logits(weight) if weight.dtype == torch.bfloat16 else make(weight, None)
        self.lm_head = None
        replace_linears(self.model.layers, make)
