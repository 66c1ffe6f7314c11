"""Attention over the paged KV cache.

``reference`` is the specification (plain torch); ``triton_attention`` holds the Triton
kernels and ``cpu_attention`` the batched CPU path, both tested against it. The model reaches
them only through an ``AttentionBackend`` object (kernels/attention_backend.py) that the model
runner picks once at start-up (``attention_backend_for``): ``triton`` on CUDA, ``cpu``
elsewhere, unless configured otherwise. On CPU the Triton kernels run only in Triton's
interpreter (``TRITON_INTERPRET=1``), which is how CI checks them.

The functions below are the same calls by backend name, for tests and benchmarks that drive
one kernel path directly.
"""

from __future__ import annotations

import torch

from kernels.attention_backend import (AttentionBackend, AttentionBackendKind, PackedStep, as_attention_backend,
                                       attention_backend_for, triton_interpreter_enabled)
from kernels.cpu_attention import EVERY_PREFILL, CpuAttentionPlan, PrefillAttention
from kernels.reference import paged_attention_reference, reshape_and_cache_reference


def resolve_backend(name: str, device: torch.device) -> AttentionBackendKind:
    """The kind ``attention_backend_for`` resolves ``name`` to on ``device`` (a str enum)."""
    return attention_backend_for(name, device).name


def plan_attention(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   slot_mapping: torch.Tensor, block_size: int, backend: str,
                   sdpa_min_tokens: int | None = None) -> CpuAttentionPlan | None:
    """``AttentionBackend.plan`` of the named backend."""
    step = PackedStep(query_start_loc, seq_lens, block_tables, slot_mapping)
    return as_attention_backend(backend).plan(step, block_size, sdpa_min_tokens)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, backend: str = "reference",
                      plan: CpuAttentionPlan | None = None) -> None:
    """``AttentionBackend.write_kv`` of the named backend."""
    as_attention_backend(backend).write_kv(key, value, key_cache, value_cache, slot_mapping, plan)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, max_query_len: int | None = None, max_seq_len: int | None = None,
                    backend: str = "reference", plan: CpuAttentionPlan | None = None) -> torch.Tensor:
    """``AttentionBackend.attend`` of the named backend. ``max_query_len`` / ``max_seq_len``:
    host-side bounds that spare the Triton path a device sync."""
    # attend reads no slots: the cpu path builds its plan (when not given) with none to write.
    step = PackedStep(query_start_loc, seq_lens, block_tables, query_start_loc.new_empty(0), max_query_len,
                      max_seq_len)
    return as_attention_backend(backend).attend(query, key_cache, value_cache, step, scale, plan)


__all__ = ["AttentionBackend", "AttentionBackendKind", "CpuAttentionPlan", "EVERY_PREFILL", "PrefillAttention",
           "attention_backend_for", "paged_attention", "paged_attention_reference", "plan_attention",
           "reshape_and_cache", "reshape_and_cache_reference", "resolve_backend", "triton_interpreter_enabled"]
