"""The engine on its own thread: submissions from other threads, outputs via callbacks,
abort, idle without CPU, failure isolation, shutdown delivering every final output."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from backend import Engine, EngineConfig, InvalidRequestError, QueueFullError, RequestOutput, SamplingParams
from backend.engine.loop import EngineLoop, EngineStepError
from tests.conftest import FIXED_BUDGET

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), **FIXED_BUDGET, num_kv_blocks=256, max_waiting_requests=4,
                               max_num_seqs=2))


def collect(q: queue.Queue, timeout: float = 60) -> list[RequestOutput | BaseException]:
    items = []
    while True:
        item = q.get(timeout=timeout)
        items.append(item)
        if isinstance(item, BaseException) or item.finished:
            return items


def test_submit_from_threads_and_match_offline_generate(engine: Engine) -> None:
    expected = [o.text for o in engine.generate(["Hello", "The sky is"], GREEDY)]
    loop = EngineLoop(engine).start()
    try:
        queues = [queue.Queue(), queue.Queue()]
        threads = [threading.Thread(target=loop.submit, args=(f"t{i}", p, GREEDY, queues[i].put))
                   for i, p in enumerate(["Hello", "The sky is"])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        texts = ["".join(o.new_text for o in collect(q)) for q in queues]
        assert texts == expected
        engine_thread_idle_cpu = _thread_cpu_while_idle(loop)
        assert engine_thread_idle_cpu < 0.05, f"idle loop used {engine_thread_idle_cpu:.3f}s CPU in 1s"
    finally:
        loop.stop()
    engine.check_invariants()


def before_forward(engine: Engine, monkeypatch: pytest.MonkeyPatch, call: int, action: Callable[[], None]) -> None:
    """Run ``action`` just before the engine's ``call``-th forward from now (1 = the next)."""
    real_execute, calls = engine.runner.execute, {"n": 0}

    def execute(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            action()
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", execute)


def fail_the_step() -> None:
    raise RuntimeError("simulated device failure")


def _thread_cpu_while_idle(loop: EngineLoop) -> float:
    start = time.process_time()
    time.sleep(1.0)
    return time.process_time() - start


def test_invalid_and_queue_full_are_raised_at_submit(engine: Engine) -> None:
    loop = EngineLoop(engine)  # not started: nothing drains the inbox
    with pytest.raises(InvalidRequestError):
        loop.submit("bad", "", GREEDY, lambda item: None)
    for i in range(4):
        loop.submit(f"q{i}", "Hello", GREEDY, lambda item: None)
    with pytest.raises(QueueFullError):
        loop.submit("q-over", "Hello", GREEDY, lambda item: None)
    loop.start()
    loop.stop()
    assert not engine.requests
    engine.check_invariants()


def test_abort_and_stop_deliver_final_outputs(engine: Engine) -> None:
    loop = EngineLoop(engine).start()
    long = queue.Queue()
    other = queue.Queue()
    loop.submit("long", "Tell me a story", SamplingParams(max_tokens=200, ignore_eos=True), long.put)
    loop.submit("other", "Tell me a joke", SamplingParams(max_tokens=200, ignore_eos=True), other.put)
    first = long.get(timeout=60)
    assert isinstance(first, RequestOutput)
    loop.abort("long")
    assert collect(long)[-1].finish_reason == "abort"
    loop.stop()   # "other" is still running: shutdown must end its stream too
    assert collect(other)[-1].finish_reason == "abort"
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    engine.check_invariants()


def test_a_failing_step_fails_in_flight_requests_and_the_loop_keeps_serving(engine: Engine,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    loop = EngineLoop(engine).start()
    try:
        before_forward(engine, monkeypatch, 2, fail_the_step)
        victim = queue.Queue()
        loop.submit("victim", "Hello", SamplingParams(max_tokens=50, ignore_eos=True), victim.put)
        assert isinstance(collect(victim)[-1], EngineStepError)
        after = queue.Queue()
        loop.submit("after", "Hello", GREEDY, after.put)
        assert collect(after)[-1].finish_reason in ("stop", "length")
    finally:
        loop.stop()
    engine.check_invariants()
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total
