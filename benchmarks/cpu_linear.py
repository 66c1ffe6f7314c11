"""Every projection of a model, as one decode step runs them, through each CPU linear path.

The model's 4 projections per layer and its LM head, with distinct random weights so that
they stream from DRAM as in a real step, are run at several row counts (one row per
decoding sequence) through ``native`` (our kernel), ``onednn`` (prepacked) and ``torch``
(``F.linear``, the reference). Paths alternate round by round and the best round counts:
the machines are shared and their speed drifts.

    python -m benchmarks.cpu_linear --rows 1,16,64
    python -m benchmarks.cpu_linear --rows 1,16,64 --dtype bfloat16   # native: our bf16 kernel (AMX, AVX512_BF16 or AVX2)
    python -m benchmarks.cpu_linear --rows 1,2,4,16,64,512 --dtype bfloat16 --paths native,native-noamx,onednn
    python -m benchmarks.cpu_linear --rows 1,8,16,32,64,512 --paths onednn --against HEAD~1   # this tree's kernel against a commit's

``onednn-hint`` is oneDNN with each weight prepacked for the row count being timed (a batch-size
hint; the engine packs without one). ``native-noamx`` is our bfloat16 kernel from a build without AMX tiles (``-mno-amx-tile
-mno-amx-bf16``: the AVX512_BF16 dot products, or AVX2): on an AMX CPU, the AMX version against
the one it replaces from 2 rows, in the same run. ``--variant NAME=CFLAGS`` adds more builds of
it as paths, e.g. the AMX version's knobs:

    python -m benchmarks.cpu_linear --dtype bfloat16 --rows 1,2,4,16 --variant amx-from-1=-DAMX_MIN_ROWS=1 \
        --variant amx-no-prefetch=-DAMX_PREFETCH_TILES=0 --paths native,amx-from-1,amx-no-prefetch,onednn

``native-dp`` and ``native-fma`` are our bfloat16 kernel with its float32-FMA version (AVX-512F
builds) off and on from one row (``-DLINEAR_BF16_FMA_ROWS``; the engine's threshold comes from a
timing at start-up, backend/model/cpu_linear_tuning.py, and ``native`` here runs with none set:
the dot products). ``--per-shape`` prints GFLOP/s per projection shape (all the step's matmuls
of that shape, one after another) and for the whole step, instead of the ms table:

    python -m benchmarks.cpu_linear --dtype bfloat16 --rows 16,64,512 --paths native-dp,native-fma --per-shape

``--spread N`` times the step N times per path instead (the paths alternating) and prints the
spread of its wall time: median, p90, p99, the largest and p99 / median. The ITL target sizes a
step by its predicted time, so how far the matmuls alone run over their median on a quiet
machine is a floor under how far a served step can (docs/benchmarks.md, "What is behind the
slow served steps"):

    python -m benchmarks.cpu_linear --dtype bfloat16 --rows 208 --paths native --spread 300
"""

from __future__ import annotations

import argparse
from typing import Callable

import numpy as np

import torch
import torch.nn.functional as F

from backend.config import EngineConfig
from backend.model.architecture import ModelArchitecture
from backend.model.cpu_linear import (PackedLinear, native_kernel_available, native_linear, onednn_packing_available,
                                      pack_pairs, pack_panels)
from backend.model.cpu_linear_tuning import projection_shapes
from benchmarks.common import best_of, timed_rounds
from benchmarks.cpu_attention import build_revision
from benchmarks.step_cost import cpu_name
from kernels import cpu_native

NO_AMX_CFLAGS = ("-mno-amx-tile", "-mno-amx-bf16")
# Our bfloat16 kernel with its float32-FMA version never run / run from one row.
FMA_BUILDS = {"native-dp": ("-DLINEAR_BF16_FMA_ROWS=0",), "native-fma": ("-DLINEAR_BF16_FMA_ROWS=1",)}


def kernel_build(cflags: tuple[str, ...], dtype: torch.dtype, revision: str | None = None
                 ) -> Callable[[torch.Tensor, None], Callable[[torch.Tensor], torch.Tensor]]:
    """A maker of layers running our kernel for ``dtype`` from a build with these extra flags
    (of git revision ``revision``'s kernels, or this tree's), over the same packed weight (no
    bias, as the other makers are called here)."""
    library = (build_revision(revision, cpu_native.CFLAGS + cflags) if revision
               else cpu_native.open_library(cpu_native.build(cflags=cpu_native.CFLAGS + cflags)))
    cpu_native.use_amx(True, library)        # as the engine runs it with cpu_linear=native

    def make(weight: torch.Tensor, bias: None) -> Callable[[torch.Tensor], torch.Tensor]:
        out_features = weight.shape[0]
        if dtype == torch.float32:
            packed = pack_panels(weight)
            return lambda x: cpu_native.linear_f32(x, packed, out_features, None, library=library)
        packed = pack_pairs(weight)
        return lambda x: cpu_native.linear_bf16(x, packed, out_features, None, library=library)
    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EngineConfig.model)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--paths", default="native,onednn,torch")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=CFLAGS",
                        help="a build of our kernel for --dtype with these extra gcc flags, as path NAME")
    parser.add_argument("--against", metavar="REV",
                        help="adds paths 'this' (this tree's kernel) and REV (git revision REV's), called alike")
    parser.add_argument("--per-shape", action="store_true",
                        help="GFLOP/s per projection shape and for the whole step, instead of ms per step")
    parser.add_argument("--spread", type=int, default=0, metavar="N",
                        help="time the step N times per path and print the spread of its time, instead of the best")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    arch = ModelArchitecture.from_folder(args.model)
    shapes = projection_shapes(arch) + [(arch.hidden_size, arch.vocab_size)]   # and the LM head
    weights = [(torch.randn(n, k) * 0.02).to(dtype) for k, n in shapes]
    # Builds of our kernel as paths: name -> (extra gcc flags, git revision or None for this tree's).
    builds: dict[str, tuple[tuple[str, ...], str | None]] = {"native-noamx": (NO_AMX_CFLAGS, None)}
    if dtype == torch.bfloat16:
        builds.update((name, (flags, None)) for name, flags in FMA_BUILDS.items())
    builds.update((name, (tuple(flags.split()), None)) for name, _, flags in (v.partition("=") for v in args.variant))
    paths = args.paths.split(",")
    if args.against:
        # Both through the same thin call (``native`` is an nn.Module: more Python per call).
        builds.update({"this": ((), None), args.against: ((), args.against)})
        paths += [p for p in ("this", args.against) if p not in paths]
    kernel = native_kernel_available(dtype)
    makers = {"native": native_linear, "onednn": PackedLinear}
    makers.update((name, kernel_build(flags, dtype, revision)) for name, (flags, revision) in builds.items()
                  if kernel and name in paths)     # each build compiled once
    available = {"native": native_kernel_available(dtype), "onednn": onednn_packing_available(dtype), "torch": True,
                 "onednn-hint": onednn_packing_available(dtype), **{name: kernel for name in builds}}
    layers: dict[str, list] = {}
    for path in paths:
        if not available[path]:
            print(f"{path}: not available here, skipped")
            continue
        if path == "onednn-hint":
            layers[path] = []    # packed for each row count below
        else:
            layers[path] = weights if path == "torch" else [makers[path](w, None) for w in weights]
    amx = dtype == torch.bfloat16 and cpu_native.use_amx(True)   # native: as the engine runs it
    print(f"device: {cpu_name()}, {torch.get_num_threads()} threads, native AMX tiles {'on' if amx else 'off'}, "
          f"{len(shapes)} matmuls per step, "
          f"{sum(k * n for k, n in shapes) * weights[0].element_size() / 1e6:.0f} MB of {args.dtype} weights")
    against = f" | this speed-up over {args.against}" if args.against else ""
    if args.spread:
        print("| rows | path | median ms | p90 ms | p99 ms | largest ms | p99 / median |")
        print("|---" * 7 + "|")
    elif args.per_shape:
        print("| rows | matmuls (in x out) | " + " | ".join(f"{p} GFLOP/s" for p in layers) + " |")
        print("|---" * (len(layers) + 2) + "|")
    else:
        print("| rows | " + " | ".join(f"{p} ms" for p in layers) + f" | native speed-up over onednn{against} |")
        print("|---" * (len(layers) + 2 + bool(args.against)) + "|")
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            inputs = {k: torch.randn(rows, k).to(dtype) for k in {k for k, _ in shapes}}
            if "onednn-hint" in layers:
                layers["onednn-hint"] = [PackedLinear(w, None, batch_size=rows) for w in weights]

            def one_step(path: str, only: tuple[int, int] | None = None) -> Callable[[], None]:
                """The step's matmuls through ``path`` (``only``: those of that shape)."""
                pairs = [(shape, layer) for shape, layer in zip(shapes, layers[path]) if only in (None, shape)]
                apply = (lambda layer, x: F.linear(x, layer)) if path == "torch" else (lambda layer, x: layer(x))

                def run() -> None:   # each output dropped at once, as a step's would be
                    for (k, _), layer in pairs:
                        apply(layer, inputs[k])
                return run

            if args.spread:
                runs = {path: one_step(path) for path in layers}
                timed_rounds(1, runs)                    # a warm-up call each, not counted
                for path, times in timed_rounds(args.spread, runs).items():
                    q = np.quantile(times, [0.5, 0.9, 0.99]) * 1e3
                    print(f"| {rows} | {path} | {q[0]:.1f} | {q[1]:.1f} | {q[2]:.1f} | {max(times) * 1e3:.1f} "
                          f"| {q[2] / q[0]:.3f} |")
                continue
            if args.per_shape:
                for only in [*dict.fromkeys(shapes), None]:
                    flops = sum(2 * rows * k * n for k, n in shapes if only in (None, (k, n)))
                    best = best_of(args.rounds, {path: one_step(path, only) for path in layers})
                    count = len(shapes) if only is None else shapes.count(only)
                    label = f"all {count}" if only is None else f"{count} x {only[0]} x {only[1]}"
                    print(f"| {rows} | {label} | " + " | ".join(f"{flops / best[p] / 1e9:.0f}" for p in layers) + " |")
                continue
            best = best_of(args.rounds, {path: one_step(path) for path in layers})
            ratio = (f"{best['onednn'] / best['native']:.2f}x" if "native" in best and "onednn" in best else "")
            if args.against:
                ratio += f" | {best[args.against] / best['this']:.2f}x" if "this" in best else " | "
            print(f"| {rows} | " + " | ".join(f"{best[p] * 1e3:.1f}" for p in layers) + f" | {ratio} |")


if __name__ == "__main__":
    main()
