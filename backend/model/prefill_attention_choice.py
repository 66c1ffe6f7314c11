"""Which kernel attends fresh prompts on CPU, chosen at start-up: ours or torch's SDPA.

Our C prefill kernel (kernels/csrc/paged_attention.c) computes in float32 vectors whatever the
cache's dtype. torch's ``scaled_dot_product_attention`` takes bfloat16 as it is, and its flash
kernel runs oneDNN's brgemm, which uses AMX tiles where the CPU has them: on the AMX Xeon the
attention of a 512-token prompt was the larger half of the step (~107 ms of ours at 85 GFLOP/s
against ~80 ms of AMX matmuls; docs/benchmarks.md), so SDPA may win there. Only fresh prompts
(no cached context) can go to it: their K/V are their own new tokens, plain causal attention.

- **Measured rule:** on a CPU without AVX-512 ours ran 2.22x (float32) and 2.45x (bfloat16)
  SDPA's speed on a 512-token prompt (the AVX2 Zen 3; docs/benchmarks.md, "Prompt attention:
  ours against torch's SDPA"): ours, untimed.
- **Timed elsewhere** (AVX-512, AVX512_BF16, AMX: no figures yet), and wherever
  ``cpu_prefill_attention=measure`` asks: one layer's attention of one prompt at the model's
  head shape, in shuffled cache blocks, at each of ``PROMPT_LENGTHS``, each path's best of
  ``ROUNDS`` alternating rounds. SDPA goes to the prompts from the shortest length from which it
  wins at every length up (by ``NATIVE_MARGIN``), and to none unless it wins at the longest:
  SDPA is one call per prompt and layer (ours one per layer for all of a step's prompts), so its
  fixed cost per call weighs most on short prompts, many of which arrive together.
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
from kernels import cpu_native
from kernels.cpu_attention import EVERY_FRESH_PROMPT, PrefillAttention, paged_attention_cpu, plan_attention_cpu
from kernels.reference import paged_attention_reference

logger = logging.getLogger(__name__)

PROMPT_LENGTHS = (32, 64, 128, 256, 512)   # up to one prompt chunk at the default token budget
ROUNDS = 3
# SDPA must be this much faster: a clear win only, on machines whose timings are noisy (two
# identical builds differed by 8-14% in one run on the shared Zen 3).
NATIVE_MARGIN = 1.10
# Largest tolerated max |out - reference| / max |reference|: float32 sums in another order; SDPA's
# bfloat16 flash kernel rounds the softmax probabilities to bfloat16 (~2^-8 each) before P x V.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2.0 ** -5}

Timings = dict[int, dict[PrefillAttention, float]]   # prompt tokens -> path -> best ms


@dataclass(frozen=True)
class PrefillAttentionChoice:
    path: PrefillAttention
    why: str                                  # for the start-up log
    sdpa_min_tokens: int | None = None        # SDPA: fresh prompts from this many tokens; None: ours for all
    timings_ms: Timings = field(default_factory=dict)   # empty unless timed

    def describe(self) -> str:
        if self.sdpa_min_tokens is None:
            return f"ours ({self.why})"
        return f"torch's SDPA for fresh prompts of {self.sdpa_min_tokens}+ tokens, ours for the rest ({self.why})"


def native_kernel_runs(dtype: torch.dtype) -> bool:
    return dtype in cpu_native.PREFILL_ATTENTION_DTYPES and cpu_native.load() is not None


def time_prefill_attention(arch: ModelArchitecture, dtype: torch.dtype, block_size: int, rounds: int = ROUNDS,
                           lengths: tuple[int, ...] = PROMPT_LENGTHS) -> tuple[Timings, dict[PrefillAttention, float]]:
    """Each path's best time (ms) for one layer's attention of one prompt of each length, for
    the paths whose output passes the check (at the longest length); and every path's relative
    error (inf: raised)."""
    generator = torch.Generator().manual_seed(0)
    tokens = max(lengths)
    num_blocks = -(-tokens // block_size)
    cache_shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    key_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    value_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    query = torch.randn(tokens, arch.num_heads, arch.head_dim, generator=generator).to(dtype)
    # Shuffled blocks, as a served cache's are after a while.
    table = torch.randperm(num_blocks, generator=generator).to(torch.int32).unsqueeze(0)
    positions = torch.arange(tokens)
    slots = table[0, positions // block_size].long() * block_size + positions % block_size
    scale = arch.head_dim ** -0.5
    sdpa_min_tokens = {PrefillAttention.NATIVE: None, PrefillAttention.SDPA: EVERY_FRESH_PROMPT}

    def prompt(length: int, path: PrefillAttention):
        """The query rows, and the plan, of a prompt of the first ``length`` tokens."""
        starts, seq_lens = torch.tensor([0, length]), torch.tensor([length])
        return query[:length], plan_attention_cpu(starts, seq_lens, table, slots[:length], block_size,
                                                  sdpa_min_tokens[path])

    reference = paged_attention_reference(query.float(), key_cache.float(), value_cache.float(),
                                          torch.tensor([0, tokens]), torch.tensor([tokens]), table, scale)
    errors: dict[PrefillAttention, float] = {}
    with torch.inference_mode():
        for path in PrefillAttention:
            try:
                rows, plan = prompt(tokens, path)
                out = paged_attention_cpu(rows, key_cache, value_cache, scale, plan, native=True).float()
                errors[path] = (float("inf") if not torch.isfinite(out).all()
                                else ((out - reference).abs().max() / reference.abs().max()).item())
            except Exception as exc:   # a path that cannot run here is no candidate, not a failed start
                logger.warning("cpu_prefill_attention: %s raised %r while being checked: not used", path.value, exc)
                errors[path] = float("inf")
        candidates = [path for path in PrefillAttention if errors[path] <= TOLERANCE[dtype]]
        best: Timings = {length: {path: float("inf") for path in candidates} for length in lengths}
        for _ in range(rounds):
            for length in lengths:
                for path in candidates:
                    rows, plan = prompt(length, path)
                    start = time.perf_counter()
                    paged_attention_cpu(rows, key_cache, value_cache, scale, plan, native=True)
                    best[length][path] = min(best[length][path], (time.perf_counter() - start) * 1e3)
    return best, errors


def sdpa_threshold(timings: Timings) -> int | None:
    """The shortest timed length from which SDPA wins by ``NATIVE_MARGIN`` at every length up;
    None where it does not win at the longest (or was left out); every fresh prompt where ours
    was left out."""
    if all(PrefillAttention.NATIVE not in paths for paths in timings.values()):
        return EVERY_FRESH_PROMPT if any(timings.values()) else None
    threshold = None
    for length in sorted(timings, reverse=True):
        ours, sdpa = timings[length].get(PrefillAttention.NATIVE), timings[length].get(PrefillAttention.SDPA)
        if sdpa is None or (ours is not None and sdpa * NATIVE_MARGIN >= ours):
            break
        threshold = length
    return threshold


def choose_prefill_attention(choice: str, dtype: torch.dtype, arch: ModelArchitecture, block_size: int,
                             cpu_attention: bool = True, features: CpuFeatures | None = None,
                             timer: Callable[..., tuple[Timings, dict]] = time_prefill_attention,
                             ) -> PrefillAttentionChoice:
    """The kernel for fresh prompts, and why: an explicit choice as given (``sdpa``: every fresh
    prompt); ``auto`` by the measured rule where it has figures, else timed as ``measure`` is.
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
        return PrefillAttentionChoice(PrefillAttention.SDPA, "cpu_prefill_attention=sdpa", EVERY_FRESH_PROMPT)
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
    figures = "; ".join(f"{length} tokens " + ", ".join(f"{path.value} {ms:.2f}" for path, ms in paths.items())
                        for length, paths in sorted(timings.items()))
    why = f"{reason}: ms for one layer's prompt, {figures}"
    threshold = sdpa_threshold(timings)
    if threshold is None:
        return PrefillAttentionChoice(native, why, None, timings)
    return PrefillAttentionChoice(PrefillAttention.SDPA, why, threshold, timings)
