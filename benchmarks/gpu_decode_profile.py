"""Where a CUDA-graph decode step's time goes (GPU only).

Two measurements behind docs/benchmarks.md's "First GPU run":

1. The paged-attention kernel alone, called plainly (host launch cost included) and replayed
   from a CUDA graph (GPU time only, as inside the engine's decode graphs).
2. One engine decode step of a dummy-weight Llama shape split into its parts (prepare the step
   inputs, execute the forward, sample), then torch's profiler over ten steps: the kernels by
   GPU time and the host calls by CPU time.

    python -m benchmarks.gpu_decode_profile                 # llama-1b, batches 1 and 64
    python -m benchmarks.gpu_decode_profile --shape llama-8b --batches 1,16
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from backend.sample.sampler import Sampler
from benchmarks.decode_roofline import SHAPES, decode_batch, dummy_runner
from benchmarks.kernels import HEAD_DIM, paged_inputs


def wall_ms(fn: Callable[[], object], iters: int = 50) -> float:
    """Mean wall milliseconds per call, the GPU drained before and after."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def attention_plain_and_graphed(batch: int, context: int) -> tuple[float, float]:
    from kernels.triton_attention import paged_attention

    query, key_cache, value_cache, qsl, seq_lens, tables = paged_inputs([(context - 1, 1)] * batch, torch.bfloat16,
                                                                        torch.device("cuda"))
    run = lambda: paged_attention(query, key_cache, value_cache, qsl, seq_lens, tables, HEAD_DIM ** -0.5, 1, context)
    plain = wall_ms(run)
    side = torch.cuda.Stream()                      # warm up (compile) off the capture stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return plain, wall_ms(graph.replay)


def profile_engine_step(shape: str, batches: list[int], context: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        runner, sampler = dummy_runner(Path(tmp), shape, max(batches), context), Sampler(0)
        for batch in batches:
            requests, scheduled, block_ids = decode_batch(runner, batch, context)
            prepare = lambda: runner.prepare(requests, scheduled, block_ids)
            input_ids, meta, sampling = prepare()
            execute = lambda: runner.execute(input_ids, meta)
            logits = execute()
            sample = lambda: sampler(logits, sampling)

            def step() -> None:
                ids, step_meta, step_sampling = runner.prepare(requests, scheduled, block_ids)
                sampler(runner.execute(ids, step_meta), step_sampling)

            print(f"\n{shape} batch {batch}, context {context}: step {wall_ms(step):.3f} ms = prepare "
                  f"{wall_ms(prepare):.3f} + execute {wall_ms(execute):.3f} + sample {wall_ms(sample):.3f}")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    step()
                torch.cuda.synchronize()
            averages = prof.key_averages()
            print(averages.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
            print(averages.table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=60))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-1b", choices=[s for s in SHAPES if s != "tiny"])
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this profiles CUDA-graph replay")
    for batch, context in [(1, 512), (1, 4096), (1, 16384), (16, 2048), (64, 2048)]:
        plain, graphed = attention_plain_and_graphed(batch, context)
        print(f"paged attention, batch {batch}, context {context}: {plain * 1e3:.1f} us a plain call, "
              f"{graphed * 1e3:.1f} us replayed from a CUDA graph")
    profile_engine_step(args.shape, [int(b) for b in args.batches.split(",")], args.context)


if __name__ == "__main__":
    main()
