"""Linear layers for CPU: prepacked for oneDNN, or weight-only int8 (opt-in).

``F.linear`` hands MKL the weight in its checkpoint layout, and MKL re-packs it into its
blocked layout on every call; for the decode batches an engine runs (tens of rows against
a weight of millions) that packing is a large share of the matmul. Packing each weight
once at load time, as PyTorch's own CPU inference path (inductor's weight freezing) does,
measured 1.6x faster for a decoder layer's projections and 2.5x for SmolLM2's 49152-row
LM head at 16 rows on a 2-core AVX2 EPYC (docs/benchmarks.md).

``F.linear`` stays the reference: ``EngineConfig.cpu_weight_packing=false`` serves with it,
and tests compare the two.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held in oneDNN's blocked layout (opaque tensor)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # No batch-size hint: one packed weight serves every number of rows.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int8Linear(nn.Module):
    """Weight-only int8 (``quantization=int8``): symmetric per-output-channel scales,
    ``W ~= scale[n] * Wq[n, :]``; the matmul runs in torch's int8 weight kernel with
    bfloat16 activations and the result is cast back. A quarter of float32's weight bytes;
    on the 2-core AVX2 EPYC measured slower than packed float32 from 16 rows up and faster
    for a single row (docs/benchmarks.md)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        weight = weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.qweight = torch.round(weight / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
        self.scales = scales.to(torch.bfloat16)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scales).to(x.dtype)
        return y if self.bias is None else y + self.bias


def replace_linears(module: nn.Module, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> int:
    """Replace every ``nn.Linear`` below ``module`` by ``make(weight, bias)``; returns how many.
    The original weights are dropped (the replacement keeps its own copy)."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child.weight, child.bias))
            count += 1
        else:
            count += replace_linears(child, make)
    return count
