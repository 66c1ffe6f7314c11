"""The engine's host work per step, apart from the forward pass, at a GPU's batch sizes.

On a GPU the forward of a decode step takes a few milliseconds at batch 64 (Llama 1B shape on an
H200, docs/benchmarks.md), and everything the engine does in Python around it (scheduling, KV
slot allocation, step preparation, sampling metadata, appending tokens, detokenizing, building
the outputs) is serial with it. This measures that host work where no GPU is needed: a tiny
dummy-weight Llama (benchmarks/decode_roofline.py's "tiny" shape, the SmolLM2 tokenizer) on
the CPU, ``batch`` greedy requests decoding together (ignore_eos), ``Engine.step`` timed as a
whole and ``ModelRunner.execute`` (the forward) inside it; host = step - forward. The forward
here is the CPU's, not the GPU's: only the host column carries over.

    python -m benchmarks.host_overhead [--batches 16,64,256] [--steps 300] [--rounds 3] [--prompt-tokens 32]
    python -m benchmarks.host_overhead --batches 64 --profile tottime   # cProfile's top functions

Rounds alternate over the batch sizes; the table gives each one's median round.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from backend import Engine, EngineConfig, SamplingParams
from backend.worker.model_runner import ModelRunner
from benchmarks.gpu_proof import dummy_model_folder
from benchmarks.step_cost import cpu_name

PROMPT_TOKENS = 32
WARM_UP_STEPS = 5


class ForwardTimer:
    """Seconds spent in ModelRunner.execute while installed (a context manager)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = ModelRunner.execute

    def __enter__(self) -> "ForwardTimer":
        original, timer = self._original, self

        def timed(runner: ModelRunner, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(runner, *args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - start
        ModelRunner.execute = timed
        return self

    def __exit__(self, *exc: object) -> None:
        ModelRunner.execute = self._original


def decoding_engine(folder: Path, batch: int, steps: int, prompt_tokens: int = PROMPT_TOKENS) -> Engine:
    """An engine with ``batch`` requests past their prompts, each with ``steps`` more to decode."""
    config = EngineConfig(model=str(folder), load_format="dummy", device="cpu", dtype="float32",
                          max_num_seqs=batch, max_num_batched_tokens=max(batch * prompt_tokens, 512),
                          num_kv_blocks=batch * (prompt_tokens + steps + 64) // 16 + 16, itl_target_ms=0,
                          max_num_partial_prefills=batch, cpu_threads=1)   # every prompt in the first step
    engine = Engine(config)
    params = SamplingParams(max_tokens=steps + 2 * WARM_UP_STEPS, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        # distinct prompts (no prefix hits), ids the tokenizer decodes to text
        engine.add_request(f"r{i}", [100 + (i * prompt_tokens + t) % 900 for t in range(prompt_tokens)], params)
    for _ in range(WARM_UP_STEPS):
        engine.step()
    assert all(r.num_output_tokens for r in engine.requests.values()), "a prompt is still prefilling"
    return engine


def one_round(folder: Path, batch: int, steps: int, prompt_tokens: int = PROMPT_TOKENS,
              profile: cProfile.Profile | None = None) -> dict[str, float]:
    engine = decoding_engine(folder, batch, steps, prompt_tokens)
    with ForwardTimer() as forward:
        if profile is not None:
            profile.enable()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - start
        if profile is not None:
            profile.disable()
    return {"step_ms": wall / steps * 1e3, "forward_ms": forward.seconds / steps * 1e3,
            "host_ms": (wall - forward.seconds) / steps * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                        help="context each request decodes after (block tables grow with it)")
    parser.add_argument("--profile", choices=("tottime", "cumulative"),
                        help="one round per batch under cProfile, its top functions printed (times inflated)")
    parser.add_argument("--json", type=Path, help="write the rounds and medians here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as work:
        folder = dummy_model_folder("tiny", Path(work))
        print(f"device: {cpu_name()}, torch {torch.__version__}, the forward on 1 CPU thread")
        if args.profile:
            for batch in batches:
                profile = cProfile.Profile()
                print(one_round(folder, batch, args.steps, args.prompt_tokens, profile))
                pstats.Stats(profile).sort_stats(args.profile).print_stats(40)
            return
        rounds: dict[int, list[dict[str, float]]] = {b: [] for b in batches}
        for r in range(args.rounds):
            for batch in (batches if r % 2 == 0 else batches[::-1]):
                rounds[batch].append(one_round(folder, batch, args.steps, args.prompt_tokens))
    print("| batch | step ms | forward ms (CPU) | host ms | host us per request |")
    print("|---|---|---|---|---|")
    medians = {}
    for batch in batches:
        median = {key: statistics.median(r[key] for r in rounds[batch]) for key in rounds[batch][0]}
        medians[batch] = median
        print(f"| {batch} | {median['step_ms']:.2f} | {median['forward_ms']:.2f} | {median['host_ms']:.2f} "
              f"| {median['host_ms'] * 1e3 / batch:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"device": cpu_name(), "steps": args.steps,
                                         "prompt_tokens": args.prompt_tokens, "rounds": rounds,
                                         "medians": medians}, indent=1) + "\n")


if __name__ == "__main__":
    main()
