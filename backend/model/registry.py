"""The model registry: a Hugging Face ``model_type`` -> the family that serves it.

A family names the module and class of its decoder (imported only when a model of it loads)
and what sets its model types apart: how the checkpoint's projections fuse into ours, which
config switches it reads, how its tokenizer loads. A new family is a module under
``backend/model/`` and an entry here; nothing in ``core/``, ``engine/`` or ``sample/`` names a
model type.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

# Fused parameter -> the checkpoint's parts, in concatenation order (Llama-style checkpoints
# keep q/k/v and gate/up apart; the decoder runs each group as one matmul).
LLAMA_FUSED_WEIGHTS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
})


# Each expert's projections (``mlp.experts.N.gate_up_proj`` / ``down_proj``, gate and up fused as
# in the dense MLP) -> the checkpoint's parts of expert N, in concatenation order.
QWEN_MOE_EXPERT_WEIGHTS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)})
MIXTRAL_EXPERT_WEIGHTS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)})


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    module: str                                  # the decoder's module ...
    class_name: str                              # ... and class
    fused_weights: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: LLAMA_FUSED_WEIGHTS)
    qkv_bias: bool = False                       # biases on q/k/v whatever config.json says
    qk_norm: bool = False                        # RMSNorm on each head of q and k before RoPE
    # config.json's sliding_window applies to every layer (Mistral's convention); elsewhere
    # only to the layers its layer_types (or use_sliding_window + max_window_layers) name.
    sliding_window_every_layer: bool = False
    # Its tokenizer is exactly tokenizer.json when tokenizer_config.json names the generic class
    # (transformers remaps no such model type; tests/test_detokenizer.py checks it).
    plain_tokenizer: bool = False
    moe: bool = False                            # MoE feed-forward (backend/model/moe.py) where config.json has experts
    moe_renormalize_default: bool = True         # without norm_topk_prob in config.json
    expert_weights: Mapping[str, tuple[str, ...]] = field(default_factory=dict)   # see QWEN_MOE_EXPERT_WEIGHTS
    renamed_weights: Mapping[str, str] = field(default_factory=dict)   # our name -> the checkpoint's
    # Gemma-style switches (backend/model/gemma.py); the defaults are Llama's.
    hidden_acts: tuple[str, ...] = ("silu",)     # the MLP activations served; the first without one in config.json
    norm_weight_offset: float = 0.0              # every RMSNorm scales by (offset + w): Gemma's (1 + w)
    scale_embeddings: bool = False               # embeddings times sqrt(hidden_size)
    tie_word_embeddings_default: bool = False    # without tie_word_embeddings in config.json
    # Without layer_types in config.json: every pattern-th layer full, the others windowed.
    sliding_window_pattern: int | None = None
    # RoPE bases without them in config.json: the (full-attention) layers', and the windowed
    # layers' where they have their own (Gemma 3's rope_local_base_freq).
    default_rope_theta: float = 10000.0
    default_local_rope_theta: float | None = None
    # Soft-caps without them in config.json (Gemma 2's config class defaults): attention
    # scores and final logits, c * tanh(x / c).
    default_attn_logit_softcapping: float | None = None
    default_final_logit_softcapping: float | None = None

    def model_class(self) -> Any:
        return getattr(importlib.import_module(self.module), self.class_name)


_LLAMA_MODULE = ("backend.model.llama", "CausalLM")
_MOE_MODULE = ("backend.model.moe", "MoECausalLM")
_GEMMA_MODULE = ("backend.model.gemma", "GemmaCausalLM")

FAMILIES: Mapping[str, ModelFamily] = MappingProxyType({family.model_type: family for family in (
    ModelFamily("llama", *_LLAMA_MODULE, plain_tokenizer=True),
    ModelFamily("mistral", *_LLAMA_MODULE, sliding_window_every_layer=True),
    ModelFamily("qwen2", *_LLAMA_MODULE, qkv_bias=True),
    ModelFamily("qwen3", *_LLAMA_MODULE, qk_norm=True),
    # Phi-3's checkpoints store qkv_proj (q|k|v) and gate_up_proj (gate|up) fused as ours are;
    # its sliding_window (Phi-3-mini-4k: 2047) applies to every layer.
    ModelFamily("phi3", *_LLAMA_MODULE, fused_weights={}, sliding_window_every_layer=True),
    ModelFamily("qwen3_moe", *_MOE_MODULE, qk_norm=True, moe=True, moe_renormalize_default=False,
                expert_weights=QWEN_MOE_EXPERT_WEIGHTS),
    ModelFamily("mixtral", *_MOE_MODULE, sliding_window_every_layer=True, moe=True,
                expert_weights=MIXTRAL_EXPERT_WEIGHTS, renamed_weights={"mlp.gate.": "block_sparse_moe.gate.",
                                                                    "mlp.experts.": "block_sparse_moe.experts."}),
    # gpt-oss: biases on q/k/v/o (transformers' attention_bias defaults to true), sinks, an MoE on
    # every layer whose stacked experts GptOssCausalLM.remap_checkpoint splits; even layers
    # windowed without layer_types (pattern 2); RoPE base 150000 without one in config.json.
    ModelFamily("gpt_oss", "backend.model.gpt_oss", "GptOssCausalLM", qkv_bias=True, moe=True,
                sliding_window_pattern=2, default_rope_theta=150_000.0),
    # Gemma 3's text decoder: (1 + w) RMSNorms (four a layer, and on q and k heads), embeddings
    # times sqrt(hidden), GeGLU, 5 windowed layers to 1 global by default, each kind its RoPE base.
    # Gemma 2: Gemma 3's layer without q/k norms, every other layer windowed (the first one),
    # one RoPE base, attention scores and final logits soft-capped.
    ModelFamily("gemma2", *_GEMMA_MODULE, hidden_acts=("gelu_pytorch_tanh",), norm_weight_offset=1.0,
                scale_embeddings=True, tie_word_embeddings_default=True, sliding_window_pattern=2,
                default_attn_logit_softcapping=50.0, default_final_logit_softcapping=30.0),
    ModelFamily("gemma3_text", *_GEMMA_MODULE, qk_norm=True, hidden_acts=("gelu_pytorch_tanh",),
                norm_weight_offset=1.0, scale_embeddings=True, tie_word_embeddings_default=True,
                sliding_window_pattern=6, default_rope_theta=1_000_000.0, default_local_rope_theta=10_000.0),
)})


def family_of(model_type: str | None) -> ModelFamily:
    """The family serving ``model_type``; ValueError naming the supported ones otherwise."""
    family = FAMILIES.get(model_type or "")
    if family is None:
        raise ValueError(f"unsupported model_type {model_type!r} (supported: {tuple(FAMILIES)})")
    return family
