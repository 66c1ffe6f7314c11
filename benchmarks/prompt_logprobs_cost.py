"""What ``prompt_logprobs`` costs a prefill, on this machine: fresh prompts of ``--prompt``
tokens prefilled to their first token (max_tokens 1, greedy) without prompt logprobs, with
``prompt_logprobs=0`` and with ``prompt_logprobs=5``, alternating, best of ``--rounds``. Every
prompt is new (random token ids), so no request gets a prefix-cache hit: what is measured is
the extra logits rows (the LM head over every prompt position), the log-softmax and the top-n.

    python -m benchmarks.prompt_logprobs_cost [--prompt 512] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from backend import Engine, EngineConfig, SamplingParams
from benchmarks.serving import cpu_info

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL = REPO_ROOT / "models" / "smollm2-135m-instruct"
SETTINGS = {"off": None, "prompt_logprobs=0": 0, "prompt_logprobs=5": 5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=str(MODEL), dtype=args.dtype))
    rng = random.Random(0)
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, n in SETTINGS.items():
            prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt)]
            started = time.perf_counter()
            engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=n))
            times[name].append(time.perf_counter() - started)
    best = {name: min(values) for name, values in times.items()}
    for name, value in best.items():
        print(f"{name}: {value * 1000:.1f} ms (x{value / best['off']:.2f})")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_info(), "prompt": args.prompt, "dtype": args.dtype,
                                         "seconds": times, "best_seconds": best,
                                         "over_off": {k: v / best["off"] for k, v in best.items()},
                                         "command": "python -m benchmarks.prompt_logprobs_cost "
                                                    f"--prompt {args.prompt} --rounds {args.rounds}"}, indent=1))


if __name__ == "__main__":
    main()
