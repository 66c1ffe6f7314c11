"""LoRA in the forward pass: the step's adapters, current while the model runs.

The runner builds a ``LoRABatch`` for each step that holds adapter requests (each token
row's slot, backend/lora/slots.py); ``CausalLM.forward`` makes it current with ``lora_batch``,
and each projection calls ``add_lora(out, x, layer, projection)`` after its base matmul.
``add_lora_per_row`` is the slow, obvious reference the batched paths are tested against.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from backend.lora.adapter import LoRAAdapter
from backend.lora.slots import LoRABatch

_current: LoRABatch | None = None   # only the engine loop thread runs forward passes


@contextmanager
def lora_batch(batch: LoRABatch | None) -> Iterator[None]:
    global _current
    _current = batch
    try:
        yield
    finally:
        _current = None


def add_lora(out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> None:
    """``out += delta`` for the rows of every adapter of the current step (in place)."""
    batch = _current
    if batch is not None:
        batch.slots.apply(out, x, layer, projection, batch)


def add_lora_per_row(out: torch.Tensor, x: torch.Tensor, layer: int, projection: str,
                     row_adapters: list[LoRAAdapter | None]) -> None:
    """The reference: each row on its own, A then B of each part, in float32."""
    for row, adapter in enumerate(row_adapters):
        weights = adapter.layers[layer].get(projection) if adapter is not None else None
        if weights is None:
            continue
        for part in weights.parts:
            a = weights.a[part.rank_start:part.rank_end].float()
            delta = (a @ x[row].float()) @ part.b_t.float()
            out[row, part.out_start:part.out_end] += delta.to(out.dtype)
