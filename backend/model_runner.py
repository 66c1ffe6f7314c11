"""Turns a scheduled step into one packed forward pass and returns next-token logits.

Owns the model weights and the per-layer KV tensors ``[num_blocks, block_size,
num_kv_heads, head_dim]``; the block ids come from the KV-cache manager.
"""

from __future__ import annotations

import torch

from backend.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from backend.model import AttentionMetadata, ModelArchitecture, load_model
from backend.request import Request

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.dtype]


class ModelRunner:
    def __init__(self, config: EngineConfig, arch: ModelArchitecture) -> None:
        self.config = config
        self.arch = arch
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        self.block_size = config.block_size
        self.model = load_model(config.model, arch, self.dtype, self.device, config.load_format, config.seed)
        self.num_blocks = config.num_kv_blocks or self._blocks_from_budget()
        shape = (self.num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(arch.num_layers)]

    @property
    def bytes_per_block(self) -> int:
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.arch.num_layers * self.block_size * self.arch.num_kv_heads * self.arch.head_dim * element

    def _blocks_from_budget(self) -> int:
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                used_by_others = total - free
                budget = int(total * self.config.gpu_memory_utilization) - used_by_others
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        num_blocks = budget // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"KV budget of {budget} bytes holds no block of {self.bytes_per_block} bytes")
        return int(num_blocks)

    def prepare(self, requests: list[Request], num_scheduled: dict[str, int],
                block_ids: dict[str, list[int]]) -> tuple[torch.Tensor, AttentionMetadata, list[Request]]:
        """Pack the step. Returns input ids, metadata and the requests that sample this step
        (those whose counter reaches the end of their token list), in logits-row order."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampling: list[Request] = []
        max_blocks = max(len(block_ids[r.request_id]) for r in requests)
        block_tables = torch.zeros((len(requests), max_blocks), dtype=torch.int32)
        for row, request in enumerate(requests):
            start = request.num_computed_tokens
            end = start + num_scheduled[request.request_id]
            blocks = block_ids[request.request_id]
            input_ids.extend(request.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            block_tables[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            if end == request.num_tokens:
                logits_indices.append(len(input_ids) - 1)
                sampling.append(request)
        device = self.device
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        )
        return torch.tensor(input_ids, dtype=torch.int64, device=device), meta, sampling

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, meta, self.kv_caches)
