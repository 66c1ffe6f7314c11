"""The bfloat16 LM head with float32 logits (kernels/csrc/linear_bf16.c through
``Float32Logits``) against the reference: ``F.linear`` on the widened operands, whose
products are the same exact values (only the summation order differs). The kernel needs
AVX512_BF16; on a CPU without it the float32-copy path runs and the test says so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from backend.model.cpu_linear import Float32Logits, pack_pairs
from kernels import cpu_native


def test_which_path_runs_here() -> None:
    head = Float32Logits(torch.randn(40, 8).bfloat16())
    kernel = head.packed_weight is not None
    print(f"Float32Logits on this CPU: {'the AVX512_BF16 kernel' if kernel else 'NOT the kernel (no AVX512_BF16): float32 copy'}")
    assert kernel == cpu_native.linear_bf16_available()


def test_pack_pairs_layout() -> None:
    weight = torch.arange(20 * 6, dtype=torch.float32).view(20, 6).bfloat16()
    packed = pack_pairs(weight)                                    # [2 panels, 3 pairs, 16, 2]
    assert packed.shape == (2, 3, 16, 2)
    assert torch.equal(packed[0, 1, 5], weight[5, 2:4])            # column 5, inputs 2 and 3
    assert torch.equal(packed[1, 2, 3], weight[19, 4:6])           # column 16 + 3
    assert (packed[1, :, 4:] == 0).all()                           # padding past 20 columns


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64])
@pytest.mark.parametrize("out_features,in_features", [(16, 2), (49152 // 64, 576), (37, 130)])
def test_float32_logits_match_reference(rows: int, out_features: int, in_features: int) -> None:
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    storage = torch.full((rows, in_features + 6), float("nan")).bfloat16()   # row stride > in_features
    storage[:, :in_features] = torch.randn(rows, in_features, generator=gen).bfloat16()
    x = storage[:, :in_features]
    logits = Float32Logits(weight)(x)
    expected = F.linear(x.float(), weight.float())
    assert logits.dtype == torch.float32 and logits.shape == (rows, out_features)
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-5)
    # Far closer than bfloat16 logits could be: that is what the head is for.
    assert (logits - expected).abs().max() < (expected.bfloat16().float() - expected).abs().max() / 10 + 1e-6


@pytest.mark.parametrize("threads", [1, 3])
def test_float32_logits_on_several_threads(threads: int) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(threads)
        weight = torch.randn(300, 64, generator=gen).bfloat16()
        x = torch.randn(21, 64, generator=gen).bfloat16()
        torch.testing.assert_close(Float32Logits(weight)(x), F.linear(x.float(), weight.float()), atol=1e-4,
                                   rtol=1e-5)
    finally:
        torch.set_num_threads(previous)


def test_float32_copy_path_where_the_kernel_is_missing(monkeypatch) -> None:
    """What a CPU without AVX512_BF16 runs (covered on every machine)."""
    monkeypatch.setattr(cpu_native, "linear_bf16_available", lambda: False)
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(50, 32, generator=gen).bfloat16()
    x = torch.randn(5, 32, generator=gen).bfloat16()
    head = Float32Logits(weight)
    assert head.packed_weight is None
    torch.testing.assert_close(head(x), F.linear(x.float(), weight.float()), atol=1e-5, rtol=1e-5)
