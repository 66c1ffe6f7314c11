"""Sampled decode throughput with the sampler's draw (inverse CDF, ``backend.sample.sampler.draw``)
against the exponential race it replaced (argmax of probs over Exp(1) noise, as vLLM draws on GPUs),
in one process, rounds alternating. docs/benchmarks.md, "Sampling a token on CPU".

    python -m benchmarks.sampling_draw [--streams 16] [--max-tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from backend import Engine, EngineConfig, SamplingParams
from backend.sample import sampler
from benchmarks.common import DEFAULT_MODEL_DIR


def exponential_race(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The draw before: exact as well, but torch draws one exponential per vocabulary entry."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    args = parser.parse_args(argv)
    # A fixed token budget: decode steps are what differs, no start-up calibration needed.
    engine = Engine(EngineConfig(model=args.model_dir, dtype="float32", num_kv_blocks=1024,
                                 max_num_seqs=args.streams, itl_target_ms=0.0))
    prompts = [[100 + 7 * i + j for j in range(args.prompt_tokens)] for i in range(args.streams)]
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)
    draws = {"inverse_cdf": sampler.draw, "exponential_race": exponential_race}
    tok_s: dict[str, list[float]] = {name: [] for name in draws}
    try:
        for _ in range(args.rounds):
            for name, draw in draws.items():
                sampler.draw = draw
                start = time.perf_counter()
                outputs = engine.generate(prompts, params)
                tok_s[name].append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start))
    finally:
        sampler.draw = draws["inverse_cdf"]
    medians = {name: statistics.median(values) for name, values in tok_s.items()}
    print(json.dumps({"streams": args.streams, "max_tokens": args.max_tokens, "torch_threads": torch.get_num_threads(),
                      "output_tok_s": {k: [round(v, 1) for v in vs] for k, vs in tok_s.items()},
                      "ratio_of_medians": round(medians["inverse_cdf"] / medians["exponential_race"], 2)}, indent=1))


if __name__ == "__main__":
    main()
