"""The CPU attention kernels against their generic versions, on one machine, side by side.

The engine's build of kernels/csrc/paged_attention.c picks, at compile time, the fastest
decode and prefill functions the CPU has (``cpu_native.attention_path``: the AVX2 ones on
every CPU with AVX2 + FMA, the AVX512_BF16 dot-product ones for bfloat16 where the CPU has it). A
second build with ``-DLLM_GENERIC_ATTENTION`` keeps only the generic functions; with
``--against REV`` the second build is instead the kernels of git revision REV (before / after
a change to them, in one process). ``--cflags``
adds flags to both builds (``--cflags=-mno-avx512bf16``: what an AVX-512 CPU without bfloat16
dot products runs). Both run the same data, alternating round by round (the
machines are shared; the best round counts), and their outputs are compared.

- decode: ``--seqs`` sequences of ~``--context`` tokens, one query each, over ``--layers``
  distinct caches visited in turn (as a decode step's layers are: the cache streams from DRAM
  instead of sitting in L3), blocks shuffled or consecutive. Figure of merit: K+V bytes read
  per second.
- prefill: a ``--prompt``-token chunk after ``--depth`` cached tokens (default 0: a fresh
  prompt). Figure of merit: causal attention GFLOP/s.
  ``--sdpa`` also times torch's ``F.scaled_dot_product_attention`` (causal, GQA) on the same
  prompt with K and V contiguous, as a fresh prompt's are before they reach the cache: whether
  torch's CPU flash attention (oneDNN's kernels, AMX where the CPU has it) would serve prompts
  faster than ours. Its output is compared with ours.
  ``--fma`` also times, for bfloat16, the engine build with each other prefill function it has
  selected (``engine+fma``: float32 FMAs, AVX-512F; ``engine+fp16``: float16 FMAs, AVX512-FP16)
  against the build's own (the AVX512_BF16 dot products where built: ``dp``), round by round in
  one run, as the engine's start-up timing chooses among them; with ``--against REV`` the
  revision's too (``REV+fma``, ``REV+fp16``).

    python -m benchmarks.cpu_attention                      # SmolLM2-135M's shape (9 heads, 3 KV heads, 64)
    python -m benchmarks.cpu_attention --block-order consecutive   # a fresh server's cache layout
    python -m benchmarks.cpu_attention --context 128 --against HEAD~1  # this tree's kernels against a commit's
    python -m benchmarks.cpu_attention --sdpa --layers 1 --rounds 5    # prefill: ours against torch's SDPA
    python -m benchmarks.cpu_attention --dtypes bfloat16 --fma --no-decode --depth 3072   # dp, fma, fp16
    python -m benchmarks.cpu_attention --dtypes bfloat16 --fma --no-decode --against HEAD  # both FMA functions
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import torch

from benchmarks.common import best_of
from benchmarks.step_cost import cpu_name
from kernels import cpu_native

def build_revision(revision: str, cflags: tuple[str, ...]) -> ctypes.CDLL:
    """The kernel library as git revision ``revision`` had it (its kernels/csrc, this tree's
    flags), built by ``cpu_native.build`` from a copy of those files and loaded. A source file
    that did not exist yet at that revision is taken from this tree; a function it lacks is left
    undeclared (``cpu_native.open_library(strict=False)``): the attention kernels are what runs."""
    repo = Path(__file__).resolve().parent.parent
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{revision}^{{commit}}"], cwd=repo,
                            capture_output=True, text=True)
    if commit.returncode != 0:
        raise SystemExit(f"--against {revision}: not a commit of this repository ({commit.stderr.strip()})")
    with tempfile.TemporaryDirectory(prefix="kernels-") as tmp:
        folder = Path(tmp)
        for path in (*cpu_native.SOURCES, *cpu_native.HEADERS):
            spec = f"{revision}:kernels/csrc/{path.name}"
            exists = subprocess.run(["git", "cat-file", "-e", spec], cwd=repo, capture_output=True).returncode == 0
            text = subprocess.run(["git", "show", spec], cwd=repo, check=True, capture_output=True,
                                  text=True).stdout if exists else path.read_text()
            (folder / path.name).write_text(text)
        library = cpu_native.open_library(cpu_native.build(cflags=cflags, folder=folder), strict=False)
        if "int64_t window" not in (folder / "paged_attention.c").read_text():
            _without_window_and_sinks(library)
        return library


ATTENTION_FUNCTIONS = tuple(f"paged_{kind}_attention_{dtype}" for kind in ("decode", "prefill")
                            for dtype in ("f32", "bf16"))


def _without_window_and_sinks(library: ctypes.CDLL) -> None:
    """A revision from before the attention kernels took a window and sinks: their arguments end
    in (scale, num_threads), where cpu_native's wrappers pass (scale, window, sinks,
    num_threads). Each function is replaced on the library object by one that drops the two (the
    benchmark runs neither)."""
    for name in ATTENTION_FUNCTIONS:
        function = getattr(library, name)
        function.argtypes = function.argtypes[:-3] + function.argtypes[-1:]
        setattr(library, name, lambda *args, function=function: function(*args[:-3], args[-1]))


def select_prefill(library: ctypes.CDLL, kernel: str) -> str:
    """cpu_native.select_prefill_bf16_kernel, also for a revision from before it (which had only
    the float32-FMA function's on/off switch)."""
    try:
        return cpu_native.select_prefill_bf16_kernel(kernel, library)
    except AttributeError:
        if kernel == "fp16":
            return "dp"
        return "fma" if library.prefill_attention_bf16_use_fma(int(kernel == "fma")) else "dp"


def paged_cache(tokens_per_seq: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                generator: torch.Generator, shuffled: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache, block_tables); ``shuffled``: each sequence's blocks scattered over
    the cache (as in a server that has freed and reused blocks for a while), else consecutive (a
    fresh server's first requests)."""
    blocks = [-(-n // block_size) for n in tokens_per_seq]
    order = (torch.randperm(sum(blocks), generator=generator) if shuffled else torch.arange(sum(blocks))).to(torch.int32)
    tables = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
    start = 0
    for i, count in enumerate(blocks):
        tables[i, :count] = order[start:start + count]
        start += count
    shape = (sum(blocks), block_size, num_kv_heads, head_dim)
    return (torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype),
            tables)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--layers", type=int, default=30, help="distinct decode caches, visited in turn")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--depth", type=int, default=0, help="prefill: tokens already in the cache before the "
                                                              "--prompt-token chunk (--sdpa only at depth 0)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--block-order", choices=("shuffled", "consecutive"), default="shuffled")
    parser.add_argument("--cflags", default="", help="more compiler flags for both builds, e.g. -mno-avx512bf16 "
                                                     "for what an AVX-512 CPU without bfloat16 dot products runs")
    parser.add_argument("--against", metavar="REV", help="compare with the kernels of this git revision "
                                                         "instead of the generic build")
    parser.add_argument("--sdpa", action="store_true", help="also time torch's scaled_dot_product_attention "
                                                             "on the prefill")
    parser.add_argument("--fma", action="store_true", help="bfloat16 prefill: also time the engine build with each "
                                                            "other function it has selected (fma, fp16: the start-up "
                                                            "may choose one), against the build's own (dp) in one run")
    parser.add_argument("--no-decode", action="store_true", help="time the prefill only")
    args = parser.parse_args(argv)
    extra = tuple(args.cflags.split())
    libraries = {"engine": cpu_native.open_library(cpu_native.build(cflags=cpu_native.CFLAGS + extra))}
    if args.against:
        other = args.against
        libraries[other] = build_revision(args.against, cpu_native.CFLAGS + extra)
    else:
        other = "generic"
        libraries[other] = cpu_native.open_library(
            cpu_native.build(cflags=cpu_native.CFLAGS + extra + ("-DLLM_GENERIC_ATTENTION",)))
    generator = torch.Generator().manual_seed(0)
    scale = args.head_dim ** -0.5
    print(f"device: {cpu_name()}, {torch.get_num_threads()} threads, build flags {' '.join(extra) or 'default'}; "
          f"heads {args.heads}/{args.kv_heads}, "
          f"head_dim {args.head_dim}, block {args.block_size}, decode blocks {args.block_order}")
    print(f"| dtype | work | engine build's function | engine ms | {other} ms | engine | {other} | speed-up | max diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        # decode: one query row per sequence, contexts spread +-32 around --context
        lens = [max(1, args.context + int(x)) for x in torch.randint(-32, 33, (args.seqs,), generator=generator)]
        caches = [paged_cache(lens, args.kv_heads, args.head_dim, args.block_size, dtype, generator,
                              args.block_order == "shuffled") for _ in range(args.layers)]
        query = torch.randn(args.seqs, args.heads, args.head_dim, generator=generator).to(dtype)
        rows, seq_lens = torch.arange(args.seqs), torch.tensor(lens)
        outs = {name: torch.empty_like(query) for name in libraries}
        engine_fma = args.fma and dtype == torch.bfloat16
        select_prefill(libraries["engine"], "dp")

        def decode(name: str) -> Callable[[], None]:
            def run() -> None:
                for key_cache, value_cache, tables in caches:
                    cpu_native.paged_decode_attention(query, outs[name], rows, seq_lens, tables, key_cache,
                                                      value_cache, scale, library=libraries[name])
            return run
        path = cpu_native.attention_path(dtype, args.head_dim, libraries["engine"])
        if not args.no_decode:
            best = best_of(args.rounds, {name: decode(name) for name in libraries})
            kv_bytes = sum(lens) * 2 * args.kv_heads * args.head_dim * query.element_size() * args.layers
            diff = (outs["engine"].float() - outs[other].float()).abs().max().item()
            print(f"| {dtype} | decode {args.seqs} x ~{args.context}, {args.layers} layers | {path} | "
                  f"{best['engine'] * 1e3:.2f} | {best[other] * 1e3:.2f} | "
                  f"{kv_bytes / best['engine'] / 1e9:.1f} GB/s | {kv_bytes / best[other] / 1e9:.1f} GB/s | "
                  f"{best[other] / best['engine']:.2f}x | {diff:.1e} |")

        # prefill: a chunk of --prompt tokens after --depth cached ones (0: a fresh prompt)
        total = args.depth + args.prompt
        key_cache, value_cache, tables = paged_cache([total], args.kv_heads, args.head_dim, args.block_size,
                                                     dtype, generator)
        query = torch.randn(args.prompt, args.heads, args.head_dim, generator=generator).to(dtype)
        starts, query_lens, seq_lens = torch.tensor([0]), torch.tensor([args.prompt]), torch.tensor([total])
        outs = {name: torch.empty_like(query) for name in libraries}

        def prefill(name: str, kernel: str = "dp") -> Callable[[], None]:
            library = libraries[name]

            def run() -> None:
                if engine_fma:     # the selection is the library's, process-wide: made before each call
                    select_prefill(library, kernel)
                cpu_native.paged_prefill_attention(query, outs[name if kernel == "dp" else f"{name}+{kernel}"], starts,
                                                   query_lens, seq_lens, tables, key_cache, value_cache, scale,
                                                   library=library)
            return run
        runs = {name: prefill(name) for name in libraries}
        if engine_fma:
            for kernel in cpu_native.PREFILL_BF16_KERNELS[1:]:
                names = ["engine"] + ([other] if args.against else [])     # the revision's function too
                for name in names:
                    if select_prefill(libraries[name], kernel) == kernel:
                        outs[f"{name}+{kernel}"] = torch.empty_like(query)
                        runs[f"{name}+{kernel}"] = prefill(name, kernel)
                    elif name == "engine":
                        print(f"(no {kernel} bfloat16 prefill in this build: fma needs AVX-512F, fp16 AVX512-FP16)")
                    select_prefill(libraries[name], "dp")
        if args.sdpa and args.depth == 0:
            runs["sdpa"] = sdpa_prefill(query, key_cache, value_cache, tables[0], args.block_size, scale, outs)
        best = best_of(args.rounds, runs)
        select_prefill(libraries["engine"], "dp")
        flops = 2 * 2 * args.heads * args.head_dim * (args.prompt * args.depth + args.prompt * (args.prompt + 1) / 2)
        for name in runs:
            if name == "engine":
                continue
            diff = (outs["engine"].float() - outs[name].float()).abs().max().item()
            function = ("torch SDPA (contiguous K, V)" if name == "sdpa"
                        else f"{path} against avx512-{name.split('+')[1]} (selected)" if "+" in name else path)
            print(f"| {dtype} | prefill {args.prompt} tokens at depth {args.depth} | {function} | {best['engine'] * 1e3:.2f} | "
                  f"{best[name] * 1e3:.2f} ({name}) | {flops / best['engine'] / 1e9:.0f} GFLOP/s | "
                  f"{flops / best[name] / 1e9:.0f} GFLOP/s | {best[name] / best['engine']:.2f}x | {diff:.1e} |")


def sdpa_prefill(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
                 block_size: int, scale: float, outs: dict[str, torch.Tensor]) -> Callable[[], None]:
    """A run of causal GQA ``F.scaled_dot_product_attention`` over the prompt in ``query``, its K and
    V gathered once (outside the timing) from the paged cache; it writes ``outs["sdpa"]`` in our
    layout [tokens, heads, head_dim]."""
    tokens = query.shape[0]
    blocks = table[:-(-tokens // block_size)].long()

    def contiguous(cache: torch.Tensor) -> torch.Tensor:     # [1, kv_heads, tokens, head_dim]
        return cache[blocks].flatten(0, 1)[:tokens].transpose(0, 1).unsqueeze(0).contiguous()
    key, value = contiguous(key_cache), contiguous(value_cache)
    q = query.transpose(0, 1).unsqueeze(0).contiguous()       # [1, heads, tokens, head_dim]

    def run() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, key, value, is_causal=True, scale=scale,
                                                               enable_gqa=True)
        outs["sdpa"] = out[0].transpose(0, 1)
    return run


if __name__ == "__main__":
    main()
