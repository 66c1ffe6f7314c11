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

import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

from backend.core.kv_cache_utils import cdiv
from backend.core.request import Request
from backend.core.step_cost import ZERO, Sample, StepCostModel, add, row_features
from backend.sampling_params import SamplingParams
from backend.worker.timing_cache import TimingCache

if TYPE_CHECKING:
    from backend.config import EngineConfig
    from backend.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


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


def fit_step_cost(runner: "ModelRunner", sampler: Any, config: "EngineConfig",
                  max_model_len: int) -> tuple[StepCostModel, str]:
    """Fit the step cost model from synthetic steps timed now: throwaway greedy requests whose
    K/V go to the first blocks of the cache, which nothing uses yet (nor is any of them in the
    prefix cache). Unless an earlier start timed the same steps on this machine, model and
    code: then its samples (backend/worker/timing_cache.py). Returns the model and where its
    samples came from."""
    block_size = config.block_size
    max_context = min(max_model_len, runner.num_blocks * block_size)
    shapes = calibration_shapes(config.max_num_batched_tokens, config.max_num_seqs, max_context)
    greedy = SamplingParams(temperature=0.0, max_tokens=1)

    def run_step(shape: list[CalibrationRow]) -> None:
        requests, num_scheduled, block_ids = [], {}, {}
        for i, row in enumerate(shape):
            length = row.num_computed + row.num_new + (0 if row.samples else 1)
            request = Request(request_id=f"calibration-{i}", prompt_token_ids=[0] * length, sampling_params=greedy,
                              arrival_seq=-1, arrival_time=0.0, max_tokens=1, eos_token_ids=frozenset())
            request.num_computed_tokens = row.num_computed
            requests.append(request)
            num_scheduled[request.request_id] = row.num_new
            block_ids[request.request_id] = list(range(cdiv(row.num_computed + row.num_new, block_size)))
        input_ids, meta, sampling = runner.prepare(requests, num_scheduled, block_ids)
        logits = runner.execute(input_ids, meta)
        if sampling:
            sampler(logits, sampling, [[] for _ in sampling])
        runner.synchronize()

    started = time.perf_counter()
    cache = TimingCache() if config.calibration_cache else None
    key = {"runner": runner.timing_signature(), "shapes": [[asdict(row) for row in shape] for shape in shapes]}
    samples = cache.load(key) if cache is not None else None
    source = "read from the calibration cache"
    if samples is None:
        samples, source = calibrate(run_step, shapes), "timed now"
        if cache is not None:
            cache.store(key, samples)
    model = StepCostModel.fitted(samples)
    logger.info("step cost model from %d calibration steps, %s, in %.1f s: %s", len(shapes), source,
                time.perf_counter() - started, model.describe())
    return model, source
