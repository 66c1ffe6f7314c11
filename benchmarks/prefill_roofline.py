"""A prefill step against the CPU's compute roofline, in float32 and bfloat16.

Prefill is compute-bound on a CPU: a 512-token step does ~118 GFLOP for SmolLM2-135M and
reads its weights once. This measures, on the machine it runs on:

1. the ISA's peak: a loop of independent FMAs (AVX2 256-bit, or AVX-512 where the compiler
   targets it; AVX512_BF16 dot products for bfloat16 where the CPU has them), one copy per
   thread, all threads at once. The ceiling no matmul can pass.
2. the best matmul rate the engine's linear paths reach on the step's largest projection
   (rows x hidden -> 2 x intermediate: our kernel, prepacked oneDNN where it can pack the dtype):
   the practical ceiling.
3. one engine step that prefills ``--tokens`` prompt tokens from an empty cache, per dtype,
   the dtypes alternating round by round (the machines are shared; the best round counts),

and prints each step's GFLOP/s as a fraction of both ceilings. FLOPs counted: every projection
(2 x tokens x in x out), causal attention (QK^T and PV over the keys each query sees) and the LM
head of the last token; norms, RoPE and activations are left out (they are memory-bound).

    python -m benchmarks.prefill_roofline                       # both dtypes, 512 tokens
    python -m benchmarks.prefill_roofline --json benchmarks/results/prefill_roofline-cpu-X.json
    python -m benchmarks.prefill_roofline --prefill-attention native,sdpa   # fresh prompts: ours vs SDPA
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backend import Engine, EngineConfig, SamplingParams
from backend.model.architecture import ModelArchitecture
from backend.model.cpu_features import detect
from backend.model.cpu_linear import PackedLinear, native_kernel_available, native_linear, onednn_packing_available
from benchmarks.common import best_of
from benchmarks.step_cost import cpu_name

# Twelve independent accumulators: more than FMA latency x FMA ports on the CPUs we meet
# (4-5 cycles x 2 ports), so the loop is bound by FMA throughput alone. Each function returns
# the FLOPs it did; ``-1`` where the compiler could not target the instruction here.
_PEAK_SOURCE = r"""
#include <stdint.h>
#include <immintrin.h>
#define CHAINS 12
#define RUN(type, zero, op, flops_per_op)                                   \
    type acc[CHAINS]; __typeof__(init) a = init, b = init;                  \
    for (int c = 0; c < CHAINS; ++c) acc[c] = zero;                         \
    for (int64_t i = 0; i < iters; ++i)                                     \
        _Pragma("GCC unroll 12") for (int c = 0; c < CHAINS; ++c) acc[c] = op; \
    float sink = 0; for (int c = 0; c < CHAINS; ++c) sink += ((float *)&acc[c])[0]; \
    *out = sink; return (double)iters * CHAINS * (flops_per_op);

double fma_f32(int64_t iters, float *out) {
#if defined(__AVX512F__)
    __m512 init = _mm512_set1_ps(1e-6f);
    RUN(__m512, _mm512_setzero_ps(), _mm512_fmadd_ps(a, b, acc[c]), 16 * 2)
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 init = _mm256_set1_ps(1e-6f);
    RUN(__m256, _mm256_setzero_ps(), _mm256_fmadd_ps(a, b, acc[c]), 8 * 2)
#else
    (void)iters; (void)out; return -1;
#endif
}

double dot_bf16(int64_t iters, float *out) {
#if defined(__AVX512BF16__)
    __m512bh init = (__m512bh)_mm512_set1_epi16(0x3000);
    RUN(__m512, _mm512_setzero_ps(), _mm512_dpbf16_ps(acc[c], a, b), 16 * 2 * 2)
#else
    (void)iters; (void)out; return -1;
#endif
}

int vector_bits(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 256;
#else
    return 0;
#endif
}
"""


def _peak_library() -> ctypes.CDLL:
    build_dir = Path(tempfile.mkdtemp(prefix="fma_peak-"))
    source, library = build_dir / "fma_peak.c", build_dir / "fma_peak.so"
    source.write_text(_PEAK_SOURCE)
    subprocess.run(["gcc", "-O3", "-march=native", "-shared", "-fPIC", "-o", str(library), str(source)],
                   check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(library))
    for name in ("fma_f32", "dot_bf16"):
        getattr(lib, name).restype = ctypes.c_double
        getattr(lib, name).argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_float)]
    lib.vector_bits.restype = ctypes.c_int
    return lib


def peak_gflops(lib: ctypes.CDLL, kernel: str, threads: int, iters: int, rounds: int = 5) -> float | None:
    """All threads running the FMA loop at once (ctypes drops the GIL); best of ``rounds`` (the
    machines are shared: a round the host slowed reads low, none reads high)."""
    function = getattr(lib, kernel)
    if function(1, ctypes.byref(ctypes.c_float())) < 0:
        return None
    best = 0.0
    for _ in range(rounds):
        flops = [0.0] * threads
        sinks = [ctypes.c_float() for _ in range(threads)]

        def run(i: int) -> None:
            flops[i] = function(iters, ctypes.byref(sinks[i]))
        workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = max(best, sum(flops) / (time.perf_counter() - start) / 1e9)
    return best


@dataclass(frozen=True)
class StepFlops:
    projections: float
    attention: float
    lm_head: float

    @property
    def total(self) -> float:
        return self.projections + self.attention + self.lm_head


def prefill_flops(arch: ModelArchitecture, tokens: int) -> StepFlops:
    """FLOPs of one step that prefills ``tokens`` prompt tokens from an empty cache."""
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    per_token_macs = (arch.hidden_size * qkv + arch.num_heads * arch.head_dim * arch.hidden_size
                      + arch.hidden_size * 2 * arch.intermediate_size + arch.intermediate_size * arch.hidden_size)
    keys_seen = tokens * (tokens + 1) // 2          # causal: query i sees keys 0..i
    attention = 2 * 2 * arch.num_heads * arch.head_dim * keys_seen * arch.num_layers   # QK^T and PV
    return StepFlops(projections=2.0 * tokens * per_token_macs * arch.num_layers, attention=float(attention),
                     lm_head=2.0 * arch.hidden_size * arch.vocab_size)


def best_matmul_gflops(arch: ModelArchitecture, dtype: torch.dtype, rows: int, rounds: int = 5) -> dict[str, float]:
    """GFLOP/s of the step's largest projection (gate+up) through each linear path that runs here."""
    k, n = arch.hidden_size, 2 * arch.intermediate_size
    weight = (torch.randn(n, k) * 0.02).to(dtype)
    x = torch.randn(rows, k).to(dtype)
    paths = {}
    if native_kernel_available(dtype):
        paths["native"] = native_linear(weight, None)
    if onednn_packing_available(dtype):
        paths["onednn"] = PackedLinear(weight, None)
    with torch.inference_mode():
        for layer in paths.values():
            layer(x)                          # first call: packing caches, page faults
        best = best_of(rounds, {name: (lambda layer=layer: layer(x)) for name, layer in paths.items()})
    return {name: 2 * rows * k * n / seconds / 1e9 for name, seconds in best.items()}


def prefill_step_seconds(engines: dict[str, Engine], tokens: int, rounds: int) -> dict[str, float]:
    """Best time of one step prefilling ``tokens`` fresh tokens, per engine, engines alternating."""
    rng = random.Random(0)
    best = {name: float("inf") for name in engines}
    for round_index in range(rounds + 1):          # round 0 warms up
        for name, engine in engines.items():
            prompt = [rng.randrange(1000, engine.arch.vocab_size) for _ in range(tokens)]
            engine.add_request(f"prefill-{round_index}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            while engine.has_unfinished_requests():
                engine.step()
            if round_index:
                best[name] = min(best[name], elapsed)
    return best


def _commit() -> str:
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent)
    return result.stdout.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EngineConfig.model)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--peak-iters", type=int, default=100_000_000, help="per thread and round (~0.2 s at 3 GHz)")
    parser.add_argument("--load-format", default=EngineConfig.load_format,
                        help="dummy: random weights of the folder's shapes (same step time; for a machine without the weights)")
    parser.add_argument("--prefill-attention", default="auto",
                        help="cpu_prefill_attention values, comma-separated: each dtype's step with each, alternating")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    arch = ModelArchitecture.from_folder(args.model)
    features = detect()

    lib = _peak_library()
    peaks = {"float32": peak_gflops(lib, "fma_f32", threads, args.peak_iters),
             "bfloat16": peak_gflops(lib, "dot_bf16", threads, args.peak_iters)}
    # Without bfloat16 dot products our bfloat16 kernel widens to float32 FMAs: the same ceiling.
    isa_peak = {"float32": peaks["float32"], "bfloat16": peaks["bfloat16"] or peaks["float32"]}

    dtypes = args.dtypes.split(",")
    blocks = -(-args.tokens // 16) + 4
    variants = [(dtype, attention) for dtype in dtypes for attention in args.prefill_attention.split(",")]
    engines = {(dtype, attention): Engine(EngineConfig(
                   model=args.model, dtype=dtype, max_num_seqs=1, num_kv_blocks=blocks,
                   max_num_batched_tokens=args.tokens, max_model_len=args.tokens + 16, itl_target_ms=0.0,
                   enable_prefix_caching=False, load_format=args.load_format, cpu_prefill_attention=attention))
               for dtype, attention in variants}
    seconds = prefill_step_seconds(engines, args.tokens, args.rounds)
    flops = prefill_flops(arch, args.tokens)

    print(f"device: {cpu_name()}, ISA {features.describe()}, {threads} threads, "
          f"{lib.vector_bits()}-bit FMA loop; {args.tokens}-token prefill = {flops.total / 1e9:.1f} GFLOP "
          f"(projections {flops.projections / 1e9:.1f}, attention {flops.attention / 1e9:.1f})")
    print(f"FMA peak: float32 {peaks['float32']:.0f} GFLOP/s, bfloat16 dot products "
          + (f"{peaks['bfloat16']:.0f} GFLOP/s" if peaks["bfloat16"] else "none on this CPU (widened to float32)"))
    print("| dtype | linear path | prompt attention | step ms | prompt tokens/s | GFLOP/s | of ISA peak "
          "| best matmul GFLOP/s | of best matmul |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    matmuls: dict[str, dict[str, float]] = {}
    for (dtype, attention), engine in engines.items():
        if dtype not in matmuls:
            matmuls[dtype] = best_matmul_gflops(arch, getattr(torch, dtype), args.tokens)
        matmul = matmuls[dtype]
        best_matmul = max(matmul.values()) if matmul else float("nan")
        step_seconds = seconds[dtype, attention]
        achieved = flops.total / step_seconds / 1e9
        row = {"dtype": dtype, "linear_path": engine.runner.cpu_linear,
               "prefill_attention": engine.runner.prefill_attention.path.value,
               "step_ms": round(step_seconds * 1e3, 1),
               "prompt_tokens_per_s": round(args.tokens / step_seconds, 1), "gflops": round(achieved, 1),
               "isa_peak_gflops": round(isa_peak[dtype], 1), "of_isa_peak": round(achieved / isa_peak[dtype], 3),
               "matmul_gflops": {name: round(rate, 1) for name, rate in matmul.items()},
               "of_best_matmul": round(achieved / best_matmul, 3)}
        rows.append(row)
        print(f"| {dtype} | {row['linear_path']} | {row['prefill_attention']} | {row['step_ms']} | {row['prompt_tokens_per_s']} | {row['gflops']} "
              f"| {row['of_isa_peak']:.0%} | " + ", ".join(f"{n} {r:.0f}" for n, r in matmul.items())
              + f" | {row['of_best_matmul']:.0%} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "device": cpu_name(), "isa": features.describe(),
            "flags": sorted(f for f in features.flags if f.startswith(("avx", "amx", "fma", "f16c"))),
            "threads": threads, "fma_vector_bits": lib.vector_bits(), "peak_gflops": peaks,
            "tokens": args.tokens, "flops": {"projections": flops.projections, "attention": flops.attention,
                                             "lm_head": flops.lm_head},
            "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": _commit()}, indent=2) + "\n")


if __name__ == "__main__":
    main()
