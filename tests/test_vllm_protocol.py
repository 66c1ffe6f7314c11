"""The vLLM backend's request and response conventions (server/stub/vllm_protocol.py), without a
server: string numbers, request parameters under the tensor, the streaming flag rule, and
the response payloads. tests/test_vllm_backend_clients.py runs that backend's own clients
against the real server."""

from __future__ import annotations

import json

import pytest

from backend.errors import InvalidRequestError
from backend.outputs import Logprob
from server.stub.vllm_protocol import (NOT_FINISHED, NULL_LOGPROBS, STREAM_WITH_INPUT_MESSAGE, check_stream_flags,
                                  coerce_value, finish_reason_text, logprobs_json, sampling_params)


def test_the_sample_clients_string_numbers_are_converted() -> None:
    params = sampling_params(json.dumps({"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}))
    assert (params.temperature, params.top_p, params.max_tokens) == (pytest.approx(0.1), pytest.approx(0.95), 100)


@pytest.mark.parametrize("kind, raw, expected", [
    (int, " 42 ", 42), (int, "-1", -1), (int, 7.0, 7), (int, "1.5", "1.5"), (int, "abc", "abc"), (int, 2.5, 2.5),
    (float, "1e-3", 0.001), (float, "0", 0.0), (float, "nan", "nan"), (float, "x", "x"),
    (bool, "false", False), (bool, "True", True), (bool, "0", False), (bool, "maybe", "maybe"), (bool, 1, 1),
])
def test_coercion_by_field_type(kind: type, raw, expected) -> None:
    assert coerce_value(kind, raw) == expected


@pytest.mark.parametrize("values, field", [
    ({"max_tokens": "many"}, "max_tokens"), ({"max_tokens": "1.5"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"), ({"ignore_eos": "perhaps"}, "ignore_eos"),
    ({"seed": "nan"}, "seed"),
])
def test_a_non_numeric_string_stays_a_clear_invalid_arg(values: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        sampling_params(json.dumps(values))
    assert error.value.field == field and repr(next(iter(values.values()))) in str(error.value)


def test_request_parameters_count_and_the_tensor_wins() -> None:
    params = sampling_params(json.dumps({"temperature": 0}), json.dumps({"temperature": 1.0, "max_tokens": 40}))
    assert params.temperature == 0.0 and params.max_tokens == 40
    # LiteLLM's triton/ provider: no tensor, parameters only.
    assert sampling_params(None, json.dumps({"max_tokens": 7})).max_tokens == 7
    # Triton's own request parameters are not sampling parameters.
    assert sampling_params(None, json.dumps({"timeout": 5, "max_tokens": 3})).max_tokens == 3


def test_logit_bias_bad_words_and_include_stop_str_in_output_as_json_sends_them() -> None:
    params = sampling_params(json.dumps({"logit_bias": {"50": 5, "7": -100.5}, "bad_words": ["cat", "dog"],
                                         "include_stop_str_in_output": "true"}))
    assert params.logit_bias == {50: 5.0, 7: -100.0} and params.bad_words == ["cat", "dog"]
    assert params.include_stop_str_in_output is True
    assert sampling_params(None, json.dumps({"include_stop_str_in_output": "false"})).include_stop_str_in_output is False
    # JSON's non-standard NaN / Infinity literals, which json.loads takes, are not biases.
    with pytest.raises(InvalidRequestError, match="^logit_bias: "):
        sampling_params('{"logit_bias": {"5": NaN}}')


def test_max_completion_tokens_is_openais_name_for_max_tokens() -> None:
    # LiteLLM passes it through next to its own default max_tokens of 2000.
    assert sampling_params(None, json.dumps({"max_tokens": 2000, "max_completion_tokens": 9})).max_tokens == 9
    assert sampling_params(json.dumps({"max_completion_tokens": "4"})).max_tokens == 4


def test_unknown_request_parameters_are_named() -> None:
    with pytest.raises(InvalidRequestError, match="temprature"):
        sampling_params(None, json.dumps({"temprature": 0}))


def test_streaming_with_the_prompt_echoed_is_refused_with_the_backends_message() -> None:
    check_stream_flags(stream=True, exclude_input_in_output=None)
    check_stream_flags(stream=True, exclude_input_in_output=True)
    check_stream_flags(stream=False, exclude_input_in_output=False)
    with pytest.raises(InvalidRequestError) as error:
        check_stream_flags(stream=True, exclude_input_in_output=False)
    assert str(error.value) == STREAM_WITH_INPUT_MESSAGE


def test_response_payloads() -> None:
    assert finish_reason_text(None) == NOT_FINISHED == "None"
    assert finish_reason_text("length") == "length"
    assert logprobs_json(None) == NULL_LOGPROBS == "null"
    payload = json.loads(logprobs_json([{5: Logprob(-0.25, 1, " the"), 9: Logprob(-2.0, 2, " a")}]))
    assert payload == [{"5": {"logprob": -0.25, "rank": 1, "decoded_token": " the"},
                        "9": {"logprob": -2.0, "rank": 2, "decoded_token": " a"}}]


@pytest.mark.parametrize("key", ["stop", "max_tokens", "seed", "n", "temperature", "allowed_token_ids", "logit_bias",
                                 "bad_words"])
def test_deeply_nested_values_are_refused_not_internal_errors(key: str) -> None:
    # Near the recursion limit, json.loads still decodes the value but a full repr of it in the
    # error message did not: RecursionError, an INTERNAL error for a bad request (the fault
    # suite found it on a seed of its own). Every depth must give INVALID_ARG.
    import sys

    from backend.errors import show

    limit = sys.getrecursionlimit()
    for depth in range(limit - 80, limit + 5):
        with pytest.raises(InvalidRequestError):
            sampling_params('{"%s": ' % key + "[" * depth + "]" * depth + "}")
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    assert show(nested) == "[[[[...]]]]"
