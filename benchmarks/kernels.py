"""Paged-attention kernel benchmark (GPU): achieved bandwidth against the device's measured
copy bandwidth, and time against torch's scaled_dot_product_attention on the same data
gathered contiguous.

Decode attention is memory-bound: each step must read every cached K/V byte of every
sequence once. So the figure of merit is bytes read / time, compared with what a plain
device-to-device copy achieves on the same GPU.

    python -m benchmarks.kernels                  # GPU: full grid, writes benchmarks/results/kernels.json
    python -m benchmarks.kernels --smoke          # any machine: tiny shapes (CPU: Triton interpreter)

Shapes: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128), bfloat16, block 16.
"""

from __future__ import annotations

import argparse
import os
import random

import torch

from benchmarks.common import copy_bandwidth_gbps, device_name, markdown_table, time_ms, write_results

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
BATCHES = [1, 4, 16, 64, 128, 256]
CONTEXTS = [512, 2048, 4096, 8192, 16384]
MAX_KV_BYTES = 24 << 30   # skip grid points whose cache would not fit comfortably


def kv_bytes_per_token(dtype: torch.dtype) -> int:
    return 2 * NUM_KV_HEADS * HEAD_DIM * torch.tensor([], dtype=dtype).element_size()


def paged_inputs(specs: list[tuple[int, int]], dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Random paged batch: (context_len, num_new) per sequence, blocks in shuffled order."""
    rng = random.Random(seed)
    blocks_per_seq = [-(-(c + n) // BLOCK_SIZE) for c, n in specs]
    num_blocks = sum(blocks_per_seq)
    order = list(range(num_blocks))
    rng.shuffle(order)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    tables = torch.zeros(len(specs), max(blocks_per_seq), dtype=torch.int32)
    start = 0
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = torch.tensor(order[start:start + count], dtype=torch.int32)
        start += count
    query_start_loc = [0]
    for _, n in specs:
        query_start_loc.append(query_start_loc[-1] + n)
    query = torch.randn(query_start_loc[-1], NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
    seq_lens = torch.tensor([c + n for c, n in specs], dtype=torch.int32, device=device)
    return (query, key_cache, value_cache, torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens, tables.to(device))


def contiguous_kv(key_cache, value_cache, tables, seq_len: int, batch: int):
    """The same K/V gathered into [batch, kv_heads, seq_len, head_dim] for SDPA."""
    num_blocks = -(-seq_len // BLOCK_SIZE)
    k = key_cache[tables[:, :num_blocks].long()].reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :seq_len]
    v = value_cache[tables[:, :num_blocks].long()].reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :seq_len]
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def bench_decode(batch: int, context: int, dtype: torch.dtype, device: torch.device, iters: int) -> dict:
    from kernels.triton_attention import paged_attention

    specs = [(context - 1, 1)] * batch
    query, key_cache, value_cache, qsl, seq_lens, tables = paged_inputs(specs, dtype, device)
    scale = HEAD_DIM ** -0.5
    run = lambda: paged_attention(query, key_cache, value_cache, qsl, seq_lens, tables, scale, 1, context)
    ms = time_ms(run, device, iters=iters)
    element = torch.tensor([], dtype=dtype).element_size()
    bytes_read = batch * context * kv_bytes_per_token(dtype) + 2 * query.numel() * element
    k, v = contiguous_kv(key_cache, value_cache, tables, context, batch)
    q = query.view(batch, NUM_HEADS, 1, HEAD_DIM)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    sdpa_ms = time_ms(sdpa, device, iters=iters)
    # Same numbers from both (the SDPA inputs are the paged data, gathered).
    diff = (run().view(batch, NUM_HEADS, HEAD_DIM).float() - sdpa().view(batch, NUM_HEADS, HEAD_DIM).float()).abs().max()
    return dict(batch=batch, context=context, ms=ms, gbps=bytes_read / (ms * 1e-3) / 1e9, sdpa_ms=sdpa_ms,
                max_abs_diff_vs_sdpa=float(diff))


def bench_mixed(dtype: torch.dtype, device: torch.device, iters: int, scale_down: int = 1) -> dict:
    """One mixed step as continuous batching produces it: 2 prefill chunks of 512 tokens
    (one over a 1536-token cached prefix), and 64 decodes at 2k context."""
    from kernels.reference import paged_attention_reference
    from kernels.triton_attention import paged_attention

    specs = [(0, 512 // scale_down), (1536 // scale_down, 512 // scale_down)]
    specs += [(2047 // scale_down, 1)] * (64 // scale_down)
    random.Random(1).shuffle(specs)
    query, key_cache, value_cache, qsl, seq_lens, tables = paged_inputs(specs, dtype, device)
    scale = HEAD_DIM ** -0.5
    max_q, max_s = max(n for _, n in specs), max(c + n for c, n in specs)
    run = lambda: paged_attention(query, key_cache, value_cache, qsl, seq_lens, tables, scale, max_q, max_s)
    ms = time_ms(run, device, iters=iters)
    expected = paged_attention_reference(query, key_cache, value_cache, qsl, seq_lens, tables, scale)
    diff = (run().float() - expected.float()).abs().max()
    element = torch.tensor([], dtype=dtype).element_size()
    bytes_read = sum(c + n for c, n in specs) * kv_bytes_per_token(dtype) + 2 * query.numel() * element
    flops = sum(4 * n * (c + (n + 1) / 2) * NUM_HEADS * HEAD_DIM for c, n in specs)  # causal QK^T + PV
    return dict(tokens=int(qsl[-1]), sequences=len(specs), ms=ms, gbps=bytes_read / (ms * 1e-3) / 1e9,
                tflops=flops / (ms * 1e-3) / 1e12, max_abs_diff_vs_reference=float(diff))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few iterations (checks the script)")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        if not args.smoke:
            raise SystemExit("no CUDA device: run with --smoke (Triton interpreter, tiny shapes)")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batches, contexts, iters = (BATCHES, CONTEXTS, args.iters) if not args.smoke else ([1, 4], [64, 200], 1)

    bandwidth = copy_bandwidth_gbps(device, (1 << 30) if not args.smoke else (1 << 22))
    print(f"device: {device_name(device)}; measured copy bandwidth {bandwidth:.0f} GB/s")
    rows, results = [], []
    for context in contexts:
        for batch in batches:
            if batch * context * kv_bytes_per_token(dtype) > MAX_KV_BYTES:
                continue
            r = bench_decode(batch, context, dtype, device, iters)
            r["fraction_of_copy_bw"] = r["gbps"] / bandwidth
            results.append(r)
            rows.append([batch, context, r["ms"], r["gbps"], f"{100 * r['fraction_of_copy_bw']:.0f}%",
                         r["sdpa_ms"], r["sdpa_ms"] / r["ms"]])
            print(markdown_table(["batch", "context", "ms", "GB/s", "of copy BW", "SDPA ms", "SDPA/ours"],
                                 [rows[-1]]).splitlines()[-1], flush=True)
    mixed = bench_mixed(dtype, device, iters, scale_down=1 if not args.smoke else 16)
    table = markdown_table(["batch", "context", "ms", "GB/s", "of copy BW", "SDPA ms", "SDPA/ours"], rows)
    print("\ndecode attention (one layer, 32 q heads / 8 KV heads, head_dim 128, block 16):\n" + table)
    print(f"\nmixed step ({mixed['sequences']} sequences, {mixed['tokens']} query tokens): {mixed['ms']:.3f} ms, "
          f"{mixed['gbps']:.0f} GB/s, {mixed['tflops']:.1f} TFLOP/s, max |diff| vs reference "
          f"{mixed['max_abs_diff_vs_reference']:.2e}")
    if not args.smoke:
        path = write_results("kernels", dict(device=device_name(device), dtype=str(dtype),
                                             copy_bandwidth_gbps=bandwidth, decode=results, mixed=mixed))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
