"""The MLP's SiLU x up, fused (``kernels.cpu_native.silu_and_mul``) against the torch ops it
replaces (``F.silu(gate, inplace=True).mul_(up)``), on CPU: first the op alone over 30 layers'
activations, then whole decode steps of one engine whose MLPs switch between the two every
round (alternating in one process: these machines' speed drifts), through the Python layer
loop (the layers as one C call always fuse).

    python -m benchmarks.silu_and_mul                      # SmolLM2 shapes, random weights
"""

from __future__ import annotations

import argparse
import random
from typing import Callable

import torch
import torch.nn.functional as F

from backend import EngineConfig
from backend.model.architecture import ModelArchitecture
from benchmarks.common import alternating_medians, best_of
from benchmarks.decode_breakdown import decoding_engine
from benchmarks.step_cost import cpu_name
from kernels import cpu_native


def op_alone(inter: int, layers: int, rows: int, dtype: torch.dtype, rounds: int) -> dict[str, float]:
    """Seconds for `layers` calls on [rows, 2 * inter] activations, best round of each."""
    base = (torch.randn(rows, 2 * inter) * 3).to(dtype)
    buffers = [base.clone() for _ in range(layers)]

    def run(fused: bool):
        def once() -> None:
            for b in buffers:
                b.copy_(base)            # fresh inputs for each call: both pay the same copy
                if fused:
                    cpu_native.silu_and_mul(b, inter)
                else:
                    F.silu(b[:, :inter], inplace=True).mul_(b[:, inter:])
        return once
    return best_of(rounds, {"torch": run(False), "fused": run(True)})


def decode_steps(model: str, dtype: str, batch: int, rounds: int, steps: int) -> dict[str, float]:
    """Median ms a decode step, the MLPs' activation by torch ops or fused, alternating rounds."""
    rng = random.Random(0)
    engine = decoding_engine(model, dtype, [rng.randint(64, 192) for _ in range(batch)], "dummy")
    engine.runner.model.cpu_decoder = None     # the Python layer loop, where the MLPs' ops switch
    mlps = [layer.mlp for layer in engine.runner.model.model.layers]
    fused_ops = mlps[0].layer_ops
    assert fused_ops is cpu_native, "the engine runs without the C layer ops here"
    def use(ops) -> Callable[[], None]:
        def switch() -> None:
            for mlp in mlps:
                mlp.layer_ops = ops
        return switch
    return alternating_medians({"fused": use(fused_ops), "torch": use(None)}, engine.step, rounds, steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EngineConfig.model)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    arch = ModelArchitecture.from_folder(args.model)
    print(f"device: {cpu_name()}, {torch.get_num_threads()} threads; intermediate {arch.intermediate_size}, "
          f"{arch.num_layers} layers")
    print("| dtype | rows | op: torch ms | op: fused ms | speed-up |\n|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for rows in (args.batch, 512):
            best = op_alone(arch.intermediate_size, arch.num_layers, rows, getattr(torch, dtype), args.rounds)
            print(f"| {dtype} | {rows} | {best['torch'] * 1e3:.2f} | {best['fused'] * 1e3:.2f} | "
                  f"{best['torch'] / best['fused']:.2f}x |")
    print(f"\n| dtype | decode step, torch SiLU (ms) | fused (ms) | saved |\n|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        step = decode_steps(args.model, dtype, args.batch, args.rounds, args.steps)
        print(f"| {dtype} | {step['torch']:.1f} | {step['fused']:.1f} | {step['torch'] - step['fused']:+.1f} ms "
              f"({step['torch'] / step['fused']:.3f}x) |")


if __name__ == "__main__":
    main()
