"""Multi-LoRA throughput: 16 streams over 4 adapters vs 16 streams of the base model, same
engine, same prompts, interleaved repetitions (docs/lora.md); and the batched LoRA delta vs
the per-row reference at a decode batch.

    python -m benchmarks.lora_throughput [--streams 16] [--adapters 4] [--rank 16] [--repeats 3]
        [--out benchmarks/results/lora_throughput-<cpu>.json]

Adapters are random (backend/lora/synthetic.py), rank ``--rank`` on all seven projections,
written next to links to the model's files in a temporary folder. Each repetition runs the
16 requests (64 prompt tokens, 128 output tokens, greedy, ignore_eos) all at once through
``Engine.generate``; output tok/s = 16 x 128 / wall time.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from backend import Engine, EngineConfig, SamplingParams
from backend.lora.adapter import LoRAAdapter
from backend.lora.batch import add_lora, add_lora_per_row, lora_batch
from backend.lora.slots import batch_for_rows
from backend.lora.synthetic import MODULES, model_with_adapters
from backend.model.cpu_features import detect

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"


def run_streams(engine: Engine, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> float:
    started = time.perf_counter()
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        engine.add_request(f"req-{time.perf_counter_ns()}-{i}", prompt,
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora_name=adapter))
    tokens = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += len(output.new_token_ids)
    return tokens / (time.perf_counter() - started)


def delta_timings(folder: Path, engine: Engine, names: list[str], rows: int, iters: int = 20) -> dict:
    """ms per call, one decode batch (``rows`` rows spread over the adapters), the qkv projection."""
    arch = engine.arch
    adapters = [LoRAAdapter.load(n, 100 + i, folder / "adapters" / n, arch, engine.runner.dtype, torch.device("cpu"))
                for i, n in enumerate(names)]
    per = rows // len(adapters)
    layout = [(adapters[i], i * per, (i + 1) * per) for i in range(len(adapters))]
    row_adapters = [a for a, s, e in layout for _ in range(s, e)]
    width = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    x = torch.randn(rows, arch.hidden_size, dtype=engine.runner.dtype)
    out = torch.zeros(rows, width, dtype=engine.runner.dtype)
    slots = engine.runner.lora_slots
    assert slots is not None, "the model folder lists adapters: the runner made its slots at start"
    batch = batch_for_rows(slots, row_adapters)

    def batched() -> None:
        with lora_batch(batch):
            add_lora(out, x, 0, "qkv")

    def per_row() -> None:
        add_lora_per_row(out, x, 0, "qkv", row_adapters)

    result = {}
    for label, fn in (("batched_ms", batched), ("per_row_ms", per_row)):
        for _ in range(3):
            fn()
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        result[label] = sorted(samples)[len(samples) // 2]
    result["speedup"] = result["per_row_ms"] / result["batched_ms"]
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        names = [f"adapter-{i}" for i in range(args.adapters)]
        folder = model_with_adapters(args.model, Path(tmp) / "model",
                                     {n: (args.rank, 2 * args.rank, MODULES, i) for i, n in enumerate(names)})
        engine = Engine(EngineConfig(model=str(folder), dtype=args.dtype, max_num_seqs=args.streams,
                                     max_loras=args.adapters))
        rng = random.Random(0)
        prompts = [[rng.randrange(1000, engine.arch.vocab_size) for _ in range(args.prompt_tokens)]
                   for _ in range(args.streams)]
        configs = {"base": [None] * args.streams,
                   f"{args.adapters} adapters": [names[i % args.adapters] for i in range(args.streams)]}
        run_streams(engine, prompts[:2], [None, names[0]], 4)         # warm-up (and adapter loads)
        for name in names:
            engine.loras.resolve(name)
        results: dict[str, list[float]] = {label: [] for label in configs}
        for repeat in range(args.repeats):   # interleaved: the machine's noise hits both alike
            for label, adapters in configs.items():
                tok_s = run_streams(engine, prompts, adapters, args.max_tokens)
                results[label].append(tok_s)
                print(f"#{repeat} {label}: {tok_s:.1f} output tok/s", flush=True)
        delta = delta_timings(folder, engine, names, args.streams)
    best = {label: max(values) for label, values in results.items()}
    lora_label = f"{args.adapters} adapters"
    summary = {"machine": f"{platform.processor() or platform.machine()}, {detect().describe()}",
               "dtype": engine.runner.dtype_choice, "streams": args.streams, "adapters": args.adapters,
               "rank": args.rank, "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
               "output_tok_s": results, "best_output_tok_s": best,
               "lora_vs_base": best[lora_label] / best["base"], "delta_qkv_decode_batch": delta}
    print(json.dumps({k: v for k, v in summary.items() if k != "output_tok_s"}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


if __name__ == "__main__":
    main()
