"""Greedy sampling's argmax on CPU: the C kernel (``kernels.cpu_native.argmax_rows``, what
``backend.sample.sampler.greedy`` runs for float32 CPU logits) against ``torch.argmax``: first
the op alone over a step's logits, then whole decode steps of one engine whose sampler switches
between the two every round (alternating in one process: these machines' speed drifts).

    python -m benchmarks.greedy_argmax                     # SmolLM2's vocabulary, random weights
"""

from __future__ import annotations

import argparse
import random
from typing import Callable

import torch

from backend import EngineConfig
from backend.model.architecture import ModelArchitecture
from backend.sample import sampler
from benchmarks.common import alternating_medians, best_of
from benchmarks.decode_breakdown import decoding_engine
from benchmarks.step_cost import cpu_name
from kernels import cpu_native


def op_alone(vocab: int, rows: int, rounds: int, calls: int = 20) -> dict[str, float]:
    """Seconds for ``calls`` argmaxes of [rows, vocab] float32 logits, best round of each."""
    logits = torch.randn(rows, vocab) * 4
    assert torch.equal(cpu_native.argmax_rows(logits), logits.argmax(dim=-1))

    def run(kernel):
        def once() -> None:
            for _ in range(calls):
                kernel(logits)
        return once
    return best_of(rounds, {"torch": run(lambda x: x.argmax(dim=-1)), "c": run(cpu_native.argmax_rows)})


def decode_steps(model: str, batch: int, rounds: int, steps: int) -> dict[str, float]:
    """Median ms a float32 decode step (greedy), the argmax by torch or the C kernel, alternating."""
    rng = random.Random(0)
    engine = decoding_engine(model, "float32", [rng.randint(64, 192) for _ in range(batch)], "dummy")
    kernels = {"c": sampler.greedy, "torch": lambda logits: logits.argmax(dim=-1)}

    def use(name: str) -> Callable[[], None]:
        return lambda: setattr(sampler, "greedy", kernels[name])
    try:
        return alternating_medians({name: use(name) for name in kernels}, engine.step, rounds, steps)
    finally:
        sampler.greedy = kernels["c"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EngineConfig.model)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    vocab = ModelArchitecture.from_folder(args.model).vocab_size
    print(f"device: {cpu_name()}, {torch.get_num_threads()} threads; vocabulary {vocab}")
    print("| rows | op: torch.argmax ms | op: C ms | speed-up |\n|---|---|---|---|")
    for rows in sorted({1, args.batch, 64}):
        best = op_alone(vocab, rows, args.rounds)
        print(f"| {rows} | {best['torch'] / 20 * 1e3:.3f} | {best['c'] / 20 * 1e3:.3f} | "
              f"{best['torch'] / best['c']:.1f}x |")
    step = decode_steps(args.model, args.batch, args.rounds, args.steps)
    print(f"\n| float32 decode step, {args.batch} rows | torch.argmax (ms) | C (ms) | saved |\n|---|---|---|---|")
    print(f"| median of {args.rounds} rounds | {step['torch']:.1f} | {step['c']:.1f} | "
          f"{step['torch'] - step['c']:+.1f} ms ({step['torch'] / step['c']:.3f}x) |")


if __name__ == "__main__":
    main()
