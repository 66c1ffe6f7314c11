"""LoRA in a packed step: which token rows use which adapter, and the batched delta.

The model runner builds a ``LoRAStep`` for each step that holds adapter requests (rows of
one request are contiguous in the packed batch); ``CausalLM.forward`` makes it current for
the forward pass, and each projection adds ``add_lora(out, x, layer, projection)`` to its
output. Every adapter of the step is stacked (ranks are small, so each row multiplies
every adapter's A: a few extra MFLOP), a mask keeps each row's own columns, and one
expand adds all deltas: three calls per projection, whatever the number of adapters or
requests. ``add_lora_per_row`` is the slow, obvious reference it is tested against.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from backend.lora.adapter import PROJECTIONS, LoRAAdapter


@dataclass
class LoRAStack:
    """Several adapters' weights side by side, per layer and projection: A matrices stacked
    ``[sum of their ranks, in]``, expands ``[sum of ranks, out]``, and which columns are whose."""
    a: list[dict[str, torch.Tensor]]
    b_t: list[dict[str, torch.Tensor]]
    columns: dict[str, dict[int, tuple[int, int]]]    # projection -> id(adapter) -> its rank columns

    @classmethod
    def of(cls, adapters: list[LoRAAdapter]) -> "LoRAStack":
        num_layers = len(adapters[0].layers)
        a: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
        b_t: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
        columns: dict[str, dict[int, tuple[int, int]]] = {}
        for projection in PROJECTIONS:
            # Which projections an adapter adapts does not vary by layer (PEFT's target_modules).
            having = [ad for ad in adapters if projection in ad.layers[0]]
            if not having:
                continue
            start = 0
            columns[projection] = {}
            for adapter in having:
                width = adapter.layers[0][projection].a.shape[0]
                columns[projection][id(adapter)] = (start, start + width)
                start += width
            for layer in range(num_layers):
                a[layer][projection] = torch.cat([ad.layers[layer][projection].a for ad in having])
                b_t[layer][projection] = torch.cat([ad.layers[layer][projection].b_t for ad in having])
        return cls(a, b_t, columns)


# Stacks by the set of adapter objects (several engines may share a process, and their
# lora_ids overlap): decode steps with the same adapters reuse one. Each entry holds its
# adapters, so that their id()s cannot be reused while it is cached.
_STACKS: dict[tuple[int, ...], tuple[list[LoRAAdapter], LoRAStack]] = {}
MAX_CACHED_STACKS = 8


def stack_for(adapters: list[LoRAAdapter]) -> LoRAStack:
    ordered = sorted(adapters, key=id)
    key = tuple(id(a) for a in ordered)
    entry = _STACKS.get(key)
    if entry is None:
        if len(_STACKS) >= MAX_CACHED_STACKS:
            _STACKS.pop(next(iter(_STACKS)))
        entry = _STACKS[key] = (ordered, LoRAStack.of(ordered))
    return entry[1]


@dataclass
class LoRAStep:
    """The step's adapters stacked, and per projection a 0/1 mask ``[tokens, sum of ranks]``
    that keeps each token row's own adapter's columns: the delta of every row is then
    ``((x @ A_all.T) * mask) @ B_all``, three calls per projection whatever the adapters."""
    stack: LoRAStack
    masks: dict[str, torch.Tensor]

    @classmethod
    def build(cls, ranges: list[tuple[LoRAAdapter | None, int, int]], device: torch.device,
              dtype: torch.dtype | None = None) -> "LoRAStep | None":
        """From each request's (adapter or None, first token row, end row), in batch order."""
        adapters = {id(a): a for a, start, end in ranges if a is not None and end > start}
        if not adapters:
            return None
        stack = stack_for(list(adapters.values()))
        num_tokens = max(end for _, _, end in ranges)
        dtype = dtype or next(iter(stack.a[0].values())).dtype
        masks = {}
        for projection, columns in stack.columns.items():
            width = max(end for _, end in columns.values())
            mask = torch.zeros(num_tokens, width, dtype=dtype)
            for adapter, start, end in ranges:
                if adapter is not None and id(adapter) in columns:
                    c0, c1 = columns[id(adapter)]
                    mask[start:end, c0:c1] = 1
            masks[projection] = mask.to(device)
        return cls(stack, masks)


_current: LoRAStep | None = None   # only the engine loop thread runs forward passes


@contextmanager
def lora_step(step: LoRAStep | None) -> Iterator[None]:
    global _current
    _current = step
    try:
        yield
    finally:
        _current = None


def add_lora(out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> None:
    """``out += delta`` for the rows of every adapter of the current step (in place)."""
    step = _current
    if step is None:
        return
    a = step.stack.a[layer].get(projection)
    if a is None:
        return
    shrunk = x @ a.T                       # every row against every adapter's A: ranks are small
    shrunk.mul_(step.masks[projection])    # keep each row's own adapter's columns (none for the base model)
    out.addmm_(shrunk, step.stack.b_t[layer][projection])


def add_lora_per_row(out: torch.Tensor, x: torch.Tensor, layer: int, projection: str,
                     row_adapters: list[LoRAAdapter | None]) -> None:
    """The reference: each row on its own, A then B of each part, in float32."""
    for row, adapter in enumerate(row_adapters):
        weights = adapter.layers[layer].get(projection) if adapter is not None else None
        if weights is None:
            continue
        for part in weights.parts:
            a = weights.a[part.rank_start:part.rank_end].float()
            delta = part.b.float() @ (a @ x[row].float())
            out[row, part.out_start:part.out_end] += delta.to(out.dtype)
