"""The calibration cache (backend/worker/timing_cache.py): a second engine on the same machine,
model, code and step limits reads the first one's calibration instead of timing its own; any
change of those times again; a broken or foreign entry is never used; no cache is touched when
``calibration_cache`` is off."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from backend import Engine, EngineConfig
from backend.core.step_cost import Sample
from backend.worker import step_calibration
from backend.worker import timing_cache
from backend.worker.timing_cache import TimingCache
from tests.test_tiny_architectures import make_tiny_model

# Prompt attention pinned: `auto` times it at start-up on AVX-512 CPUs, and two starts that
# chose differently have different keys (sdpa_prompt_min_tokens), so the second would calibrate again.
SMALL = dict(dtype="float32", max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=64,
             cpu_prefill_attention="native")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory, tokenizer_dir: Path) -> str:
    """A 3-layer random model: its calibration takes well under a second."""
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    make_tiny_model("qwen2", folder, tokenizer_dir)
    return str(folder)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv(timing_cache.ENV_VAR, str(tmp_path / "step-cost"))
    return tmp_path / "step-cost"


@pytest.fixture
def calibrations(monkeypatch) -> list[int]:
    """How many calibrations ran (each appends its number of shapes)."""
    ran: list[int] = []
    real = step_calibration.calibrate

    def counting(run_step, shapes, *args, **kwargs):
        ran.append(len(shapes))
        return real(run_step, shapes, *args, **kwargs)

    monkeypatch.setattr(step_calibration, "calibrate", counting)
    return ran


def test_a_second_start_reads_the_first_ones_calibration(tiny_qwen2, cache_dir, calibrations) -> None:
    first = Engine(EngineConfig(model=tiny_qwen2, **SMALL))
    assert len(calibrations) == 1 and len(list(cache_dir.glob("*.json"))) == 1
    second = Engine(EngineConfig(model=tiny_qwen2, **SMALL))
    assert len(calibrations) == 1, "the second engine timed its own calibration"
    assert list(second.cost_model.coefficients) == list(first.cost_model.coefficients)
    assert second.cost_model.calibration == first.cost_model.calibration
    # Scheduling-only settings do not change a step's time: same entry.
    Engine(EngineConfig(model=tiny_qwen2, **SMALL, itl_target_ms=90.0, scheduling_policy="priority"))
    assert len(calibrations) == 1


def test_what_changes_a_step_s_time_times_again(tiny_qwen2, cache_dir, calibrations, monkeypatch) -> None:
    threads = torch.get_num_threads()
    changes = [dict(max_num_batched_tokens=96), dict(max_num_seqs=4), dict(block_size=8), dict(fused_layer_ops=False),
               dict(cpu_linear="torch"), dict(cpu_threads=threads + 1), dict(cpu_prefill_attention="sdpa")]
    try:
        Engine(EngineConfig(model=tiny_qwen2, **SMALL))
        for i, change in enumerate(changes, start=2):
            Engine(EngineConfig(model=tiny_qwen2, **{**SMALL, **change}))
            assert len(calibrations) == i, f"{change}: read another configuration's calibration"
        monkeypatch.setattr(timing_cache, "source_digest", lambda: "another version of the engine")
        Engine(EngineConfig(model=tiny_qwen2, **SMALL))
        assert len(calibrations) == len(changes) + 2, "read a calibration of other code"
    finally:
        torch.set_num_threads(threads)
    assert len(list(cache_dir.glob("*.json"))) == len(changes) + 2


def test_calibration_cache_off_neither_reads_nor_writes(tiny_qwen2, cache_dir, calibrations) -> None:
    for _ in range(2):
        Engine(EngineConfig(model=tiny_qwen2, **SMALL, calibration_cache=False))
    assert len(calibrations) == 2
    assert not cache_dir.exists()


def test_source_digest_covers_the_kernels_and_the_engine() -> None:
    # A real hash of real files (not a constant): 64 hex digits, stable within a process.
    digest = timing_cache.source_digest()
    assert len(digest) == 64 and digest == timing_cache.source_digest()


KEY = {"runner": {"machine": "test"}, "shapes": [[{"num_new": 1, "num_computed": 0, "samples": True}]]}
SAMPLES = [Sample((1.0, 1.0, 1.0, 1.0, 0.0, 0.0), 0.01), Sample((1.0, 64.0, 1.0, 0.0, 2080.0, 64.0), 0.2)]


def test_store_then_load_round_trips(tmp_path: Path) -> None:
    cache = TimingCache(tmp_path)
    assert cache.load(KEY) is None
    cache.store(KEY, SAMPLES)
    assert cache.load(KEY) == SAMPLES
    assert cache.load({**KEY, "runner": {"machine": "other"}}) is None
    assert [p.name for p in tmp_path.iterdir()] == [cache.path(KEY).name]   # no temporary file left


@pytest.mark.parametrize("corrupt", [
    lambda entry: "{ not json",
    lambda entry: json.dumps({**entry, "key": {"runner": {"machine": "another"}}}),   # a hash collision
    lambda entry: json.dumps({**entry, "format": -1}),
    lambda entry: json.dumps({**entry, "samples": []}),
    lambda entry: json.dumps({**entry, "samples": [[[1.0, 2.0], 0.1]]}),           # too few features
    lambda entry: json.dumps({**entry, "samples": [[[1.0] * 6, -0.1]]}),
    lambda entry: json.dumps({**entry, "samples": [[[1.0] * 6, "fast"]]}),
    lambda entry: json.dumps({k: v for k, v in entry.items() if k != "samples"}),
], ids=["not_json", "other_key", "format", "empty", "short", "negative", "not_a_number", "no_samples"])
def test_a_broken_or_foreign_entry_is_never_used(tmp_path: Path, corrupt) -> None:
    cache = TimingCache(tmp_path)
    cache.store(KEY, SAMPLES)
    path = cache.path(KEY)
    path.write_text(corrupt(json.loads(path.read_text())))
    assert cache.load(KEY) is None
    cache.store(KEY, SAMPLES)                # the next calibration replaces it
    assert cache.load(KEY) == SAMPLES


def test_an_unwritable_cache_is_logged_and_changes_nothing(tmp_path: Path, caplog) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = TimingCache(blocker / "step-cost")      # a directory under a file: cannot be made
    with caplog.at_level(logging.WARNING, logger="backend.worker.timing_cache"):
        cache.store(KEY, SAMPLES)
    assert "not writable" in caplog.text
    assert cache.load(KEY) is None
