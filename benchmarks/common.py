"""Shared helpers of the benchmarks: timing (CUDA events or wall clock; alternating best-of
rounds on CPU), the device's copy bandwidth, result files."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# The model `make model` converts: the default of every benchmark with a --model-dir.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 3, iters: int = 20) -> float:
    """Median milliseconds per call. CUDA events on a GPU; wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def timed_rounds(rounds: int, runs: dict[str, Callable[[], Any]]) -> dict[str, list[float]]:
    """Wall-clock seconds of each run in each of ``rounds`` rounds, the runs alternating within
    a round (CPU machines are shared and drift: alternation keeps the comparison fair)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def best_of(rounds: int, runs: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Best wall-clock seconds of each run over ``rounds`` alternating rounds (the best round is
    the one the host disturbed least)."""
    return {name: min(times) for name, times in timed_rounds(rounds, runs).items()}


def alternating_medians(variants: dict[str, Callable[[], Any]], step: Callable[[], Any], rounds: int,
                        steps: int) -> dict[str, float]:
    """Median ms of ``step()`` under each variant: ``variants[name]()`` switches to it (an
    engine's kernel, a model's loop), then one unmeasured step, then ``steps`` timed ones. The
    variants take turns, in dict order in even rounds and reversed in odd ones, so neither is
    always first after the other (CPU machines drift). The caller restores what it switched."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        for name in (list(variants) if r % 2 == 0 else list(reversed(variants))):
            variants[name]()
            step()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def copy_bandwidth_gbps(device: torch.device, num_bytes: int = 1 << 30) -> float:
    """Measured device-memory bandwidth: a large device-to-device copy moves each byte twice
    (read + write). This, not the datasheet figure, is the roofline's ceiling."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup=3, iters=20)
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    def fmt(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
