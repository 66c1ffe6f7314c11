"""Cost of one engine step against batch size: why continuous batching pays more or less.

Continuous batching wins by keeping the batch full; how much that is worth depends on how
the step time grows with the batch. When a decode step is bound by reading the weights (a
GPU, or a large model), a fuller batch is nearly free; when it is bound by arithmetic (a
small model on 2 CPU cores), every sequence adds its own cost and the win shrinks. This
prints, for decode-only steps at several batch sizes (every sequence ``--context`` tokens
deep), the step time, tokens/s and the marginal cost per added sequence, plus the cost of
prefill steps of ``max_num_batched_tokens`` tokens, and optionally writes JSON.

    python -m benchmarks.step_cost --json benchmarks/results/step_cost-cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from backend import Engine, EngineConfig, SamplingParams


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def decode_step_ms(engine: Engine, batch: int, context: int, steps: int, rng: random.Random) -> float:
    """Median time of a decode-only step with ``batch`` sequences ``context`` tokens deep (the
    requests are aborted after; max_tokens only keeps early admits from finishing first)."""
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for request_id in ids:
        prompt = [rng.randrange(1000, engine.arch.vocab_size) for _ in range(context)]
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=1024, ignore_eos=True, temperature=0.0))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    engine.step()
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        samples.append(time.perf_counter() - start)
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    samples.sort()
    return samples[len(samples) // 2] * 1e3


def prefill_step_ms(engine: Engine, tokens: int, repeats: int, rng: random.Random) -> float:
    samples = []
    for i in range(repeats):
        prompt = [rng.randrange(1000, engine.arch.vocab_size) for _ in range(tokens)]
        engine.add_request(f"prefill-{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        start = time.perf_counter()
        engine.step()
        samples.append(time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
    samples.sort()
    return samples[len(samples) // 2] * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EngineConfig.model)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--cpu-linear", default="auto", help="auto, native, onednn or torch (EngineConfig.cpu_linear)")
    parser.add_argument("--no-fused-ops", action="store_true", help="torch ops instead of the fused layer ops")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine(EngineConfig(model=args.model, max_num_seqs=max(batches), num_kv_blocks=4096, dtype=args.dtype,
                                 quantization=args.quantization, cpu_linear=args.cpu_linear,
                                 fused_layer_ops=not args.no_fused_ops,
                                 enable_prefix_caching=False))
    rng = random.Random(0)
    rows = []
    for batch in batches:
        ms = decode_step_ms(engine, batch, args.context, args.steps, rng)
        rows.append({"batch": batch, "step_ms": round(ms, 1), "tokens_per_s": round(batch / ms * 1e3, 1)})
    for previous, row in zip(rows, rows[1:]):
        row["ms_per_added_sequence"] = round((row["step_ms"] - previous["step_ms"]) / (row["batch"] - previous["batch"]), 2)
    budget = engine.config.max_num_batched_tokens
    prefill = prefill_step_ms(engine, budget, 3, rng)
    print(f"device: {cpu_name()}, {torch.get_num_threads()} threads, dtype {engine.runner.dtype}, "
          f"linear {engine.runner.cpu_linear}, fused ops {engine.runner.model.fused_layer_ops}, context {args.context}")
    print("| batch | decode step ms | tokens/s | ms per added sequence |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['batch']} | {row['step_ms']} | {row['tokens_per_s']} | {row.get('ms_per_added_sequence', '')} |")
    print(f"prefill step of {budget} tokens: {prefill:.0f} ms ({budget / prefill * 1e3:.0f} prompt tokens/s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "device": cpu_name(), "threads": torch.get_num_threads(), "dtype": str(engine.runner.dtype),
            "quantization": args.quantization, "cpu_linear": engine.runner.cpu_linear,
            "fused_layer_ops": engine.runner.model.fused_layer_ops, "context": args.context, "decode": rows,
            "prefill_tokens": budget, "prefill_step_ms": round(prefill, 1),
            "date": time.strftime("%Y-%m-%d")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
