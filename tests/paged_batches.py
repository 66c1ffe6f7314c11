"""Random packed batches over a paged KV cache, shared by the attention kernel tests
(tests/test_kernels.py for Triton, tests/test_cpu_attention.py for the CPU path).

Every batch is built to catch out-of-bounds reads: permuted, non-contiguous block tables,
context lengths that are not multiples of the block size, NaN in every cache slot no
sequence owns, and block-table padding pointing at an all-NaN block.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Error bounds per dtype, against the float32 reference on the same (rounded) inputs. The
# Triton kernel rounds the softmax probabilities to the input dtype before the P@V product
# (as flash attention does), and the output is rounded once more.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SCENARIOS = ["decode", "prefill", "chunked", "mixed"]
# (query heads, KV heads, head_dim, block_size): GQA ratios 1, 2, 4, 6 and 8; head_dim 64
# and 128; block sizes 16 and 32 (each pairing covered at least once).
SHAPES = [(4, 4, 64, 16), (8, 4, 128, 32), (8, 2, 64, 32), (12, 2, 128, 16), (8, 1, 64, 16), (16, 2, 128, 32)]


def shape_id(shape: tuple[int, int, int, int]) -> str:
    return "h{}kv{}d{}bs{}".format(*shape)


@dataclass
class PagedBatch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int


def make_batch(seed: int, specs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, device: torch.device = DEVICE) -> PagedBatch:
    """``specs``: (context_len, num_new_tokens) per sequence. The caches hold random K/V in
    every slot a sequence owns and NaN elsewhere; table padding points at an all-NaN block."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-(c + n) // block_size) for c, n in specs]
    num_blocks = sum(blocks_per_seq) + 1 + rng.randrange(4)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    poison_block, ids = ids[0], ids[1:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    max_blocks = max(blocks_per_seq) + rng.randrange(3)
    block_tables = torch.full((len(specs), max_blocks), poison_block, dtype=torch.int32)
    query_start_loc, seq_lens = [0], []
    for row, (context_len, num_new) in enumerate(specs):
        seq_len = context_len + num_new
        table = [ids.pop() for _ in range(blocks_per_seq[row])]
        block_tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
        for pos in range(seq_len):
            block, offset = table[pos // block_size], pos % block_size
            key_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            value_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
        query_start_loc.append(query_start_loc[-1] + num_new)
        seq_lens.append(seq_len)
    query = torch.randn(query_start_loc[-1], num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(query.to(device), key_cache.to(device), value_cache.to(device),
                      torch.tensor(query_start_loc, dtype=torch.int32, device=device),
                      torch.tensor(seq_lens, dtype=torch.int32, device=device), block_tables.to(device),
                      max(n for _, n in specs), max(seq_lens))


def scenario_specs(scenario: str, rng: random.Random, block_size: int) -> list[tuple[int, int]]:
    odd = lambda low, high: rng.randrange(low, high) | 1          # never a multiple of the block size
    if scenario == "decode":
        return [(odd(1, 6 * block_size), 1) for _ in range(rng.randrange(3, 7))]
    if scenario == "prefill":                                       # fresh prompts, no context
        return [(0, odd(2, 3 * block_size)) for _ in range(rng.randrange(2, 4))]
    if scenario == "chunked":                                       # later chunks over a cached prefix
        return [(odd(block_size, 4 * block_size), odd(2, 2 * block_size)) for _ in range(rng.randrange(2, 4))]
    # mixed: decodes, a fresh prefill, a chunk over context, in one launch
    specs = [(odd(1, 5 * block_size), 1) for _ in range(3)]
    specs += [(0, odd(2, 2 * block_size)), (odd(block_size, 3 * block_size), odd(2, block_size))]
    rng.shuffle(specs)
    return specs
