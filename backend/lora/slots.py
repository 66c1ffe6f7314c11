"""Adapter slots: where the LoRA weights a step may use live, and the batched delta's backends.

``max_loras`` slots, as many as adapters that may run at once (the scheduler never lets
more be running). The runner gives every adapter of a step a slot (``assign``) and writes
each token row's slot, or -1 for the base model, into the step buffers; the forward pass
then adds, per projection, ``B_s (A_s x)`` to each row of slot ``s`` in one call
(``apply``), whatever the mix of adapters.

How a slot holds its adapter depends on the backend:

- ``cpu``: the slot table holds the addresses of the adapter's own A and B (one C call per
  projection reads them: kernels/csrc/lora.c). Nothing is copied.
- ``triton``: the weights are copied into stacked, rank-padded tensors allocated once
  (``[max_loras, max_rank x parts, features]``), which the Triton kernels index by slot
  (kernels/triton_lora.py). The tensors never move, so a captured CUDA graph replays for
  any adapters: a new adapter is a copy into its slot, a new mix only new slot ids.
- ``torch``: one shrink and one expand matmul per slot of the step (no C compiler here, or
  the reference attention backend): the obvious fallback.

A slot is reused least recently used first, never one that an adapter of the same step
holds. An adapter evicted while one of its requests still runs (its request got no tokens
in a step that brought in a new adapter) is copied back in at its next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from backend.lora.adapter import PROJECTIONS, LoRAAdapter, part_slices, projection_inputs
from backend.model.architecture import ModelArchitecture
from kernels import cpu_native
from kernels.attention_backend import AttentionBackendKind, attention_backend_kind

NO_SLOT = -1


class LoRABackend(str, Enum):
    CPU = "cpu"          # kernels/csrc/lora.c, one call per projection
    TRITON = "triton"    # kernels/triton_lora.py over rank-padded stacks (CUDA; the interpreter in tests)
    TORCH = "torch"      # a shrink and an expand matmul per slot

    @classmethod
    def for_attention_backend(cls, attention: AttentionBackendKind | str) -> "LoRABackend":
        """The delta's kernels that go with a resolved attention backend: Triton's with Triton's
        (both captured in the same CUDA graphs), C with the C attention where the library built,
        torch's otherwise."""
        kind = attention_backend_kind(attention)
        if kind is AttentionBackendKind.TRITON:
            return cls.TRITON
        if kind is AttentionBackendKind.CPU and cpu_native.load() is not None:
            return cls.CPU
        return cls.TORCH


class LoRASlots:
    def __init__(self, max_loras: int, max_rank: int, max_tokens: int, arch: ModelArchitecture,
                 dtype: torch.dtype, device: torch.device, backend: LoRABackend) -> None:
        """``max_rank``: the largest adapter rank the ``triton`` stacks hold (per part);
        ``max_tokens``: the most token rows of a step."""
        self.max_loras, self.max_rank, self.backend = max_loras, max_rank, backend
        self.adapters: list[LoRAAdapter | None] = [None] * max_loras
        self._last_used = [0] * max_loras
        self._clock = 0
        num_layers = arch.num_layers
        outputs = {name: parts[-1][1] for name, parts in part_slices(arch).items()}
        inputs = projection_inputs(arch)
        num_parts = {name: len(parts) for name, parts in part_slices(arch).items()}
        # Which projections some resident adapter adapts: the others skip LoRA entirely.
        self._adapted: dict[str, int] = {name: 0 for name in PROJECTIONS}
        # cpu: per layer and projection, a row per slot: where its A and each part's B are.
        self.tables: list[dict[str, torch.Tensor]] = []
        self.a_stacks: list[dict[str, torch.Tensor]] = []
        self.b_stacks: list[dict[str, torch.Tensor]] = []
        if backend == LoRABackend.CPU:
            self.tables = [{name: torch.zeros(max_loras, cpu_native.LORA_SLOT_FIELDS, dtype=torch.int64) for name in PROJECTIONS}
                           for _ in range(num_layers)]
        elif backend == LoRABackend.TRITON:
            self.a_stacks = [{name: torch.zeros(max_loras, max_rank * num_parts[name], inputs[name], dtype=dtype,
                                                device=device) for name in PROJECTIONS} for _ in range(num_layers)]
            self.b_stacks = [{name: torch.zeros(max_loras, max_rank * num_parts[name], outputs[name], dtype=dtype,
                                                device=device) for name in PROJECTIONS} for _ in range(num_layers)]
        # Per projection, each slot's used rows of the stacks (an adapter's rank x its parts
        # there; the same in every layer): the kernels skip the zero padding past them.
        self.stack_ranks = {name: torch.zeros(max_loras, dtype=torch.int32, device=device) for name in PROJECTIONS}
        # The triton shrink's float32 output per rank width, allocated once: a CUDA graph
        # captured over a view of it must find it in place at every replay.
        self._shrunk = {width: torch.empty(max_tokens, width, dtype=torch.float32, device=device)
                        for width in {stacks.shape[1] for stacks in (self.a_stacks[0].values() if self.a_stacks else [])}}

    # ---- residency (the engine loop thread) --------------------------------------------------
    def slot_of(self, adapter: LoRAAdapter) -> int | None:
        return next((i for i, held in enumerate(self.adapters) if held is adapter), None)

    def assign(self, adapters: list[LoRAAdapter]) -> dict[int, int]:
        """A slot for every adapter of a step: {lora_id: slot}. Loads those not resident into
        the least recently used slots that no adapter of this step holds."""
        self._clock += 1
        wanted = {a.lora_id: a for a in adapters}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step holds {len(wanted)} adapters; there are {self.max_loras} slots")
        slots: dict[int, int] = {}
        missing = []
        for lora_id, adapter in wanted.items():
            slot = self.slot_of(adapter)
            if slot is None:
                missing.append(adapter)
            else:
                slots[lora_id] = slot
        free = sorted((i for i in range(self.max_loras) if i not in slots.values()), key=lambda i: self._last_used[i])
        for adapter, slot in zip(missing, free):
            self._load(slot, adapter)
            slots[adapter.lora_id] = slot
        for slot in slots.values():
            self._last_used[slot] = self._clock
        return slots

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        previous = self.adapters[slot]
        if previous is not None:
            for name in previous.layers[0]:
                self._adapted[name] -= 1
        for name in adapter.layers[0]:
            self._adapted[name] += 1
        self.adapters[slot] = adapter
        if self.backend == LoRABackend.TRITON:
            for name in PROJECTIONS:
                projection = adapter.layers[0].get(name)
                self.stack_ranks[name][slot] = 0 if projection is None else projection.a.shape[0]
        for layer, weights in enumerate(adapter.layers):
            for name in PROJECTIONS:
                projection = weights.get(name)
                if self.backend == LoRABackend.CPU:
                    # The adapter object (held in self.adapters) keeps these tensors alive.
                    parts = [] if projection is None else [
                        (part.b_t, part.rank_start, part.rank_end, part.out_start, part.out_end)
                        for part in projection.parts]
                    self.tables[layer][name][slot] = torch.tensor(
                        cpu_native.lora_slot_fields(None if projection is None else projection.a, parts))
                elif self.backend == LoRABackend.TRITON:
                    a_stack, b_stack = self.a_stacks[layer][name], self.b_stacks[layer][name]
                    a_stack[slot].zero_()
                    b_stack[slot].zero_()
                    if projection is not None:
                        width = projection.a.shape[0]
                        if width > a_stack.shape[1]:
                            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}; the slots hold "
                                             f"up to {self.max_rank} (max_lora_rank)")
                        a_stack[slot, :width].copy_(projection.a)
                        b_stack[slot, :width].copy_(projection.b_t)

    # ---- the forward pass --------------------------------------------------------------------
    def adapts(self, projection: str) -> bool:
        """Whether ``apply`` may change this projection's output: some resident adapter adapts
        it (always, with Triton's kernels, which always launch)."""
        return self.backend == LoRABackend.TRITON or bool(self._adapted[projection])

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str, batch: "LoRABatch") -> None:
        """``out[t] += B_s (A_s x[t])`` for every row with a slot (in place)."""
        if self.backend == LoRABackend.TRITON:
            # Always launched, even when no resident adapter adapts this projection (a slot's
            # rank 0 makes its programs exit): a CUDA graph captured before any adapter was
            # loaded must still hold these launches.
            from kernels import triton_lora
            a_stack = self.a_stacks[layer][projection]
            shrunk = self._shrunk[a_stack.shape[1]][:x.shape[0]]
            ranks = self.stack_ranks[projection]
            triton_lora.lora_shrink(x, a_stack, batch.slot_ids, ranks, shrunk)
            triton_lora.lora_expand(shrunk, self.b_stacks[layer][projection], batch.slot_ids, ranks, out)
        elif not self._adapted[projection]:
            return
        elif self.backend == LoRABackend.CPU:
            cpu_native.lora_apply(x, out, batch.slot_ids, self.tables[layer][projection])
        else:
            for slot, rows in batch.row_groups():
                weights = self.adapters[slot].layers[layer].get(projection)
                if weights is not None:
                    out[rows] += (x[rows] @ weights.a.T) @ weights.b_t


@dataclass
class LoRABatch:
    """The forward pass's view of a step's adapters: the slots and each token row's slot."""
    slots: LoRASlots
    slot_ids: torch.Tensor                     # [num_tokens] int32 on the model's device; -1: none
    _groups: list[tuple[int, torch.Tensor]] | None = field(default=None, repr=False)

    def row_groups(self) -> list[tuple[int, torch.Tensor]]:
        """(slot, row indices) per slot present (the torch backend's grouping), once per step."""
        if self._groups is None:
            ids = self.slot_ids.cpu()
            self._groups = [(slot, (ids == slot).nonzero().flatten().to(self.slot_ids.device))
                            for slot in ids.unique().tolist() if slot != NO_SLOT]
        return self._groups


def batch_for_rows(slots: LoRASlots, row_adapters: list[LoRAAdapter | None]) -> LoRABatch:
    """A batch from each token row's adapter, outside the runner (tests, benchmarks)."""
    slot_of = slots.assign([a for a in row_adapters if a is not None])
    ids = [NO_SLOT if a is None else slot_of[a.lora_id] for a in row_adapters]
    device = slots.a_stacks[0]["qkv"].device if slots.a_stacks else torch.device("cpu")
    return LoRABatch(slots, torch.tensor(ids, dtype=torch.int32, device=device))
