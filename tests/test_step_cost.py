"""The step cost model: its features, its fit, its online refit, and the calibration shapes."""

from __future__ import annotations

import math
import random

import pytest

from backend.core import step_cost
from backend.core.step_cost import (NUM_FEATURES, Sample, StepCostModel, StepKind, add, fit_nonnegative, row_features,
                                     step_kind, sub)
from backend.worker.step_calibration import calibrate, calibration_shapes, features_of

TRUE = (0.012, 250e-6, 40e-6, 900e-9, 530e-9, 2e-6)   # a fit on the 2-core EPYC, bfloat16


def random_steps(rng: random.Random, count: int) -> list[tuple[float, ...]]:
    steps = []
    for _ in range(count):
        features = step_cost.ZERO
        for _ in range(rng.randrange(0, 16)):
            features = step_cost.add(features, row_features(1, rng.randrange(1, 4000), True))
        for _ in range(rng.randrange(0, 3)):
            features = step_cost.add(features, row_features(rng.randrange(2, 512), rng.randrange(0, 3000),
                                                            rng.random() < 0.5))
        steps.append((1.0, *features[1:]))
    return steps


def true_seconds(features, coefficients=TRUE) -> float:
    return sum(c * x for c, x in zip(coefficients, features))


def sized_step(rng: random.Random) -> tuple[float, ...]:
    """Decodes beside a prefill chunk, with step = 1: the kind of step an ITL target sizes."""
    features = step_cost.ZERO
    for _ in range(rng.randrange(1, 16)):
        features = step_cost.add(features, row_features(1, rng.randrange(64, 4000), True))
    features = step_cost.add(features, row_features(rng.randrange(2, 512), rng.randrange(0, 3000), rng.random() < 0.5))
    return (1.0, *features[1:])


def test_row_features() -> None:
    assert row_features(1, 99, True) == (0, 1, 1, 100, 0, 0)             # a decode reads 100 keys
    assert row_features(4, 10, False) == (0, 4, 0, 0, 4 * 10 + 10, 14)   # 4 queries x 10 cached + 4*5/2 causal,
                                                                          # over a context of 14


def test_fit_recovers_the_coefficients() -> None:
    samples = [Sample(f, true_seconds(f)) for f in random_steps(random.Random(0), 60)]
    assert fit_nonnegative(samples) == pytest.approx(TRUE, rel=1e-6)


def test_fit_is_nonnegative_and_relative() -> None:
    # No per-row cost in truth, and noise of +-10%: no coefficient goes negative, and the fit
    # predicts short steps as well as long ones (relative error, not absolute).
    truth = (0.012, 250e-6, 0.0, 900e-9, 530e-9, 2e-6)
    rng = random.Random(1)
    samples = [Sample(f, true_seconds(f, truth) * rng.uniform(0.9, 1.1)) for f in random_steps(rng, 200)]
    coefficients = fit_nonnegative(samples)
    assert (coefficients >= 0).all()
    model = StepCostModel(coefficients)
    errors = sorted(abs(model.predict(s.features) - true_seconds(s.features, truth)) / true_seconds(s.features, truth)
                    for s in samples)
    assert errors[len(errors) // 2] < 0.05 and errors[-1] < 0.2


def test_observed_steps_refit_the_model() -> None:
    # Calibrated on a fast machine, then every step runs twice as slow (a noisy neighbour): the
    # refits follow the measurements.
    rng = random.Random(2)
    calibration = [Sample(f, true_seconds(f)) for f in random_steps(rng, 15)]
    model = StepCostModel.fitted(calibration)
    slow = tuple(2 * c for c in TRUE)
    errors = [model.observe((0.0, *f[1:]), true_seconds(f, slow)) for f in random_steps(rng, 8 * step_cost.REFIT_EVERY)]
    assert model.num_refits == 8
    assert sum(errors[:4]) / 4 > 0.4                                            # 2x off before
    assert sum(errors[-step_cost.REFIT_EVERY:]) / step_cost.REFIT_EVERY < 0.1
    # what the refits, anchored by the calibration, left over
    assert all(1.0 <= drift < 1.1 for drift in model.drift.values())


def test_drift_corrects_what_the_features_do_not_see() -> None:
    # Calibrated alone; served, every step runs 1.12x (the response path shares the cores):
    # between refits the running ratio brings the predictions to the measurements, for step
    # shapes the traffic rarely shows too, within a few steps of their kind and without a refit.
    rng = random.Random(4)
    calibration = [Sample(f, true_seconds(f)) for f in random_steps(rng, 200)]
    model = StepCostModel.fitted(calibration)
    steps = [(0.0, *sized_step(rng)[1:]) for _ in range(step_cost.REFIT_EVERY - 1)]
    errors = [model.observe(f, 1.12 * true_seconds((1.0, *f[1:]))) for f in steps]
    assert model.num_refits == 0
    assert model.drift[StepKind.MIXED] == pytest.approx(1.12, rel=0.01)
    assert errors[0] > 0.09 and max(errors[-8:]) < 0.01
    deep = step_cost.add(row_features(256, 3000, False), row_features(1, 500, True))
    assert model.predict(deep) == pytest.approx(1.12 * true_seconds((1.0, *deep[1:])), rel=0.02)


def test_each_kind_of_step_has_its_own_drift() -> None:
    # Decode steps run 0.84x the calibration, steps with a prefill chunk beside the decodes
    # exactly it: many decode steps must not shrink the prediction for the first mixed one (its
    # chunk would be sized too large, and the step would overrun the ITL target by 1/0.84).
    rng = random.Random(7)
    model = StepCostModel.fitted([Sample(f, true_seconds(f)) for f in random_steps(rng, 200)])
    decode = step_cost.ZERO
    for _ in range(8):
        decode = step_cost.add(decode, row_features(1, rng.randrange(64, 200), True))
    assert step_kind(decode) is StepKind.DECODE
    for _ in range(step_cost.REFIT_EVERY - 1):
        model.observe(decode, 0.84 * true_seconds((1.0, *decode[1:])))
    assert model.predict(decode) == pytest.approx(0.84 * true_seconds((1.0, *decode[1:])), rel=0.02)
    mixed = step_cost.add(decode, row_features(300, 0, False))
    prefill = row_features(300, 1000, False)
    assert step_kind(mixed) is StepKind.MIXED and step_kind(prefill) is StepKind.PREFILL
    assert model.predict(mixed) == pytest.approx(true_seconds((1.0, *mixed[1:])), rel=0.02)
    assert model.predict(prefill) == pytest.approx(true_seconds((1.0, *prefill[1:])), rel=0.02)
    # A refit re-centres each kind on its own recent steps, and keeps the others'.
    model.observe(decode, 0.84 * true_seconds((1.0, *decode[1:])))
    assert model.num_refits == 1
    assert model.drift[StepKind.MIXED] == 1.0 and model.drift[StepKind.PREFILL] == 1.0
    assert model.predict(decode) == pytest.approx(0.84 * true_seconds((1.0, *decode[1:])), rel=0.02)


def test_one_slow_step_moves_the_drift_little() -> None:
    model = StepCostModel(TRUE)
    features = (0.0, *random_steps(random.Random(5), 1)[0][1:])
    model.observe(features, 100 * true_seconds((1.0, *features[1:])))   # a 100x outlier (a pause)
    drift = model.drift[step_kind(features)]
    assert 1.0 < drift <= math.exp(step_cost.DRIFT_WEIGHT * math.log(step_cost.DRIFT_CLAMP[1])) + 1e-12


def test_a_fixed_clock_never_learns() -> None:
    model = StepCostModel(TRUE, learn=False)
    for f in random_steps(random.Random(3), 2 * step_cost.REFIT_EVERY):
        model.observe((0.0, *f[1:]), 1.0)
    assert model.num_refits == 0 and tuple(model.coefficients) == TRUE
    assert set(model.drift.values()) == {1.0}


@pytest.mark.parametrize("max_tokens,max_seqs,max_context", [(512, 64, 8192), (48, 8, 8192), (16, 2, 64), (512, 64, 300)])
def test_calibration_shapes_stay_within_the_limits(max_tokens: int, max_seqs: int, max_context: int) -> None:
    shapes = calibration_shapes(max_tokens, max_seqs, max_context)
    assert len(shapes) >= 6
    for shape in shapes:
        assert sum(row.num_new for row in shape) <= max_tokens
        assert len(shape) <= max_seqs
        assert all(row.num_computed + row.num_new + (not row.samples) <= max_context for row in shape)
    # Decode rows, prefill pairs and plain tokens all vary, so the fit can tell them apart.
    features = [features_of(shape) for shape in shapes]
    for column in (1, 2, 3, 4, 5):
        assert len({f[column] for f in features}) >= 2


def test_calibrate_times_every_shape_once_after_warmup() -> None:
    shapes = calibration_shapes(64, 8, 512)
    ran = []
    samples = calibrate(ran.append, shapes, warmup=2)
    assert ran == shapes[:2] + shapes
    assert [s.features for s in samples] == [features_of(shape) for shape in shapes]
    assert all(s.seconds >= 0 for s in samples)


def test_add_and_sub_are_elementwise_over_every_feature() -> None:
    """add and sub spell out their six sums: a feature added to FEATURES must be added there."""
    rng = random.Random(5)
    for _ in range(100):
        a = tuple(rng.uniform(-1e3, 1e3) for _ in range(NUM_FEATURES))
        b = tuple(rng.uniform(-1e3, 1e3) for _ in range(NUM_FEATURES))
        assert add(a, b) == tuple(x + y for x, y in zip(a, b))
        assert sub(a, b) == tuple(x - y for x, y in zip(a, b))
