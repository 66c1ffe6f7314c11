"""Where a decode step's time goes, per op family, for one or more dtypes on CPU.

``benchmarks/step_cost.py`` gives the step time; this splits it. Every op family the
model calls is wrapped in a timer (attention, linear layers incl. the LM head, norms,
RoPE + K/V write, the step's attention plan, sampling, host-side batch preparation); what
is left ("other") is the MLP activation, embedding, RoPE tables, the scheduler and Python
overhead. The wrappers cost ~1 us per call (~300 calls a step), well under 1% of a step.

The families are timed where the model's Python layer loop calls them, so the breakdown runs
that loop (``CausalLM._decoder_fused``); where the engine runs the layers as one C call
(``backend/model/cpu_decoder.py``: the same kernels), that step is timed in the same rounds as
its own column, "C step".

The engines of the dtypes compared are built side by side and measured in alternating
rounds, so a machine that is busy with something else (a test suite on the same 2
cores) slows both alike; each figure is the median over rounds of a round's mean step.

    python -m benchmarks.decode_breakdown --json benchmarks/results/decode_breakdown-cpu-epyc-2core.json
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from backend import Engine, EngineConfig, SamplingParams
from backend.model import cpu_linear, llama
from backend.sample.sampler import Sampler
from benchmarks.step_cost import cpu_name
from kernels import attention_backend, cpu_native

FAMILIES = ("attention", "linear", "norms", "rope+kv write", "plan", "sampling", "prepare", "other")
_totals: dict[str, float] = defaultdict(float)
_depth = [0]    # only the outermost timed call counts (F.linear runs inside nn.Linear.forward, etc.)


def _timed(family: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _depth[0]:
            return fn(*args, **kwargs)
        _depth[0] += 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _totals[family] += time.perf_counter() - start
            _depth[0] -= 1
    return wrapper


def instrument() -> None:
    """Wrap the op families where the model looks them up (module attributes, class methods)."""
    for backend in (attention_backend.CpuAttention, attention_backend.ReferenceAttention,
                    attention_backend.TritonAttention):
        backend.attend = _timed("attention", backend.attend)
        backend.plan = _timed("plan", backend.plan)
        backend.write_kv = _timed("rope+kv write", backend.write_kv)
    llama.apply_rope = _timed("rope+kv write", llama.apply_rope)
    cpu_native.rope_and_cache = _timed("rope+kv write", cpu_native.rope_and_cache)
    cpu_native.add_rms_norm = _timed("norms", cpu_native.add_rms_norm)
    llama.RMSNorm.forward = _timed("norms", llama.RMSNorm.forward)
    F.linear = _timed("linear", F.linear)      # nn.Linear and the tied LM head when not packed
    for cls in (cpu_linear.NativeLinear, cpu_linear.NativeBf16Linear, cpu_linear.PackedLinear, cpu_linear.Int8Linear,
                cpu_linear.Float32Logits):
        cls.forward = _timed("linear", cls.forward)
    Sampler.__call__ = _timed("sampling", Sampler.__call__)


def start_decodes(engine: Engine, contexts: list[int], rng: random.Random,
                  lora_names: list[str] | None = None) -> None:
    """Sequence i: a random prompt of contexts[i] tokens (through adapter lora_names[i])."""
    for i, context in enumerate(contexts):
        prompt = [rng.randrange(1000, engine.arch.vocab_size) for _ in range(context)]
        engine.add_request(f"seq-{i}", prompt, SamplingParams(max_tokens=4096, ignore_eos=True, temperature=0.0,
                                                              lora_name=lora_names[i] if lora_names else None))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    engine.step()


def decoding_engine(model: str, dtype: str, contexts: list[int], load_format: str,
                    lora_names: list[str] | None = None, **config) -> Engine:
    """An engine decoding len(contexts) greedy sequences, each past a random prompt of that many
    tokens (and through adapter ``lora_names[i]``). A fixed token budget (itl_target_ms=0): only
    decode steps are measured, so the start-up calibration that sizes prefill chunks would be
    time spent for nothing. ``config``: more EngineConfig fields."""
    engine = Engine(EngineConfig(model=model, dtype=dtype, max_num_seqs=len(contexts), num_kv_blocks=2048,
                                 enable_prefix_caching=False, itl_target_ms=0.0, load_format=load_format, **config))
    start_decodes(engine, contexts, random.Random(0), lora_names)
    return engine


def measure_round(engine: Engine, steps: int) -> dict[str, float]:
    """Mean ms per decode step, total and per family, over ``steps`` steps."""
    _totals.clear()
    prepare = engine.runner.prepare
    engine.runner.prepare = _timed("prepare", prepare)
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        engine.step()
    total, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    engine.runner.prepare = prepare
    row = {family: _totals[family] / steps * 1e3 for family in FAMILIES if family != "other"}
    row["other"] = total / steps * 1e3 - sum(row.values())
    row["step"] = total / steps * 1e3
    # CPU time of all the process's threads: grows far less than wall time when other
    # processes take the cores, so it tells a slow round from a crowded one.
    row["cpu"] = cpu / steps * 1e3
    return row


def c_step(engine: Engine, steps: int) -> float:
    """Mean ms a decode step with the layers as one C call (the timers left on its path, around
    the plan, the LM head and sampling, and around each projection C calls back where those are
    not our kernel: oneDNN's, int8, LoRA steps; ~1 us a call)."""
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EngineConfig.model)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--min-context", type=int, default=300)
    parser.add_argument("--max-context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=5, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--load-format", default=EngineConfig.load_format,
                        help="dummy: random weights of the folder's shapes (same step time; for a machine without the weights)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    span = args.max_context - args.min_context
    contexts = [args.min_context + span * i // max(args.batch - 1, 1) for i in range(args.batch)]
    instrument()
    engines = {}
    for dtype in dtypes:
        engine = decoding_engine(args.model, dtype, contexts, args.load_format)
        measure_round(engine, 2)    # warm-up
        engines[dtype] = engine
    rounds: dict[str, list[dict[str, float]]] = {dtype: [] for dtype in dtypes}
    for _ in range(args.rounds):
        for dtype, engine in engines.items():
            model = engine.runner.model
            decoder, model.cpu_decoder = model.cpu_decoder, None     # the loop: its families are timed
            row = measure_round(engine, args.steps)
            model.cpu_decoder = decoder
            row["C step"] = c_step(engine, args.steps) if decoder is not None else float("nan")
            rounds[dtype].append(row)
    print(f"device: {cpu_name()}, {torch.get_num_threads()} threads; {args.batch} decodes, contexts "
          f"{args.min_context}..{args.max_context}; median of {args.rounds} rounds of {args.steps} steps "
          "(ms per step; cpu: process CPU time, all threads)")
    columns = ["step", "cpu", *FAMILIES, "C step"]
    print("| dtype | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    result = {}
    for dtype, samples in rounds.items():
        medians = {c: round(statistics.median(s[c] for s in samples), 2) for c in columns}
        result[dtype] = {"median_ms": medians, "step_ms_per_round": [round(s["step"], 2) for s in samples],
                         "fused_layer_ops": engines[dtype].runner.model.fused_layer_ops,
                         "cpu_linear": engines[dtype].runner.cpu_linear}
        print(f"| {dtype} | " + " | ".join(f"{medians[c]:.1f}" for c in columns) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": cpu_name(), "threads": torch.get_num_threads(),
                                         "batch": args.batch, "contexts": contexts, "steps": args.steps,
                                         "rounds": args.rounds, "dtypes": result,
                                         "date": time.strftime("%Y-%m-%d")}, indent=2) + "\n")


if __name__ == "__main__":
    main()
