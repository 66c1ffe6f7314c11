"""The model's shape, read from a Hugging Face config.json and normalised across the
families of the model registry (backend/model/registry.py)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from backend.model.registry import ModelFamily, family_of


def rope_scaling_of(cfg: dict[str, Any], rope: dict[str, Any], rope_type: str) -> dict[str, Any] | None:
    """config.json's RoPE scaling (None: plain RoPE). LongRoPE's (``longrope``, once ``su``)
    comes resolved as transformers resolves it: ``original_max_position_embeddings`` (the
    top-level key first, where Phi-3 keeps it) and the ``attention_factor`` that scales cos and
    sin (by default sqrt(1 + ln(factor) / ln(original)), factor = max_position_embeddings /
    original or the given ``factor``; 1 where factor <= 1). Partial rotary is refused: our RoPE
    (torch, C and Triton) rotates whole heads."""
    partial = float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    if partial != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {partial:g}: RoPE here rotates whole heads "
                         "(partial rotary, as Phi-4-mini's 0.75, is not served)")
    if rope_type == "default":
        return None
    if rope_type == "yarn":
        return yarn_scaling_of(cfg, rope)
    if rope_type not in ("longrope", "su"):
        return rope
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    for key in ("short_factor", "long_factor"):
        if len(rope.get(key) or ()) != head_dim // 2:
            raise ValueError(f"longrope {key} must list head_dim / 2 = {head_dim // 2} factors, "
                             f"got {len(rope.get(key) or ())}")
    original, factor = _original_length_and_factor(cfg, rope)
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {**rope, "rope_type": "longrope", "original_max_position_embeddings": original,
            "attention_factor": float(attention_factor)}


def _original_length_and_factor(cfg: dict[str, Any], rope: dict[str, Any]) -> tuple[int, float]:
    """LongRoPE's and YaRN's ``original_max_position_embeddings`` (the top-level key first, where
    Phi-3 keeps it) and ``factor`` (max_position_embeddings / original without one)."""
    max_pos = cfg.get("max_position_embeddings", 2048)
    original = int(cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
                   or max_pos)
    factor = rope.get("factor")
    return original, max_pos / original if factor is None else factor


def yarn_scaling_of(cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """YaRN's settings resolved as transformers' ``_compute_yarn_parameters`` resolves them:
    ``original_max_position_embeddings`` (the top-level key first, as for LongRoPE), ``factor``
    (max_position_embeddings / original without one), ``beta_fast`` / ``beta_slow`` (32 / 1 where
    absent or 0), ``truncate`` (True without it) and the ``attention_factor`` that scales cos and
    sin: the given one, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both
    are set, else mscale(factor) = 0.1 ln(factor) + 1 (1 where factor <= 1)."""
    original, factor = _original_length_and_factor(cfg, rope)

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            attention_factor = mscale_of(factor, rope["mscale"]) / mscale_of(factor, rope["mscale_all_dim"])
        else:
            attention_factor = mscale_of(factor)
    return {**rope, "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": rope.get("beta_fast") or 32, "beta_slow": rope.get("beta_slow") or 1,
            "truncate": rope.get("truncate", True), "attention_factor": float(attention_factor)}


@dataclass(frozen=True)
class MoEArchitecture:
    """A mixture-of-experts feed-forward: each token goes to ``top_k`` of ``num_experts``
    SwiGLU experts of ``intermediate_size``; layers in ``dense_layers`` keep a dense MLP."""
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool               # the top-k routing weights rescaled to sum to 1
    dense_layers: frozenset[int] = frozenset()
    # gpt-oss's clamped SwiGLU (backend/model/gpt_oss.py; no other family reads them), with
    # transformers' defaults: gate clamped above, up on both sides at the limit, gate * sigmoid(alpha * gate).
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    @classmethod
    def from_config(cls, cfg: dict[str, Any], family: ModelFamily) -> "MoEArchitecture | None":
        """Mixtral's and Qwen-MoE's keys (``num_local_experts`` / ``num_experts``,
        ``moe_intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step``,
        ``mlp_only_layers``)."""
        num_experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        if not family.moe or not num_experts:
            return None
        step = cfg.get("decoder_sparse_step") or 1
        dense = {i for i in range(cfg["num_hidden_layers"])
                 if i in set(cfg.get("mlp_only_layers") or ()) or (i + 1) % step != 0}
        return cls(num_experts=num_experts, top_k=cfg["num_experts_per_tok"],
                   intermediate_size=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
                   renormalize=bool(cfg.get("norm_topk_prob", family.moe_renormalize_default)),
                   dense_layers=frozenset(dense), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                   swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))


@dataclass(frozen=True)
class ModelArchitecture:
    """What the forward pass needs from config.json, normalised across model families."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    initializer_range: float
    moe: MoEArchitecture | None = None
    # Per layer: its sliding window of keys, or None for full attention.
    layer_windows: tuple[int | None, ...] = ()
    # Gemma-style switches (backend/model/gemma.py); the defaults are Llama's.
    hidden_act: str = "silu"                        # the MLP's gate activation
    norm_weight_offset: float = 0.0                 # RMSNorms scale by (offset + w): Gemma's (1 + w)
    embedding_multiplier: float | None = None       # embeddings times this (Gemma: sqrt(hidden_size))
    attention_scale: float | None = None            # query_pre_attn_scalar ** -0.5; None: head_dim ** -0.5
    final_logit_softcapping: float | None = None    # logits := tanh(logits / c) * c
    attn_logit_softcapping: float | None = None     # each attention score s := tanh(s / c) * c (Gemma 2)
    local_rope_theta: float | None = None           # the windowed layers' own RoPE base (Gemma 3's local one)

    def local_rope_architecture(self) -> "ModelArchitecture":
        """This architecture as the windowed layers' RoPE sees it: their own base, default RoPE
        (Gemma 3's local layers; any scaling applies to the global layers only)."""
        return replace(self, rope_theta=self.local_rope_theta, rope_scaling=None)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def release_window(self) -> int | None:
        """The window past which no layer reads a key (every layer windowed), so the KV blocks
        wholly before it may be released; None when some layer attends every key."""
        if not self.layer_windows or any(w is None for w in self.layer_windows):
            return None
        return max(self.layer_windows)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelArchitecture":
        cfg = json.loads((Path(folder) / "config.json").read_text())
        model_type = cfg.get("model_type")
        family = family_of(model_type)
        refuse_quantized_checkpoint(cfg)
        # Gemma names it hidden_activation (transformers' Gemma 3 reads no other key).
        hidden_act = cfg.get("hidden_activation") or cfg.get("hidden_act") or family.hidden_acts[0]
        if hidden_act not in family.hidden_acts:
            raise ValueError(f"unsupported hidden_act {hidden_act!r} (for {model_type}: {family.hidden_acts})")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("unsupported use_bidirectional_attention True: bidirectional attention (EmbeddingGemma) "
                             "is not served")
        # transformers >= 5 nests RoPE settings in rope_parameters; older configs use
        # rope_theta + rope_scaling at the top level. Gemma 3's are per layer type in 5
        # (full_attention, sliding_attention), rope_theta + rope_scaling (the global layers')
        # and rope_local_base_freq before.
        rope_parameters = cfg.get("rope_parameters") or {}
        per_type = any(isinstance(rope_parameters.get(kind), dict) for kind in ("full_attention", "sliding_attention"))
        if per_type:
            rope = dict(rope_parameters.get("full_attention") or {})
            local_rope = dict(rope_parameters.get("sliding_attention") or {})
        else:
            rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            local_rope = {"rope_theta": cfg["rope_local_base_freq"]} if cfg.get("rope_local_base_freq") else {}
        if local_rope.get("rope_type", local_rope.get("type", "default")) != "default":
            raise ValueError(f"unsupported rope_type {local_rope.get('rope_type', local_rope.get('type'))!r} for the "
                             "sliding-window layers (their RoPE is the default one here)")
        local_rope_theta = local_rope.get("rope_theta", family.default_local_rope_theta)
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", family.default_rope_theta)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        num_heads = cfg["num_attention_heads"]
        max_pos = cfg.get("max_position_embeddings", 2048)
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling_of(cfg, rope, rope_type),
            max_position_embeddings=max_pos,
            tie_word_embeddings=cfg.get("tie_word_embeddings", family.tie_word_embeddings_default),
            qkv_bias=family.qkv_bias or cfg.get("attention_bias", False),
            qk_norm=family.qk_norm,
            initializer_range=cfg.get("initializer_range", 0.02),
            moe=MoEArchitecture.from_config(cfg, family),
            layer_windows=layer_windows(cfg, family),
            hidden_act=hidden_act,
            norm_weight_offset=family.norm_weight_offset,
            embedding_multiplier=cfg["hidden_size"] ** 0.5 if family.scale_embeddings else None,
            attention_scale=cfg["query_pre_attn_scalar"] ** -0.5 if cfg.get("query_pre_attn_scalar") else None,
            final_logit_softcapping=softcap(cfg, "final_logit_softcapping", family.default_final_logit_softcapping),
            attn_logit_softcapping=softcap(cfg, "attn_logit_softcapping", family.default_attn_logit_softcapping),
            local_rope_theta=None if local_rope_theta is None else float(local_rope_theta),
        )


def softcap(cfg: dict[str, Any], key: str, default: float | None) -> float | None:
    """A soft-cap from config.json: its value, the family's default where the key is absent,
    None where it is null or 0 (off)."""
    value = cfg.get(key, default)
    return float(value) if value else None


def layer_windows(cfg: dict[str, Any], family: ModelFamily) -> tuple[int | None, ...]:
    """Each layer's sliding window from config.json, as transformers reads it: ``layer_types``
    where given ("sliding_attention" layers), else Gemma 3's pattern (every pattern-th layer
    full), else every layer for Mistral-style families, else the layers from
    ``max_window_layers`` on when ``use_sliding_window`` is set."""
    num_layers, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    if not window:
        return (None,) * num_layers
    if cfg.get("layer_types"):
        return tuple(window if kind == "sliding_attention" else None for kind in cfg["layer_types"])
    if family.sliding_window_pattern:      # Gemma 3 (sliding_window_pattern, 6 by default)
        pattern = cfg.get("sliding_window_pattern") or family.sliding_window_pattern
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))
    if family.sliding_window_every_layer:
        return (window,) * num_layers
    if cfg.get("use_sliding_window"):
        first = cfg.get("max_window_layers", num_layers)
        return tuple(window if i >= first else None for i in range(num_layers))
    return (None,) * num_layers


def refuse_quantized_checkpoint(cfg: dict[str, Any]) -> None:
    """ValueError for a checkpoint config.json calls quantized (``quantization_config`` with a
    ``quant_method``): weights are loaded as float tensors only (``quantization=int8`` quantizes
    float weights after loading). gpt-oss's own checkpoints are MXFP4 (4-bit experts in
    ``*_blocks`` / ``*_scales`` tensors)."""
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if not method:
        return
    if str(method).lower() == "mxfp4":
        raise ValueError("unsupported quantization_config quant_method 'mxfp4': MXFP4-quantized experts are not "
                         "served (no MXFP4 kernels); use a checkpoint with bfloat16 or float32 weights")
    raise ValueError(f"unsupported quantization_config quant_method {method!r}: quantized checkpoints are not "
                     "served (float weights only)")
