"""The KV cache's shape and size: how many blocks the memory budget holds, and allocating them.

The budget is ``kv_cache_memory_bytes`` where set; otherwise on CUDA a share
(``gpu_memory_utilization``) of the memory free once the weights are loaded, less the
activation peak of the largest step (measured by running one), and on CPU a fixed default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backend.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from backend.core.kv_cache_utils import cdiv
from backend.model.architecture import ModelArchitecture
from backend.model.llama import AttentionMetadata

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class KVCacheLayout:
    """Per layer a key and a value tensor ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    arch: ModelArchitecture
    block_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_block(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        arch = self.arch
        return 2 * arch.num_layers * self.block_size * arch.num_kv_heads * arch.head_dim * element

    def allocate(self, num_blocks: int) -> KVCaches:
        """(key, value) per layer. Left uninitialised: every kernel reads only the slots of a
        sequence's own tokens, which are written first (the kernel tests fill every other slot
        with NaN). Zeroing the default 1 GiB CPU cache is a noticeable part of a CPU start-up."""
        shape = (num_blocks, self.block_size, self.arch.num_kv_heads, self.arch.head_dim)
        return [(torch.empty(shape, dtype=self.dtype, device=self.device),
                 torch.empty(shape, dtype=self.dtype, device=self.device)) for _ in range(self.arch.num_layers)]


def blocks_from_budget(config: EngineConfig, layout: KVCacheLayout, model: nn.Module, max_step_tokens: int,
                       max_logits_rows: int) -> tuple[int, str]:
    """The KV blocks the budget holds, and where the budget came from (for the start-up log).
    ``max_step_tokens``: the most tokens one sequence may bring to a step; ``max_logits_rows``:
    the most logits rows a step may have (both size the CUDA activation peak)."""
    budget, source = config.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    if budget is None:
        if layout.device.type == "cuda":
            budget, source = _cuda_kv_budget(config, layout, model, max_step_tokens, max_logits_rows)
        else:
            budget, source = DEFAULT_CPU_KV_CACHE_BYTES, "the CPU default budget"
    num_blocks = budget // layout.bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV budget of {budget} bytes holds no block of {layout.bytes_per_block} bytes")
    return int(num_blocks), source


def _cuda_kv_budget(config: EngineConfig, layout: KVCacheLayout, model: nn.Module, max_step_tokens: int,
                    max_logits_rows: int) -> tuple[int, str]:
    """gpu_memory_utilization x the memory free once the weights are loaded, less the
    activation peak of a full-budget step; and how it was found."""
    device = layout.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    activation_peak = profile_activation_peak(layout, model, max_step_tokens, max_logits_rows)
    budget = int(free * config.gpu_memory_utilization) - activation_peak
    return budget, (f"free after weights {free / 2**30:.2f} GiB x gpu_memory_utilization "
                    f"{config.gpu_memory_utilization:.2f}, less an activation peak of "
                    f"{activation_peak / 2**30:.2f} GiB")


@torch.inference_mode()
def profile_activation_peak(layout: KVCacheLayout, model: nn.Module, num_tokens: int, max_logits_rows: int) -> int:
    """Peak memory of the largest step: one sequence of ``num_tokens`` tokens with a throwaway
    cache just big enough, and as many logits rows as a step can have."""
    device = layout.device
    num_blocks = cdiv(num_tokens, layout.block_size)
    caches = layout.allocate(num_blocks)
    torch.cuda.synchronize(device)
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    num_logits = min(max_logits_rows, num_tokens)
    meta = AttentionMetadata(
        positions=torch.arange(num_tokens, device=device),
        slot_mapping=torch.arange(num_tokens, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0),
        logits_indices=torch.arange(num_tokens - num_logits, num_tokens, device=device),
        max_query_len=num_tokens, max_seq_len=num_tokens)
    model(torch.zeros(num_tokens, dtype=torch.int64, device=device), meta, caches)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    del caches
    torch.cuda.empty_cache()
    return int(peak)
