"""The preallocated inputs of one step, shared by the model runner (which fills them) and
the CUDA graphs (which read them in place)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class StepBuffers:
    """Preallocated inputs of one step: rows ``[:num_tokens]`` / ``[:num_seqs]`` are live.
    The runner keeps a host set (written through numpy views) and, on CUDA, a device set the
    model and the CUDA graphs read in place; on CPU both are the same object."""
    input_ids: torch.Tensor       # [max_tokens] int64
    positions: torch.Tensor       # [max_tokens] int64
    slot_mapping: torch.Tensor    # [max_tokens] int64
    query_start_loc: torch.Tensor  # [max_seqs + 1] int32
    seq_lens: torch.Tensor        # [max_seqs] int32
    block_tables: torch.Tensor    # [max_seqs, max_blocks_per_seq] int32
    logits_indices: torch.Tensor  # [max_tokens] int64 (a row per sequence, or per verified draft position)
    lora_slots: torch.Tensor      # [max_tokens] int32: each token row's LoRA adapter slot, -1 = none
    # async_scheduling: input rows whose token the previous step sampled on the device
    # (``pending_rows``), and that step's sampling row for each (``pending_sources``).
    pending_rows: torch.Tensor    # [max_seqs] int64
    pending_sources: torch.Tensor  # [max_seqs] int64

    @classmethod
    def allocate(cls, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 pin_memory: bool = False) -> "StepBuffers":
        def new(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory and device.type == "cpu")
        return cls(new(max_tokens, dtype=torch.int64), new(max_tokens, dtype=torch.int64),
                   new(max_tokens, dtype=torch.int64), new(max_seqs + 1, dtype=torch.int32),
                   new(max_seqs, dtype=torch.int32), new(max_seqs, max_blocks_per_seq, dtype=torch.int32),
                   new(max_tokens, dtype=torch.int64), new(max_tokens, dtype=torch.int32).fill_(-1),
                   new(max_seqs, dtype=torch.int64), new(max_seqs, dtype=torch.int64))

    def numpy(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name).numpy() for name in self.__dataclass_fields__}

    def copy_rows_from(self, other: "StepBuffers", num_tokens: int, num_seqs: int, num_logits: int,
                       num_block_columns: int, num_lora_rows: int = 0) -> None:
        """Asynchronous host->device copy of the live rows (the host side is pinned);
        ``lora_slots`` only where written (none while the runner has no LoRA slots)."""
        for name, rows in (("input_ids", num_tokens), ("positions", num_tokens), ("slot_mapping", num_tokens),
                           ("query_start_loc", num_seqs + 1), ("seq_lens", num_seqs),
                           ("logits_indices", num_logits), ("lora_slots", num_lora_rows)):
            getattr(self, name)[:rows].copy_(getattr(other, name)[:rows], non_blocking=True)
        # Only the columns this step's sequences use; later columns are never read.
        self.block_tables[:num_seqs, :num_block_columns].copy_(
            other.block_tables[:num_seqs, :num_block_columns], non_blocking=True)


@dataclass
class PendingTokens:
    """async_scheduling: the tokens the step before sampled, still on the device (``tokens``,
    one per sampling row), and each request's row there. A decode whose input is one of them
    takes it on the device, without the host ever reading it first."""
    tokens: torch.Tensor          # [rows] int64, on the step buffers' device
    rows: dict[str, int]          # request id -> row of ``tokens``
