"""Which kernel attends prompts on CPU, chosen at start-up: ours or torch's SDPA.

Our C prefill kernel (kernels/csrc/paged_attention.c) computes in float32 vectors whatever the
cache's dtype. torch's ``scaled_dot_product_attention`` takes bfloat16 as it is, and its flash
kernel runs oneDNN's brgemm, which uses AMX tiles where the CPU has them: on a CPU with AMX our
attention of a 512-token prompt was the larger half of the step, longer than its AMX matmuls
(docs/benchmarks.md), so SDPA may win there. A fresh prompt is
plain causal attention for it; a chunk over cached context (chunked prefill, prefix hits)
attends its gathered context with a mask.

- **Measured rule:** on a CPU without AVX-512 ours ran well ahead of SDPA, in float32 and in
  bfloat16, on a 512-token prompt (docs/benchmarks.md, "Prompt attention: ours against torch's
  SDPA"): ours, untimed.
- **Timed elsewhere** (AVX-512, AVX512_BF16, AMX: no figures yet), and wherever
  ``cpu_prefill_attention=measure`` asks: one layer's attention of one prefill at the model's
  head shape, in shuffled cache blocks, of each of ``PROMPT_LENGTHS`` new tokens, fresh and over
  ``CONTEXT_TOKENS`` of cached context, each path's best of ``ROUNDS`` alternating rounds. SDPA
  goes to the prefills from the shortest length from which it wins both cases at every length
  up (by ``NATIVE_MARGIN``), and to none unless it wins at the longest: SDPA is one call per
  prefill and layer (ours one per layer for all of a step's prefills), so its fixed cost weighs
  most on short prompts, many of which arrive together.
- **A wrong kernel is never chosen:** each path's output is first checked against the reference
  (kernels/reference.py) in float32 on the same inputs; one off by more than its dtype's
  rounding, or that raises, is left out and the log says so.

**Which of our bfloat16 prefill functions** (``choose_bf16_prefill_kernel``), before the above
(whose timing of ours then runs the one chosen): the build's own (``dp``: AVX512_BF16 dot products
where the compiler targets them, else the AVX2 one); the float32-FMA one (``fma``: K and V widened
to float32 once per key block, 512-bit FMAs; built wherever AVX-512F is); the float16 one
(``fp16``: K, V and the queries narrowed to float16 by powers of 2, float16 FMAs, sums in float32
after 16 products for the scores and 32 for the values; a task whose queries hold an outlier
dimension runs the float32-FMA one; built wherever AVX512-FP16 is); or the build's own with P x V
in dot products too (``dp-pv``: the probabilities rounded to bfloat16, as torch's SDPA does,
pairs of keys per 32-bit lane; built wherever AVX512_BF16 is). Where ``vdpbf16ps`` runs at half
the FMA rate (the Intel Xeon of docs/benchmarks.md) the second is faster than the first; where a
float16 FMA does twice a float32 one's products at the same rate the third is faster still; where
the dot product runs at the FMA's rate (AMD Zen 4) the fourth does P x V in half the
instructions. So it is timed here, never read off the CPU's name: one prefill (``BF16_TILE``: new
tokens over cached context) at the model's head shape, each function's best of ``BF16_ROUNDS``
alternating calls, after each is checked against the reference; the fastest runs, another than
the build's own only where it beats the build's own by ``FMA_MARGIN``. Functions the build lacks,
or that do not serve the model's head size, are not timed; where no other one serves, the build's
own runs, untimed. ``cpu_prefill_bf16_kernel`` (EngineConfig: ``auto``, ``dp``, ``fma``, ``fp16``,
``dp-pv``) forces it. The choice is process-wide (the C decoder's prefills take it too); the
start-up log names the function and the timings.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from backend.config import CPU_PREFILL_ATTENTION_CHOICES, CPU_PREFILL_BF16_KERNEL_CHOICES
from backend.model.architecture import ModelArchitecture
from backend.model.cpu_features import CpuFeatures, detect
from backend.model.cpu_linear_tuning import relative_error
from kernels import cpu_native
from kernels.cpu_attention import EVERY_PREFILL, PrefillAttention, paged_attention_cpu, plan_attention_cpu
from kernels.reference import paged_attention_reference

logger = logging.getLogger(__name__)

PROMPT_LENGTHS = (32, 64, 128, 256, 512)   # new tokens: up to one chunk at the default token budget
CONTEXT_TOKENS = (0, 512)                  # cached context before them: a fresh prompt, a later chunk
ROUNDS = 3
BF16_ROUNDS = 5            # the bfloat16 functions: one prefill each, cheap; more rounds against noise
# SDPA must be this much faster: a clear win only, on machines whose timings are noisy (two
# identical builds differed by about this margin in one run on a shared machine).
NATIVE_MARGIN = 1.10
# Largest tolerated max |out - reference| / max |reference|: float32 sums in another order; SDPA's
# bfloat16 flash kernel rounds the softmax probabilities to bfloat16 (~2^-8 each) before P x V.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2.0 ** -5}

Timings = dict[tuple[int, int], dict[PrefillAttention, float]]   # (new tokens, context) -> path -> best ms

# The bfloat16 prefill functions of ours (choose_bf16_prefill_kernel): the build's own, the
# float32-FMA one, the float16 one, the build's own with P x V in dot products.
BF16_KERNELS = cpu_native.PREFILL_BF16_KERNELS
BF16_TILE = (256, 768)         # (new tokens, cached context) of the timed prefill: a chunk of a long prompt
# Another function must be this much faster than the build's own (ties keep the build's own, which the
# engine ran before).
FMA_MARGIN = 1.03


@dataclass(frozen=True)
class Bf16PrefillKernel:
    """Which function our bfloat16 prefills run (``cpu_native.prefill_bf16_path``'s name), and why."""
    kernel: str                                           # e.g. "avx512-fp16", "avx512-fma", "avx512-bf16"
    why: str
    timings_ms: dict[str, float] = field(default_factory=dict)   # BF16_KERNELS -> best ms; empty unless timed

    def describe(self) -> str:
        return f"bfloat16 prompts in our {self.kernel} function ({self.why})"


@dataclass(frozen=True)
class PrefillAttentionChoice:
    path: PrefillAttention
    why: str                                  # for the start-up log
    sdpa_min_tokens: int | None = None        # SDPA: prefills from this many new tokens; None: ours for all
    timings_ms: Timings = field(default_factory=dict)   # empty unless timed
    bf16_kernel: Bf16PrefillKernel | None = None        # bfloat16 with our C kernel only

    def describe(self) -> str:
        kernel = "" if self.bf16_kernel is None else f"; {self.bf16_kernel.describe()}"
        if self.sdpa_min_tokens is None:
            return f"ours ({self.why}){kernel}"
        return (f"torch's SDPA for prefills of {self.sdpa_min_tokens}+ new tokens, ours for the rest "
                f"({self.why}){kernel}")


def native_kernel_runs(dtype: torch.dtype) -> bool:
    return dtype in cpu_native.PREFILL_ATTENTION_DTYPES and cpu_native.load() is not None


def time_prefill_attention(arch: ModelArchitecture, dtype: torch.dtype, block_size: int, rounds: int = ROUNDS,
                           lengths: tuple[int, ...] = PROMPT_LENGTHS, contexts: tuple[int, ...] = CONTEXT_TOKENS,
                           ) -> tuple[Timings, dict[PrefillAttention, float]]:
    """Each path's best time (ms) for one layer's attention of one prefill of each length over
    each context, for the paths whose output passes the check (the longest prefill over the
    longest context); and every path's relative error (inf: raised)."""
    generator = torch.Generator().manual_seed(0)
    tokens = max(lengths) + max(contexts)
    num_blocks = -(-tokens // block_size)
    cache_shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    key_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    value_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    query = torch.randn(max(lengths), arch.num_heads, arch.head_dim, generator=generator).to(dtype)
    # Shuffled blocks, as a served cache's are after a while.
    table = torch.randperm(num_blocks, generator=generator).to(torch.int32).unsqueeze(0)
    positions = torch.arange(tokens)
    slots = table[0, positions // block_size].long() * block_size + positions % block_size
    scale = arch.head_dim ** -0.5
    sdpa_min_tokens = {PrefillAttention.NATIVE: None, PrefillAttention.SDPA: EVERY_PREFILL}

    def prefill(length: int, context: int, path: PrefillAttention):
        """The query rows, and the plan, of ``length`` new tokens after ``context`` cached ones."""
        starts, seq_lens = torch.tensor([0, length]), torch.tensor([context + length])
        return query[:length], plan_attention_cpu(starts, seq_lens, table, slots[context:context + length],
                                                  block_size, sdpa_min_tokens[path])

    longest = (max(lengths), max(contexts))
    reference = paged_attention_reference(query.float(), key_cache.float(), value_cache.float(),
                                          torch.tensor([0, longest[0]]), torch.tensor([sum(longest)]), table, scale)
    errors: dict[PrefillAttention, float] = {}
    with torch.inference_mode():
        for path in PrefillAttention:
            try:
                rows, plan = prefill(*longest, path)
                errors[path] = relative_error(paged_attention_cpu(rows, key_cache, value_cache, scale, plan,
                                                                  native=True), reference)
            except Exception as exc:   # a path that cannot run here is no candidate, not a failed start
                logger.warning("cpu_prefill_attention: %s raised %r while being checked: not used", path.value, exc)
                errors[path] = float("inf")
        candidates = [path for path in PrefillAttention if errors[path] <= TOLERANCE[dtype]]
        cases = [(length, context) for length in lengths for context in contexts]
        prefills = {(case, path): prefill(*case, path) for case in cases for path in candidates}
        best: Timings = {case: {path: float("inf") for path in candidates} for case in cases}
        for _ in range(rounds):
            for case in cases:
                for path in candidates:
                    rows, plan = prefills[case, path]
                    start = time.perf_counter()
                    paged_attention_cpu(rows, key_cache, value_cache, scale, plan, native=True)
                    best[case][path] = min(best[case][path], (time.perf_counter() - start) * 1e3)
    return best, errors


def time_bf16_prefill_kernels(arch: ModelArchitecture, block_size: int, rounds: int = BF16_ROUNDS,
                              tile: tuple[int, int] = BF16_TILE, kernels: tuple[str, ...] = BF16_KERNELS,
                              ) -> tuple[dict[str, float], dict[str, float]]:
    """Our bfloat16 prefill functions ``kernels`` on one prefill of ``tile`` (new tokens, cached
    context) at the model's head shape, in shuffled blocks, on the engine's threads: each one's
    best ms of ``rounds`` alternating calls (after a first untimed one), for those whose output
    passes the check against the reference; and every one's relative error. Leaves the build's
    own selected."""
    length, context = tile
    tokens = length + context
    generator = torch.Generator().manual_seed(0)
    num_blocks = -(-tokens // block_size)
    cache_shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    key_cache = torch.randn(cache_shape, generator=generator).to(torch.bfloat16)
    value_cache = torch.randn(cache_shape, generator=generator).to(torch.bfloat16)
    query = torch.randn(length, arch.num_heads, arch.head_dim, generator=generator).to(torch.bfloat16)
    table = torch.randperm(num_blocks, generator=generator).to(torch.int32).unsqueeze(0)
    starts, query_lens, seq_lens = torch.tensor([0]), torch.tensor([length]), torch.tensor([tokens])
    scale = arch.head_dim ** -0.5
    reference = paged_attention_reference(query.float(), key_cache.float(), value_cache.float(),
                                          torch.tensor([0, length]), seq_lens, table, scale)
    out = torch.empty_like(query)

    def run(kernel: str) -> float:
        cpu_native.select_prefill_bf16_kernel(kernel)
        out.fill_(float("nan"))     # a function that wrote nothing must not pass on another's output
        start = time.perf_counter()
        cpu_native.paged_prefill_attention(query, out, starts, query_lens, seq_lens, table, key_cache, value_cache,
                                           scale)
        return (time.perf_counter() - start) * 1e3

    errors: dict[str, float] = {}
    try:
        for kernel in kernels:
            run(kernel)
            errors[kernel] = relative_error(out, reference)
        candidates = [kernel for kernel in kernels if errors[kernel] <= TOLERANCE[torch.bfloat16]]
        best = {kernel: float("inf") for kernel in candidates}
        for _ in range(rounds):
            for kernel in candidates:
                best[kernel] = min(best[kernel], run(kernel))
    finally:
        cpu_native.select_prefill_bf16_kernel("dp")
    return best, errors


def kernels_serving(head_dim: int) -> tuple[str, ...]:
    """Our bfloat16 prefill functions that run here at this head size: the build's own, and each
    other one the build has and that serves the size. Leaves the build's own selected."""
    serving = ["dp"]
    for kernel in BF16_KERNELS[1:]:
        if (cpu_native.select_prefill_bf16_kernel(kernel) == kernel
                and cpu_native.prefill_bf16_path(head_dim) == f"avx512-{kernel}"):
            serving.append(kernel)
    cpu_native.select_prefill_bf16_kernel("dp")
    return tuple(serving)


def fastest_bf16_kernel(timings: dict[str, float]) -> str:
    """The fastest timed function; another than the build's own only where it beats the build's
    own by ``FMA_MARGIN`` (the build's own where it was left out: any faster one)."""
    own = timings.get("dp", float("inf"))
    eligible = {kernel: ms for kernel, ms in timings.items() if kernel == "dp" or ms * FMA_MARGIN < own}
    return min(eligible, key=eligible.get) if eligible else "dp"


def choose_bf16_prefill_kernel(arch: ModelArchitecture, block_size: int, choice: str = "auto",
                               timer: Callable[..., tuple[dict[str, float], dict[str, float]]]
                               = time_bf16_prefill_kernels) -> Bf16PrefillKernel:
    """Which of our bfloat16 prefill functions runs in this process, chosen and selected here
    (the module's docstring says how). ``choice`` (EngineConfig.cpu_prefill_bf16_kernel):
    ``auto`` or one of ``BF16_KERNELS``; ``timer``: tests fake the clock."""
    if choice not in CPU_PREFILL_BF16_KERNEL_CHOICES:
        raise ValueError(f"cpu_prefill_bf16_kernel must be one of {CPU_PREFILL_BF16_KERNEL_CHOICES}, got {choice!r}")
    head_dim = arch.head_dim
    serving = kernels_serving(head_dim)
    own = cpu_native.prefill_bf16_path(head_dim)
    if choice != "auto":
        selected = cpu_native.select_prefill_bf16_kernel(choice if choice in serving else "dp")
        return Bf16PrefillKernel(cpu_native.prefill_bf16_path(head_dim), f"cpu_prefill_bf16_kernel={choice}"
                                 + ("" if selected == choice else ": not served here, the build's own runs"))
    if len(serving) == 1:
        library = cpu_native.load()
        built = [name for name, has in (("float32-FMA", library.prefill_attention_bf16_fma_built()),
                                        ("float16", library.prefill_attention_bf16_fp16_built()),
                                        ("dot-product P x V", library.prefill_attention_bf16_dp_pv_built()))
                 if has]
        reason = (f"the {' and the '.join(built)} function{'s do' if len(built) > 1 else ' does'} not serve "
                  f"head_dim {head_dim}" if built else "no AVX-512F: no float32-FMA or float16 function")
        return Bf16PrefillKernel(own, f"the build's own, untimed: {reason}")
    timings, errors = timer(arch, block_size, kernels=serving)
    for kernel, error in errors.items():
        if error > TOLERANCE[torch.bfloat16]:
            logger.warning("bfloat16 prefill: our %s function computes wrong results on this CPU (max relative "
                           "error %.3g against the reference): not used", kernel, error)
    cpu_native.select_prefill_bf16_kernel(fastest_bf16_kernel(timings))
    length, context = BF16_TILE
    figures = ", ".join(f"{kernel} {ms:.2f}" for kernel, ms in timings.items())
    return Bf16PrefillKernel(cpu_native.prefill_bf16_path(head_dim),
                             f"timed at start-up, ms for one layer's {length} tokens over {context}: {figures}",
                             dict(timings))


def sdpa_threshold(timings: Timings) -> int | None:
    """The shortest timed length from which SDPA wins by ``NATIVE_MARGIN`` over every context at
    every length up; None where it does not win at the longest (or was left out); every prefill
    where ours was left out."""
    if all(PrefillAttention.NATIVE not in paths for paths in timings.values()):
        return EVERY_PREFILL if any(timings.values()) else None

    def sdpa_wins(paths: dict[PrefillAttention, float]) -> bool:
        ours, sdpa = paths.get(PrefillAttention.NATIVE), paths.get(PrefillAttention.SDPA)
        return sdpa is not None and (ours is None or sdpa * NATIVE_MARGIN < ours)

    threshold = None
    for length in sorted({length for length, _ in timings}, reverse=True):
        if not all(sdpa_wins(paths) for (n, _), paths in timings.items() if n == length):
            break
        threshold = length
    return threshold


def choose_prefill_attention(choice: str, dtype: torch.dtype, arch: ModelArchitecture, block_size: int,
                             cpu_attention: bool = True, features: CpuFeatures | None = None,
                             timer: Callable[..., tuple[Timings, dict]] = time_prefill_attention,
                             bf16_kernel: str = "auto") -> PrefillAttentionChoice:
    """The kernel for prefills, and why: an explicit choice as given (``sdpa``: every
    prefill); ``auto`` by the measured rule where it has figures, else timed as ``measure`` is.
    ``bf16_kernel``: which of our bfloat16 functions (``choose_bf16_prefill_kernel``).
    ``cpu_attention``: the model runs the ``cpu`` attention backend (elsewhere the setting has no
    effect). ``features`` and ``timer``: tests fake the machine and the clock."""
    if choice not in CPU_PREFILL_ATTENTION_CHOICES:
        raise ValueError(f"cpu_prefill_attention must be one of {CPU_PREFILL_ATTENTION_CHOICES}, got {choice!r}")
    native = PrefillAttention.NATIVE
    if not cpu_attention:
        return PrefillAttentionChoice(native, "not the cpu attention backend: no effect")
    if not native_kernel_runs(dtype):
        # paged_attention_cpu's torch path then attends every prefill, whatever the plan says.
        return PrefillAttentionChoice(native, f"our C kernel does not run for {dtype} here: "
                                              f"torch's path attends every prefill")
    # Which of our bfloat16 functions, first: the timing against SDPA below runs it.
    kernel = choose_bf16_prefill_kernel(arch, block_size, bf16_kernel) if dtype == torch.bfloat16 else None
    if choice == "native":
        return PrefillAttentionChoice(native, "cpu_prefill_attention=native", bf16_kernel=kernel)
    if choice == "sdpa":
        return PrefillAttentionChoice(PrefillAttention.SDPA, "cpu_prefill_attention=sdpa", EVERY_PREFILL,
                                      bf16_kernel=kernel)
    features = features or detect()
    if choice == "auto" and not features.avx512:
        return PrefillAttentionChoice(native, "cpu_prefill_attention=auto: the measured rule "
                                              "(no AVX-512: ours 2.2-2.45x torch's SDPA; docs/benchmarks.md)",
                                      bf16_kernel=kernel)
    reason = ("cpu_prefill_attention=auto: this CPU (AVX-512) is timed at start-up" if choice == "auto"
              else "cpu_prefill_attention=measure")
    timings, errors = timer(arch, dtype, block_size)
    for path, error in errors.items():
        if TOLERANCE[dtype] < error < float("inf"):
            logger.warning("cpu_prefill_attention: %s computes wrong results on this CPU (max relative error %.3g "
                           "against the reference, tolerance %.3g): not used", path.value, error, TOLERANCE[dtype])
    if not any(timings.values()):
        raise RuntimeError(f"cpu_prefill_attention: no prefill attention computes correct results here ({errors})")
    figures = "; ".join(f"{length} tokens over {context}: " + ", ".join(f"{path.value} {ms:.2f}"
                                                                         for path, ms in paths.items())
                        for (length, context), paths in sorted(timings.items()))
    why = f"{reason}: ms for one layer's prefill, {figures}"
    threshold = sdpa_threshold(timings)
    if threshold is None:
        return PrefillAttentionChoice(native, why, None, timings, kernel)
    return PrefillAttentionChoice(PrefillAttention.SDPA, why, threshold, timings, kernel)
