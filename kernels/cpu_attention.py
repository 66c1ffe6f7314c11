"""Paged attention for CPU: every decode row of a step in one batched computation per layer.

The reference (``kernels/reference.py``) loops over sequences in Python and copies K/V per
query head; on CPU that loop dominated a decode step at 16 sequences. Here the
step's indices are derived from the block tables once (``plan_attention_cpu``) and every
layer reuses them:

- Decode rows (sequences with one new token) are attended together in one call. float32
  and bfloat16 caches go to the C kernel (``cpu_native``: reads each K/V element once,
  straight from the pages, on all cores, float32 arithmetic). Otherwise (float16, a query
  dtype other than the cache's, no C compiler) their K/V are gathered into a padded
  ``[num_decodes, num_kv_heads, max_len, head_dim]`` float32 tensor and
  ``scaled_dot_product_attention`` runs over it with ``enable_gqa`` (K/V are never repeated
  per query head) and a padding mask. That copies every decode's whole context per layer
  and step, so it is only the fallback: at 16 bfloat16 decodes of 300-1000 tokens it took
  many times the C kernel's time (benchmarks/decode_breakdown.py). Padding
  positions gather a slot the sequence owns, so nothing outside a sequence's own blocks is
  ever read (unused slots may hold garbage).
- Sequences with several new tokens (prefill chunks, fresh prompts) go to the C prefill
  kernel (float32 or bfloat16 pages, flash-attention style, causal blocks skipped; all of a
  step's prefills in one call). For bfloat16 it runs the build's own function or, where the
  start-up timing found one faster (backend/model/prefill_attention_choice.py), the float32-FMA
  or the float16 one (``cpu_native.select_prefill_bf16_kernel``: process-wide). Without the C
  kernel, each runs one SDPA call over its gathered
  float32 context with the causal mask aligned to the end of the cached context.
- Prefills of at least ``sdpa_min_tokens`` new tokens may instead go to torch's SDPA in the
  cache's own dtype, one call each (chosen at start-up by
  backend/model/prefill_attention_choice.py): its flash kernel runs oneDNN's brgemm, which uses
  AMX tiles for bfloat16 where the CPU has them, and no kernel of ours does for attention. A
  fresh prompt is plain causal attention over its own K/V; a chunk over cached context attends
  its gathered context with a mask. Without AVX-512 ours ran well ahead of SDPA
  (docs/benchmarks.md, "Prompt attention: ours against torch's SDPA"), so there it is never
  chosen.
- Sliding windows, attention sinks and logit soft-capping (``window``, ``sinks``, ``softcap``:
  the reference's meanings) go to the C kernels, which start each query's keys at its window,
  add the sinks and cap the scores. A layer with any of them sends its SDPA prefills to the C
  prefill kernel too (``CpuAttentionPlan.every_prefill``), and where the C kernels do not apply
  (torch's path) it goes through the reference.

Scores and softmax are float32 whatever the cache dtype, as in the reference.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_native
from kernels.reference import paged_attention_reference


class PrefillAttention(str, enum.Enum):
    """Which kernel attends prefills (fresh prompts and chunks over cached context) on CPU."""
    NATIVE = "native"    # our C prefill kernel, every prefill of a step in one call
    SDPA = "sdpa"        # torch's scaled_dot_product_attention (flash, in the cache's dtype), one
                         # call per prefill of at least a start-up-measured length


EVERY_PREFILL = 2        # sdpa_min_tokens that sends every prefill to SDPA (a prefill has 2+ new tokens)


@dataclass
class PrefillSpan:
    """One sequence with several query tokens: rows ``q_start:q_end`` of the packed batch."""
    q_start: int
    q_end: int
    slots: torch.Tensor   # [seq_len] cache slots of positions 0..seq_len-1
    # [num_queries, seq_len] bool, True where the query may attend; None for a fresh prompt
    # (no cached context: plain causal attention, SDPA's is_causal).
    mask: torch.Tensor | None


def prefill_span(starts: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor, seq: int,
                 block_size: int) -> PrefillSpan:
    """Sequence ``seq``'s span (``tables``: int64 block tables)."""
    q_start, q_end, seq_len = int(starts[seq]), int(starts[seq + 1]), int(seq_lens[seq])
    positions = torch.arange(seq_len)
    slots = tables[seq, positions // block_size] * block_size + positions % block_size
    # Query j is at absolute position context_len + j and sees keys 0..context_len + j.
    context_len = seq_len - (q_end - q_start)
    mask = (None if context_len == 0
            else positions.unsqueeze(0) <= (torch.arange(q_end - q_start) + context_len).unsqueeze(1))
    return PrefillSpan(q_start, q_end, slots, mask)


@dataclass
class TorchAttentionPlan:
    """The gather indices of torch's path (the fallback, and the torch K/V write)."""
    decode_slots: torch.Tensor | None    # [num_decodes * max_len] slots, row-major by sequence
    decode_mask: torch.Tensor | None     # [num_decodes, 1, 1, max_len] bool; None when no padding
    decode_max_len: int
    decodes_are_all_rows: bool           # every query row is a decode row, in order
    prefills: list[PrefillSpan]
    write_rows: torch.Tensor | None      # rows whose K/V are written (None: all rows)
    write_slots: torch.Tensor            # their slots


# The C prefill kernel's per-sequence arguments: first query rows, query lengths, sequence
# lengths (int64) and block tables (int32, contiguous).
PrefillArrays = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def prefill_arrays(starts: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                   seqs: torch.Tensor) -> PrefillArrays:
    """The C prefill kernel's arguments for sequences ``seqs`` of a step (``starts``: its
    query_start_loc, int64 on the host)."""
    query_lens = starts[1:] - starts[:-1]
    return (starts[seqs], query_lens[seqs], seq_lens[seqs],
            block_tables.index_select(0, seqs).to("cpu", torch.int32).contiguous())


@dataclass
class CpuAttentionPlan:
    """One step's attention indices, shared by every layer: what the C kernels read, built
    eagerly; torch's gather indices (``torch_plan``) only when a layer takes torch's path, since
    with the C kernels nothing reads them (building them costs time every step)."""
    decode_rows: torch.Tensor | None     # [num_decodes] query rows of one-token sequences
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64
    decode_tables: torch.Tensor | None    # [num_decodes, max_blocks] int32, contiguous
    prefill_starts: torch.Tensor | None  # [num_prefills] int64: first query row of each
    prefill_query_lens: torch.Tensor | None   # [num_prefills] int64
    prefill_seq_lens: torch.Tensor | None     # [num_prefills] int64
    prefill_tables: torch.Tensor | None       # [num_prefills, max_blocks] int32, contiguous
    # The step's metadata as torch_plan needs it: references to the model runner's step buffers,
    # so a plan is valid only within its own forward pass (as it is used).
    starts: torch.Tensor                 # [num_seqs + 1] int64 query_start_loc
    seq_lens: torch.Tensor               # [num_seqs] int64
    block_tables: torch.Tensor           # [num_seqs, max_blocks]
    slot_mapping: torch.Tensor
    block_size: int
    # The prefills torch's SDPA attends (sdpa_min_tokens). They are not in the prefill_* arrays
    # above, which then hold only the C kernel's prefills.
    sdpa_spans: tuple[PrefillSpan, ...] = ()

    @functools.cached_property
    def torch_plan(self) -> TorchAttentionPlan:
        return plan_torch_attention(self)

    @property
    def native_prefills(self) -> PrefillArrays | None:
        """The C prefill kernel's arguments for the prefills not in ``sdpa_spans`` (None: none)."""
        if self.prefill_starts is None:
            return None
        return self.prefill_starts, self.prefill_query_lens, self.prefill_seq_lens, self.prefill_tables

    @functools.cached_property
    def every_prefill(self) -> PrefillArrays | None:
        """``native_prefills`` for every prefill of the step, ``sdpa_spans`` included: for the layers
        SDPA cannot serve (``paged_attention_cpu`` says why). Built on first use."""
        if not self.sdpa_spans:
            return self.native_prefills
        seqs = (self.starts[1:] - self.starts[:-1] > 1).nonzero().squeeze(1)
        return prefill_arrays(self.starts, self.seq_lens, self.block_tables, seqs)


def plan_attention_cpu(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                       slot_mapping: torch.Tensor, block_size: int,
                       sdpa_min_tokens: int | None = None) -> CpuAttentionPlan:
    """Derive the step's C kernel indices from its metadata (host tensors; one pass). Prefills
    of at least ``sdpa_min_tokens`` new tokens (None: none) are listed in ``sdpa_spans`` instead."""
    starts = query_start_loc.to("cpu", torch.int64)
    lens = seq_lens.to("cpu", torch.int64)
    query_lens = starts[1:] - starts[:-1]
    decode_rows = decode_lens = decode_tables = None
    decode_seqs = (query_lens == 1).nonzero().squeeze(1)
    if decode_seqs.numel():
        decode_lens = lens[decode_seqs]
        decode_rows = starts[decode_seqs]
        decode_tables = block_tables.index_select(0, decode_seqs).to("cpu", torch.int32).contiguous()
    prefill_starts = prefill_query_lens = prefill_seq_lens = prefill_tables = None
    prefill_seqs = (query_lens > 1).nonzero().squeeze(1)
    sdpa_spans: tuple[PrefillSpan, ...] = ()
    if sdpa_min_tokens is not None and prefill_seqs.numel():
        to_sdpa = query_lens[prefill_seqs] >= sdpa_min_tokens
        tables = block_tables.to("cpu", torch.int64)
        sdpa_spans = tuple(prefill_span(starts, lens, tables, seq, block_size)
                           for seq in prefill_seqs[to_sdpa].tolist())
        prefill_seqs = prefill_seqs[~to_sdpa]
    if prefill_seqs.numel():
        prefill_starts, prefill_query_lens, prefill_seq_lens, prefill_tables = prefill_arrays(
            starts, lens, block_tables, prefill_seqs)
    return CpuAttentionPlan(decode_rows, decode_lens, decode_tables, prefill_starts, prefill_query_lens,
                            prefill_seq_lens, prefill_tables, starts, lens, block_tables, slot_mapping, block_size,
                            sdpa_spans)


def plan_torch_attention(plan: CpuAttentionPlan) -> TorchAttentionPlan:
    """torch's gather indices for ``plan``'s step."""
    starts, lens, block_size = plan.starts, plan.seq_lens, plan.block_size
    tables = plan.block_tables.to("cpu", torch.int64)
    query_lens = starts[1:] - starts[:-1]
    num_tokens = int(starts[-1])
    valid = plan.slot_mapping >= 0
    all_valid = bool(valid.all())
    write_rows = None if all_valid else valid.nonzero().squeeze(1)
    write_slots = plan.slot_mapping.long() if all_valid else plan.slot_mapping[valid].long()

    decode_slots = decode_mask = None
    decode_max_len = 0
    num_decodes = 0 if plan.decode_rows is None else plan.decode_rows.numel()
    if num_decodes:
        decode_seqs = (query_lens == 1).nonzero().squeeze(1)
        decode_lens = plan.decode_seq_lens
        decode_max_len = int(decode_lens.max())
        positions = torch.arange(decode_max_len).unsqueeze(0).expand(num_decodes, -1)
        in_range = positions < decode_lens.unsqueeze(1)
        # Padding reads position 0 of the same sequence: a real slot, masked out below.
        positions = torch.where(in_range, positions, 0)
        blocks = tables[decode_seqs].gather(1, positions // block_size)
        decode_slots = (blocks * block_size + positions % block_size).reshape(-1)
        decode_mask = None if bool(in_range.all()) else in_range.view(num_decodes, 1, 1, decode_max_len)
    decodes_are_all_rows = num_decodes == num_tokens == query_lens.numel()

    prefills = [prefill_span(starts, lens, tables, seq, block_size)
                for seq in (query_lens > 1).nonzero().squeeze(1).tolist()]
    return TorchAttentionPlan(decode_slots, decode_mask, decode_max_len, decodes_are_all_rows, prefills,
                              write_rows, write_slots)


def reshape_and_cache_cpu(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, plan: CpuAttentionPlan) -> None:
    """Write new K/V into their slots with one indexed copy per tensor."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    torch_plan = plan.torch_plan
    if torch_plan.write_rows is not None:
        key, value = key[torch_plan.write_rows], value[torch_plan.write_rows]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, torch_plan.write_slots, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, torch_plan.write_slots,
                                                             value.to(value_cache.dtype))


def _gather(cache: torch.Tensor, slots: torch.Tensor, batch: int, length: int,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[batch, num_kv_heads, length, head_dim]`` K or V of the given slots, in ``dtype``."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    flat = cache.view(-1, num_kv_heads * head_dim).index_select(0, slots)   # 2-D rows: faster
    return flat.view(batch, length, num_kv_heads, head_dim).transpose(1, 2).to(dtype)


def paged_attention_cpu(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        scale: float, plan: CpuAttentionPlan, native: bool | None = None, window: int | None = None,
                        sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Same contract as ``paged_attention_reference`` (``window``, ``sinks``, ``softcap``
    included; a ``softcap`` of 0 is None, off, as in config.json), driven by a precomputed plan.
    ``native``: decode rows through the C kernel (None: when it applies and is available)."""
    if native is None:
        native = (key_cache.dtype == query.dtype and query.dtype in cpu_native.DECODE_ATTENTION_DTYPES
                  and cpu_native.load() is not None)
    softcap = softcap or None
    # Layers torch's attention cannot serve: see below.
    restricted = window is not None or sinks is not None or softcap is not None
    if restricted and not native:
        # torch's path gathers every key of a sequence (the blocks before a window may have been
        # released: their slots hold anything) and has no sinks and no soft cap; it only serves
        # what the C kernels cannot (float16, mixed dtypes, no compiler), and the reference does
        # it right.
        return paged_attention_reference(query, key_cache, value_cache, plan.starts, plan.seq_lens,
                                         plan.block_tables, scale, window, sinks, softcap)
    out = torch.empty_like(query)
    c_window = 0 if window is None else window
    c_sinks = None if sinks is None else sinks.float().contiguous()
    c_softcap = 0.0 if softcap is None else float(softcap)
    if plan.decode_rows is not None:
        if native:
            query = query.contiguous()
            cpu_native.paged_decode_attention(query, out, plan.decode_rows, plan.decode_seq_lens,
                                              plan.decode_tables, key_cache, value_cache, scale,
                                              window=c_window, sinks=c_sinks, softcap=c_softcap)
        else:
            _decode_attention_torch(query, key_cache, value_cache, scale, plan, out)
    if native:
        # SDPA takes no sinks and no soft cap, and a window as a mask would still gather (and weigh
        # by zero) the keys before it, whose released blocks may hold NaN: a layer with any of
        # them attends the plan's SDPA prefills in the C kernel with the rest.
        prefills = plan.every_prefill if restricted else plan.native_prefills
        if prefills is not None:
            cpu_native.paged_prefill_attention(query.contiguous(), out, *prefills, key_cache, value_cache, scale,
                                               window=c_window, sinks=c_sinks, softcap=c_softcap)
        if not restricted:
            sdpa_prefill_attention(query, key_cache, value_cache, scale, plan, out)
        return out
    # torch's path attends every prefill, sdpa_spans included (torch_plan lists them all), in
    # float32 whatever the cache dtype: torch's CPU flash attention would take bfloat16 as it
    # is (no widened copies, faster for a 512-token prompt), but it rounds the softmax
    # probabilities to bfloat16 before the weighted sum (2% of outputs off by 1-2 units).
    _prefills_through_sdpa(query, key_cache, value_cache, scale, plan.torch_plan.prefills, out, torch.float32)
    return out


def sdpa_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float,
                           plan: CpuAttentionPlan, out: torch.Tensor) -> None:
    """The plan's ``sdpa_spans`` through torch's SDPA into ``out``'s rows, in the cache's dtype
    (bfloat16 stays bfloat16: that is what lets oneDNN use AMX; its flash kernel rounds the
    softmax probabilities to bfloat16 before the weighted sum, as the Triton kernel does)."""
    _prefills_through_sdpa(query, key_cache, value_cache, scale, plan.sdpa_spans, out, key_cache.dtype)


def _prefills_through_sdpa(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float,
                           spans: list[PrefillSpan] | tuple[PrefillSpan, ...], out: torch.Tensor,
                           dtype: torch.dtype) -> None:
    """One SDPA call per span in ``dtype``, over its sequence's K/V gathered from their slots,
    into ``out``'s rows."""
    for span in spans:
        seq_len = span.slots.numel()
        q = query[span.q_start:span.q_end].to(dtype).transpose(0, 1).unsqueeze(0)   # [1, heads, n, head_dim]
        k = _gather(key_cache, span.slots, 1, seq_len, dtype)
        v = _gather(value_cache, span.slots, 1, seq_len, dtype)
        # A prompt without cached context is plain causal attention: no mask to build or read.
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=scale, is_causal=span.mask is None,
                                           enable_gqa=True)
        out[span.q_start:span.q_end] = o.squeeze(0).transpose(0, 1).to(out.dtype)


def _decode_attention_torch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float,
                            plan: CpuAttentionPlan, out: torch.Tensor) -> None:
    """All decode rows as one padded SDPA over gathered K/V (any dtype)."""
    torch_plan = plan.torch_plan
    num_decodes, length = plan.decode_rows.numel(), torch_plan.decode_max_len
    q = query if torch_plan.decodes_are_all_rows else query.index_select(0, plan.decode_rows)
    q = q.float().unsqueeze(2)                                      # [D, num_heads, 1, head_dim]
    k = _gather(key_cache, torch_plan.decode_slots, num_decodes, length)   # [D, num_kv_heads, L, head_dim]
    v = _gather(value_cache, torch_plan.decode_slots, num_decodes, length)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=torch_plan.decode_mask, scale=scale, enable_gqa=True)
    out.index_copy_(0, plan.decode_rows, o.squeeze(2).to(query.dtype))
