"""CPU linear layers (backend/cpu_linear.py) against plain ``F.linear``: the oneDNN-packed
weights give the same products, the int8 weight-only layer is its dequantised matmul, and
the engine's greedy tokens do not depend on packing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from backend import Engine, EngineConfig, SamplingParams
from backend.cpu_linear import Int8Linear, PackedLinear, onednn_packing_available, replace_linears


def test_onednn_packing_is_available_here() -> None:
    # The CPU default depends on it; a torch build without oneDNN would silently fall back.
    assert onednn_packing_available()


@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(960, 576, generator=gen)
    b = torch.randn(960, generator=gen) if bias else None
    x = torch.randn(rows, 576, generator=gen)
    layer = PackedLinear(weight, b)
    torch.testing.assert_close(layer(x), F.linear(x, weight, b), atol=1e-4, rtol=1e-5)
    # Non-contiguous input rows (a slice of a wider activation), as the model produces.
    wide = torch.randn(rows, 1152, generator=gen)
    torch.testing.assert_close(layer(wide[:, :576]), F.linear(wide[:, :576], weight, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_its_dequantised_matmul(bias: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(256, 192, generator=gen)
    b = torch.randn(256, generator=gen) if bias else None
    layer = Int8Linear(weight, b)
    dequantised = layer.qweight.float() * layer.scales.float().unsqueeze(1)
    # Per-channel rounding error at most half a step (bf16 scales add their own rounding).
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((dequantised - weight).abs() <= 0.51 * step + 1e-2 * weight.abs()).all()
    x = torch.randn(16, 192, generator=gen)
    expected = F.linear(x.bfloat16().float(), dequantised, b)
    torch.testing.assert_close(layer(x), expected, atol=0.05, rtol=0.02)
    assert layer(x).dtype == torch.float32


def test_replace_linears_replaces_every_linear_below() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4, bias=False), nn.ReLU()))
    assert replace_linears(model, PackedLinear) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


def test_engine_tokens_do_not_depend_on_packing(model_dir: Path, prose_ids: list[int]) -> None:
    prompts = [prose_ids[:5], prose_ids[40:140], prose_ids[300:331]]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    results = []
    for packing in (True, False):
        engine = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=128, cpu_weight_packing=packing))
        layer = engine.runner.model.model.layers[0].mlp.down_proj
        assert isinstance(layer, PackedLinear) == packing
        results.append([o.token_ids for o in engine.generate(prompts, params)])
    assert results[0] == results[1]
