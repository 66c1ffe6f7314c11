"""The decoder layers as one C call (``backend/model/cpu_decoder.py``) against the Python loop of
the same kernels (``CausalLM._decoder_fused``): engine steps of one engine whose model switches
between the two every round (alternating in one process: these machines' speed drifts), for a
decode step (``--batch`` sequences) and a prompt's prefill (one ``--prompt``-token prompt, all
its steps, in an engine of its own).

    python -m benchmarks.cpu_decoder                        # SmolLM2 shapes, random weights
    python -m benchmarks.cpu_decoder --cpu-linear onednn    # projections called back from C
    python -m benchmarks.cpu_decoder --lora-adapters 4      # decode steps with LoRA adapters

``--cpu-linear``: the projections' kernel, ``native`` by default (ours: inside the C call; the
default ``auto`` picks oneDNN on some AVX-512 and AMX CPUs). With ``onednn`` or ``torch`` the C
call hands each projection back to Python (backend/model/cpu_decoder.py).
``--lora-adapters N``: the decode step's sequences use N random rank-16 adapters in turn (every
projection is then called back, its deltas added there); the prefill row is skipped.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch

from backend import Engine, EngineConfig, SamplingParams
from backend.lora.synthetic import MODULES, model_with_adapters
from benchmarks.common import alternating_medians
from benchmarks.decode_breakdown import decoding_engine
from benchmarks.step_cost import cpu_name


def alternate(engine: Engine, run_step, rounds: int, steps: int) -> dict[str, float]:
    """Median ms of ``run_step()`` with the layers in C and in the Python loop, alternating."""
    model = engine.runner.model
    decoder = model.cpu_decoder
    assert decoder is not None, "the C decoder does not apply here (the C layer ops are needed)"
    variants = {"c": lambda: setattr(model, "cpu_decoder", decoder),
                "loop": lambda: setattr(model, "cpu_decoder", None)}
    try:
        return alternating_medians(variants, run_step, rounds, steps)
    finally:
        model.cpu_decoder = decoder


def prefill_step(engine: Engine, prompt: int, rng: random.Random):
    """The steps that prefill one fresh ``prompt``-token prompt and sample its one token."""
    counter = iter(range(10 ** 9))

    def run() -> None:
        request_id = f"prefill-{next(counter)}"
        tokens = [rng.randrange(1000, engine.arch.vocab_size) for _ in range(prompt)]
        engine.add_request(request_id, tokens, SamplingParams(max_tokens=1, temperature=0.0))
        while request_id in engine.requests:
            engine.step()
    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EngineConfig.model)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--cpu-linear", default="native", choices=["native", "onednn", "torch"])
    parser.add_argument("--lora-adapters", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"device: {cpu_name()}, {torch.get_num_threads()} threads; medians of {args.rounds} rounds, alternating")
    print(f"projections: cpu_linear={args.cpu_linear}" + (f"; {args.lora_adapters} LoRA adapters (rank 16)"
                                                            if args.lora_adapters else ""))
    print("| dtype | step | Python loop ms | one C call ms | speed-up |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="cpu-decoder-") as tmp:
        model, lora_names, config = args.model, None, {}
        if args.lora_adapters:
            names = [f"adapter-{i}" for i in range(args.lora_adapters)]
            model = str(model_with_adapters(Path(args.model).resolve(), Path(tmp) / "model",
                                            {name: (16, 32, MODULES, i) for i, name in enumerate(names)}))
            lora_names = [names[i % len(names)] for i in range(args.batch)]
            config = {"max_loras": len(names)}
        for dtype in args.dtypes.split(","):
            rng = random.Random(0)
            engine = decoding_engine(model, dtype, [rng.randint(64, 192) for _ in range(args.batch)],
                                     args.load_format, lora_names, cpu_linear=args.cpu_linear, **config)
            decode = alternate(engine, engine.step, args.rounds, args.steps)
            print(f"| {dtype} | decode, {args.batch} sequences of 64-192 tokens | {decode['loop']:.1f} | "
                  f"{decode['c']:.1f} | {decode['loop'] / decode['c']:.2f}x |")
            del engine
            if args.lora_adapters:
                continue
            engine = Engine(EngineConfig(model=model, dtype=dtype, max_num_seqs=4, num_kv_blocks=2048,
                                         enable_prefix_caching=False, itl_target_ms=0.0,
                                         load_format=args.load_format, cpu_linear=args.cpu_linear))
            prefill = alternate(engine, prefill_step(engine, args.prompt, rng), max(2, args.rounds // 2), 1)
            print(f"| {dtype} | prefill of a {args.prompt}-token prompt | {prefill['loop']:.1f} | "
                  f"{prefill['c']:.1f} | {prefill['loop'] / prefill['c']:.2f}x |")


if __name__ == "__main__":
    main()
