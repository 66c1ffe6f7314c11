"""Greedy agreement of lower-precision engine settings with transformers in float32.

The engine's HF-equality prompts (tests/test_hf_equality.py: 12 prompts of 1-430 tokens,
24 greedy tokens each) run through transformers (float32 and bfloat16) and through the
engine in each setting; per prompt, the share of generated tokens identical before the
first divergence.
float32 must score 1.0 (the tests demand exact equality); the others are written down in
docs/benchmarks.md.

    python -m benchmarks.precision_agreement
"""

from __future__ import annotations

import argparse
import statistics

import torch

from backend import Engine, EngineConfig, SamplingParams
from tests.conftest import MODEL_DIR, _PROSE, hf_greedy
from tests.test_hf_equality import MAX_NEW_TOKENS, PROMPT_LENGTHS

SETTINGS = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"},
            # bfloat16 through each CPU linear path (auto picks one by the CPU: docs/benchmarks.md)
            "bfloat16-native": {"dtype": "bfloat16", "cpu_linear": "native"},
            "bfloat16-onednn": {"dtype": "bfloat16", "cpu_linear": "onednn"},
            "int8": {"dtype": "float32", "quantization": "int8"}}


def prefix_share(ours: list[int], reference: list[int]) -> float:
    same = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), len(reference))
    return same / len(reference)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    prose: list[int] = []
    while len(prose) < 2000:
        prose += tokenizer(_PROSE * 4).input_ids
    prompts = [prose[7 * i + 1: 7 * i + 1 + n] for i, n in enumerate(PROMPT_LENGTHS)]
    references = {dtype: hf_greedy(AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=dtype).eval(), prompts,
                                   MAX_NEW_TOKENS) for dtype in (torch.float32, torch.bfloat16)}
    print("| setting | vs transformers | mean share identical before first divergence | prompts fully identical |\n"
          "|---|---|---|---|")
    for name in args.settings.split(","):
        engine = Engine(EngineConfig(model=str(MODEL_DIR), num_kv_blocks=512, **SETTINGS[name]))
        outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
        for dtype, reference in references.items():
            shares = [prefix_share(o.token_ids, r) for o, r in zip(outputs, reference)]
            print(f"| {name} | {str(dtype)[6:]} | {statistics.mean(shares):.3f} | "
                  f"{sum(s == 1.0 for s in shares)}/{len(shares)} |")


if __name__ == "__main__":
    main()
