"""Start-up calibration of the step cost model (backend/core/step_cost.py).

Times a fixed set of synthetic steps that span what the scheduler will ask the model about:
decode batches of several sizes and context depths, prefill chunks of several sizes at
several depths into a prompt (the attention term), and a prefill chunk beside decodes. The
caller hands a ``run_step`` that computes one step of the given rows (forward pass and
sampling, on throwaway requests); this module only chooses shapes and keeps time, so it
never sees the engine. It is a noticeable part of a CPU start-up, once per machine, model and
code: later starts read the samples from the timing cache (backend/worker/timing_cache.py). The
engine's own step timings refine the fit from then on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from backend.core.step_cost import ZERO, Sample, add, row_features


@dataclass(frozen=True)
class CalibrationRow:
    num_new: int          # tokens computed for this row
    num_computed: int     # tokens before them (already in the cache)
    samples: bool         # whether the row reaches the end of its tokens (produces a token)


Shape = list[CalibrationRow]


def calibration_shapes(max_tokens: int, max_seqs: int, max_context: int) -> list[Shape]:
    """Steps to time, within a step's token budget and sequence cap and the deepest context
    the cache can hold (``max_context`` tokens in one sequence)."""
    shapes: list[Shape] = []

    def context(c: int) -> int:
        return max(1, min(c, max_context - 1))

    for rows in sorted({1, min(8, max_seqs, max_tokens), min(32, max_seqs, max_tokens)}):
        for depth in sorted({context(128), context(2048)}):
            shapes.append([CalibrationRow(1, depth - 1, True)] * rows)
    # Prefill chunks at several depths: small chunks go deep (cheap, and they pin down the
    # attention term), large ones stay shallower (their time grows fastest with depth).
    for chunk, prefixes in ((32, (3072,)), (64, (0, 1024, 3072)), (256, (0, 1024)), (max_tokens, (0, 1024))):
        chunk = min(chunk, max_tokens, max_context)
        for prefix in prefixes:
            prefix = max(0, min(prefix, max_context - chunk))
            shape = [CalibrationRow(chunk, prefix, True)]
            if shape not in shapes:
                shapes.append(shape)
    decodes = min(8, max_seqs - 1, max_tokens // 2)
    chunk = min(max_tokens - decodes, max_tokens // 2, max_context)
    if decodes > 0 and chunk > 1:
        for prefix in sorted({0, max(0, min(1024, max_context - chunk - 1))}):
            shapes.append([CalibrationRow(1, context(512) - 1, True)] * decodes
                          + [CalibrationRow(chunk, prefix, False)])
    return shapes


def features_of(shape: Shape) -> tuple[float, ...]:
    features = ZERO
    for row in shape:
        features = add(features, row_features(row.num_new, row.num_computed, row.samples))
    return (1.0, *features[1:])


def calibrate(run_step: Callable[[Shape], None], shapes: list[Shape], warmup: int = 2) -> list[Sample]:
    """One timed run per shape, after the first ``warmup`` shapes ran once untimed (the first
    steps of a process pay one-off costs: allocations, a matmul library choosing kernels)."""
    for shape in shapes[:warmup]:
        run_step(shape)
    samples = []
    for shape in shapes:
        start = time.perf_counter()
        run_step(shape)
        samples.append(Sample(features_of(shape), time.perf_counter() - start))   # type: ignore[arg-type]
    return samples
