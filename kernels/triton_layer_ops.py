"""The small per-layer ops fused for the GPU path, in Triton: the twin of the C layer ops.

A decoder layer's torch ops outside the matmuls and attention (RMSNorm in float32 with its
casts, the residual adds, RoPE's slice-negate-concatenate-multiply-add, the cache write) are
~20 small kernel launches. A Llama-1B decode step replayed from a CUDA graph spent a large
share of its GPU time in ~300 of them (benchmarks/gpu_decode_profile.py;
docs/benchmarks.md, "First GPU run"). These two kernels do the same work in three launches a
layer, with the same contracts as ``kernels.cpu_native.add_rms_norm`` and
``kernels.cpu_native.rope_and_cache``, so ``CausalLM`` runs either behind one seam:

- ``add_rms_norm``: ``residual += delta`` (rounded to the stream's dtype), then
  ``out = weight * RMSNorm(residual)``: float32 statistics, the normalised row rounded to the
  dtype before the weight multiplies it (transformers' LlamaRMSNorm).
- ``rope_and_cache``: rotate-half RoPE on the q and k heads of the packed qkv rows, in place,
  each product rounded to the dtype before the add (torch's order), then k and v written to
  their cache slots (slot < 0: padding, not written).

The torch ops in ``backend/model/llama.py`` are the reference; tests/test_layer_ops.py
checks these against them (under ``TRITON_INTERPRET=1`` on CPU) and tests/test_kernels_compile.py
compiles them for sm_90 and sm_80.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels import triton_interpreter_enabled
from kernels.triton_attention import KernelLaunch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Read once, as Triton reads it once when a kernel module is imported: the launches below are
# on every layer of every step.
_INTERPRETED = triton_interpreter_enabled()


@triton.jit
def _round(x, dtype: tl.constexpr, BF16_BY_BITS: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` (to nearest, ties to even). BF16_BY_BITS: by integer
    arithmetic on the float32 bits, for Triton's CPU interpreter, whose float32 -> bfloat16
    cast truncates; a GPU's cast rounds, and the branch is compiled out there."""
    if BF16_BY_BITS:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)   # a NaN stays a NaN
    return x.to(dtype)


def _bf16_by_bits(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and _INTERPRETED


def _rows_per_program(rows: int) -> int:
    """One row (token) per program on a GPU. Triton's CPU interpreter pays a large fixed cost
    a program whatever its size, so there a program takes up to 256 rows."""
    return min(triton.next_power_of_2(rows), 256) if _INTERPRETED else 1


# The step's row / token counts are left unspecialised: see kernels/triton_attention.py.
@triton.jit(do_not_specialize=["num_rows"])
def _add_rms_norm_kernel(residual_ptr, delta_ptr, weight_ptr, out_ptr, num_rows, hidden, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         BF16_BY_BITS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < num_rows) & (cols < hidden)
    at = rows.to(tl.int64) * hidden + cols
    dtype = out_ptr.dtype.element_ty
    h = tl.load(residual_ptr + at, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + at, mask=mask, other=0.0)
        h = _round(h.to(tl.float32) + delta.to(tl.float32), dtype, BF16_BY_BITS)
        tl.store(residual_ptr + at, h, mask=mask)
    x = h.to(tl.float32)
    # Correctly rounded, as torch's CPU ops and layer_ops.c are (a GPU's default sqrt and
    # division are approximate).
    inv_rms = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=1) / hidden + eps))
    weight = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    normed = _round(x * inv_rms[:, None], dtype, BF16_BY_BITS).to(tl.float32)
    tl.store(out_ptr + at, _round(weight * normed, dtype, BF16_BY_BITS), mask=mask)


def add_rms_norm_launch(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                        out: torch.Tensor, eps: float) -> KernelLaunch:
    rows, hidden = residual.shape
    assert residual.is_contiguous() and out.is_contiguous() and out.shape == residual.shape
    assert delta is None or (delta.is_contiguous() and delta.shape == residual.shape)
    assert residual.dtype == out.dtype and weight.shape == (hidden,) and weight.is_contiguous()
    block, block_rows = triton.next_power_of_2(hidden), _rows_per_program(rows)
    return KernelLaunch(
        _add_rms_norm_kernel, (triton.cdiv(rows, block_rows),),
        (residual, residual if delta is None else delta, weight, out, rows, hidden, float(eps)),
        dict(HAS_DELTA=delta is not None, BLOCK=block, BLOCK_ROWS=block_rows,
             BF16_BY_BITS=_bf16_by_bits(residual.dtype)),
        dict(num_warps=min(16, max(4, block // 512))))


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
                 eps: float) -> None:
    """``residual += delta`` (when given), then ``out = RMSNorm(residual) * weight``; all
    [rows, hidden] contiguous, one program per row on a GPU."""
    if residual.shape[0]:
        add_rms_norm_launch(residual, delta, weight, out, eps)()


@triton.jit(do_not_specialize=["num_tokens"])
def _rope_and_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, key_cache_ptr, value_cache_ptr, num_tokens,
                           stride_qkv, stride_cache_block, stride_cache_offset, stride_cache_head,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, ROTATED_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                           HALF: tl.constexpr, DIM: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
                           BF16_BY_BITS: tl.constexpr):
    dtype = qkv_ptr.dtype.element_ty
    # [token, head, i]: the program's tokens x (the q heads, then the k heads) x the first half
    # of head_dim.
    tokens = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)[:, None, None]
    heads = tl.arange(0, ROTATED_HEADS)[None, :, None]
    i = tl.arange(0, HALF)[None, None, :]
    token_ok = tokens < num_tokens
    in_half = i < HEAD_DIM // 2
    mask = token_ok & (heads < NUM_HEADS + NUM_KV_HEADS) & in_half
    row = qkv_ptr + tokens.to(tl.int64) * stride_qkv
    first = row + heads * HEAD_DIM + i
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HEAD_DIM // 2, mask=mask, other=0.0).to(tl.float32)
    angles = tokens.to(tl.int64) * HEAD_DIM + i
    angle_mask = token_ok & in_half
    cos1 = tl.load(cos_ptr + angles, mask=angle_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + angles + HEAD_DIM // 2, mask=angle_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + angles, mask=angle_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + angles + HEAD_DIM // 2, mask=angle_mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin with torch's roundings: each product in the dtype, then the sum.
    y1 = _round(_round(x1 * cos1, dtype, BF16_BY_BITS).to(tl.float32)
                - _round(x2 * sin1, dtype, BF16_BY_BITS).to(tl.float32), dtype, BF16_BY_BITS)
    y2 = _round(_round(x2 * cos2, dtype, BF16_BY_BITS).to(tl.float32)
                + _round(x1 * sin2, dtype, BF16_BY_BITS).to(tl.float32), dtype, BF16_BY_BITS)
    tl.store(first, y1, mask=mask)
    tl.store(first + HEAD_DIM // 2, y2, mask=mask)

    # The cache write: slot < 0 (padding) writes nothing.
    slot = tl.load(slots_ptr + tokens, mask=token_ok, other=-1).to(tl.int64)
    written = slot >= 0
    slot = tl.where(written, slot, 0)
    at = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_offset
    is_key = mask & written & (heads >= NUM_HEADS)
    key_row = key_cache_ptr + at + (heads - NUM_HEADS) * stride_cache_head + i
    tl.store(key_row, y1, mask=is_key)
    tl.store(key_row + HEAD_DIM // 2, y2, mask=is_key)
    kv_heads = tl.arange(0, KV_HEADS)[None, :, None]
    dims = tl.arange(0, DIM)[None, None, :]
    v_mask = token_ok & written & (kv_heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kv_heads) * HEAD_DIM + dims, mask=v_mask)
    tl.store(value_cache_ptr + at + kv_heads * stride_cache_head + dims, v, mask=v_mask)


def rope_and_cache_launch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                          key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                          head_dim: int) -> KernelLaunch:
    tokens = qkv.shape[0]
    assert qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == sin.shape == (tokens, head_dim)
    assert slots.shape == (tokens,) and slots.is_contiguous()
    assert key_cache.shape[2:] == (num_kv_heads, head_dim)
    assert key_cache.dtype == value_cache.dtype == qkv.dtype and key_cache.stride() == value_cache.stride()
    assert key_cache.stride(-1) == 1 and head_dim % 2 == 0
    block_tokens = _rows_per_program(tokens)
    return KernelLaunch(
        _rope_and_cache_kernel, (triton.cdiv(tokens, block_tokens),),
        (qkv, cos, sin, slots, key_cache, value_cache, tokens, qkv.stride(0),
         key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)),
        dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=key_cache.shape[1],
             ROTATED_HEADS=triton.next_power_of_2(num_heads + num_kv_heads),
             KV_HEADS=triton.next_power_of_2(num_kv_heads), HALF=triton.next_power_of_2(head_dim // 2),
             DIM=triton.next_power_of_2(head_dim), BLOCK_TOKENS=block_tokens,
             BF16_BY_BITS=_bf16_by_bits(qkv.dtype)),
        # No multiply-add contraction: each product rounds on its own, as torch's separate ops
        # (and layer_ops.c's fp-contract=off) do. With Triton's default on, the H200 gave bfloat16
        # rotations that differed from torch's in some bits (tests/test_layer_ops.py), most likely
        # from a bfloat16 multiply and subtract fused into one rounding.
        dict(enable_fp_fusion=False))


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                   key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> None:
    """Rotate the q and k heads of ``qkv`` [tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    in place and write k and v to cache slots ``slots`` (< 0: not written); one program per
    token on a GPU. cos/sin: [tokens, head_dim] contiguous, the qkv dtype; caches [num_blocks,
    block_size, num_kv_heads, head_dim]."""
    if qkv.shape[0]:
        rope_and_cache_launch(qkv, cos, sin, slots, key_cache, value_cache, num_heads, num_kv_heads, head_dim)()


@triton.jit(do_not_specialize=["num_rows"])
def _silu_and_mul_kernel(x_ptr, num_rows, inter, stride_row, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                         BF16_BY_BITS: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)[:, None]
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)[None, :]
    mask = (rows < num_rows) & (cols < inter)
    gate_at = x_ptr + rows.to(tl.int64) * stride_row + cols
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(gate_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_at + inter, mask=mask, other=0.0).to(tl.float32)
    # torch's two ops: SiLU (x / (1 + exp(-x)), rounded to the dtype), then the product, rounded.
    # On a GPU libdevice's exp, as torch's CUDA kernel calls expf: tl.exp there is exp2 of
    # x * log2(e), whose rounded product put the result ~10 float32 units off at |x| ~ 30 (an
    # H100). The interpreter has no libdevice; its tl.exp is numpy's, accurate.
    e = libdevice.exp(-gate) if LIBDEVICE_EXP else tl.exp(-gate)
    silu = _round(tl.div_rn(gate, 1.0 + e), dtype, BF16_BY_BITS).to(tl.float32)
    tl.store(gate_at, _round(silu * up, dtype, BF16_BY_BITS), mask=mask)


def silu_and_mul_launch(gate_up: torch.Tensor, inter: int) -> KernelLaunch:
    rows = gate_up.shape[0]
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] == 2 * inter
    block_rows = _rows_per_program(rows)
    # One program per row and 1,024 columns on a GPU; the whole width in the interpreter.
    block_cols = triton.next_power_of_2(inter) if _INTERPRETED else min(1024, triton.next_power_of_2(inter))
    return KernelLaunch(
        _silu_and_mul_kernel, (triton.cdiv(rows, block_rows), triton.cdiv(inter, block_cols)),
        (gate_up, rows, inter, gate_up.stride(0)),
        dict(BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, BF16_BY_BITS=_bf16_by_bits(gate_up.dtype),
             LIBDEVICE_EXP=not _INTERPRETED),
        dict(num_warps=4, enable_fp_fusion=False))


def silu_and_mul(gate_up: torch.Tensor, inter: int) -> None:
    """The MLP's activation in place: ``gate_up`` [tokens, 2 * inter] holds [gate | up] per row;
    the gate half becomes ``SiLU(gate) * up``."""
    if gate_up.shape[0]:
        silu_and_mul_launch(gate_up, inter)()
