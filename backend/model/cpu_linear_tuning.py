"""``cpu_linear`` chosen by timing at start-up, where the measured rule has no figures.

``resolve_cpu_linear``'s rule comes from ``benchmarks.cpu_linear`` runs on the CPUs measured so
far (docs/benchmarks.md). One cell is timed instead: bfloat16 on a CPU with AMX, where our
kernel's AMX-tile version competes with oneDNN's own AMX path (the tiles won every timing so
far, by margins that varied by machine). There, and wherever
``cpu_linear=measure`` asks, the engine times every path that runs here on the model's own
projection shapes, before it loads the weights, and takes the fastest; the start-up log gives
the figures.

- **What is timed:** the model's decoder projections, layer by layer, at ``DECODE_ROWS`` rows (a
  decode step of that many sequences), each packed from the first layer's random weights into
  memory of its own, so that they stream from memory as a real step's do: as many whole layers
  as ``MAX_WEIGHT_BYTES`` holds for every path's packed copy at once, scaled to the model; and
  the first layer at ``PREFILL_ROWS`` rows (a prompt chunk: compute-bound, so one layer times
  it). Paths alternate round by round and each keeps its best round. Not timed: the LM head (a
  bfloat16 one runs our kernel whatever ``cpu_linear`` says; a float32 one follows the choice),
  and models too large for one layer per path in the budget, or with int8 projections, which
  keep the rule.
- **The score:** time per token over as many prompt tokens as output tokens, decode time /
  decode rows + prefill time / prefill rows. A path that serves decode fast but prompts slowly
  would raise TTFT; the score weighs both.
- **Ours wins ties:** another path must score ``NATIVE_MARGIN`` better to be chosen, since with
  our kernel (and the default fused layer ops) the whole decoder runs as one C call a step, which
  this timing of the matmuls alone does not see (a faster decode step than with oneDNN's projections
  called back from C: docs/benchmarks.md, "Projections called back from the C layer loop").
- **A wrong kernel is never chosen:** each path's output on the first layer's shapes (every
  shape a layer has), at both row counts, is checked against ``F.linear`` in float32 on the same
  weights first. A path off by more than its dtype's rounding, or that raises, is left out and
  the log says so.

Our bfloat16 kernel's float32-FMA version (kernels/csrc/linear_bf16.c, built on AVX-512F CPUs)
is a second, separate timing, wherever the choice is our bfloat16 kernel without AMX tiles
(``choose_fma_rows``): the first layer's projections at ``FMA_CANDIDATE_ROWS`` rows, the dot
products (or the AVX2 version) against the FMAs, alternating round by round. Prompt-sized calls
are compute-bound, and on some CPUs ``vdpbf16ps`` has half the float32 FMAs' rate (the 2-core
Emerald Rapids Xeon: docs/benchmarks.md); decode-sized ones stream the weight, which is what the
dot products are fast at. The FMAs run from the smallest timed row count from which they were
``FMA_MARGIN`` faster at every timed count, else never; ``cpu_linear_fma_rows`` (EngineConfig)
sets the threshold instead (0: never). The log line of the linear layers gives the threshold and the figures.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from backend.model.architecture import ModelArchitecture
from backend.model.cpu_features import CpuFeatures, detect
from backend.model.cpu_linear import (bf16_fma_built, bf16_fma_rows, bf16_fp16_built, bf16_fp16_rows, linear_maker,
                                      native_kernel_available, onednn_packing_available, pack_pairs,
                                      resolve_cpu_linear, rule_is_measured, use_bf16_fma_rows, use_bf16_fp16_rows)
from kernels import cpu_native

logger = logging.getLogger(__name__)

DECODE_ROWS = 16               # the decode batch the served comparisons run (16 streams); fewer if max_num_seqs is
PREFILL_ROWS = 512             # one prompt chunk
NATIVE_MARGIN = 1.10           # another path must score this much better than ours (why: the module docstring)
MAX_WEIGHT_BYTES = 1 << 30     # every path's packed projections together, at most: each path's share is more
                               # than a large L3 (the 2-core Xeon's share of its 300 MiB), and it is freed at once
ROUNDS = 3
# Largest tolerated max |y - reference| / max |reference|: float32 sums in another order, and a
# bfloat16 output's rounding (2^-9 relative; correct kernels measured 0.002-0.003) with margin.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.0 / 128}
PROJECTIONS_PER_LAYER = 4      # qkv, o, gate|up, down: projection_shapes' order

PATH_MAKERS: dict[str, Callable[[torch.Tensor, torch.Tensor | None], nn.Module]] = {
    "native": linear_maker("native"),
    "onednn": linear_maker("onednn"),
}
# oneDNN with its weights packed for the decode batch (a batch-size hint; ``onednn`` packs without
# one). Timed as a path of its own: on an AMX CPU oneDNN's unhinted AMX path streamed the
# weights well below the memory's pace at 16 rows, and whether the hint is why has not been measured.
HINTED_ONEDNN = "onednn-hinted"


@dataclass(frozen=True)
class PathTiming:
    path: str
    decode_ms: float
    prefill_ms: float
    decode_rows: int
    prefill_rows: int

    @property
    def per_token_ms(self) -> float:
        """Time per token with as many prompt tokens as output tokens."""
        return self.decode_ms / self.decode_rows + self.prefill_ms / self.prefill_rows

    def describe(self) -> str:
        return (f"{self.path} {self.decode_ms:.1f} ms at {self.decode_rows} rows, {self.prefill_ms:.1f} ms at "
                f"{self.prefill_rows}")


@dataclass(frozen=True)
class LinearChoice:
    path: str                              # a cpu_linear value: native, onednn or torch
    why: str                               # for the start-up log
    timings: tuple[PathTiming, ...] = ()   # empty where the rule or an explicit choice decided
    onednn_batch_hint: int | None = None   # onednn: the rows its weights are packed for (None: no hint)
    fma_min_rows: int = 0                  # our bf16 kernel: float32 FMAs from this many rows (0: never)
    fp16_min_rows: int = 0                 # ... float16 FMAs from this many, if the weights allow (0: never)


def projection_shapes(arch: ModelArchitecture) -> list[tuple[int, int]]:
    """(in_features, out_features) of every decoder projection of a step, layer by layer."""
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    layer = [(arch.hidden_size, qkv), (arch.num_heads * arch.head_dim, arch.hidden_size),
             (arch.hidden_size, 2 * arch.intermediate_size), (arch.intermediate_size, arch.hidden_size)]
    return layer * arch.num_layers


def runnable_paths(dtype: torch.dtype, features: CpuFeatures) -> list[str]:
    """The fast paths that run here for this dtype, ours first (oneDNN packed with and without
    the batch-size hint count as one)."""
    paths = []
    if native_kernel_available(dtype):
        paths.append("native")
    if onednn_packing_available(dtype, features):
        paths.append("onednn")
    return paths


def path_makers(decode_rows: int) -> dict[str, Callable[[torch.Tensor, torch.Tensor | None], nn.Module]]:
    return {**PATH_MAKERS, HINTED_ONEDNN: linear_maker("onednn", decode_rows)}


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> float:
    """max |output - reference| / max |reference|; inf where the output has a NaN or infinity."""
    output = output.float()
    if not torch.isfinite(output).all():
        return float("inf")
    return ((output - reference).abs().max() / reference.abs().max().clamp(min=1e-30)).item()


def layers_to_time(shapes: list[tuple[int, int]], dtype: torch.dtype, num_paths: int) -> int:
    """How many whole layers of ``shapes`` every path's packed copy fits in the budget (0: not one)."""
    element = torch.tensor([], dtype=dtype).element_size()
    layer_bytes = sum(k * n for k, n in shapes[:PROJECTIONS_PER_LAYER]) * element
    return min(len(shapes) // PROJECTIONS_PER_LAYER, MAX_WEIGHT_BYTES // (layer_bytes * num_paths))


def time_paths(shapes: list[tuple[int, int]], dtype: torch.dtype, paths: list[str], decode_rows: int,
               prefill_rows: int = PREFILL_ROWS, rounds: int = ROUNDS,
               makers: dict[str, Callable[[torch.Tensor, torch.Tensor | None], nn.Module]] | None = None,
               ) -> tuple[list[PathTiming], dict[str, float]]:
    """Each path's best round at both row counts, scaled to all of ``shapes`` (whole layers, as
    ``projection_shapes`` gives them), for the paths whose output passes the check; and every
    path's relative error against ``F.linear`` (inf where it raised). ``makers`` must copy the
    weight they are given (every packer does): the copies are what streams from memory."""
    makers = makers or PATH_MAKERS
    layers = layers_to_time(shapes, dtype, len(paths))
    if layers < 1:
        raise ValueError("not one layer of these projections per path fits MAX_WEIGHT_BYTES")
    first_layer = shapes[:PROJECTIONS_PER_LAYER]
    kept = shapes[:layers * PROJECTIONS_PER_LAYER]
    generator = torch.Generator().manual_seed(0)
    layer_weights = [(torch.randn(n, k, generator=generator) * 0.02).to(dtype) for k, n in first_layer]
    inputs = {rows: {k: torch.randn(rows, k, generator=generator).to(dtype) for k, _ in first_layer}
              for rows in (decode_rows, prefill_rows)}
    errors: dict[str, float] = {}
    stacks: dict[str, list[nn.Module]] = {}
    amx_before = cpu_native.amx_in_use()
    try:
        # Our bfloat16 kernel runs AMX tiles (where built) only once asked, as the engine asks
        # for cpu_linear=native; the state before is restored below.
        if dtype == torch.bfloat16 and "native" in paths:
            cpu_native.use_amx(True)
        with torch.inference_mode():
            for path in paths:
                try:
                    stack = [makers[path](layer_weights[i % len(first_layer)], None) for i in range(len(kept))]
                    errors[path] = max(relative_error(stack[i](xs[k]), F.linear(xs[k].float(), layer_weights[i].float()))
                                       for i, (k, _) in enumerate(first_layer) for xs in inputs.values())
                except Exception as exc:   # a path that cannot run here is no candidate, not a failed start
                    logger.warning("cpu_linear: %s raised %r while being checked: not used", path, exc)
                    errors[path] = float("inf")
                    continue
                if errors[path] <= TOLERANCE[dtype]:
                    stacks[path] = stack
            # (rows, how many projections): the kept layers for decode, the first for prefill.
            runs = ((decode_rows, len(kept)), (prefill_rows, len(first_layer)))
            best = {(path, rows): float("inf") for path in stacks for rows, _ in runs}
            for _ in range(rounds):
                for path, stack in stacks.items():
                    for rows, count in runs:
                        xs = inputs[rows]
                        start = time.perf_counter()
                        for (k, _), layer in zip(kept[:count], stack):
                            layer(xs[k])
                        best[path, rows] = min(best[path, rows], (time.perf_counter() - start) * 1e3)
    finally:
        cpu_native.use_amx(amx_before)
    timings = [PathTiming(path, best[path, decode_rows] * len(shapes) / len(kept),
                          best[path, prefill_rows] * len(shapes) / len(first_layer), decode_rows, prefill_rows)
               for path in stacks]
    return timings, errors


def fastest(timings: list[PathTiming]) -> PathTiming:
    """The best score, ours unless another is ``NATIVE_MARGIN`` better."""
    best = min(timings, key=lambda t: t.per_token_ms)
    ours = next((t for t in timings if t.path == "native"), None)
    if ours is not None and ours.per_token_ms <= best.per_token_ms * NATIVE_MARGIN:
        return ours
    return best


def choose_cpu_linear(choice: str, dtype: torch.dtype, arch: ModelArchitecture, on_cpu: bool = True,
                      max_num_seqs: int = DECODE_ROWS, quantization: str = "none", features: CpuFeatures | None = None,
                      timer: Callable[..., tuple[list[PathTiming], dict[str, float]]] = time_paths,
                      fma_timer: Callable[..., tuple[list[FmaTiming], float]] | None = None,
                      fma_rows: int | None = None,
                      fp16_timer: Callable[..., tuple[list[Fp16Timing], float]] | None = None,
                      fp16_rows: int | None = None) -> LinearChoice:
    """The linear-layer path, and why: an explicit choice as given; ``auto`` by the measured rule
    where it has figures for this CPU and dtype, else timed as ``measure`` is. Where that is our
    bfloat16 kernel, also from how many rows it runs float32 FMAs (``choose_fma_rows``; ``fma_rows``:
    EngineConfig.cpu_linear_fma_rows), which is set for the process here, and from how many its
    float16 version would (``choose_fp16_rows``; ``fp16_rows``: EngineConfig.cpu_linear_fp16_rows),
    which the engine sets once it has seen the weights. ``features``, ``timer``, ``fma_timer`` and
    ``fp16_timer``: tests fake the machine and the clocks."""
    features = features or detect()
    linear = _choose_path(choice, dtype, arch, on_cpu, max_num_seqs, quantization, features, timer)
    if not (on_cpu and dtype == torch.bfloat16):
        return linear
    rows, note = choose_fma_rows(linear.path, arch, quantization, features, fma_timer or time_fma, fma_rows)
    use_bf16_fma_rows(rows)
    if note:
        linear = dataclasses.replace(linear, why=f"{linear.why}; {note}", fma_min_rows=rows)
    rows, note = choose_fp16_rows(linear.path, arch, quantization, fp16_timer or time_fp16, fp16_rows)
    return dataclasses.replace(linear, why=f"{linear.why}; {note}", fp16_min_rows=rows) if note else linear


def _choose_path(choice: str, dtype: torch.dtype, arch: ModelArchitecture, on_cpu: bool, max_num_seqs: int,
                 quantization: str, features: CpuFeatures,
                 timer: Callable[..., tuple[list[PathTiming], dict[str, float]]]) -> LinearChoice:
    """``choose_cpu_linear``'s path and why."""
    if choice != "measure":
        path = resolve_cpu_linear(choice, dtype, on_cpu, features)
        if choice != "auto":
            return LinearChoice(path, f"cpu_linear={choice}")
        if not on_cpu or rule_is_measured(dtype, features):
            return LinearChoice(path, "cpu_linear=auto: the measured rule (docs/benchmarks.md, CPU linear layers)")
        reason = "cpu_linear=auto: this CPU and dtype are timed at start-up (our kernel against oneDNN)"
    else:
        if not on_cpu:
            raise ValueError("cpu_linear=measure applies to CPU weights")
        reason = "cpu_linear=measure"
    rule = resolve_cpu_linear("auto", dtype, on_cpu, features)
    if quantization != "none":
        return LinearChoice(rule, f"{reason}: the rule, the projections being {quantization} (nothing to time)")
    paths = runnable_paths(dtype, features)
    if len(paths) < 2:
        return LinearChoice(rule, f"{reason}: only {rule} runs here")
    decode_rows = min(max_num_seqs, DECODE_ROWS)
    if "onednn" in paths:
        paths.append(HINTED_ONEDNN)
    shapes = projection_shapes(arch)
    if layers_to_time(shapes, dtype, len(paths)) < 1:
        return LinearChoice(rule, f"{reason}: the rule, a layer being too large to time at start-up")
    timings, errors = timer(shapes, dtype, paths, decode_rows, makers=path_makers(decode_rows))
    for path, error in errors.items():
        # inf: the path raised, which time_paths has logged with its exception.
        if TOLERANCE[dtype] < error < float("inf"):
            logger.warning("cpu_linear: %s computes wrong results on this CPU (max relative error %.3g against "
                           "F.linear, tolerance %.3g): not used", path, error, TOLERANCE[dtype])
    if not timings:
        raise RuntimeError(f"cpu_linear: no linear path computes correct results here ({errors})")
    chosen = fastest(timings)
    figures = "; ".join(t.describe() for t in timings)
    why = f"{reason}: {figures} (the model's projections)"
    if chosen.path == HINTED_ONEDNN:
        return LinearChoice("onednn", why, tuple(timings), onednn_batch_hint=decode_rows)
    return LinearChoice(chosen.path, why, tuple(timings))


# ---- our bfloat16 kernel's float32-FMA version (the module docstring, last paragraph)
FMA_CANDIDATE_ROWS = (32, 64, 128, 256, 512)   # thresholds tried: prompt chunks, never a decode step of <= 16
FMA_MARGIN = 1.05          # the FMAs must be this much faster at a row count to run there
FMA_MAX_WEIGHTS = 1 << 21  # a timed projection's weight, at most (elements: columns cut beyond; SmolLM2 is whole)
FMA_CHECK_ROWS = 37        # the rows the FMAs' output is checked at (every tile shape: 4 x 8 rows and 5)
FMA_ROUNDS = 5             # ~60 ms a round for SmolLM2-135M's layer on the 2-core Xeon
# The float16 version (AVX512-FP16 builds) changes the sums' rounding: it must buy at least this.
FP16_MARGIN = 1.10


@dataclass(frozen=True)
class Fp16Timing:
    rows: int
    without_ms: float   # the projections of one layer as the kernel runs them without the float16 version
    fp16_ms: float      # the same through it

    def describe(self) -> str:
        return f"{self.rows} rows {self.without_ms:.2f}/{self.fp16_ms:.2f} ms"


@dataclass(frozen=True)
class FmaTiming:
    rows: int
    dot_ms: float     # the projections of one layer, the dot products (or the AVX2 version)
    fma_ms: float     # the same through the float32 FMAs

    def describe(self) -> str:
        return f"{self.rows} rows {self.dot_ms:.2f}/{self.fma_ms:.2f} ms"


def fma_shapes(arch: ModelArchitecture) -> list[tuple[int, int]]:
    """The first layer's projections as timed: (in, out), out cut to a multiple of 48 columns (a
    tile's) where the weight would pass ``FMA_MAX_WEIGHTS`` (compute-bound calls: their pace
    per FLOP does not depend on the columns' count, and a large model's layer would take seconds)."""
    return [(k, n if k * n <= FMA_MAX_WEIGHTS else max(48, FMA_MAX_WEIGHTS // k // 48 * 48))
            for k, n in projection_shapes(arch)[:PROJECTIONS_PER_LAYER]]


def time_fma(shapes: list[tuple[int, int]], rows: tuple[int, ...] = FMA_CANDIDATE_ROWS, rounds: int = FMA_ROUNDS,
             library=None) -> tuple[list[FmaTiming], float]:
    """Our bfloat16 kernel over ``shapes`` (random weights, bfloat16 out, no bias) at each row
    count, without and with the FMAs, alternating; each projection keeps its best round and a
    row count's time is their sum. Also the FMAs' max relative error against ``F.linear`` in
    float32 (``relative_error``) at ``FMA_CHECK_ROWS`` rows. The process's threshold is left as it
    was. In-process results are kept per shapes, rows and threads (engines started again in one
    process, as tests do, time once)."""
    pairs, error = _time_version("fma", tuple(shapes), tuple(rows), rounds, torch.get_num_threads(), library, 0)
    return [FmaTiming(r, off, on) for r, off, on in pairs], error


def time_fp16(shapes: list[tuple[int, int]], rows: tuple[int, ...] = FMA_CANDIDATE_ROWS,
              rounds: int = FMA_ROUNDS, library=None) -> tuple[list[Fp16Timing], float]:
    """As ``time_fma``, the float16 version against what the kernel runs without it (the
    float32-FMA threshold in effect now, as ``choose_fma_rows`` just set it)."""
    pairs, error = _time_version("fp16", tuple(shapes), tuple(rows), rounds, torch.get_num_threads(), library,
                                 bf16_fma_rows(library))
    return [Fp16Timing(r, off, on) for r, off, on in pairs], error


# version -> (what sets its threshold for the process, what reads it back)
VERSION_SWITCHES = {"fma": (use_bf16_fma_rows, bf16_fma_rows), "fp16": (use_bf16_fp16_rows, bf16_fp16_rows)}


@lru_cache(maxsize=16)
def _time_version(version: str, shapes: tuple[tuple[int, int], ...], rows: tuple[int, ...], rounds: int,
                  threads: int, library, fma_rows_now: int) -> tuple[list[tuple[int, float, float]], float]:
    """(rows, ms without, ms with) per row count, and the error with, for ``version`` ``fma`` or
    ``fp16``; ``fma_rows_now`` keys the cache (the float16 timing's baseline depends on it)."""
    switch, threshold_now = VERSION_SWITCHES[version]
    generator = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=generator) * 0.02).bfloat16() for k, n in shapes]
    packed = [pack_pairs(w) for w in weights]
    inputs = {r: {k: torch.randn(r, k, generator=generator).bfloat16() for k, _ in shapes}
              for r in (*rows, FMA_CHECK_ROWS)}

    before = threshold_now(library)
    # Each projection keeps its best round (short timed units: a shared machine disturbs fewer).
    best = {(r, on): [float("inf")] * len(shapes) for r in rows for on in (False, True)}
    try:
        with torch.inference_mode():
            switch(1, library)
            checked = inputs[FMA_CHECK_ROWS]
            error = max(relative_error(cpu_native.linear_bf16(checked[k], p, n, None, library=library),
                                       F.linear(checked[k].float(), w.float()))
                        for (k, n), p, w in zip(shapes, packed, weights))
            for _ in range(rounds):
                for r in rows:
                    for on in (False, True):
                        switch(1 if on else 0, library)
                        for i, ((k, n), p) in enumerate(zip(shapes, packed)):
                            x = inputs[r][k]
                            start = time.perf_counter()
                            cpu_native.linear_bf16(x, p, n, None, library=library)
                            best[r, on][i] = min(best[r, on][i], (time.perf_counter() - start) * 1e3)
    finally:
        switch(before, library)
    return [(r, sum(best[r, False]), sum(best[r, True])) for r in rows], error


def faster_from(timings: list[tuple[int, float, float]], margin: float) -> int:
    """The smallest row count of ``(rows, ms without, ms with)`` from which the version was
    ``margin`` faster at every timed count above it (0: none)."""
    threshold = 0
    for rows, without_ms, with_ms in sorted(timings, reverse=True):
        if without_ms < with_ms * margin:
            break
        threshold = rows
    return threshold


def fma_threshold(timings: list[FmaTiming]) -> int:
    """The smallest timed row count from which the FMAs were ``FMA_MARGIN`` faster at every
    timed count (0: none)."""
    return faster_from([(t.rows, t.dot_ms, t.fma_ms) for t in timings], FMA_MARGIN)


def fp16_threshold(timings: list[Fp16Timing]) -> int:
    """The same for the float16 version, by ``FP16_MARGIN``."""
    return faster_from([(t.rows, t.without_ms, t.fp16_ms) for t in timings], FP16_MARGIN)


def choose_fma_rows(path: str, arch: ModelArchitecture, quantization: str = "none",
                    features: CpuFeatures | None = None,
                    timer: Callable[..., tuple[list[FmaTiming], float]] = time_fma,
                    forced: int | None = None) -> tuple[int, str]:
    """From how many rows our bfloat16 kernel runs float32 FMAs (0: never), and a note for the
    log ('' where there is nothing to say: another path, no FMA version here). Timed where the
    bfloat16 projections run our kernel's dot products or AVX2 version and the FMA version is
    built (AVX-512F); not where its AMX version is built (its tiles take every call of 2 rows and
    more) or the projections are quantized. ``forced`` (EngineConfig.cpu_linear_fma_rows): that
    threshold, untimed."""
    features = features or detect()
    if (path != "native" or quantization != "none" or not features.avx512
            or cpu_native.linear_bf16_version() in cpu_native.AMX_VERSIONS or not bf16_fma_built()):
        return 0, ""
    return _forced_or_timed("bf16 matmuls: float32 FMAs", "float32-FMA", "cpu_linear_fma_rows",
                            "dot products/FMAs", arch, timer, fma_threshold, forced)


def fp16_unavailable(path: str, quantization: str = "none") -> str:
    """Why our bfloat16 kernel's float16 version cannot run here ('' where it can): the one
    rule choose_fp16_rows applies and the start-up log gives a user who asked for it."""
    if path != "native":
        return f"the linear layers run {path}, not our kernel"
    if quantization != "none":
        return f"{quantization} weights"
    if cpu_native.linear_bf16_version() in cpu_native.AMX_VERSIONS:
        return "the AMX tiles take these matmuls"
    if not bf16_fp16_built():
        return "this build has no AVX512-FP16 version"
    return ""


def choose_fp16_rows(path: str, arch: ModelArchitecture, quantization: str = "none",
                     timer: Callable[..., tuple[list[Fp16Timing], float]] = time_fp16,
                     forced: int | None = None) -> tuple[int, str]:
    """From how many rows our bfloat16 kernel should run its float16 version (0: never), and a
    note for the log ('' where there is nothing to say). Timed, after ``choose_fma_rows`` has set
    the FMAs' threshold, where the projections run our kernel unquantized and the build has the
    version (AVX512-FP16) and no AMX version (whose tiles take every call of 2 rows and more,
    as for the FMAs); it runs from the smallest timed row count from which it was
    ``FP16_MARGIN`` faster at every timed count. Not set for the process here: the engine turns
    it on once it has seen the weights (``FP16_WEIGHT_MAX``). ``forced``
    (EngineConfig.cpu_linear_fp16_rows): that threshold, untimed."""
    if fp16_unavailable(path, quantization):
        return 0, ""
    return _forced_or_timed("float16 matmuls", "float16", "cpu_linear_fp16_rows", "without/with", arch, timer,
                            fp16_threshold, forced)


def _forced_or_timed(name: str, version: str, setting: str, columns: str, arch: ModelArchitecture,
                     timer: Callable[..., tuple[list, float]], threshold: Callable[[list], int],
                     forced: int | None) -> tuple[int, str]:
    """What ``choose_fma_rows`` and ``choose_fp16_rows`` share once the version may run: the
    ``forced`` threshold (the engine parameter ``setting``), or the ``threshold`` of ``timer``'s
    timings of the first layer, never where the version's results were wrong; with the note
    (``name`` leads it, ``columns`` heads the figures)."""
    if forced is not None:
        rows = max(int(forced), 0)
        return rows, f"{name} {f'from {rows} rows' if rows else 'never'} ({setting})"
    timings, error = timer(fma_shapes(arch))
    if not error <= TOLERANCE[torch.bfloat16]:
        logger.warning("cpu_linear: the bfloat16 kernel's %s version computes wrong results on this CPU "
                       "(max relative error %.3g against F.linear, tolerance %.3g): not used", version, error,
                       TOLERANCE[torch.bfloat16])
        return 0, f"{name} never (wrong results here: error {error:.3g})"
    rows = threshold(timings)
    figures = ", ".join(t.describe() for t in timings)
    return rows, f"{name} {f'from {rows} rows' if rows else 'never'} (a layer, {columns}: {figures})"
