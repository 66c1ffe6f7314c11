"""Engine decode step against the memory-bandwidth floor (GPU).

A decode step must read every weight once and every cached K/V byte of the batch once, so
no step can be faster than ``(weight bytes + KV bytes) / copy bandwidth``. This measures
the engine's hot path for one decode step (host metadata into the step buffers, the forward
pass, CUDA-graph replay unless --eager, greedy sampling and the one device-to-host copy of
the sampled tokens) for a dummy-weight Llama at batch 1 to 256, and reports it against
that floor. Batching is what moves a step toward the floor's weight term: the weights are
read once for the whole batch.

    python -m benchmarks.decode_roofline                     # GPU: 1B and 8B shapes, graphs and eager
    python -m benchmarks.decode_roofline --smoke             # any machine: a tiny shape (checks the script)
    python -m benchmarks.decode_roofline --overlap ...       # also steps launched before the last is read

``--overlap`` adds the steady state of async_scheduling (backend/engine/overlap.py): each step
is packed and launched, then the step before's tokens are read, so the host's packing runs
while the device computes; a step's time is the run's wall clock over its steps.

Each request holds ``--context`` tokens, so every step attends over that many keys.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch

from backend.config import EngineConfig
from backend.core.request import Request
from backend.engine.overlap import HostTokenBuffers, InFlightStep
from backend.model.architecture import ModelArchitecture
from backend.sample.sampler import Sampler
from backend.sampling_params import SamplingParams
from backend.worker.model_runner import ModelRunner
from benchmarks.common import copy_bandwidth_gbps, device_name, markdown_table, time_ms, write_results

# Llama-3.2-1B and Llama-3.1-8B shapes (config.json fields); weights are random.
SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=1024, tie_word_embeddings=True),
}
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def write_config(folder: Path, shape: dict, max_len: int) -> None:
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5,
                  rope_theta=500000.0, max_position_embeddings=max_len, initializer_range=0.02, **shape)
    (folder / "config.json").write_text(json.dumps(config))


def decode_requests(batch: int, context: int) -> list[Request]:
    """Requests whose next step is one token at position ``context`` (the last of their
    prompt), the shape of every step in a long decode."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    requests = []
    for i in range(batch):
        r = Request(request_id=str(i), prompt_token_ids=[(i + t) % 1000 for t in range(context + 1)],
                    sampling_params=params, arrival_seq=i, arrival_time=0.0, max_tokens=1, eos_token_ids=frozenset())
        r.num_computed_tokens = context
        requests.append(r)
    return requests


def decode_batch(runner: ModelRunner, batch: int, context: int) -> tuple[list[Request], dict[str, int],
                                                                         dict[str, list[int]]]:
    """``runner.prepare``'s arguments for one decode step of ``batch`` requests at ``context``
    tokens: the requests, one scheduled token each, and their (consecutive) blocks."""
    requests = decode_requests(batch, context)
    blocks_per_seq = -(-(context + 1) // runner.block_size)
    block_ids = {r.request_id: list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
                 for i, r in enumerate(requests)}
    return requests, {r.request_id: 1 for r in requests}, block_ids


def dummy_runner(folder: Path, name: str, max_batch: int, context: int, **overrides) -> ModelRunner:
    """A model runner for the dummy-weight ``SHAPES[name]`` (config written into ``folder``)
    with KV blocks for ``max_batch`` requests of ``context`` tokens."""
    write_config(folder, SHAPES[name], max_len=max(4096, context + 16))
    blocks = max_batch * (-(-(context + 1) // 16)) + 1
    config = EngineConfig(model=str(folder), load_format="dummy", block_size=16, num_kv_blocks=blocks,
                          max_num_seqs=max_batch, max_num_batched_tokens=max(512, max_batch),
                          max_model_len=context + 16, **overrides)
    return ModelRunner(config, ModelArchitecture.from_folder(folder))


def step_ms(runner: ModelRunner, sampler: Sampler, batch: int, context: int, iters: int) -> float:
    requests, num_scheduled, block_ids = decode_batch(runner, batch, context)

    def one_step() -> None:
        input_ids, meta, sampling = runner.prepare(requests, num_scheduled, block_ids)
        logits = runner.execute(input_ids, meta)
        sampler(logits, sampling)          # greedy: argmax + the step's one device-to-host copy

    # Wall clock (time_ms on a CPU device): the step ends with the device-to-host copy of the
    # sampled tokens, so host time covers the GPU work and the host work around it.
    return time_ms(one_step, torch.device("cpu"), warmup=3, iters=iters)


def overlapped_step_ms(runner: ModelRunner, sampler: Sampler, batch: int, context: int, iters: int) -> float:
    """Milliseconds per step when each step is launched before the one before is read."""
    requests, num_scheduled, block_ids = decode_batch(runner, batch, context)
    buffers = HostTokenBuffers(runner.max_logits_rows(), runner.device)

    def launch() -> InFlightStep:
        input_ids, meta, sampling = runner.prepare(requests, num_scheduled, block_ids)
        logits = runner.execute(input_ids, meta)
        _, tokens = sampler.choose(logits, sampler.prepare(sampling, None, logits.shape[-1], logits.device))
        return InFlightStep.launch(sampling, tokens, buffers)

    for _ in range(3):
        launch().read()
    started = time.perf_counter()
    before = launch()
    for _ in range(iters - 1):
        step = launch()
        before.read()
        before = step
    before.read()
    return (time.perf_counter() - started) * 1e3 / iters


def run_shape(name: str, batches: list[int], context: int, eager: bool, device: torch.device,
              bandwidth: float, iters: int, fused_layer_ops: bool = True, overlap: bool = False) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        runner = dummy_runner(Path(tmp), name, max(batches), context, enforce_eager=eager,
                              fused_layer_ops=fused_layer_ops)
        arch = runner.arch
        sampler = Sampler(0)
        element = torch.tensor([], dtype=runner.dtype).element_size()
        weight_bytes = sum(p.numel() for p in runner.model.parameters()) * element
        kv_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * element
        rows = []
        mode = "eager" if eager else "cuda-graphs"
        for batch in batches:
            floor_ms = (weight_bytes + batch * (context + 1) * kv_per_token) / (bandwidth * 1e9) * 1e3
            timings = [(mode, step_ms(runner, sampler, batch, context, iters))]
            if overlap:
                timings.append((f"{mode}, overlapped", overlapped_step_ms(runner, sampler, batch, context, iters)))
            for label, ms in timings:
                rows.append(dict(shape=name, mode=label, batch=batch, context=context,
                                 fused_layer_ops=runner.model.fused_layer_ops,
                                 step_ms=ms, floor_ms=floor_ms, ratio=ms / floor_ms, tokens_per_s=batch / (ms * 1e-3),
                                 weight_gb=weight_bytes / 1e9))
                print(f"{name} {label} batch {batch}: {ms:.3f} ms (floor {floor_ms:.3f} ms, "
                      f"{ms / floor_ms:.2f}x)", flush=True)
        # The runner and its CUDA graphs refer to each other: collect the cycle now, or the
        # next shape is allocated while this one still holds its weights and KV cache.
        del runner
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama-1b,llama-8b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    parser.add_argument("--eager", action="store_true", help="only eager steps (no CUDA graphs)")
    parser.add_argument("--graphs-only", action="store_true", help="only CUDA-graph steps (no eager)")
    parser.add_argument("--no-fused-ops", action="store_true", help="torch ops instead of the fused layer ops")
    parser.add_argument("--overlap", action="store_true",
                        help="also time steps launched before the step before is read (async_scheduling)")
    parser.add_argument("--json", type=Path, help="where to write the results (default benchmarks/results/)")
    parser.add_argument("--smoke", action="store_true", help="tiny shape, two batch sizes, CPU allowed")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke")
    shapes = args.shapes.split(",") if not args.smoke else ["tiny"]
    batches = [int(b) for b in args.batches.split(",")] if not args.smoke else [1, 4]
    context = args.context if not args.smoke else 64
    iters = args.iters if not args.smoke else 2
    bandwidth = copy_bandwidth_gbps(device, (1 << 30) if not args.smoke else (1 << 22))
    print(f"device: {device_name(device)}; measured copy bandwidth {bandwidth:.0f} GB/s")

    modes = [True] if args.eager or device.type != "cuda" else [False] if args.graphs_only else [False, True]
    results = []
    for name in shapes:
        for eager in modes:
            results += run_shape(name, batches, context, eager, device, bandwidth, iters, not args.no_fused_ops,
                                 args.overlap)
    table = markdown_table(["shape", "mode", "batch", "step ms", "floor ms", "step / floor", "tokens/s"],
                           [[r["shape"], r["mode"], r["batch"], r["step_ms"], r["floor_ms"], r["ratio"],
                             round(r["tokens_per_s"])] for r in results])
    print(f"\ndecode step at context {context} (floor = (weights + KV read) / {bandwidth:.0f} GB/s):\n{table}")
    payload = dict(device=device_name(device), copy_bandwidth_gbps=bandwidth, context=context,
                   fused_layer_ops=results[0]["fused_layer_ops"] if results else None, results=results)
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    elif not args.smoke:
        print(f"wrote {write_results('decode_roofline', payload)}")


if __name__ == "__main__":
    main()
