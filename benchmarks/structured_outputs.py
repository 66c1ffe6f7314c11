"""Structured outputs (xgrammar): what a constrained row costs, and throughput with a JSON
schema vs none, side by side in one process (docs/structured_outputs.md).

    python -m benchmarks.structured_outputs [--requests 16] [--rounds 3] [--json PATH]

1. Per row: a valid document is walked token by token by ``--requests`` grammar matchers at
   staggered positions; at every step the engine's ``AllowedTokensProcessor`` fills their
   bitmask rows (``prepare``) and masks a [rows, vocab] float32 logits tensor (``apply``).
   Reported in microseconds per constrained row and step; the engine's apply
   (``mask_logits_``), the torch reference (``bitmask_to_bool``, gathered rows) and
   xgrammar's C++ kernel (``apply_token_bitmask_inplace``) side by side.
2. Throughput: ``--requests`` concurrent chat requests asking for JSON, sampled at
   temperature 1.0, with the schema; then the same prompts without it, each request held to
   the very length its constrained run had (ignore_eos + max_tokens), so that both runs
   compute the same tokens in the same batch shapes. Rounds alternate between the two; the
   medians are compared. Time spent filling and applying masks is timed inside the run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import torch
import xgrammar as xgr

from backend import Engine, EngineConfig, SamplingParams
from backend.sample.grammar import GrammarConstraint
from backend.sample.constraints import bitmask_to_bool
from backend.sample.logits_processors import AllowedTokensProcessor, TokenMask
from backend.sample.metadata import SamplingBatch
from benchmarks.common import DEFAULT_MODEL_DIR

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "structured_outputs-cpu-epyc-2core.json"

SCHEMA: dict[str, Any] = {       # typed fields, nesting, an array, enums, an integer range
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                   "country": {"enum": ["US", "UK", "DE", "FR", "JP"]}},
                    "required": ["street", "city", "country"]},
        "status": {"enum": ["active", "inactive", "pending"]},
    },
    "required": ["name", "age", "email", "skills", "address", "status"],
}
# The same with every string bounded (maxLength): xgrammar computes those masks token by token
# (no precomputed cache for a counted repetition), tens to hundreds of times slower.
BOUNDED_SCHEMA: dict[str, Any] = json.loads(json.dumps(SCHEMA).replace('{"type": "string"}',
                                                                       '{"type": "string", "maxLength": 24}'))
SCHEMAS = {"schema": SCHEMA, "schema_max_length": BOUNDED_SCHEMA}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "skills": ["maths", "poetry"],
            "address": {"street": "12 St James's Square", "city": "London", "country": "UK"}, "status": "active"}
QUESTIONS = ["Describe an employee as JSON.", "Create a JSON profile of a software engineer.",
             "Give me a customer record in JSON.", "Invent a person and describe them in JSON.",
             "Write a JSON object for a new user account.", "Describe a scientist as a JSON record.",
             "Make up a JSON profile for a teacher.", "Return a JSON description of a gardener."]


def cpu_info() -> dict[str, str]:
    """Model name and flags from lscpu (the figures depend on AVX2 / AVX-512 and the core count)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"model_name": platform.processor() or platform.machine()}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {"model_name": fields.get("Model name", "").strip(), "cpus": fields.get("CPU(s)", "").strip(),
            "flags": fields.get("Flags", "").strip()}


# ---- 1. per constrained row --------------------------------------------------------------------
def apply_reference(logits: torch.Tensor, state: TokenMask) -> None:
    """``bitmask_to_bool`` over the constrained rows, gathered and scattered back."""
    rows = torch.tensor(state.rows)
    allowed = bitmask_to_bool(state.bitmask[rows], logits.shape[-1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_xgrammar(logits: torch.Tensor, state: TokenMask) -> None:
    """xgrammar's C++ kernel (writes -inf for every clear bit)."""
    xgr.apply_token_bitmask_inplace(logits, state.bitmask, vocab_size=logits.shape[-1], indices=state.rows)


class _Row:
    """A stand-in request for the processor: just the constraint."""
    def __init__(self, constraint: GrammarConstraint) -> None:
        self.constraint = constraint


def per_row_costs(engine: Engine, schema: dict[str, Any], num_rows: int) -> dict[str, float]:
    """Microseconds per constrained row and step, over every position of ``DOCUMENT``."""
    spec = SamplingParams(structured_outputs={"json": schema}).grammar_spec
    tokens = engine.tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False) + sorted(engine.eos_token_ids)[:1]
    vocab = engine.arch.vocab_size
    compiled = engine.grammars.compiled(spec).result()
    processor = AllowedTokensProcessor()

    def fresh() -> GrammarConstraint:
        return GrammarConstraint(xgr.GrammarMatcher(compiled))

    rows = [fresh() for _ in range(num_rows)]
    positions = [0] * num_rows
    for i, row in enumerate(rows):                       # staggered: every state of the walk is sampled
        for token in tokens[:(i * (len(tokens) - 1)) // num_rows]:
            row.advance(token)
            positions[i] += 1
    logits = torch.randn(num_rows, vocab)
    times: dict[str, list[float]] = {"fill": [], "apply": [], "apply_reference": [], "apply_xgrammar": []}
    for _ in range(len(tokens) * 2):
        batch = SamplingBatch([_Row(r) for r in rows], [[] for _ in rows])      # type: ignore[misc]
        start = time.perf_counter()
        state = processor.prepare(batch, vocab, torch.device("cpu"))
        times["fill"].append(time.perf_counter() - start)
        for name, apply in (("apply", processor.apply), ("apply_reference", apply_reference),
                            ("apply_xgrammar", apply_xgrammar)):
            work = logits.clone()
            start = time.perf_counter()
            apply(work, state)
            times[name].append(time.perf_counter() - start)
        for i, row in enumerate(rows):
            row.advance(tokens[positions[i]])
            positions[i] += 1
            if positions[i] == len(tokens):            # EOS accepted: start the document again
                rows[i], positions[i] = fresh(), 0
    return {name: statistics.mean(values) * 1e6 / num_rows for name, values in times.items()}


# ---- GIL -----------------------------------------------------------------------------------------
def python_rate_while_compiling(engine: Engine, seconds: float = 0.5) -> dict[str, float]:
    """Iterations of a pure-Python loop on this thread, idle and while the grammar service
    compiles a schema with 60 distinct patterns (about a second): near 100% when xgrammar
    releases the GIL during the compile."""
    schema = {"type": "object", "title": f"gil-{time.time()}",     # a new text: never cached
              "properties": {f"f{i}": {"type": "string", "pattern": f"^[a-z]{{2,{8 + i}}}[0-9]*$"} for i in range(60)}}

    def spin() -> int:
        count, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            count += 1
        return count

    idle = spin()
    start = time.perf_counter()
    future = engine.grammars.compiled(SamplingParams(structured_outputs={"json": schema}).grammar_spec)
    during = spin()
    busy = not future.done()
    future.result()
    return {"idle": idle, "during_compile": during, "ratio": during / idle, "compile_s": time.perf_counter() - start,
            "compile_outlasted_the_window": busy}


# ---- 2. throughput ------------------------------------------------------------------------------
class _Timer:
    """Wall time inside some methods (forward pass, sampling, mask fill and apply) during a run."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._restore: list[Callable[[], None]] = []

    def wrap(self, obj: Any, name: str, label: str) -> None:
        original = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start

        setattr(obj, name, timed)
        self._restore.append(lambda: setattr(obj, name, original))

    def restore(self) -> None:
        for undo in self._restore:
            undo()


def run_batch(engine: Engine, prompts: list[str], params: list[SamplingParams]) -> dict[str, Any]:
    processor = next(p for p in engine.sampler.processors if isinstance(p, AllowedTokensProcessor))
    timer = _Timer()
    timer.wrap(processor, "prepare", "fill_s")
    timer.wrap(processor, "apply", "apply_s")
    timer.wrap(engine.sampler, "sample", "sample_s")
    timer.wrap(engine.runner, "execute", "forward_s")
    before = engine.num_steps
    start = time.perf_counter()
    try:
        outputs = engine.generate(prompts, params)
    finally:
        timer.restore()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds, "steps": engine.num_steps - before,
            "lengths": [len(o.token_ids) for o in outputs], "texts": [o.text for o in outputs],
            "finish_reasons": [str(o.finish_reason) for o in outputs], **timer.seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)

    engine = Engine(EngineConfig(model=str(args.model_dir), num_kv_blocks=1024))
    tokenizer = engine.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                             tokenize=False, add_generation_prompt=True)
               for i in range(args.requests)]
    engine.grammars                                       # xgrammar's vocabulary, built once (not timed below)
    results: dict[str, Any] = {"gil": python_rate_while_compiling(engine)}
    gil = results["gil"]
    print(f"a pure-Python loop on the engine's thread ran at {gil['ratio'] * 100:.0f}% of its idle rate while a "
          f"{gil['compile_s']:.1f} s compile ran on the grammar service's thread", flush=True)
    for label, schema in SCHEMAS.items():
        start = time.perf_counter()
        engine.grammars.compiled(SamplingParams(structured_outputs={"json": schema}).grammar_spec).result()
        compile_ms = (time.perf_counter() - start) * 1e3
        rows = per_row_costs(engine, schema, args.requests)
        print(f"{label}: compiled in {compile_ms:.0f} ms; per constrained row and step ({args.requests} rows): fill "
              f"{rows['fill']:.1f} us, apply {rows['apply']:.1f} us (torch reference {rows['apply_reference']:.1f} "
              f"us, xgrammar's kernel {rows['apply_xgrammar']:.1f} us)", flush=True)
        throughput = compare_throughput(engine, prompts, schema, args)
        results[label] = {"compile_ms": compile_ms, "per_row_us": rows, **throughput}
    payload = {"cpu": cpu_info(), "torch_threads": torch.get_num_threads(),
               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "settings": {k: str(v) for k, v in vars(args).items()},
               "command": "python -m benchmarks.structured_outputs", "results": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


def compare_throughput(engine: Engine, prompts: list[str], schema: dict[str, Any], args: argparse.Namespace,
                       ) -> dict[str, Any]:
    """Rounds of: the batch with the schema, then the batch without it held to the same lengths."""
    n = len(prompts)
    schema_params = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, structured_outputs={"json": schema})
                     for _ in range(n)]
    run_batch(engine, prompts[:2], schema_params[:2])                              # warm-up
    runs: dict[str, list[dict[str, Any]]] = {"with_schema": [], "without": []}
    for _ in range(args.rounds):
        constrained = run_batch(engine, prompts, schema_params)
        plain_params = [SamplingParams(max_tokens=length, temperature=1.0, ignore_eos=True)
                        for length in constrained["lengths"]]
        runs["with_schema"].append(constrained)
        runs["without"].append(run_batch(engine, prompts, plain_params))
    sampled = [(text, reason) for r in runs["with_schema"] for text, reason in zip(r["texts"], r["finish_reasons"])]
    valid = sum(_is_json(text) for text, _ in sampled)
    # Why an output does not parse: cut at max_tokens inside the document, or (a bug) ended by
    # the grammar's EOS and still not JSON.
    not_parsing: dict[str, int] = {}
    for text, reason in sampled:
        if not _is_json(text):
            not_parsing[reason] = not_parsing.get(reason, 0) + 1
    summary: dict[str, Any] = {}
    for mode, results in runs.items():
        steps = statistics.median(r["steps"] for r in results)
        summary[mode] = {"tok_s_median": statistics.median(r["tok_s"] for r in results),
                         "tok_s_runs": [round(r["tok_s"], 1) for r in results],
                         "tokens": [r["tokens"] for r in results], "steps": [r["steps"] for r in results],
                         **{key.replace("_s", "_ms_per_step"): statistics.median(r.get(key, 0.0) for r in results)
                            / steps * 1e3 for key in ("forward_s", "sample_s", "fill_s", "apply_s")}}
    ratio = summary["with_schema"]["tok_s_median"] / summary["without"]["tok_s_median"]
    print(f"  {n} concurrent requests: with the schema {summary['with_schema']['tok_s_median']:.1f} tok/s, without "
          f"{summary['without']['tok_s_median']:.1f} tok/s ({(ratio - 1) * 100:+.1f}%); "
          f"{valid}/{n * args.rounds} outputs parse as JSON (the others, by finish reason: {not_parsing})", flush=True)
    for mode, s in summary.items():
        print(f"    {mode:11s} per step: forward {s['forward_ms_per_step']:.2f} ms, sampling "
              f"{s['sample_ms_per_step']:.2f} ms (fill {s['fill_ms_per_step']:.2f} ms, apply "
              f"{s['apply_ms_per_step']:.2f} ms)", flush=True)
    return {"throughput": summary, "with_over_without": ratio, "valid_json": valid, "outputs": n * args.rounds,
            "not_parsing_by_finish_reason": not_parsing,
            "finish_reasons": {reason: sum(1 for _, r in sampled if r == reason) for reason in {r for _, r in sampled}}}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
