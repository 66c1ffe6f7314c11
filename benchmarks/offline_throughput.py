"""Offline throughput: continuous vs static batching on the same seeded workload.

Closed loop with N concurrent clients: each client submits its next request as soon as its
previous one finishes, so the engine always has N requests in flight (or queued). Output
lengths are heavy-tailed and pinned with ignore_eos + max_tokens, exactly as in the seeds'
argument: static batching waits for the longest request of each batch, continuous batching
refills a slot the step after it frees.

    python -m benchmarks.offline_throughput --concurrency 32 --requests 128 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from backend import Engine, EngineConfig, SamplingParams
from backend.model.cpu_features import detect
from benchmarks.serving import cpu_info


def make_workload(num_requests: int, seed: int, vocab_size: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs: prompts 16-512 tokens, outputs lognormal,
    median ~60 tokens with a long tail, capped at 512."""
    rng = random.Random(seed)
    work = []
    for _ in range(num_requests):
        prompt_len = int(min(512, max(16, rng.lognormvariate(4.6, 0.8))))
        output_len = int(min(512, max(4, rng.lognormvariate(4.1, 0.9))))
        prompt = [rng.randrange(1000, vocab_size) for _ in range(prompt_len)]
        work.append((prompt, output_len))
    return work


def run(batching: str, args: argparse.Namespace) -> dict:
    engine = Engine(EngineConfig(model=args.model, batching=batching, max_num_seqs=args.concurrency,
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 num_kv_blocks=args.num_kv_blocks, load_format=args.load_format))
    workload = make_workload(args.requests, args.seed, engine.arch.vocab_size)
    submitted = 0
    start = time.perf_counter()
    submit_time: dict[str, float] = {}
    latencies: list[float] = []
    output_tokens = 0
    running_samples: list[int] = []

    def submit() -> None:
        nonlocal submitted
        prompt, output_len = workload[submitted]
        request_id = f"req-{submitted}"
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0))
        submit_time[request_id] = time.perf_counter()
        submitted += 1

    while submitted < min(args.concurrency, len(workload)):
        submit()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        running_samples.append(engine.stats().num_running)
        for out in outputs:
            if out.finished:
                output_tokens += len(out.token_ids)
                latencies.append(time.perf_counter() - submit_time[out.request_id])
                if submitted < len(workload):
                    submit()
    elapsed = time.perf_counter() - start
    engine.check_invariants()
    return {
        "batching": batching,
        "requests": len(latencies),
        "output_tokens": output_tokens,
        "seconds": round(elapsed, 2),
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
        "mean_running": round(statistics.mean(running_samples), 1),
        "latency_p50_s": round(statistics.median(latencies), 2),
        "steps": engine.stats().num_steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EngineConfig.model)
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="continuous,static")
    parser.add_argument("--json", type=Path, help="also write the settings, the CPU and the results here")
    args = parser.parse_args()
    results = [run(mode, args) for mode in args.modes.split(",")]
    for r in results:
        print(json.dumps(r))
    ratio = None
    if len(results) == 2:
        ratio = results[0]["output_tokens_per_s"] / results[1]["output_tokens_per_s"]
        print(f"continuous/static output-token throughput: {ratio:.2f}x")
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        payload = {"command": "python -m benchmarks.offline_throughput", "settings": settings, **cpu_info(),
                   "cpu_flags": sorted(f for f in detect().flags if f.startswith(("avx", "amx", "fma"))),
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results,
                   "continuous_over_static": ratio}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
