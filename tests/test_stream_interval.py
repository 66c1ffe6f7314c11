"""stream_interval (vLLM's name): a running request's tokens are handed out once that many
have gathered, its first token, its end and any error at once; nothing is lost or reordered."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest

from backend import Engine, EngineConfig, SamplingParams
from backend.core.request import RequestStatus
from backend.engine.loop import EngineLoop, EngineStepError
from tests.conftest import FIXED_BUDGET
from tests.test_engine_loop import before_forward, collect, fail_the_step

INTERVAL = 4


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), **FIXED_BUDGET, num_kv_blocks=256, max_num_seqs=4,
                               stream_interval=INTERVAL))


@pytest.fixture
def loop(engine: Engine):
    loop = EngineLoop(engine).start()
    yield loop
    loop.stop()
    engine.check_invariants()
    assert engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def test_tokens_go_out_first_then_every_interval_then_the_end(engine: Engine, loop: EngineLoop) -> None:
    params = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True, logprobs=2)
    [expected] = engine.generate(["The sky is"], params)
    got = queue.Queue()
    loop.submit("r", "The sky is", params, got.put)
    outputs = collect(got)
    # 1 (the first token at once), 4, 4, then the last 2 with the finish.
    assert [len(o.new_token_ids) for o in outputs] == [1, INTERVAL, INTERVAL, 2]
    assert [t for o in outputs for t in o.new_token_ids] == expected.token_ids
    assert "".join(o.new_text for o in outputs) == expected.text
    assert [len(o.new_logprobs) for o in outputs] == [len(o.new_token_ids) for o in outputs]
    assert [o.num_output_tokens for o in outputs] == [1, 5, 9, 11]
    assert outputs[-1].logprobs == expected.logprobs


def test_an_output_shorter_than_the_interval_ends_in_one_response(loop: EngineLoop) -> None:
    got = queue.Queue()
    loop.submit("short", "Hello", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), got.put)
    outputs = collect(got)
    assert [len(o.new_token_ids) for o in outputs] == [1, 2]
    assert outputs[-1].finish_reason == "length"


def test_an_abort_hands_out_the_held_tokens_with_the_final_output(engine: Engine, loop: EngineLoop,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    got = queue.Queue()
    # Two tokens after the first are held by the third forward: abort before it runs.
    before_forward(engine, monkeypatch, 3, lambda: loop.abort("cut"))
    loop.submit("cut", "Tell me a story", SamplingParams(max_tokens=200, ignore_eos=True), got.put)
    outputs = collect(got)
    final = outputs[-1]
    assert final.finish_reason == "abort"
    assert sum(len(o.new_token_ids) for o in outputs) == final.num_output_tokens >= 3
    assert len(outputs) == 2   # the first token, then everything else with the end


def test_a_failed_step_hands_out_the_held_tokens_before_the_error(engine: Engine, loop: EngineLoop,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    got = queue.Queue()
    before_forward(engine, monkeypatch, 4, fail_the_step)   # after the first token and two held ones
    loop.submit("victim", "Hello", SamplingParams(max_tokens=50, ignore_eos=True), got.put)
    outputs = collect(got)
    assert isinstance(outputs[-1], EngineStepError)
    assert [len(o.new_token_ids) for o in outputs[:-1]] == [1, 2]
    assert not any(o.finished for o in outputs[:-1])


def test_the_interval_is_an_engine_parameter_of_at_least_one() -> None:
    assert EngineConfig.from_dict({"stream_interval": "8"}).stream_interval == 8
    assert EngineConfig().stream_interval == 1
    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)


def test_a_preempted_request_hands_out_what_it_held(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Four blocks of 16 tokens hold both requests' prompts but not both outputs: the later one
    # is preempted part-way, and whatever of it was held must reach its client then, not only
    # once it has been scheduled again. (With these prompts it is preempted holding 3 tokens.)
    engine = Engine(EngineConfig(model=str(model_dir), **FIXED_BUDGET, num_kv_blocks=4, max_num_seqs=2,
                                 enable_prefix_caching=False, stream_interval=INTERVAL))
    loop = EngineLoop(engine)
    received: dict[str, int] = {"first": 0, "second": 0}
    held_at_preemption: list[int] = []
    real_deliver = loop._deliver

    def deliver(outputs):   # after each step's delivery: what a waiting (preempted) request's client has
        real_deliver(outputs)
        request = engine.requests.get("second")
        if request is not None and request.status is RequestStatus.WAITING and request.num_output_tokens:
            held_at_preemption.append(request.num_output_tokens - received["second"])

    monkeypatch.setattr(loop, "_deliver", deliver)
    queues = {name: queue.Queue() for name in received}

    def count(name: str):
        def put(item) -> None:
            if not isinstance(item, BaseException):
                received[name] += len(item.new_token_ids)
            queues[name].put(item)
        return put

    loop.start()
    try:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        loop.submit("first", "The sky is", params, count("first"))
        loop.submit("second", "Tell me a long story", params, count("second"))
        finals = {name: collect(q)[-1] for name, q in queues.items()}
    finally:
        loop.stop()
    assert engine.stats().num_preemptions > 0, "nobody was preempted"
    assert held_at_preemption and held_at_preemption == [0] * len(held_at_preemption)
    assert [finals[name].num_output_tokens for name in received] == [40, 40]
    assert received == {"first": 40, "second": 40}
    engine.check_invariants()
