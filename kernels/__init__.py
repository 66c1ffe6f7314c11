"""Attention over the paged KV cache, behind one dispatch point.

``reference`` is the specification (plain torch); ``triton_attention`` holds the Triton
kernels and ``cpu_attention`` the batched CPU path, both tested against it. The model calls
only ``plan_attention`` (once per step), ``reshape_and_cache`` and ``paged_attention``
below, with the backend the model runner resolved once at start-up: ``triton`` on CUDA,
``cpu`` elsewhere, unless configured otherwise. On CPU the Triton kernels run only in
Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI checks them.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from kernels.cpu_attention import (EVERY_PREFILL, CpuAttentionPlan, PrefillAttention, paged_attention_cpu,
                                   plan_attention_cpu, reshape_and_cache_cpu)
from kernels.reference import paged_attention_reference, reshape_and_cache_reference

BACKENDS = ("auto", "triton", "cpu", "reference")


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_backend(name: str, device: torch.device) -> str:
    """``auto`` -> ``triton`` on CUDA, ``cpu`` elsewhere. Refuses combinations that
    cannot run, at start-up rather than at the first request."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    if name == "triton" and device.type != "cuda" and not triton_interpreter_enabled():
        raise ValueError("attention_backend=triton on CPU needs TRITON_INTERPRET=1 (Triton's interpreter; slow)")
    return name


def _triton() -> ModuleType:
    # Imported on first use: CPU serving never pays for importing triton.
    from kernels import triton_attention
    return triton_attention


def plan_attention(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   slot_mapping: torch.Tensor, block_size: int, backend: str,
                   sdpa_min_tokens: int | None = None) -> CpuAttentionPlan | None:
    """Per-step work shared by every layer (the CPU path's gather indices, and which prefills
    torch's SDPA attends: ``plan_attention_cpu``); None for the backends that need none."""
    if backend == "cpu":
        return plan_attention_cpu(query_start_loc, seq_lens, block_tables, slot_mapping, block_size,
                                  sdpa_min_tokens)
    return None


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, backend: str = "reference",
                      plan: CpuAttentionPlan | None = None) -> None:
    """Write new K/V ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots (< 0: skip)."""
    if backend == "cpu" and plan is not None:
        reshape_and_cache_cpu(key, value, key_cache, value_cache, plan)
    elif backend == "triton":
        _triton().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    else:
        reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, max_query_len: int | None = None, max_seq_len: int | None = None,
                    backend: str = "reference", plan: CpuAttentionPlan | None = None) -> torch.Tensor:
    """Causal attention of the packed batch over the paged cache (see kernels/reference.py).
    ``max_query_len`` / ``max_seq_len`` are host-side bounds that let the Triton path pick
    its launch shape without reading device tensors; ``plan`` is the step's
    ``plan_attention`` result (the CPU path builds one here when it is not given)."""
    if backend == "cpu":
        if plan is None:
            plan = plan_attention_cpu(query_start_loc, seq_lens, block_tables,
                                      torch.zeros(query.shape[0], dtype=torch.int64), key_cache.shape[1])
        return paged_attention_cpu(query, key_cache, value_cache, scale, plan)
    if backend == "triton":
        return _triton().paged_attention(query, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
                                         scale, max_query_len, max_seq_len)
    return paged_attention_reference(query, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale)


__all__ = ["BACKENDS", "CpuAttentionPlan", "EVERY_PREFILL", "PrefillAttention", "paged_attention", "plan_attention",
           "reshape_and_cache", "resolve_backend", "triton_interpreter_enabled",
           "paged_attention_reference", "reshape_and_cache_reference"]
