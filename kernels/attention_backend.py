"""One interface for attention over the paged KV cache, and the one place that picks a backend.

The model holds an ``AttentionBackend`` object and calls only its methods: ``plan`` once per
step (work every layer shares), ``write_kv`` and ``attend`` once per layer. What differs
between backends beside the kernels is stated here too, so callers ask the object instead of
comparing names: whether a CUDA graph can capture its forward (``supports_cuda_graphs``),
which fused layer ops go with it (``layer_ops``) and whether its plan honours the start-up's
prompt-attention choice (``honours_sdpa_choice``).

- ``reference``: plain torch (kernels/reference.py), the specification the others are tested
  against. It loops over sequences on the host, so no CUDA graph can hold it.
- ``cpu``: the batched CPU path (kernels/cpu_attention.py): the C kernels, or torch's SDPA for
  long prompts where the start-up chose it. Its per-step plan syncs with the host. The C
  kernels take sliding windows, attention sinks (gpt-oss) and score soft-capping (Gemma 2);
  layers with any of them keep their prompts off SDPA.
- ``triton``: the Triton kernels (kernels/triton_attention.py), on CUDA or, for tests, in
  Triton's interpreter (``TRITON_INTERPRET=1``). Imported on first use, so CPU serving never
  pays for importing triton.

This module needs nothing from ``backend/``: anything with the step's layout attributes
(``StepLayout``; the model's ``AttentionMetadata``, or a ``PackedStep``) describes a step.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from types import ModuleType
from typing import ClassVar, Protocol

import torch

from kernels import cpu_native
from kernels.cpu_attention import CpuAttentionPlan, paged_attention_cpu, plan_attention_cpu, reshape_and_cache_cpu
from kernels.reference import paged_attention_reference, reshape_and_cache_reference


class AttentionBackendKind(str, Enum):
    """The closed set of ``attention_backend`` settings. A ``str``: equal to its config string."""
    AUTO = "auto"            # resolved at start-up: triton on CUDA, cpu elsewhere
    TRITON = "triton"
    CPU = "cpu"
    REFERENCE = "reference"

    def __str__(self) -> str:
        return self.value


BACKENDS = tuple(kind.value for kind in AttentionBackendKind)


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class StepLayout(Protocol):
    """What a backend reads of a packed step (see kernels/reference.py for the layout)."""

    @property
    def query_start_loc(self) -> torch.Tensor: ...      # [num_seqs + 1] cu_seqlens of the queries

    @property
    def seq_lens(self) -> torch.Tensor: ...             # [num_seqs] context + new tokens

    @property
    def block_tables(self) -> torch.Tensor: ...         # [num_seqs, max_blocks]

    @property
    def slot_mapping(self) -> torch.Tensor: ...         # [num_tokens] cache slot of each new K/V (< 0: none)

    @property
    def max_query_len(self) -> int | None: ...          # host-side bounds (None: read from the tensors)

    @property
    def max_seq_len(self) -> int | None: ...


@dataclass(frozen=True)
class PackedStep:
    """A ``StepLayout`` for callers without the model's metadata (the function API, tests)."""
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int | None = None
    max_seq_len: int | None = None


AttentionPlan = CpuAttentionPlan    # what plan() returns; only the cpu backend plans a step


class AttentionBackend(ABC):
    """A paged-attention backend: stateless, so one object serves every layer of a model."""
    name: ClassVar[AttentionBackendKind]
    # A CUDA graph replays the kernels it captured: a backend qualifies when its forward never
    # syncs with the host and reads every step's layout from device tensors in place.
    supports_cuda_graphs: ClassVar[bool] = False
    # Whether ``plan`` routes prompts of at least ``sdpa_min_tokens`` tokens to torch's SDPA
    # (backend/model/prefill_attention_choice.py makes that choice only where this holds).
    honours_sdpa_choice: ClassVar[bool] = False

    def plan(self, step: StepLayout, block_size: int, sdpa_min_tokens: int | None = None) -> AttentionPlan | None:
        """The step's work shared by every layer, built once per step; None where none is needed."""
        return None

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, plan: AttentionPlan | None = None) -> None:
        """Write new K/V ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots (< 0: skip)."""

    @abstractmethod
    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, step: StepLayout,
               scale: float, plan: AttentionPlan | None = None, window: int | None = None,
               sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        """Causal attention of the packed queries ``[num_tokens, num_heads, head_dim]`` over the
        paged cache, within a sliding ``window`` of keys where given, with one softmax sink
        logit per query head where ``sinks`` (``[num_heads]``) is given, each score soft-capped
        at ``softcap`` where given (``paged_attention_reference``'s contract)."""

    def layer_ops(self, dtype: torch.dtype, device: torch.device) -> ModuleType | None:
        """The fused layer ops (residual add + RMSNorm, RoPE + K/V write, SiLU x up) that go with
        this backend for weights of ``dtype`` on ``device``, or None: the model's torch ops."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ReferenceAttention(AttentionBackend):
    name = AttentionBackendKind.REFERENCE

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, plan: AttentionPlan | None = None) -> None:
        reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, step: StepLayout,
               scale: float, plan: AttentionPlan | None = None, window: int | None = None,
               sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        return paged_attention_reference(query, key_cache, value_cache, step.query_start_loc, step.seq_lens,
                                         step.block_tables, scale, window, sinks, softcap)


class CpuAttention(AttentionBackend):
    name = AttentionBackendKind.CPU
    honours_sdpa_choice = True

    def plan(self, step: StepLayout, block_size: int, sdpa_min_tokens: int | None = None) -> CpuAttentionPlan:
        """The C kernels' gather indices, and which prefills torch's SDPA attends."""
        return plan_attention_cpu(step.query_start_loc, step.seq_lens, step.block_tables, step.slot_mapping,
                                  block_size, sdpa_min_tokens)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, plan: AttentionPlan | None = None) -> None:
        if plan is None:
            reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping)
        else:
            reshape_and_cache_cpu(key, value, key_cache, value_cache, plan)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, step: StepLayout,
               scale: float, plan: AttentionPlan | None = None, window: int | None = None,
               sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        if plan is None:
            # Attention alone writes nothing: the slots only matter to write_kv.
            plan = plan_attention_cpu(step.query_start_loc, step.seq_lens, step.block_tables,
                                      torch.zeros(query.shape[0], dtype=torch.int64), key_cache.shape[1])
        return paged_attention_cpu(query, key_cache, value_cache, scale, plan, window=window, sinks=sinks,
                                   softcap=softcap)

    def layer_ops(self, dtype: torch.dtype, device: torch.device) -> ModuleType | None:
        """The C layer ops (kernels/csrc/layer_ops.c), for float32 or bfloat16 on the CPU, where
        the C library built."""
        if dtype in cpu_native.LAYER_OPS_SUFFIXES and device.type == "cpu" and cpu_native.load() is not None:
            return cpu_native
        return None


def _triton_attention() -> ModuleType:
    from kernels import triton_attention
    return triton_attention


class TritonAttention(AttentionBackend):
    name = AttentionBackendKind.TRITON
    # The kernels find each query's sequence on the device and size their grids from host-side
    # bounds alone, so one captured launch serves every later step of its shape.
    supports_cuda_graphs = True

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, plan: AttentionPlan | None = None) -> None:
        _triton_attention().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, step: StepLayout,
               scale: float, plan: AttentionPlan | None = None, window: int | None = None,
               sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
        return _triton_attention().paged_attention(query, key_cache, value_cache, step.query_start_loc, step.seq_lens,
                                                   step.block_tables, scale, step.max_query_len, step.max_seq_len,
                                                   window=window, sinks=sinks, softcap=softcap)

    def layer_ops(self, dtype: torch.dtype, device: torch.device) -> ModuleType | None:
        """The Triton layer ops (kernels/triton_layer_ops.py), imported on first use as the
        attention kernels are."""
        from kernels import triton_layer_ops
        return triton_layer_ops if dtype in triton_layer_ops.DTYPES else None


_IMPLEMENTATIONS: dict[AttentionBackendKind, type[AttentionBackend]] = {
    cls.name: cls for cls in (ReferenceAttention, CpuAttention, TritonAttention)}


def attention_backend_kind(name: str | AttentionBackendKind) -> AttentionBackendKind:
    """The kind of a setting, refusing one outside the closed set."""
    try:
        return AttentionBackendKind(name)
    except ValueError:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}") from None


def attention_backend_for(name: str | AttentionBackendKind, device: torch.device) -> AttentionBackend:
    """The backend a setting gives on ``device``: ``auto`` -> ``triton`` on CUDA, ``cpu``
    elsewhere. Refuses combinations that cannot run, at start-up rather than at the first
    request."""
    kind = attention_backend_kind(name)
    if kind is AttentionBackendKind.AUTO:
        kind = AttentionBackendKind.TRITON if device.type == "cuda" else AttentionBackendKind.CPU
    if kind is AttentionBackendKind.TRITON and device.type != "cuda" and not triton_interpreter_enabled():
        raise ValueError("attention_backend=triton on CPU needs TRITON_INTERPRET=1 (Triton's interpreter; slow)")
    return _IMPLEMENTATIONS[kind]()


def as_attention_backend(backend: AttentionBackend | str | AttentionBackendKind) -> AttentionBackend:
    """A backend object from an object or a resolved kind (no device check, no ``auto``: the
    model runner resolves those with ``attention_backend_for``)."""
    if isinstance(backend, AttentionBackend):
        return backend
    kind = attention_backend_kind(backend)
    if kind is AttentionBackendKind.AUTO:
        raise ValueError("attention backend 'auto' must be resolved for a device (attention_backend_for)")
    return _IMPLEMENTATIONS[kind]()
