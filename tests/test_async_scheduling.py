"""async_scheduling: each step is launched before the tokens of the step before are read
(backend/engine/overlap.py). On the CPU nothing overlaps, but the order of work is the one a
GPU runs, so everything a user sees must be what a synchronous engine gives: the same tokens,
text and finish reasons, no request computed past its max_tokens, failures isolated, no KV
block left behind. (Greedy equality with transformers under chunking, preemption and prefix
hits: tests/test_hf_equality.py's async configurations.)"""

from __future__ import annotations

import queue
from pathlib import Path

import pytest

from backend import Engine, EngineConfig, SamplingParams
from backend.core.request import Request
from backend.engine.loop import EngineLoop
from tests.conftest import FIXED_BUDGET
from tests.test_engine_loop import collect
from tests.test_step_failures import fail_when, run

CONFIG = dict(**FIXED_BUDGET, num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def sync_engine(model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), **CONFIG))


@pytest.fixture(scope="module")
def async_engine(model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), **CONFIG, async_scheduling=True))


@pytest.fixture(autouse=True)
def no_leaks(async_engine: Engine):
    async_engine.runner.fault_hook = None
    yield
    async_engine.runner.fault_hook = None
    async_engine.check_invariants()
    stats = async_engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, "KV blocks leaked"
    assert not async_engine.has_unfinished_requests()


def finals(engine: Engine, prompts: dict[str, list[int] | str], params: dict[str, SamplingParams]):
    return {request_id: (o.token_ids, o.text, o.finish_reason) for request_id, o in run(engine, prompts, params).items()}


def test_outputs_are_those_of_a_synchronous_engine(sync_engine: Engine, async_engine: Engine,
                                                  prose_ids: list[int]) -> None:
    # Every way a request ends: its length (1, 2 and more tokens), EOS, a stop string, a stop
    # token; with prompts long enough to be chunked beside the others' decodes.
    prompts = {"one": prose_ids[:9], "two": prose_ids[10:40], "long": prose_ids[50:180],
               "eos": "The capital of France is", "stop_string": prose_ids[200:230],
               "stop_token": prose_ids[240:260], "chat": "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"}
    greedy = dict(temperature=0.0)
    params = {"one": SamplingParams(max_tokens=1, **greedy), "two": SamplingParams(max_tokens=2, **greedy),
              "long": SamplingParams(max_tokens=30, ignore_eos=True, **greedy),
              "eos": SamplingParams(max_tokens=60, **greedy), "chat": SamplingParams(max_tokens=60, **greedy)}
    # A stop string and a stop token the synchronous engine meets part-way.
    plain, stop_probe = sync_engine.generate([prose_ids[200:230], prose_ids[240:260]],
                                             SamplingParams(max_tokens=20, **greedy))
    params["stop_string"] = SamplingParams(max_tokens=20, stop=[plain.text[8:12]], **greedy)
    params["stop_token"] = SamplingParams(max_tokens=20, stop_token_ids=[stop_probe.token_ids[5]], **greedy)
    expected = finals(sync_engine, prompts, params)
    before = async_engine.num_overlapped_steps
    got = finals(async_engine, prompts, params)
    assert got == expected
    assert {reason for _, _, reason in got.values()} >= {"length", "stop"}
    assert got["stop_string"][2] == "stop" and got["stop_token"][2] == "stop"
    assert async_engine.num_overlapped_steps > before


def test_no_request_is_computed_past_its_max_tokens(async_engine: Engine, prose_ids: list[int]) -> None:
    # A synchronous engine feeds back every token but the last; a step launched before the
    # last one is read must not schedule that one either (nor a position past max_model_len).
    computed: dict[str, int] = {}
    real_prepare = async_engine.runner.prepare

    def prepare(requests: list[Request], num_scheduled: dict[str, int], *args, **kwargs):
        for request in requests:
            computed[request.request_id] = computed.get(request.request_id, 0) + num_scheduled[request.request_id]
        return real_prepare(requests, num_scheduled, *args, **kwargs)

    async_engine.runner.prepare = prepare
    try:
        prompts = {f"r{n}": prose_ids[20 * n:20 * n + 7 + n] for n in range(1, 6)}
        params = {f"r{n}": SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in range(1, 6)}
        outputs = run(async_engine, prompts, params)
    finally:
        del async_engine.runner.prepare
    for n in range(1, 6):
        assert len(outputs[f"r{n}"].token_ids) == n
        assert computed[f"r{n}"] == len(prompts[f"r{n}"]) + n - 1


def test_a_request_that_needs_its_last_token_waits_for_it(sync_engine: Engine, async_engine: Engine,
                                                          prose_ids: list[int]) -> None:
    # A seeded request, one with logprobs and one with a repetition penalty among plain greedy
    # ones: their steps run synchronously, their tokens are the synchronous engine's, and the
    # plain requests overlap before they arrive and after they end.
    prompts = {"plain": prose_ids[:20], "seeded": prose_ids[30:50], "logprobs": prose_ids[60:70],
               "penalty": prose_ids[80:95]}
    params = {"plain": SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              "seeded": SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True),
              "logprobs": SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True),
              "penalty": SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)}
    expected = run(sync_engine, prompts, params)
    before = async_engine.num_overlapped_steps
    got = run(async_engine, prompts, params)
    for request_id in prompts:
        assert got[request_id].token_ids == expected[request_id].token_ids, request_id
    assert got["logprobs"].logprobs == expected["logprobs"].logprobs
    assert async_engine.num_overlapped_steps > before


def test_random_requests_without_a_seed_overlap(async_engine: Engine, prose_ids: list[int]) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, ignore_eos=True)
    before = async_engine.num_overlapped_steps
    outputs = async_engine.generate([prose_ids[:10], prose_ids[20:45]], params)
    assert [len(o.token_ids) for o in outputs] == [12, 12]
    assert async_engine.num_overlapped_steps > before


def test_an_abort_while_its_token_is_on_the_device(async_engine: Engine, prose_ids: list[int]) -> None:
    for request_id, prompt in (("kept", prose_ids[:12]), ("cut", prose_ids[20:32])):
        async_engine.add_request(request_id, prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    outputs = {"kept": [], "cut": []}
    while async_engine.has_unfinished_requests():
        for output in async_engine.step():
            outputs[output.request_id].append(output)
        if len(outputs["cut"]) == 3 and not outputs["cut"][-1].finished:
            assert async_engine.requests["cut"].num_pending_tokens == 1   # launched, not read
            assert async_engine.abort("cut")
    cut = outputs["cut"]
    assert cut[-1].finish_reason == "abort" and sum(len(o.new_token_ids) for o in cut) == 3
    assert cut[-1].token_ids == cut[-2].token_ids    # the token it had on the device is dropped
    assert len(outputs["kept"][-1].token_ids) == 20


def test_a_failed_launch_is_isolated_as_a_synchronous_step_is(sync_engine: Engine, async_engine: Engine,
                                                               prose_ids: list[int]) -> None:
    prompts = {"a": prose_ids[:30], "bad": prose_ids[100:160], "c": prose_ids[200:230]}
    params = {name: SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True) for name in prompts}
    expected = run(sync_engine, prompts, params)
    async_engine.runner.fault_hook = fail_when("bad", min_output_tokens=3)
    got = run(async_engine, prompts, params)
    assert got["bad"].finish_reason == "error"
    assert got["a"].token_ids == expected["a"].token_ids and got["c"].token_ids == expected["c"].token_ids


def test_tokens_stream_through_the_engine_loop(sync_engine: Engine, async_engine: Engine) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0)
    [expected] = sync_engine.generate(["Tell me about the sea."], params)
    loop = EngineLoop(async_engine).start()
    try:
        got = queue.Queue()
        loop.submit("streamed", "Tell me about the sea.", params, got.put)
        outputs = collect(got)
    finally:
        loop.stop()
    assert [t for o in outputs for t in o.new_token_ids] == expected.token_ids
    assert "".join(o.new_text for o in outputs) == expected.text


def test_async_scheduling_does_not_combine_with_speculative_decoding() -> None:
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, speculative_method="ngram")
    assert EngineConfig.from_dict({"async_scheduling": "true"}).async_scheduling is True
    assert EngineConfig().async_scheduling is False


def test_a_launch_that_fails_once_ends_as_a_synchronous_step_would(sync_engine: Engine, async_engine: Engine,
                                                                    prose_ids: list[int],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # A forward that raises once, whoever is in it (no request to blame): the synchronous engine
    # fails the step's requests; an overlapped launch must not quietly retry it into success.
    ends = {}
    for name, engine in (("sync", sync_engine), ("async", async_engine)):
        real_execute, calls = engine.runner.execute, {"n": 0}

        def execute(*args, real_execute=real_execute, calls=calls, **kwargs):
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("a transient failure")
            return real_execute(*args, **kwargs)

        monkeypatch.setattr(engine.runner, "execute", execute)
        [output] = engine.generate([prose_ids[:12]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        monkeypatch.undo()
        ends[name] = (output.finish_reason, output.token_ids)
    assert ends["async"] == ends["sync"] and ends["sync"][0] == "error"


def test_a_follow_up_turn_finds_as_much_cached_as_after_a_synchronous_engine(sync_engine: Engine,
                                                                             async_engine: Engine,
                                                                             prose_ids: list[int]) -> None:
    # The last block a request computes held an input that was still on the device when its
    # step was scheduled: it is cached when the request ends, as a synchronous engine caches it.
    cached = {}
    for name, engine in (("sync", sync_engine), ("async", async_engine)):
        engine.kv_cache.reset_prefix_cache()
        prompt = prose_ids[600:620]
        [first] = engine.generate([prompt], SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True))
        [follow_up] = engine.generate([prompt + first.token_ids + prose_ids[700:710]],
                                      SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        cached[name] = follow_up.num_cached_tokens
    assert cached["async"] == cached["sync"] == 32


def test_a_launch_failed_by_a_request_that_has_just_ended_blames_nobody_else(async_engine: Engine,
                                                                             prose_ids: list[int]) -> None:
    # "bad" poisons any step once it has 5 tokens on the host, and ends on its 6th token (a
    # stop token): the launch it poisons is read only after it ended, and the others must go on.
    bad_prompt = prose_ids[100:130]
    [free_run] = async_engine.generate([bad_prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    stop = free_run.token_ids[5]
    poisoned_from = free_run.token_ids.index(stop)
    async_engine.runner.fault_hook = fail_when("bad", min_output_tokens=poisoned_from)
    prompts = {"bad": bad_prompt, "good0": prose_ids[:20], "good1": prose_ids[300:325]}
    params = {name: SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                   stop_token_ids=[stop] if name == "bad" else None) for name in prompts}
    got = run(async_engine, prompts, params)
    assert got["bad"].finish_reason == "stop"
    assert [got[name].finish_reason for name in ("good0", "good1")] == ["length", "length"]
