"""Speculative decoding (n-gram drafts) off vs on, one stream, in one process (docs/benchmarks.md).

    python -m benchmarks.speculative [--rounds 3] [--max-tokens 128] [--json benchmarks/results/...]

Two engines with the same weights, one with ``speculative_method=ngram``. Every workload runs
alone (one request at a time: the low-load case speculation is for), alternating between the
engines round by round, so that a noisy machine slows both alike. Greedy: both engines emit the
very same tokens, so output tokens/s and time per output token compare directly.

Workloads (chat template of the served model):
  edit       "repeat this paragraph with one change": the answer copies the paragraph.
  code       rewrite a function whose identifiers repeat.
  free       an open question, no text to copy (the non-repetitive case).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from backend import Engine, EngineConfig, SamplingParams
from benchmarks.common import DEFAULT_MODEL_DIR


PARAGRAPH = ("The river town woke slowly. Fishermen pulled their boats onto the grey stones, the baker "
             "opened his shutters, and the bells of the old church rang seven times. Children ran along "
             "the river path with their dogs, and the ferry crossed the water twice before the market opened.")
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal = subtotal + item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
'''
WORKLOADS = {
    "edit": f"Repeat this paragraph exactly, but change 'seven' to 'eight':\n\n{PARAGRAPH}",
    "code": f"Rewrite this Python function with the parameter `items` renamed to `products`:\n\n{CODE}",
    "free": "Tell me about the history of bread in a few sentences.",
}


def run_once(engine: Engine, prompt: list[int], max_tokens: int) -> dict:
    before = engine.stats()
    start = time.perf_counter()
    output = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    elapsed = time.perf_counter() - start
    after = engine.stats()
    tokens = len(output.token_ids)
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed, "steps": after.num_steps - before.num_steps,
            "drafted": after.spec_draft_tokens - before.spec_draft_tokens,
            "accepted": after.spec_accepted_tokens - before.spec_accepted_tokens, "token_ids": output.token_ids}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=EngineConfig.num_speculative_tokens)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    base = dict(model=str(args.model_dir), num_kv_blocks=512)
    engines = {"off": Engine(EngineConfig(**base)),
               "on": Engine(EngineConfig(**base, speculative_method="ngram",
                                         num_speculative_tokens=args.num_speculative_tokens))}
    tokenizer = engines["off"].tokenizer
    results: dict[str, dict] = {}
    for name in args.workloads.split(","):
        text = tokenizer.apply_chat_template([{"role": "user", "content": WORKLOADS[name]}], tokenize=False,
                                             add_generation_prompt=True)
        prompt = tokenizer(text, add_special_tokens=False).input_ids
        for engine in engines.values():        # warm-up
            run_once(engine, prompt, 8)
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for _ in range(args.rounds):
            for mode, engine in engines.items():
                runs[mode].append(run_once(engine, prompt, args.max_tokens))
        if runs["off"][0]["token_ids"] != runs["on"][0]["token_ids"]:
            raise SystemExit(f"{name}: speculation changed the greedy output")
        summary = {}
        for mode, rs in runs.items():
            tok_s = statistics.median(r["tok_s"] for r in rs)
            summary[mode] = {"tok_s_median": tok_s, "tok_s_runs": [round(r["tok_s"], 2) for r in rs],
                             "ms_per_token": 1000.0 / tok_s, "tokens": rs[0]["tokens"], "steps": rs[0]["steps"],
                             "drafted": rs[0]["drafted"], "accepted": rs[0]["accepted"]}
        summary["speedup"] = summary["on"]["tok_s_median"] / summary["off"]["tok_s_median"]
        results[name] = summary
        on = summary["on"]
        print(f"{name:5s}: off {summary['off']['tok_s_median']:6.1f} tok/s, on {on['tok_s_median']:6.1f} tok/s "
              f"({summary['speedup']:.2f}x); {on['tokens']} tokens in {summary['off']['steps']} -> {on['steps']} "
              f"steps; drafts {on['drafted']}, accepted {on['accepted']}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                         "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                         "settings": {k: str(v) for k, v in vars(args).items()},
                                         "results": results}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
