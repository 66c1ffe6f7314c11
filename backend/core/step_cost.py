"""The scheduler's clock: a step's time predicted from what it computes.

A step's time is close to linear in six features of its composition (``FEATURES``):

- ``step``: 1 per step. Scheduling, packing, launching; reading every weight once, which is
  what a small decode step mostly costs.
- ``tokens``: tokens computed. Every token goes through every linear layer.
- ``sampled``: rows that produce a token. The LM head and the sampler run per row.
- ``decode_context``: over rows computing one token, the context each reads (its position + 1).
  Decode attention streams each row's K/V pages: memory-bound, cost per key.
- ``prefill_pairs``: over rows computing several tokens (prefill chunks, draft verification),
  the query-key pairs of their attention: ``n * (p + (n + 1) / 2)`` for ``n`` tokens after ``p``
  cached ones. This is the term that grows as a long prompt's chunks move deeper into it.
- ``prefill_context``: over the same rows, the context they attend to, ``p + n``: what a chunk
  pays for streaming its K/V pages whatever its size. Measured: a 32-token chunk 3,000 tokens
  deep costs noticeably more per pair than a 256-token one (its K/V no longer fit the core's
  L2 and few queries share each load); 1,000 deep they cost the same.

The coefficients (seconds per unit) are fitted by least squares on relative error (each sample
weighted by 1 / its measured time, so a 20 ms decode step counts as much as a 400 ms prefill),
constrained to be non-negative. They are fitted first from a calibration run at start-up
(backend/worker/step_calibration.py) and refitted every ``REFIT_EVERY`` steps from the engine's
own step timings (the calibration samples stay in, so shapes the traffic has not shown yet
keep their anchor). With fixed coefficients and no observations, the model is what scheduler
tests use as a fake clock.

The calibration runs in a quiet process; a serving one shares its cores with what streams the
tokens out (the Python backend's response threads, Triton's frontends, clients on the same
machine), which no feature sees. Traced on a 2-core machine (docs/benchmarks.md), steps that
stream tokens ran 1.10-1.13x their prediction at the median and steps without any 0.97x, and the
refits, anchored by the calibration, kept most of that gap for the rare prefill shapes. So every
prediction is also multiplied by a ``drift``: a running (geometric, ``DRIFT_WEIGHT``) mean of
measured / predicted, each ratio clamped to ``DRIFT_CLAMP``, re-centred on the last
``DRIFT_REFIT_STEPS`` steps after each refit. There is one drift per ``StepKind`` (decodes
alone, prefill alone, both), each learnt from steps of its kind only: what the features miss is
not the same for each (the response path runs beside the steps that stream; in a process
without one, decode steps ran 0.84x a calibration that fitted its prefill and mixed shapes
within 6%), and the many decode steps of a busy server must not set the correction for the
rare mixed steps the ITL target sizes. With one drift for all, a first long prompt among
decoding streams was cut into chunks sized with the decodes' 0.84, and its steps ran 1.2-1.3x
the target (docs/benchmarks.md).
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

FEATURES = ("step", "tokens", "sampled", "decode_context", "prefill_pairs", "prefill_context")
NUM_FEATURES = len(FEATURES)
DECODE_CONTEXT, PREFILL_PAIRS = FEATURES.index("decode_context"), FEATURES.index("prefill_pairs")
# Refit after this many observed steps, over the calibration samples and the last WINDOW steps.
REFIT_EVERY = 64
WINDOW = 1024
# The running correction for what the features do not see (module docstring).
DRIFT_WEIGHT = 1 / 16
DRIFT_CLAMP = (0.67, 1.5)          # one step's ratio counts at most this far from 1 (a GC pause, a fault)
DRIFT_REFIT_STEPS = 32

Features = tuple[float, ...]   # NUM_FEATURES values, in FEATURES order
ZERO: Features = (0.0,) * NUM_FEATURES


class StepKind(enum.Enum):
    """What a step computes, for its own ``drift`` (module docstring)."""
    DECODE = "decode"     # every row computes one token (or nothing is scheduled)
    PREFILL = "prefill"   # only rows of several tokens: nothing streams beside them
    MIXED = "mixed"       # both: the steps whose chunks an ITL target sizes


def step_kind(features: Features) -> StepKind:
    decodes, prefills = features[DECODE_CONTEXT] > 0, features[PREFILL_PAIRS] > 0
    if prefills:
        return StepKind.MIXED if decodes else StepKind.PREFILL
    return StepKind.DECODE


def row_features(num_new: int, num_computed: int, samples: bool) -> Features:
    """The features one row adds to a step: ``num_new`` tokens computed after ``num_computed``
    cached ones, producing a token or not (a prefill chunk that does not reach the end)."""
    if num_new == 1:
        return (0.0, 1.0, float(samples), float(num_computed + 1), 0.0, 0.0)
    pairs = num_new * (num_computed + (num_new + 1) / 2)
    return (0.0, float(num_new), float(samples), 0.0, pairs, float(num_computed + num_new))


def add(a: Features, b: Features) -> Features:
    # Spelt out: the scheduler adds one row's features per request per step.
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], a[4] + b[4], a[5] + b[5])


def sub(a: Features, b: Features) -> Features:
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2], a[3] - b[3], a[4] - b[4], a[5] - b[5])


@dataclass
class Sample:
    features: Features       # with step = 1
    seconds: float


def fit_nonnegative(samples: list[Sample]) -> np.ndarray:
    """Coefficients >= 0 minimising the sum of squared relative errors. With six features,
    every subset of them is tried (an exact non-negative least squares for this size): the
    best subset whose unconstrained fit has no negative coefficient wins."""
    x = np.array([s.features for s in samples], dtype=np.float64)
    y = np.array([s.seconds for s in samples], dtype=np.float64)
    weights = 1.0 / np.maximum(y, 1e-6)
    xw, yw = x * weights[:, None], y * weights
    scale = np.maximum(np.abs(xw).max(axis=0), 1e-12)   # columns of very different magnitudes
    best, best_residual = np.zeros(NUM_FEATURES), float(np.sum(yw**2))
    for size in range(1, NUM_FEATURES + 1):
        for subset in itertools.combinations(range(NUM_FEATURES), size):
            cols = list(subset)
            solution, *_ = np.linalg.lstsq(xw[:, cols] / scale[cols], yw, rcond=None)
            if np.any(solution < 0):
                continue
            coef = np.zeros(NUM_FEATURES)
            coef[cols] = solution / scale[cols]
            residual = float(np.sum((xw @ coef - yw) ** 2))
            if residual < best_residual:
                best, best_residual = coef, residual
    return best


class StepCostModel:
    """Predicts a step's seconds from its features; learns from observed steps."""

    def __init__(self, coefficients: Features | list[float], calibration: list[Sample] | None = None,
                 learn: bool = True) -> None:
        """``learn=False`` keeps the coefficients fixed (a fake clock for tests)."""
        self.coefficients = np.asarray(coefficients, dtype=np.float64)
        assert self.coefficients.shape == (NUM_FEATURES,)
        self.calibration = list(calibration or [])
        self.learn = learn
        self.window: deque[Sample] = deque(maxlen=WINDOW)
        self._since_refit = 0
        self.num_refits = 0
        # measured / fitted prediction, running, per kind of step (module docstring)
        self.drift: dict[StepKind, float] = dict.fromkeys(StepKind, 1.0)

    @classmethod
    def fitted(cls, calibration: list[Sample]) -> "StepCostModel":
        return cls(fit_nonnegative(calibration), calibration)

    def fitted_seconds(self, features: Features) -> float:
        """The linear model alone (``step`` = 1 is added here)."""
        c = self.coefficients
        return float(c[0] + c[1] * features[1] + c[2] * features[2] + c[3] * features[3] + c[4] * features[4]
                     + c[5] * features[5])

    def predict(self, features: Features) -> float:
        """Seconds for a step with these features: the linear model times its kind's ``drift``."""
        return self.fitted_seconds(features) * self.drift[step_kind(features)]

    def observe(self, features: Features, seconds: float) -> float:
        """Record a measured step; returns the relative error of its prediction
        (|predicted - measured| / measured) made before this observation."""
        fitted, kind = self.fitted_seconds(features), step_kind(features)
        error = abs(fitted * self.drift[kind] - seconds) / max(seconds, 1e-9)
        self.window.append(Sample((1.0, *features[1:]), seconds))
        if self.learn:
            ratio = clamped_ratio(seconds, fitted)
            self.drift[kind] = math.exp((1 - DRIFT_WEIGHT) * math.log(self.drift[kind])
                                        + DRIFT_WEIGHT * math.log(ratio))
        self._since_refit += 1
        if self.learn and self._since_refit >= REFIT_EVERY:
            self.refit()
        return error

    def refit(self) -> None:
        self._since_refit = 0
        self.coefficients = fit_nonnegative(self.calibration + list(self.window))
        self.num_refits += 1
        # The new coefficients absorb part of each drift: what is left of it, from the last
        # steps of its kind in the window (a kind the window lacks keeps its drift).
        for kind in StepKind:
            recent = [s for s in self.window if step_kind(s.features) is kind][-DRIFT_REFIT_STEPS:]
            if recent:
                logs = [math.log(clamped_ratio(s.seconds, self.fitted_seconds(s.features))) for s in recent]
                self.drift[kind] = math.exp(sum(logs) / len(logs))

    def describe(self) -> str:
        units = {"step": ("ms", 1e3), "tokens": ("us/token", 1e6), "sampled": ("us/row", 1e6),
                 "decode_context": ("ns/key", 1e9), "prefill_pairs": ("ns/pair", 1e9),
                 "prefill_context": ("us/key", 1e6)}
        return ", ".join(f"{name} {value * units[name][1]:.3g} {units[name][0]}"
                         for name, value in zip(FEATURES, self.coefficients))


def clamped_ratio(measured: float, predicted: float) -> float:
    """measured / predicted within ``DRIFT_CLAMP`` (1 where nothing was predicted)."""
    if predicted <= 0:
        return 1.0
    return min(max(measured / predicted, DRIFT_CLAMP[0]), DRIFT_CLAMP[1])


def largest_fitting(cost_model: StepCostModel, max_new: int, target: float,
                    step_with: Callable[[int], Features]) -> int:
    """The largest ``n`` <= ``max_new`` whose step (``step_with(n)``: its features) the model
    predicts within ``target`` seconds; 0 when none is (binary search: the prediction grows
    with ``n``)."""

    def fits(num_new: int) -> bool:
        return cost_model.predict(step_with(num_new)) <= target

    if max_new <= 0:
        return 0
    if fits(max_new):
        return max_new
    low, high = 0, max_new          # fits(low) is assumed (0: nothing added), fits(high) is false
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low
