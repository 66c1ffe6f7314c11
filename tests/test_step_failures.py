"""A step that fails is pinned on the request(s) responsible: they end with finish_reason
"error", every other request of the step goes on with exactly the tokens it would have
produced, and no KV block (or stale prefix-cache entry) is left behind."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import pytest

from backend import Engine, EngineConfig, EngineUnhealthyError, FinishReason, SamplingParams
from backend.core.request import Request
from backend.engine.failure_isolation import MAX_FAILED_STEPS_IN_A_ROW, EngineHealth
from backend.engine.loop import EngineLoop, EngineStepError
from tests.conftest import FIXED_BUDGET

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    # Small chunks, so that prompts take several steps and requests share steps in many ways.
    return Engine(EngineConfig(model=str(model_dir), **FIXED_BUDGET, num_kv_blocks=128, max_num_seqs=8,
                               max_num_batched_tokens=48))


@pytest.fixture(autouse=True)
def no_fault(engine: Engine):
    engine.runner.fault_hook = None
    yield
    engine.runner.fault_hook = None
    # The module's engine is shared: heal what a health test left behind.
    engine.health = EngineHealth()
    engine.check_invariants()
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, "KV blocks leaked"


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def fail_when(request_id: str, min_output_tokens: int = 0):
    """A fault hook: any batch holding ``request_id`` once it has generated that many tokens
    raises, as a request with a poisoned parameter would."""
    def hook(requests: list[Request]) -> None:
        for request in requests:
            if request.request_id == request_id and request.num_output_tokens >= min_output_tokens:
                raise OverflowError(f"poisoned request {request_id}")
    return hook


def run(engine: Engine, prompts: dict[str, list[int]], params: dict[str, SamplingParams]) -> dict[str, object]:
    """All requests submitted at once, stepped to completion: request id -> final output."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params[request_id])
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def workload(prose_ids: list[int]) -> tuple[dict[str, list[int]], dict[str, SamplingParams]]:
    prompts = {"a": prose_ids[:30], "b": prose_ids[40:45], "bad": prose_ids[100:160],
               "c": prose_ids[200:290], "seeded": prose_ids[300:320]}
    params = {name: SamplingParams(max_tokens=12, **GREEDY) for name in prompts}
    params["seeded"] = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    return prompts, params


@pytest.mark.parametrize("fail_after", [0, 3], ids=["fails-in-prefill", "fails-mid-decode"])
def test_a_failing_request_is_isolated_and_the_others_tokens_are_unchanged(engine: Engine, prose_ids: list[int],
                                                                          fail_after: int) -> None:
    prompts, params = workload(prose_ids)
    clean = run(engine, {k: v for k, v in prompts.items() if k != "bad"}, params)
    steps_before = engine.num_steps

    engine.runner.fault_hook = fail_when("bad", fail_after)
    faulty = run(engine, prompts, params)

    assert faulty["bad"].finish_reason == "error"
    assert "poisoned request bad" in faulty["bad"].finish_message
    assert len(faulty["bad"].token_ids) == fail_after
    for name in clean:
        assert faulty[name].finish_reason == "length", name
        assert faulty[name].token_ids == clean[name].token_ids, f"{name}'s tokens changed by the failure"
    assert engine.num_steps > steps_before


def test_two_culprits_in_one_step(engine: Engine, prose_ids: list[int]) -> None:
    prompts, params = workload(prose_ids)
    clean = run(engine, {k: v for k, v in prompts.items() if k not in ("bad", "c")}, params)

    def hook(requests: list[Request]) -> None:
        fail_when("bad")(requests)
        fail_when("c", 2)(requests)
    engine.runner.fault_hook = hook
    faulty = run(engine, prompts, params)
    assert faulty["bad"].finish_reason == faulty["c"].finish_reason == "error"
    for name in clean:
        assert faulty[name].token_ids == clean[name].token_ids, name


def test_a_request_sharing_blocks_the_culprit_was_filling_is_recomputed(engine: Engine,
                                                                        prose_ids: list[int]) -> None:
    """``twin`` is admitted in the same step as ``bad`` and takes prefix hits on the blocks
    ``bad`` fills in that step; when ``bad`` fails, those blocks are never written, so ``twin``
    must not read them (it is preempted and recomputed) and they must leave the prefix cache."""
    engine.kv_cache.pool.reset_prefix_cache()
    shared = prose_ids[500:532]                       # two full blocks
    prompts = {"bad": shared + prose_ids[600:604], "twin": shared + prose_ids[700:708]}
    params = {name: SamplingParams(max_tokens=8, **GREEDY) for name in prompts}
    clean = run(engine, {"twin": prompts["twin"]}, params)
    engine.kv_cache.pool.reset_prefix_cache()

    engine.runner.fault_hook = fail_when("bad")
    preemptions = engine.scheduler.num_preemptions
    faulty = run(engine, prompts, params)
    assert faulty["bad"].finish_reason == "error"
    assert faulty["twin"].token_ids == clean["twin"].token_ids
    assert engine.scheduler.num_preemptions == preemptions + 1, "twin should have been recomputed"


def test_a_failure_no_request_explains_fails_that_step_only(engine: Engine, prose_ids: list[int]) -> None:
    def hook(requests: list[Request]) -> None:
        if len(requests) > 1:
            raise RuntimeError("only fails for a whole batch")
    engine.runner.fault_hook = hook
    engine.add_request("x", prose_ids[:10], SamplingParams(max_tokens=4, **GREEDY))
    engine.add_request("y", prose_ids[20:30], SamplingParams(max_tokens=4, **GREEDY))
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["x"].finish_reason == outputs["y"].finish_reason == "error"
    assert "whole batch" in outputs["x"].finish_message
    engine.runner.fault_hook = None
    later = run(engine, {"z": prose_ids[40:50]}, {"z": SamplingParams(max_tokens=4, **GREEDY)})
    assert later["z"].finish_reason == "length"


def test_a_failure_after_sampling_drew_noise_leaves_seeded_requests_unchanged(engine: Engine, prose_ids: list[int],
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler fails after the seeded rows drew their noise: the re-run must draw the same."""
    prompts = {"bad": prose_ids[100:120], "seeded": prose_ids[300:320], "random": prose_ids[400:410]}
    params = {"bad": SamplingParams(max_tokens=8, **GREEDY),
              "seeded": SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True),
              "random": SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)}
    clean = run(engine, {"seeded": prompts["seeded"]}, params)
    real_sampler = engine.sampler.__class__.__call__

    def failing_sampler(self, logits, requests, drafts=None):
        result = real_sampler(self, logits, requests, drafts)
        if any(r.request_id == "bad" and r.num_output_tokens >= 2 for r in requests):
            raise OverflowError("poisoned request bad (after sampling)")
        return result
    monkeypatch.setattr(engine.sampler.__class__, "__call__", failing_sampler)
    faulty = run(engine, prompts, params)
    assert faulty["bad"].finish_reason == "error"
    assert faulty["seeded"].token_ids == clean["seeded"].token_ids


def test_two_levels_of_same_step_prefix_sharing(engine: Engine, prose_ids: list[int]) -> None:
    """``c`` fills block X; ``s1`` hits X and fills Y; ``s2`` hits X and Y, all in one step.
    When ``c`` fails, both must be recomputed and neither X nor Y may stay in the cache."""
    engine.kv_cache.pool.reset_prefix_cache()
    x, y = prose_ids[800:816], prose_ids[816:832]
    prompts = {"c": x + prose_ids[900:904], "s1": x + y + prose_ids[910:914], "s2": x + y + prose_ids[920:928]}
    params = {name: SamplingParams(max_tokens=6, **GREEDY) for name in prompts}
    clean = {}
    for name in ("s1", "s2"):
        engine.kv_cache.pool.reset_prefix_cache()
        clean.update(run(engine, {name: prompts[name]}, params))
    engine.kv_cache.pool.reset_prefix_cache()
    engine.runner.fault_hook = fail_when("c")
    faulty = run(engine, prompts, params)
    assert faulty["c"].finish_reason == "error"
    assert faulty["s1"].token_ids == clean["s1"].token_ids
    assert faulty["s2"].token_ids == clean["s2"].token_ids


def test_the_loop_sends_the_culprit_an_error_and_the_others_their_text(engine: Engine, prose_ids: list[int]) -> None:
    params = SamplingParams(max_tokens=10, **GREEDY)
    expected = engine.generate([prose_ids[:20]], params)[0].token_ids
    engine.runner.fault_hook = fail_when("bad", 2)
    loop = EngineLoop(engine).start()
    try:
        good, bad = queue.Queue(), queue.Queue()
        loop.submit("bad", prose_ids[50:70], params, bad.put)
        loop.submit("good", prose_ids[:20], params, good.put)
        bad_items = [bad.get(timeout=60) for _ in range(3)]
        assert isinstance(bad_items[-1], EngineStepError) and "poisoned" in str(bad_items[-1])
        tokens = []
        while True:
            item = good.get(timeout=60)
            assert not isinstance(item, BaseException), item
            tokens += item.new_token_ids
            if item.finished:
                break
        assert tokens == expected
    finally:
        loop.stop()


# --- engine health: failures the engine cannot isolate ------------------------------------------

def always_fail(requests: list[Request]) -> None:
    raise RuntimeError("the device stopped answering")


def test_steps_that_fail_every_request_in_a_row_make_the_engine_unhealthy(engine: Engine,
                                                                          prose_ids: list[int]) -> None:
    params = SamplingParams(max_tokens=4, **GREEDY)
    engine.runner.fault_hook = always_fail
    for attempt in range(MAX_FAILED_STEPS_IN_A_ROW):
        assert engine.health_error is None, f"unhealthy after {attempt} failed steps"
        finals = run(engine, {f"r{attempt}-{i}": prose_ids[i * 10:i * 10 + 8] for i in range(2)},
                     {f"r{attempt}-{i}": params for i in range(2)})
        assert all(f.finish_reason is FinishReason.ERROR for f in finals.values())
    assert engine.health_error is not None and "device stopped answering" in engine.health_error
    assert engine.stats().health_error == engine.health_error


def test_a_good_step_between_failures_keeps_the_engine_healthy(engine: Engine, prose_ids: list[int]) -> None:
    params = SamplingParams(max_tokens=2, **GREEDY)
    for round_ in range(2 * MAX_FAILED_STEPS_IN_A_ROW):
        engine.runner.fault_hook = fail_when(f"bad{round_}")   # a poisoned request, alone in its step
        run(engine, {f"bad{round_}": prose_ids[:8]}, {f"bad{round_}": params})
        engine.runner.fault_hook = None
        run(engine, {f"good{round_}": prose_ids[:8]}, {f"good{round_}": params})
    assert engine.health_error is None


def test_a_device_error_makes_the_engine_unhealthy_at_once(engine: Engine, prose_ids: list[int]) -> None:
    def cuda_error(requests: list[Request]) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine.runner.fault_hook = cuda_error
    engine.add_request("victim", prose_ids[:8], SamplingParams(max_tokens=4, **GREEDY))
    with pytest.raises(RuntimeError, match="CUDA error"):
        engine.step()
    assert engine.health_error is not None and "illegal memory access" in engine.health_error
    engine.abort("victim")
    engine.runner.fault_hook = None
    engine.step()


def test_the_loop_refuses_everything_once_the_engine_is_unhealthy(engine: Engine, prose_ids: list[int]) -> None:
    loop = EngineLoop(engine).start()
    try:
        engine.runner.fault_hook = always_fail
        streams = {name: queue.Queue() for name in ("a", "b", "c")}
        for i, (name, stream) in enumerate(streams.items()):
            loop.submit(name, prose_ids[i * 10:i * 10 + 8], SamplingParams(max_tokens=50, **GREEDY), stream.put)
        ends = {name: stream.get(timeout=60) for name, stream in streams.items()}
        # Each failed step takes its requests with it; the third leaves the engine unhealthy.
        deadline = time.monotonic() + 30
        while loop.health_error is None and time.monotonic() < deadline:
            late = queue.Queue()
            try:
                loop.submit(f"late-{time.monotonic()}", prose_ids[:8], SamplingParams(max_tokens=4, **GREEDY), late.put)
            except EngineUnhealthyError:
                break
            assert isinstance(late.get(timeout=60), (EngineStepError, EngineUnhealthyError))
        assert loop.health_error is not None
        assert all(isinstance(end, (EngineStepError, EngineUnhealthyError)) for end in ends.values()), ends
        engine.runner.fault_hook = None      # even with the device back, the engine stays refused
        with pytest.raises(EngineUnhealthyError, match="engine is unhealthy .*retry on another replica"):
            loop.submit("after", prose_ids[:8], SamplingParams(max_tokens=4, **GREEDY), queue.Queue().put)
        assert wait_until(lambda: loop.stats.health_error is not None)
    finally:
        loop.stop()
