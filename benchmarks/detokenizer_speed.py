"""The incremental detokenizer's cost per generated token, its two paths side by side.

The Python path decodes the window twice per token from Python; the DecodeStream path steps the
Rust tokenizers' stream once (backend/engine/detokenizer.py). Requests of 200 tokens, each
with a new detokenizer (its set-up counted), over three id sequences: random ids under 1,024
(what the dummy-weight tiny model of benchmarks/host_overhead.py generates), random ids over
the whole vocabulary, and real text (this repository's README). The paths alternate; the
median of the repetitions is reported.

    python -m benchmarks.detokenizer_speed [--repeats 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from backend.config import DEFAULT_MODEL
from backend.engine.detokenizer import IncrementalDetokenizer, ids_decoder, rust_tokenizer
from backend.engine.tokenizer import load_tokenizer
from benchmarks.step_cost import cpu_name

TOKENS = 4000
REQUEST_TOKENS = 200
PROMPT_TAIL = [1, 2, 3, 4, 5]


def us_per_token(tokenizer, decode, rust, ids: list[int]) -> float:
    start = time.perf_counter()
    for first in range(0, len(ids), REQUEST_TOKENS):
        detokenizer = IncrementalDetokenizer(tokenizer, PROMPT_TAIL, [], False, decode, rust)
        for token in ids[first:first + REQUEST_TOKENS]:
            detokenizer.add_token(token)
        detokenizer.finish()
    return (time.perf_counter() - start) / len(ids) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parents[1]
    tokenizer = load_tokenizer(str(root / DEFAULT_MODEL))
    decode, rust = ids_decoder(tokenizer), rust_tokenizer(tokenizer)
    if rust is None:
        raise SystemExit("this tokenizer has no DecodeStream path")
    rng = random.Random(0)
    sequences = {
        "random ids < 1024": [rng.randrange(1024) for _ in range(TOKENS)],
        "random ids, whole vocabulary": [rng.randrange(len(tokenizer)) for _ in range(TOKENS)],
        "README text": tokenizer((root / "README.md").read_text()).input_ids[:TOKENS],
    }
    results = {}
    print("| ids | python path (us/token) | DecodeStream (us/token) | ratio |")
    print("|---|---|---|---|")
    for name, ids in sequences.items():
        times: dict[str, list[float]] = {"python": [], "decode_stream": []}
        for _ in range(args.repeats):
            times["python"].append(us_per_token(tokenizer, decode, None, ids))
            times["decode_stream"].append(us_per_token(tokenizer, decode, rust, ids))
        medians = {path: statistics.median(values) for path, values in times.items()}
        results[name] = {"us_per_token": medians, "all": times}
        print(f"| {name} | {medians['python']:.2f} | {medians['decode_stream']:.2f} | "
              f"{medians['python'] / medians['decode_stream']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "repeats": args.repeats, "tokens": TOKENS,
                                         "request_tokens": REQUEST_TOKENS, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
