"""Triton kernels over the paged KV cache: the fast path of ``kernels.reference``.

Same layout and semantics as the reference (read that module's docstring first):

- ``reshape_and_cache``: one program per new token copies its K and V rows into the cache
  slot ``slot_mapping[token]``; slots < 0 (padding) are skipped.
- ``paged_attention``: one launch for the whole packed batch, whatever mix of prefill
  chunks and decodes it holds. Each program owns a *tile*: up to ``BLOCK_Q`` consecutive
  query tokens of one sequence times the ``GROUP`` query heads that share one KV head
  (grouped-query attention packs those heads into the rows of one matrix, so every K/V
  element loaded serves all of them). It walks the sequence's keys ``BLOCK_N`` at a time,
  gathering each key's physical address through the block table, and keeps an online
  (flash-attention) softmax in float32.
- Split-KV: a small decode batch gives too few tiles to fill the GPU, so the key range can
  be cut into ``num_splits`` parts computed by separate programs; a second kernel merges
  the partial results with their log-sum-exp weights. Every split's range is computed
  from ``seq_lens`` on the device, so the launch shape depends only on tensor shapes and
  a CUDA graph can replay it.
- Attention sinks (gpt-oss; ``sinks``, one logit per query head): without splits each row's
  online softmax starts from its head's sink (running max = the sink, running sum = 1, nothing
  accumulated), which adds exactly the sink's term to the denominator; with splits the merge
  adds it once, beside the splits' sums.
- Logit soft-capping (Gemma 2; ``softcap``): each scaled score is capped before the mask, a
  compile-time switch (``HAS_SOFTCAP``), so uncapped models run the same code as before.

Mapping programs to tiles without a host sync: sequence ``i`` owns the tile slots starting
at ``query_start_loc[i] // BLOCK_Q + i``; that gives every sequence at least
``cdiv(n_i, BLOCK_Q)`` slots, the grid is ``num_tokens // BLOCK_Q + num_seqs`` and a
program finds its sequence by binary search over ``query_start_loc``. Slots a sequence
does not need exit at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl


# ---- cache write -----------------------------------------------------------------------------
@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_cache_block, stride_cache_offset, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_ELEMENTS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # a padding slot writes nothing
    offs = tl.arange(0, BLOCK_ELEMENTS)
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    mask = offs < NUM_KV_HEADS * HEAD_DIM
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = block * stride_cache_block + offset * stride_cache_offset + head * stride_cache_head + dim
    k = tl.load(key_ptr + token * stride_key_token + head * stride_key_head + dim, mask=mask)
    v = tl.load(value_ptr + token * stride_value_token + head * stride_value_head + dim, mask=mask)
    tl.store(key_cache_ptr + dst, k, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


@dataclass
class KernelLaunch:
    """One kernel launch, fully resolved: what ``kernel[grid](*args, **constexprs)`` runs.
    Kept as data so tests can also compile exactly these launches ahead of time for a GPU
    they do not have (tests/test_kernels_compile.py)."""
    kernel: Any                      # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]
    options: dict[str, int] = field(default_factory=dict)   # num_warps, num_stages

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options)


def cache_write_launch(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> KernelLaunch:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key.dtype == key_cache.dtype and value.dtype == value_cache.dtype
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and key_cache.stride(-1) == 1
    assert key_cache.stride() == value_cache.stride()
    return KernelLaunch(
        _reshape_and_cache_kernel, (num_tokens,),
        (key, value, key_cache, value_cache, slot_mapping,
         key.stride(0), key.stride(1), value.stride(0), value.stride(1),
         key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)),
        dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=key_cache.shape[1],
             BLOCK_ELEMENTS=triton.next_power_of_2(num_kv_heads * head_dim)))


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if key.shape[0] == 0:
        return
    if key.dtype != key_cache.dtype:
        # The kernel is a pure copy; casting here rounds exactly as the reference does.
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    cache_write_launch(key, value, key_cache, value_cache, slot_mapping)()


# ---- attention -------------------------------------------------------------------------------
# The batch's counts change every step: left unspecialised (Triton would otherwise compile a
# variant per "== 1" / "divisible by 16" combination as they first occur, mid-serving).
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "window"])
def _paged_attention_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    partial_out_ptr, partial_max_ptr, partial_sum_ptr, sinks_ptr,
    scale, softcap, num_seqs, num_tokens, window,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_cache_block, stride_cache_offset, stride_cache_head, stride_block_table,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DECODE_ONLY: tl.constexpr, DOT_IN_FP32: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE_ONLY:
        seq = tile  # one query per sequence: tile i is sequence i
    else:
        # The last sequence whose first tile slot is <= tile (binary search).
        lo: tl.int32 = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    num_queries = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if DECODE_ONLY:
        local_tile = 0
    else:
        local_tile = tile - (q_start // BLOCK_Q + seq)
    if local_tile * BLOCK_Q >= num_queries:
        return  # a tile slot this sequence does not need
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - num_queries

    # Row m of the tile is query token m // GROUP of the tile, head kv_head * GROUP + m % GROUP.
    rows = tl.arange(0, BLOCK_M)
    query_index = local_tile * BLOCK_Q + rows // GROUP             # within the sequence's queries
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (query_index < num_queries)
    query_pos = context_len + query_index                           # absolute position
    token = (q_start + query_index).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM

    q = tl.load(query_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    # Keys this tile can see: up to the position of its last query (causal), from the first
    # key its first query's sliding window holds (window > 0; 0: every key).
    last_query = tl.minimum(local_tile * BLOCK_Q + BLOCK_Q, num_queries) - 1
    num_keys = context_len + last_query + 1
    first_key = tl.where(window > 0, tl.maximum(context_len + local_tile * BLOCK_Q - window + 1, 0), 0)
    first_key_tile = first_key // BLOCK_N
    num_key_tiles = tl.cdiv(num_keys, BLOCK_N)
    if NUM_SPLITS == 1:
        key_tile_lo = first_key_tile
        key_tile_hi = num_key_tiles
    else:
        tiles_per_split = tl.cdiv(num_key_tiles - first_key_tile, NUM_SPLITS)
        key_tile_lo = first_key_tile + split * tiles_per_split
        key_tile_hi = tl.minimum(key_tile_lo + tiles_per_split, num_key_tiles)

    if HAS_SINKS and NUM_SPLITS == 1:
        # The sink's column of the softmax, seen first: max = sink, sum = exp(sink - sink), no value.
        row_max = tl.load(sinks_ptr + head).to(tl.float32)
        row_sum = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:       # with splits the merge adds the sink once
        row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    for key_tile in range(key_tile_lo, key_tile_hi):
        key_pos = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        # Keys before the window are not even loaded: their blocks may have been released.
        key_valid = (key_pos < num_keys) & (key_pos >= first_key)
        physical_block = tl.load(block_table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        key_offset = (physical_block * stride_cache_block + (key_pos % BLOCK_SIZE) * stride_cache_offset
                      + kv_head * stride_cache_head)
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        # Masked loads (other=0) keep unwritten cache slots, NaN or not, out of the sums.
        k = tl.load(key_cache_ptr + key_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + key_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0)

        if DOT_IN_FP32:
            scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = scores * scale
        if HAS_SOFTCAP:
            # softcap * tanh(scores / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to
            # +-1 without NaN where exp overflows or vanishes.
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        visible = (key_pos[None, :] <= query_pos[:, None]) & key_valid[None, :]
        visible = visible & ((window <= 0) | (key_pos[None, :] > query_pos[:, None] - window))
        scores = tl.where(visible, scores, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row that has seen no visible key yet keeps max -inf; subtracting 0 instead avoids NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp(scores - safe_max[:, None])
        correction = tl.exp(row_max - safe_max)
        row_sum = row_sum * correction + tl.sum(probs, axis=1)
        # P is rounded to the cache dtype for the P@V product (flash-attention practice).
        probs = probs.to(v.dtype)
        if DOT_IN_FP32:
            acc = acc * correction[:, None] + tl.dot(probs.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * correction[:, None] + tl.dot(probs, v)
        row_max = new_max

    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
    out_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + token[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials are [NUM_SPLITS, num_tokens, NUM_HEADS, HEAD_DIM] (+ max/sum without HEAD_DIM).
        stat = (split * num_tokens + token) * NUM_HEADS + head
        tl.store(partial_out_ptr + stat[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)
        tl.store(partial_max_ptr + stat, row_max, mask=row_valid)
        tl.store(partial_sum_ptr + stat, row_sum, mask=row_valid)


@triton.jit(do_not_specialize=["num_tokens"])
def _merge_splits_kernel(
    out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, sinks_ptr, num_tokens,
    stride_o_token, stride_o_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PADDED: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    split_valid = splits < NUM_SPLITS
    stat = (splits * num_tokens + token) * NUM_HEADS + head
    split_max = tl.load(partial_max_ptr + stat, mask=split_valid, other=float("-inf"))
    split_sum = tl.load(partial_sum_ptr + stat, mask=split_valid, other=0.0)
    global_max = tl.max(split_max, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        global_max = tl.maximum(global_max, sink)
    # Each split's output is normalised by its own sum; reweight by its share of the total.
    weight = tl.where(split_max == float("-inf"), 0.0, split_sum * tl.exp(split_max - global_max))
    part = tl.load(partial_out_ptr + stat[:, None] * HEAD_DIM + dims[None, :],
                   mask=split_valid[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(weight, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - global_max)      # the sink's share of the denominator, no value
    out = tl.sum(part * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_o_token + head * stride_o_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@dataclass(frozen=True)
class LaunchPlan:
    """Tile shapes of one launch; chosen on the host from shapes only (graph-safe)."""
    block_m: int      # rows per tile = query tokens x grouped heads (a power of two, >= 16 for tl.dot)
    block_q: int      # query tokens per tile
    block_n: int      # keys per inner step
    num_splits: int   # key-range splits (1 = no split-KV)
    decode_only: bool = False  # every sequence has exactly one query: one tile per sequence


def plan_launch(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int,
                max_query_len: int, max_seq_len: int, num_sms: int, interpreter: bool = False) -> LaunchPlan:
    group = num_heads // num_kv_heads
    decode_only = max_query_len <= 1 and num_tokens == num_seqs
    if max_query_len <= 1:
        # Decode: one query per sequence, so the tile rows are just the grouped heads.
        block_m = max(16, triton.next_power_of_2(group))
        block_q = 1
    else:
        block_m = max(128 if interpreter else 64, triton.next_power_of_2(group))
        block_q = block_m // group
    # The interpreter pays per operation, not per element: wider key tiles run faster there.
    block_n = 128 if interpreter else 64
    num_splits = 1
    if max_query_len <= 1:
        # Few (sequence, KV head) programs cannot keep every SM busy; cut long key ranges
        # so that roughly two programs per SM exist, never below 256 keys per split.
        programs = num_seqs * num_kv_heads
        wanted = triton.cdiv(2 * num_sms, max(programs, 1))
        by_length = triton.cdiv(max_seq_len, 256)
        num_splits = max(1, min(wanted, by_length, 32))
    return LaunchPlan(block_m, block_q, block_n, num_splits, decode_only)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a small number still exercises split-KV in tests


def attention_launches(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                       scale: float, plan: LaunchPlan, out: torch.Tensor, window: int | None = None,
                       sinks: torch.Tensor | None = None, softcap: float | None = None) -> list[KernelLaunch]:
    """The attention launch, then the split merge when the plan splits the keys. ``window``:
    a sliding window of keys (kernels/reference.py), None for every key; ``sinks``: one
    softmax sink logit per query head (``[num_heads]``, read as float32), None for none;
    ``softcap``: each score soft-capped (Gemma 2), None for none."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    assert query.stride(-1) == 1 and key_cache.stride(-1) == 1 and key_cache.stride() == value_cache.stride()
    if plan.decode_only and num_tokens != num_seqs:
        raise ValueError("a decode-only plan needs exactly one query per sequence")
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.stride(0) == 1, "sinks: one logit per query head"
    # tl.dot needs K >= 16 for 16-bit inputs; padded dims are masked to zero.
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    num_tiles = num_seqs if plan.decode_only else num_tokens // plan.block_q + num_seqs
    if plan.num_splits > 1:
        partial_out = torch.empty((plan.num_splits, num_tokens, num_heads, head_dim),
                                  dtype=torch.float32, device=query.device)
        partial_max = torch.empty((plan.num_splits, num_tokens, num_heads), dtype=torch.float32,
                                  device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = out  # unused
    launches = [KernelLaunch(
        _paged_attention_kernel, (num_tiles, num_kv_heads, plan.num_splits),
        (out, query, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
         partial_out, partial_max, partial_sum, out if sinks is None else sinks,   # out: unused
         scale, softcap or 0.0, num_seqs, num_tokens, window or 0,
         query.stride(0), query.stride(1), out.stride(0), out.stride(1),
         key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0)),
        dict(NUM_HEADS=num_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
             HEAD_DIM_PADDED=head_dim_padded, BLOCK_SIZE=key_cache.shape[1], BLOCK_M=plan.block_m,
             BLOCK_Q=plan.block_q, BLOCK_N=plan.block_n, NUM_SPLITS=plan.num_splits,
             DECODE_ONLY=plan.decode_only, DOT_IN_FP32=_dot_in_fp32(query), HAS_SINKS=sinks is not None,
             HAS_SOFTCAP=softcap is not None),
        dict(num_warps=4, num_stages=2))]
    if plan.num_splits > 1:
        launches.append(KernelLaunch(
            _merge_splits_kernel, (num_tokens, num_heads),
            (out, partial_out, partial_max, partial_sum, out if sinks is None else sinks, num_tokens,
             out.stride(0), out.stride(1)),
            dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PADDED=head_dim_padded,
                 NUM_SPLITS=plan.num_splits, SPLITS_PADDED=triton.next_power_of_2(plan.num_splits),
                 HAS_SINKS=sinks is not None)))
    return launches


def _dot_in_fp32(query: torch.Tensor) -> bool:
    """float32 models get IEEE float32 products (not TF32), so greedy outputs match the
    reference. Triton's CPU interpreter mis-computes bfloat16 ``tl.dot``; there the
    bfloat16 operands are widened first, which gives the same products (a bf16 x bf16
    product is exact in fp32) summed in fp32, as the tensor cores do."""
    return query.dtype == torch.float32 or (query.device.type == "cpu" and query.dtype == torch.bfloat16)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, max_query_len: int | None = None, max_seq_len: int | None = None,
                    plan: LaunchPlan | None = None, out: torch.Tensor | None = None,
                    window: int | None = None, sinks: torch.Tensor | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Drop-in for ``paged_attention_reference`` (``window``, ``sinks`` and ``softcap`` included).
    ``max_query_len`` / ``max_seq_len`` are host-side bounds (the model runner knows them);
    without them they are read from the tensors, which costs a device sync. ``plan`` overrides the tile shapes (tests, CUDA
    graphs); ``out`` receives the result when given."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    out = torch.empty_like(query) if out is None else out
    if num_tokens == 0:
        return out
    if plan is None:
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        plan = plan_launch(num_tokens, num_seqs, num_heads, num_kv_heads, max_query_len, max_seq_len,
                           _num_sms(query.device), interpreter=query.device.type == "cpu")
    for launch in attention_launches(query, key_cache, value_cache, query_start_loc, seq_lens, block_tables,
                                     scale, plan, out, window, sinks, softcap):
        launch()
    return out
