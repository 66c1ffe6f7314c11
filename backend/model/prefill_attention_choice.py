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
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from backend.config import CPU_PREFILL_ATTENTION_CHOICES
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
# SDPA must be this much faster: a clear win only, on machines whose timings are noisy (two
# identical builds differed by about this margin in one run on a shared machine).
NATIVE_MARGIN = 1.10
# Largest tolerated max |out - reference| / max |reference|: float32 sums in another order; SDPA's
# bfloat16 flash kernel rounds the softmax probabilities to bfloat16 (~2^-8 each) before P x V.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2.0 ** -5}

Timings = dict[tuple[int, int], dict[PrefillAttention, float]]   # (new tokens, context) -> path -> best ms


@dataclass(frozen=True)
class PrefillAttentionChoice:
    path: PrefillAttention
    why: str                                  # for the start-up log
    sdpa_min_tokens: int | None = None        # SDPA: prefills from this many new tokens; None: ours for all
    timings_ms: Timings = field(default_factory=dict)   # empty unless timed

    def describe(self) -> str:
        if self.sdpa_min_tokens is None:
            return f"ours ({self.why})"
        return f"torch's SDPA for prefills of {self.sdpa_min_tokens}+ new tokens, ours for the rest ({self.why})"


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
                             ) -> PrefillAttentionChoice:
    """The kernel for prefills, and why: an explicit choice as given (``sdpa``: every
    prefill); ``auto`` by the measured rule where it has figures, else timed as ``measure`` is.
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
    if choice == "native":
        return PrefillAttentionChoice(native, "cpu_prefill_attention=native")
    if choice == "sdpa":
        return PrefillAttentionChoice(PrefillAttention.SDPA, "cpu_prefill_attention=sdpa", EVERY_PREFILL)
    features = features or detect()
    if choice == "auto" and not features.avx512:
        return PrefillAttentionChoice(native, "cpu_prefill_attention=auto: the measured rule "
                                              "(no AVX-512: ours 2.2-2.45x torch's SDPA; docs/benchmarks.md)")
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
        return PrefillAttentionChoice(native, why, None, timings)
    return PrefillAttentionChoice(PrefillAttention.SDPA, why, threshold, timings)
