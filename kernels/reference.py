"""Reference implementations (plain torch): the spec the GPU kernels are tested against.

Layout
------
- ``key_cache`` / ``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
  Token slot ``s`` lives at block ``s // block_size``, offset ``s % block_size``.
- The batch is *packed*: all query tokens of all sequences concatenated. Sequence ``i``
  owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; those are its *last*
  ``n_i`` tokens of ``seq_lens[i]`` in total, so the first ``seq_lens[i] - n_i`` tokens
  are context already in the cache (prefix hit, earlier chunk, or earlier decodes).
- A sliding window of ``W`` keys: the query at position ``p`` sees keys ``p - W + 1 .. p``
  (transformers' convention). Block-table entries of blocks wholly before every query's
  window may point anywhere (the KV manager releases such blocks): they are never read.
- Attention sinks (gpt-oss): one learned logit per query head joins every row's softmax
  denominator beside the row's scaled scores; its value is zero (it adds probability mass and
  nothing to the output): ``softmax([q.k * scale ..., sink])`` with the sink's column dropped.
- Logit soft-capping (Gemma 2): each scaled score ``s`` becomes ``softcap * tanh(s / softcap)``
  before the mask and the sinks (transformers' eager Gemma 2 attention).
"""

from __future__ import annotations

import torch


def reshape_and_cache_reference(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                                value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new K/V ``[num_tokens, num_kv_heads, head_dim]`` into their cache slots.
    Slots < 0 are padding and are skipped."""
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = key[valid].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[valid].to(value_cache.dtype)


def paged_attention_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                              query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                              block_tables: torch.Tensor, scale: float, window: int | None = None,
                              sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of packed queries ``[num_tokens, num_heads, head_dim]`` over K/V read
    only from the paged cache (grouped-query: ``num_heads`` a multiple of ``num_kv_heads``),
    within a sliding ``window`` of keys where given, with one sink logit per query head in
    every row's softmax where ``sinks`` (``[num_heads]``, used in float32) is given, each score
    soft-capped at ``softcap`` where given. Softmax in float32; the output has the query's dtype."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        num_queries = q_end - q_start
        if num_queries == 0:
            continue
        context_len = seq_len - num_queries
        # Keys from the first one the first query sees: whole blocks before it are not read.
        first_key = 0 if window is None else max(0, context_len - window + 1)
        first_block, num_blocks = first_key // block_size, -(-seq_len // block_size)
        blocks = block_tables[i, first_block:num_blocks].long()
        skip = first_key - first_block * block_size
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[skip:seq_len - first_block * block_size].float()
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[skip:seq_len - first_block * block_size].float()
        k = k.repeat_interleave(group, dim=1)                        # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        q = query[q_start:q_end].float()                              # [num_queries, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale           # [num_heads, num_queries, seq_len]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        # Query j sits at absolute position context_len + j and sees keys 0..context_len + j
        # (the last ``window`` of them).
        q_pos = torch.arange(num_queries, device=query.device).unsqueeze(1) + context_len
        k_pos = torch.arange(first_key, seq_len, device=query.device).unsqueeze(0)
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores.masked_fill_(hidden, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            # The sink as one more column of every row (as transformers' gpt-oss), then dropped.
            sink = sinks.float().view(num_heads, 1, 1).expand(num_heads, num_queries, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


# ---- LoRA over a packed batch ------------------------------------------------------------------
# One fused projection of one layer, for the adapters resident in ``num_slots`` slots:
# - ``a_stack`` ``[num_slots, max_rank, in_features]``: slot s's A (its parts' A stacked), rows
#   past the adapter's rank zero;
# - ``b_stack`` ``[num_slots, max_rank, out_features]``: slot s's B transposed, each part's B in
#   its block of columns (scaling folded in), zeros elsewhere;
# - ``slot_ids`` ``[num_tokens]`` (int32): token row t uses slot ``slot_ids[t]``; -1: no adapter.
# The shrink is ``y[t] = a_stack[s] @ x[t]`` in float32, the expand ``out[t] += y[t] @ b_stack[s]``
# in float32 with one rounding to out's dtype. Rows without an adapter are left untouched.

def lora_shrink_reference(x: torch.Tensor, a_stack: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """``[num_tokens, max_rank]`` float32; rows with slot -1 are zero."""
    y = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    for slot in slot_ids.unique().tolist():
        if slot < 0:
            continue
        rows = slot_ids == slot
        y[rows] = x[rows].float() @ a_stack[slot].float().T
    return y


def lora_expand_reference(y: torch.Tensor, b_stack: torch.Tensor, slot_ids: torch.Tensor, out: torch.Tensor) -> None:
    """``out[t] += y[t] @ b_stack[slot_ids[t]]`` in place, for rows with a slot."""
    for slot in slot_ids.unique().tolist():
        if slot < 0:
            continue
        rows = slot_ids == slot
        out[rows] = (out[rows].float() + y[rows] @ b_stack[slot].float()).to(out.dtype)
