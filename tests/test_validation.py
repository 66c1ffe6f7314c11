"""Request and configuration validation, admission control and abort.

Every rejection must be an InvalidRequestError (a ValueError) naming the culprit field,
or a QueueFullError for a full queue, and must leave the engine exactly as healthy as
before: it still serves a normal request with the same greedy tokens, and its KV-block
accounting is consistent.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from backend import (Engine, EngineConfig, InvalidRequestError, QueueFullError, RequestOutput,
                     SamplingParams)

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"
VOCAB_SIZE = 49152
MAX_MODEL_LEN = 64
NUM_KV_BLOCKS = 3            # 48 tokens: less than max_model_len, so some legal lengths never fit
BLOCK_SIZE = 16
MAX_WAITING = 4
NORMAL_PROMPT = "The capital of France is"
NORMAL_PARAMS = SamplingParams(temperature=0.0, max_tokens=4)


# ---- SamplingParams -------------------------------------------------------------------------

INVALID_PARAMS: list[tuple[str, dict[str, Any]]] = [
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": -1}),
    ("max_tokens", {"max_tokens": 1.5}),
    ("max_tokens", {"max_tokens": True}),
    ("max_tokens", {"max_tokens": "3"}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}),
    ("temperature", {"temperature": "1"}),
    ("top_p", {"top_p": 0}),
    ("top_p", {"top_p": 1.5}),
    ("top_p", {"top_p": math.nan}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.0}),
    ("min_p", {"min_p": 1.5}),
    ("min_p", {"min_p": -0.1}),
    ("stop", {"stop": [""]}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": [1]}),
    ("stop", {"stop": ["ok", None]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": [1.0]}),
    ("stop_token_ids", {"stop_token_ids": 5}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("presence_penalty", {"presence_penalty": 3}),
    ("presence_penalty", {"presence_penalty": -2.5}),
    ("frequency_penalty", {"frequency_penalty": -3}),
    ("frequency_penalty", {"frequency_penalty": 2.01}),
    ("priority", {"priority": 1.5}),
    ("priority", {"priority": None}),
    ("logprobs", {"logprobs": 21}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": 2.0}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("min_tokens", {"min_tokens": -1}),
    ("seed", {"seed": "x"}),
    ("seed", {"seed": 1.0}),
    ("logit_bias", {"logit_bias": [[5, 1.0]]}),
    ("logit_bias", {"logit_bias": {"five": 1.0}}),
    ("logit_bias", {"logit_bias": {"-1": 1.0}}),
    ("logit_bias", {"logit_bias": {"1.5": 1.0}}),
    ("logit_bias", {"logit_bias": {True: 1.0}}),
    ("logit_bias", {"logit_bias": {"9" * 5000: 1.0}}),
    ("logit_bias", {"logit_bias": {"5": math.nan}}),
    ("logit_bias", {"logit_bias": {"5": math.inf}}),
    ("logit_bias", {"logit_bias": {"5": "1"}}),
    ("logit_bias", {"logit_bias": {"5": None}}),
    ("logit_bias", {"logit_bias": {str(i): 1.0 for i in range(1025)}}),
    ("bad_words", {"bad_words": "word"}),
    ("bad_words", {"bad_words": [""]}),
    ("bad_words", {"bad_words": ["ok", 5]}),
    ("bad_words", {"bad_words": ["\ud800"]}),
    ("bad_words", {"bad_words": [f"w{i}" for i in range(129)]}),
    ("bad_words", {"bad_words": ["x" * (16 * 1024 + 1)]}),
    ("include_stop_str_in_output", {"include_stop_str_in_output": "yes"}),
    ("include_stop_str_in_output", {"include_stop_str_in_output": 1}),
]


@pytest.mark.parametrize(("field", "kwargs"), INVALID_PARAMS, ids=[f"{f}={v}"[:60] for f, v in INVALID_PARAMS])
def test_invalid_sampling_param_names_the_field(field: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize(("field", "kwargs"), INVALID_PARAMS, ids=[f"{f}={v}"[:60] for f, v in INVALID_PARAMS])
def test_invalid_sampling_param_from_dict(field: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict(dict(kwargs))
    assert info.value.field == field and field in str(info.value)


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 1}, {"max_tokens": None}, {"temperature": 0}, {"temperature": 0.0}, {"temperature": 2},
    {"top_p": 1}, {"top_p": 1e-9}, {"top_k": 0}, {"top_k": -1}, {"top_k": 1}, {"min_p": 0}, {"min_p": 1},
    {"stop": "###"}, {"stop": ["a", "bc"]}, {"stop_token_ids": [0, 2]}, {"ignore_eos": True},
    {"repetition_penalty": 1e-3}, {"presence_penalty": -2}, {"presence_penalty": 2},
    {"frequency_penalty": 2.0}, {"priority": -5}, {"logprobs": 0}, {"logprobs": 20}, {"seed": 0},
    {"seed": None}, {"min_tokens": 4, "max_tokens": 4}, {"min_tokens": 100, "max_tokens": None},
])
def test_boundary_values_are_accepted(kwargs: dict[str, Any]) -> None:
    params = SamplingParams.from_dict(dict(kwargs))
    for name, value in kwargs.items():
        expected = [value] if name == "stop" and isinstance(value, str) else value
        assert getattr(params, name) == expected


def test_is_greedy_threshold() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy


def test_from_dict_rejects_unknown_keys_naming_them() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict({"max_tokens": 4, "max_token": 5})
    assert info.value.field == "max_token"
    assert "max_token" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict({"beam_width": 2})
    assert "beam_width" in str(info.value)


@pytest.mark.parametrize("name,bad", [("n", 65), ("n", 0), ("n", "1"), ("best_of", 2), ("best_of", 1.0)])
def test_n_in_range_and_best_of_only_1(name: str, bad: Any) -> None:
    # OpenAI-style clients always send n (and best_of): best_of 1 is accepted, anything else named.
    assert SamplingParams.from_dict({"n": 1, "best_of": 1}).n == 1
    assert SamplingParams.from_dict({"n": 64}).n == 64
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict({name: bad})
    assert info.value.field == name


@pytest.mark.parametrize("values", [None, [("max_tokens", 4)], "max_tokens=4", 4])
def test_from_dict_rejects_non_dict(values: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict(values)
    assert info.value.field == "sampling_parameters"


def test_logit_bias_and_bad_words_are_taken_as_vllm_takes_them() -> None:
    params = SamplingParams.from_dict({"logit_bias": {"5": 2, " 7 ": -0.5, "9": 250, "11": -1e9, 13: 1.5},
                                       "bad_words": ["a", "b", "a"], "include_stop_str_in_output": True})
    # JSON's string keys become ids; biases are clamped into [-100, 100]; duplicate words dropped.
    assert params.logit_bias == {5: 2.0, 7: -0.5, 9: 100.0, 11: -100.0, 13: 1.5}
    assert params.bad_words == ["a", "b"] and params.include_stop_str_in_output is True
    assert SamplingParams.from_dict({"bad_words": None, "logit_bias": None}).bad_words == []
    assert SamplingParams.from_dict({"bad_words": [f"w{i}" for i in range(128)]}).bad_words[-1] == "w127"
    assert len(SamplingParams.from_dict({"logit_bias": {str(i): 1 for i in range(1024)}}).logit_bias) == 1024
    # The tokenized words are the engine's, never a request key.
    assert "tokenized_bad_words" not in SamplingParams.field_names()
    with pytest.raises(InvalidRequestError):
        SamplingParams.from_dict({"tokenized_bad_words": None})


def test_from_dict_round_trip() -> None:
    params = SamplingParams.from_dict({"max_tokens": 7, "temperature": 0.3, "stop": "x", "seed": 3})
    assert (params.max_tokens, params.temperature, params.stop, params.seed) == (7, 0.3, ["x"], 3)


# ---- EngineConfig ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"block_size": 0}, {"block_size": -16}, {"scheduling_policy": "lifo"}, {"scheduling_policy": "FCFS"},
    {"batching": "dynamic"}, {"dtype": "float64"}, {"num_kv_blocks": 0}, {"max_num_seqs": 0},
    {"max_num_seqs": 64, "max_num_batched_tokens": 32}, {"gpu_memory_utilization": 0.0},
    {"gpu_memory_utilization": 1.5}, {"max_model_len": 0}, {"max_waiting_requests": 0},
    {"load_format": "pt"}, {"kv_cache_memory_bytes": 0},
])
def test_engine_config_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as info:
        EngineConfig(**kwargs)
    assert next(iter(kwargs)) in str(info.value) or "max_num_batched_tokens" in str(info.value)


def test_engine_config_from_dict_coerces_strings() -> None:
    config = EngineConfig.from_dict({
        "block_size": "16", "num_kv_blocks": " 32 ", "max_model_len": "none", "kv_cache_memory_bytes": "null",
        "enable_prefix_caching": "true", "enable_chunked_prefill": "false", "gpu_memory_utilization": "0.5",
        "scheduling_policy": "priority", "max_waiting_requests": "8", "seed": "7",
    })
    assert config.block_size == 16 and type(config.block_size) is int
    assert config.num_kv_blocks == 32 and type(config.num_kv_blocks) is int
    assert config.max_model_len is None and config.kv_cache_memory_bytes is None
    assert config.enable_prefix_caching is True and config.enable_chunked_prefill is False
    assert config.gpu_memory_utilization == 0.5 and type(config.gpu_memory_utilization) is float
    assert config.scheduling_policy == "priority"
    assert (config.max_waiting_requests, config.seed) == (8, 7)


@pytest.mark.parametrize(("raw", "expected"), [("true", True), ("True", True), ("1", True), ("yes", True),
                                               ("on", True), ("false", False), ("0", False), ("off", False),
                                               ("no", False), (True, True), (False, False)])
def test_engine_config_from_dict_booleans(raw: Any, expected: bool) -> None:
    assert EngineConfig.from_dict({"enable_prefix_caching": raw}).enable_prefix_caching is expected


def test_engine_config_from_dict_typed_values_pass_through() -> None:
    config = EngineConfig.from_dict({"block_size": 8, "num_kv_blocks": None, "max_model_len": 128})
    assert (config.block_size, config.num_kv_blocks, config.max_model_len) == (8, None, 128)


@pytest.mark.parametrize("values", [{"block_size": "sixteen"}, {"block_size": "none"},
                                    {"enable_prefix_caching": "maybe"}, {"gpu_memory_utilization": "most"},
                                    {"block_size": "0"}, {"scheduling_policy": "random"}])
def test_engine_config_from_dict_rejects_bad_values(values: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as info:
        EngineConfig.from_dict(values)
    assert next(iter(values)) in str(info.value)


def test_engine_config_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError) as info:
        EngineConfig.from_dict({"block_size": "16", "blocksize": "16", "tensor_parallel": "2"})
    assert "blocksize" in str(info.value) and "tensor_parallel" in str(info.value)


# ---- the engine -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine() -> Engine:
    if not (MODEL_DIR / "model.safetensors").is_file():
        pytest.fail(f"{MODEL_DIR} is missing: run `make model`")
    # Built the way the serving layer builds it: from string parameters.
    config = EngineConfig.from_dict({
        "model": str(MODEL_DIR), "max_model_len": str(MAX_MODEL_LEN), "num_kv_blocks": str(NUM_KV_BLOCKS),
        "block_size": str(BLOCK_SIZE), "max_waiting_requests": str(MAX_WAITING), "device": "cpu",
    })
    return Engine(config)


@pytest.fixture(scope="module")
def reference(engine: Engine) -> RequestOutput:
    """The normal request's greedy output on the fresh engine, before any rejection."""
    output = engine.generate([NORMAL_PROMPT], NORMAL_PARAMS)[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 4
    return output


def run_to_completion(engine: Engine) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return finals
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.check_invariants()
    raise AssertionError("engine did not drain")


def assert_idle_and_consistent(engine: Engine) -> None:
    engine.check_invariants()
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total == NUM_KV_BLOCKS
    assert not engine.has_unfinished_requests()


def assert_still_serves(engine: Engine, reference: RequestOutput) -> None:
    """After a rejection: nothing was queued, and a normal request gives the reference tokens."""
    assert_idle_and_consistent(engine)
    output = engine.generate([NORMAL_PROMPT], NORMAL_PARAMS)[0]
    assert output.token_ids == reference.token_ids
    assert output.text == reference.text
    assert_idle_and_consistent(engine)


def test_engine_built_from_string_config(engine: Engine) -> None:
    assert engine.config.max_model_len == MAX_MODEL_LEN and engine.max_model_len == MAX_MODEL_LEN
    assert engine.stats().kv_blocks_total == NUM_KV_BLOCKS


BAD_PROMPTS: list[tuple[str, Any]] = [
    ("empty string", ""),
    ("empty token list", []),
    ("token id == vocab size", [1, 2, VOCAB_SIZE]),
    ("token id far out of range", [10**9]),
    ("negative token id", [5, -1]),
    ("float token id", [5, 7.0]),
    ("string token id", ["5"]),
    ("bool token id", [True, 3]),
    ("None token id", [None]),
]


@pytest.mark.parametrize(("case", "prompt"), BAD_PROMPTS, ids=[c for c, _ in BAD_PROMPTS])
def test_add_request_rejects_bad_prompts(engine: Engine, reference: RequestOutput, case: str, prompt: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(f"bad-{case}", prompt, SamplingParams(max_tokens=2))
    assert isinstance(info.value, ValueError)
    assert info.value.field == "prompt" and "prompt" in str(info.value)
    assert_still_serves(engine, reference)


def test_add_request_accepts_boundary_token_ids(engine: Engine, reference: RequestOutput) -> None:
    engine.add_request("edge-ids", [0, VOCAB_SIZE - 1, 5], SamplingParams(max_tokens=2, temperature=0.0))
    finals = run_to_completion(engine)
    assert finals["edge-ids"].finish_reason in ("length", "stop")
    assert_still_serves(engine, reference)


def test_prompt_plus_max_tokens_beyond_max_model_len(engine: Engine, reference: RequestOutput) -> None:
    prompt = [100] * 10
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("too-long", prompt, SamplingParams(max_tokens=MAX_MODEL_LEN - 9))   # 65 > 64
    assert info.value.field == "max_tokens"
    assert str(MAX_MODEL_LEN) in str(info.value)
    assert_still_serves(engine, reference)


def test_prompt_alone_fills_max_model_len(engine: Engine, reference: RequestOutput) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("prompt-too-long", [100] * MAX_MODEL_LEN, SamplingParams(max_tokens=None))
    assert info.value.field == "prompt"
    with pytest.raises(InvalidRequestError):
        engine.add_request("prompt-too-long", [100] * (MAX_MODEL_LEN + 10), SamplingParams(max_tokens=1))
    assert_still_serves(engine, reference)


def test_request_that_never_fits_the_kv_cache(engine: Engine, reference: RequestOutput) -> None:
    # 5 + 50 = 55 tokens is within max_model_len (64) but needs 4 blocks of 16; the cache has 3.
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("too-big", [100] * 5, SamplingParams(max_tokens=50))
    assert info.value.field == "max_tokens" and "KV" in str(info.value)
    # max_tokens=None resolves to max_model_len - prompt: the same 64 tokens, also never fits.
    with pytest.raises(InvalidRequestError):
        engine.add_request("too-big-none", [100] * 5, SamplingParams(max_tokens=None))
    assert_still_serves(engine, reference)


def test_request_filling_the_whole_cache_is_accepted(engine: Engine, reference: RequestOutput) -> None:
    capacity = NUM_KV_BLOCKS * BLOCK_SIZE
    prompt = list(range(1000, 1040))
    engine.add_request("fills-cache", prompt, SamplingParams(max_tokens=capacity - len(prompt), ignore_eos=True,
                                                             temperature=0.0))
    finals = run_to_completion(engine)
    assert finals["fills-cache"].finish_reason == "length"
    assert len(finals["fills-cache"].token_ids) == capacity - len(prompt)
    assert_still_serves(engine, reference)


def test_duplicate_request_id_in_flight(engine: Engine, reference: RequestOutput) -> None:
    engine.add_request("dup", NORMAL_PROMPT, NORMAL_PARAMS)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("dup", "another prompt", SamplingParams(max_tokens=2))
    assert info.value.field == "request_id" and "dup" in str(info.value)
    engine.step()                                  # running now: still a duplicate
    with pytest.raises(InvalidRequestError):
        engine.add_request("dup", "another prompt", SamplingParams(max_tokens=2))
    finals = run_to_completion(engine)
    assert finals["dup"].token_ids == reference.token_ids   # the first one was not disturbed
    engine.add_request("dup", NORMAL_PROMPT, NORMAL_PARAMS)  # finished: the id is free again
    assert run_to_completion(engine)["dup"].token_ids == reference.token_ids
    assert_still_serves(engine, reference)


@pytest.mark.parametrize("request_id", ["", None, 7])
def test_bad_request_id(engine: Engine, reference: RequestOutput, request_id: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(request_id, NORMAL_PROMPT, NORMAL_PARAMS)
    assert info.value.field == "request_id"
    assert_still_serves(engine, reference)


def test_out_of_range_seed_is_an_invalid_request(engine: Engine, reference: RequestOutput) -> None:
    """A seed torch cannot take must be refused as a bad request (INVALID_ARG), naming the
    field, not surface as some other exception (INTERNAL) from inside add_request."""
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("huge-seed", NORMAL_PROMPT, SamplingParams.from_dict({"max_tokens": 2, "seed": 2**64}))
    assert info.value.field == "seed"
    assert_still_serves(engine, reference)


@pytest.mark.parametrize(("field", "params", "message"), [
    ("logit_bias", {"logit_bias": {str(VOCAB_SIZE): 1.0}}, f"[0, {VOCAB_SIZE})"),
    ("bad_words", {"bad_words": ["   "]}, "tokenizes to no tokens"),
    # 65 words of two spellings each ("w0" and " w0"): 130 sequences, over vLLM's 128.
    ("bad_words", {"bad_words": [f"w{i}" for i in range(65)]}, "130 token sequences"),
    ("bad_words", {"bad_words": ["the " * 1100]}, "tokens in all"),
])
def test_vocabulary_dependent_checks_name_the_field(engine: Engine, reference: RequestOutput, field: str,
                                                    params: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad-vocab", NORMAL_PROMPT, SamplingParams.from_dict({"max_tokens": 2, **params}))
    assert info.value.field == field and str(info.value).startswith(f"{field}: ") and message in str(info.value)
    assert_still_serves(engine, reference)


def test_bad_words_are_tokenized_once_per_request(engine: Engine, monkeypatch) -> None:
    """The first validation (the serving layer's, on the caller's thread) keeps the token
    sequences on the parameters; the engine's, and the n > 1 children's copies, reuse them."""
    from backend.engine import validation
    from backend.engine.parallel_sampling import child_params

    calls = []
    tokenize = validation.tokenize_bad_words
    monkeypatch.setattr(validation, "tokenize_bad_words", lambda *args: calls.append(args) or tokenize(*args))
    params = SamplingParams(max_tokens=2, bad_words=["Paris"], n=2)
    assert engine.validator.validate(NORMAL_PROMPT, params).bad_words is not None
    children = [child_params(params, i) for i in range(2)]
    for i, child in enumerate(children):
        engine.add_request(f"child-{i}", NORMAL_PROMPT, child)
    run_to_completion(engine)
    assert len(calls) == 1
    # A copy whose words were changed is tokenized again.
    engine.validator.validate(NORMAL_PROMPT, dataclasses.replace(children[0], bad_words=["London"]))
    assert len(calls) == 2


def test_queue_full(engine: Engine, reference: RequestOutput) -> None:
    for i in range(MAX_WAITING):
        engine.add_request(f"q{i}", NORMAL_PROMPT, NORMAL_PARAMS)
    assert engine.stats().num_waiting == MAX_WAITING
    with pytest.raises(QueueFullError) as info:
        engine.add_request("q-extra", NORMAL_PROMPT, NORMAL_PARAMS)
    assert not isinstance(info.value, InvalidRequestError)
    assert not isinstance(info.value, ValueError)
    assert "q-extra" not in engine.requests
    engine.check_invariants()
    # Validation comes first: an invalid request is still reported as invalid.
    with pytest.raises(InvalidRequestError):
        engine.add_request("q-bad", "", NORMAL_PARAMS)
    finals = run_to_completion(engine)             # 4 requests through 3 blocks
    assert sorted(finals) == [f"q{i}" for i in range(MAX_WAITING)]
    for output in finals.values():
        assert output.token_ids == reference.token_ids
    # Once the queue drained, the refused id is accepted.
    engine.add_request("q-extra", NORMAL_PROMPT, NORMAL_PARAMS)
    assert run_to_completion(engine)["q-extra"].token_ids == reference.token_ids
    assert_still_serves(engine, reference)


def test_queue_full_counts_only_waiting_requests(engine: Engine, reference: RequestOutput) -> None:
    for i in range(MAX_WAITING):
        engine.add_request(f"w{i}", NORMAL_PROMPT, NORMAL_PARAMS)
    engine.step()                                  # some are admitted: room in the queue again
    assert engine.stats().num_waiting < MAX_WAITING
    engine.add_request("w-late", NORMAL_PROMPT, NORMAL_PARAMS)
    finals = run_to_completion(engine)
    assert len(finals) == MAX_WAITING + 1
    assert all(o.token_ids == reference.token_ids for o in finals.values())
    assert_still_serves(engine, reference)


# ---- abort ----------------------------------------------------------------------------------

def test_abort_waiting_and_running(engine: Engine, reference: RequestOutput) -> None:
    long_params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("run", NORMAL_PROMPT, long_params)
    engine.step()
    engine.step()
    engine.add_request("wait", "Another prompt entirely", long_params)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.kv_blocks_free < stats.kv_blocks_total

    assert engine.abort("wait") is True
    assert engine.abort("wait") is False           # already gone
    engine.check_invariants()
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["wait"].finish_reason == "abort"
    assert outputs["wait"].finished and outputs["wait"].token_ids == []
    assert outputs["run"].finish_reason is None    # the other request kept going

    assert engine.abort("run") is True
    engine.check_invariants()
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert engine.has_unfinished_requests()        # the abort output is still to be reported
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("run", "abort")]
    assert outputs[0].token_ids == reference.token_ids[:3]   # three steps ran, greedy prefix
    assert engine.step() == []
    assert_still_serves(engine, reference)


def test_abort_unknown_and_finished_ids(engine: Engine, reference: RequestOutput) -> None:
    assert engine.abort("never-submitted") is False
    finished = engine.generate([NORMAL_PROMPT], NORMAL_PARAMS)[0]
    assert engine.abort(finished.request_id) is False
    assert engine.step() == []
    assert_still_serves(engine, reference)


def test_abort_everything_under_memory_pressure(engine: Engine, reference: RequestOutput) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(MAX_WAITING):
        engine.add_request(f"p{i}", [100 + i] * 12, params)
    for _ in range(6):
        engine.step()
        engine.check_invariants()
    ids = [f"p{i}" for i in range(MAX_WAITING)]
    assert all(engine.abort(i) for i in ids)
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == ids
    assert all(o.finish_reason == "abort" for o in outputs)
    assert_still_serves(engine, reference)
