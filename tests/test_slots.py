"""Slot timelines from step records (loadtest/slots.py) and the engine loop's step trace
that feeds them (EngineConfig.step_trace_path)."""

from __future__ import annotations

import gc
import json
import threading
import time
from pathlib import Path

from backend import Engine, EngineConfig, SamplingParams
from backend.engine.loop import CpuSnapshot, EngineLoop
from loadtest.slots import read_steps, slot_timeline
from loadtest.steps import cpu_attribution, mixed_steps


def step(*rows: tuple[str, int, bool]) -> dict:
    return {"step": 0, "t": 0.0, "ms": 1.0, "rows": [list(r) for r in rows]}


def test_continuous_refills_a_slot_the_step_after_it_frees() -> None:
    steps = [step(("a", 5, True), ("b", 3, True)), step(("a", 1, False), ("b", 1, False)),
             step(("b", 1, False), ("c", 4, True)), step(("b", 1, False), ("c", 1, False))]
    timeline = slot_timeline(steps)
    assert timeline.request.shape == (2, 4)
    assert timeline.request[0].tolist() == [0, 0, 2, 2]        # a, then c in a's slot
    assert timeline.request[1].tolist() == [1, 1, 1, 1]
    assert timeline.prefill[0].tolist() == [True, False, True, False]
    assert timeline.occupancy == 1.0


def test_static_batch_leaves_finished_slots_idle_until_it_drains() -> None:
    steps = [step(("a", 5, True), ("b", 3, True)), step(("a", 1, False), ("b", 1, False)),
             step(("b", 1, False)), step(("b", 1, False)), step(("c", 4, True), ("d", 2, True))]
    timeline = slot_timeline(steps)
    assert timeline.request[0].tolist() == [0, 0, -1, -1, 2]   # idle while b finishes
    assert timeline.request[1].tolist() == [1, 1, 1, 1, 3]
    assert timeline.occupancy == 8 / 10


def test_engine_loop_writes_one_record_per_step(tmp_path: Path, model_dir: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    engine = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4,
                                 step_trace_path=str(trace)))
    step_once = engine.step

    def step_with_a_collection():   # the third step runs a full collection: its line must show it
        if engine.num_steps == 2:
            gc.collect()
        return step_once()

    engine.step = step_with_a_collection
    loop = EngineLoop(engine).start()
    try:
        done = []
        loop.submit("r1", list(range(100, 140)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                    lambda out: done.append(out) if not isinstance(out, BaseException) and out.finished else None)
        assert loop.wait_idle(60)
    finally:
        loop.stop()
    steps = read_steps(trace)
    assert done and len(steps) == engine.num_steps
    tokens = [row[1] for s in steps for row in s["rows"]]
    prefill = [row[2] for s in steps for row in s["rows"]]
    assert tokens == [16, 16, 8, 1, 1]            # a 40-token prompt in 16-token chunks, then 2 decodes
    assert prefill == [True, True, True, False, False]
    assert all(s["ms"] > 0 for s in steps) and json.loads(trace.read_text().splitlines()[0])["rows"][0][0] == "r1"
    assert steps[2]["gc_ms"] > 0 and steps[2]["gc_ms"] <= steps[2]["ms"]
    assert all(isinstance(s["minor_faults"], int) and s["minor_faults"] >= 0 and isinstance(s["preempted"], int)
               and s["preempted"] >= 0 for s in steps)
    assert loop._on_gc not in gc.callbacks         # the loop's collector hook leaves with it
    # Where the CPU went: the engine thread ran each step on a core (no longer than the step),
    # and the kernel and steal times are counts, not guesses.
    for s in steps:
        assert s["threads_ms"] and all(on_core >= 1.0 and waiting >= 0 for on_core, waiting in s["threads_ms"])
        assert s["threads_ms"][0][0] <= s["ms"] + 1.0
        assert s["threads_ms"] == sorted(s["threads_ms"], reverse=True)
        assert s["sys_ms"] >= 0 and isinstance(s["steal_ms"], int) and s["steal_ms"] >= 0
    assert steps[2]["threads_ms"][0][0] >= steps[2]["gc_ms"] - 1.0   # the collection ran on that thread


def test_cpu_snapshot_sees_a_busy_thread_and_not_an_idle_one() -> None:
    before = CpuSnapshot.take()
    spun, release = threading.Event(), threading.Event()

    def spin() -> None:   # 30 ms of CPU time, then alive (a thread that ended is not in /proc) until released
        end = time.thread_time() + 0.03
        while time.thread_time() < end:
            pass
        spun.set()
        release.wait()

    worker = threading.Thread(target=spin)
    sleeper = threading.Thread(target=release.wait)
    worker.start(), sleeper.start()
    try:
        assert spun.wait(10)
        rows = CpuSnapshot.take().since(before)["threads_ms"]
    finally:
        release.set()
        worker.join(), sleeper.join()
    assert rows[0][0] >= 29.0               # the spinner; the sleeper's well under 1 ms is left out
    assert all(on_core >= 1.0 for on_core, _ in rows) and len(rows) <= 2   # the spinner, and this thread at most


def test_cpu_attribution_separates_slow_steps_by_where_their_time_went() -> None:
    def traced(measured: float, waiting: float, steal: int) -> dict:
        return {"step": 0, "t": 0.0, "ms": measured, "engine_ms": measured, "predicted_ms": 100.0, "sys_ms": 2.0,
                "steal_ms": steal, "threads_ms": [[measured - waiting, waiting / 2], [measured - waiting, waiting / 2],
                                                  [3.0, 0.0]], "rows": []}
    steps = [traced(100.0, 2.0, 0), traced(98.0, 2.0, 0), traced(101.0, 2.0, 0),
             traced(130.0, 30.0, 0), traced(125.0, 2.0, 20), {"step": 0, "t": 0.0, "ms": 1.0, "rows": []}]
    attribution = cpu_attribution(steps, over=1.05)
    assert attribution.slow.steps == 2 and attribution.rest.steps == 3
    assert attribution.slow.compute_waiting_ms == 16.0 and attribution.rest.compute_waiting_ms == 2.0
    assert attribution.slow.stolen_ms == 10.0 and attribution.rest.stolen_ms == 0.0
    assert attribution.rest.other_threads_ms == 3.0
    assert cpu_attribution([{"step": 0, "t": 0.0, "ms": 1.0, "rows": []}]) is None   # an older trace


def test_mixed_steps_are_those_with_a_chunk_beside_decodes() -> None:
    steps = [step(("a", 16, True)), step(("a", 16, True), ("b", 1, False)), step(("b", 1, False)),
             step(("b", 1, False), ("c", 1, False), ("d", 7, True))]
    assert mixed_steps(steps) == [steps[1], steps[3]]
