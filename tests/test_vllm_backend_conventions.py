"""Triton's vLLM backend's request and response conventions through the real server, as that
backend's own clients use them: its sample client's request (numbers as strings, the same
values as tensor and as request parameters), its additional-outputs checks (on a
representative part of its grid), the streaming-with-prompt refusal, and sampling
parameters sent as Triton request parameters only (LiteLLM's triton/ provider, the vLLM
backend README's curl). docs/vllm_backend_compat.md runs the backend's own files unchanged."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from server.stub.vllm_protocol import STREAM_WITH_INPUT_MESSAGE
from tests.grpc_requests import stream_request, vllm_inputs

pytestmark = pytest.mark.server
# Greedy SmolLM2 runs the default 16 tokens on this prompt (on "In this example," it stops at 14:
# that backend's test expects "length", which holds for OPT-125m only).
PROMPT = "In this example, we will"
FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
         "return_num_output_tokens")


def text(result) -> str:
    return result.as_numpy("text_output")[0].decode()


# ---- the sample client (samples/client.py) ------------------------------------------------------
SAMPLE_CLIENT_SAMPLING = {"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}


@pytest.mark.parametrize("stream, exclude", [(False, False), (False, True), (True, True)])
def test_the_sample_clients_requests_succeed(server, stream: bool, exclude: bool) -> None:
    inputs = vllm_inputs("The capital of France is", stream, SAMPLE_CLIENT_SAMPLING, exclude_input_in_output=exclude)
    responses = stream_request(server, inputs, parameters=SAMPLE_CLIENT_SAMPLING)
    assert all(error is None for _, error in responses), responses[0][1]
    output = "".join(text(result) for result, _ in responses)
    assert output.startswith("The capital of France is") != exclude
    assert len(output) > 30


def test_streaming_with_the_prompt_is_refused_with_the_backends_message(server) -> None:
    responses = stream_request(server, vllm_inputs(PROMPT, True, {"max_tokens": 4}, exclude_input_in_output=False))
    assert len(responses) == 1 and responses[0][1] is not None
    assert responses[0][1].message() == STREAM_WITH_INPUT_MESSAGE


# ---- additional outputs (ci/L0_additional_outputs_vllm) -------------------------------------------
def check_additional_outputs(responses: list[tuple], stream: bool, sampling: dict, flags: dict) -> None:
    """That test's assertions, restated."""
    assert all(error is None for _, error in responses)
    assert "".join(text(r) for r, _ in responses).count(" ") > 4
    previous_cumulative = 0.0
    for i, (result, _) in enumerate(responses):
        last = i == len(responses) - 1
        finish = result.as_numpy("finish_reason")
        if flags.get("return_finish_reason"):
            assert finish[0].decode() == ("length" if last else "None")
        else:
            assert finish is None
        cumulative = result.as_numpy("cumulative_logprob")
        if flags.get("return_cumulative_logprob"):
            assert cumulative[0] != previous_cumulative and np.isfinite(cumulative[0])
            assert cumulative[0] < previous_cumulative      # logprobs are negative: the sum falls
            previous_cumulative = cumulative[0]
        else:
            assert cumulative is None
        num_output = result.as_numpy("num_output_tokens")
        if flags.get("return_num_output_tokens"):
            assert num_output[0] > 0
        else:
            assert num_output is None
        num_input = result.as_numpy("num_input_tokens")
        if flags.get("return_num_input_tokens"):
            assert 0 < num_input[0] <= len(PROMPT)
        else:
            assert num_input is None
        logprobs = result.as_numpy("logprobs")
        if not flags.get("return_logprobs"):
            assert logprobs is None
            continue
        positions = json.loads(logprobs[0].decode())
        if "logprobs" not in sampling:
            assert positions is None
            continue
        assert isinstance(positions, list) and positions
        if flags.get("return_num_output_tokens"):
            assert len(positions) == num_output[0]
        rank_one_text = ""
        for position in positions:
            assert 1 <= len(position) <= sampling["logprobs"] + 1
            ranks = [entry["rank"] for entry in position.values()]
            assert ranks.count(1) == 1
            for token_id, entry in position.items():
                assert token_id.isdigit() and set(entry) == {"logprob", "rank", "decoded_token"}
                assert isinstance(entry["logprob"], float) and isinstance(entry["rank"], int)
                if entry["rank"] == 1:
                    rank_one_text += entry["decoded_token"]
        assert (rank_one_text if stream else PROMPT + rank_one_text) == text(result)


GRID = [(stream, logprobs, value) for stream in (True, False) for logprobs in (None, 0, 2) for value in (True, None)]


@pytest.mark.parametrize("stream, logprobs, flag_value", GRID)
def test_additional_outputs_as_the_backends_ci_checks_them(server, stream: bool, logprobs: int | None,
                                                           flag_value: bool | None) -> None:
    sampling = {"temperature": "0", "top_p": "1", **({} if logprobs is None else {"logprobs": logprobs})}
    flags = dict.fromkeys(FLAGS, flag_value)
    responses = stream_request(server, vllm_inputs(PROMPT, stream, sampling, **flags), parameters=sampling)
    if stream:
        assert len(responses) > 1
    check_additional_outputs(responses, stream, sampling, flags)


def test_each_flag_alone_and_false_flags(server) -> None:
    sampling = {"temperature": "0", "top_p": "1", "logprobs": 2}
    for flag in FLAGS:
        for value in (True, False):
            flags = {flag: value}
            check_additional_outputs(stream_request(server, vllm_inputs(PROMPT, True, sampling, **flags)), True, sampling, flags)


# ---- sampling parameters as Triton request parameters -------------------------------------------
def http_generate(server, body: dict) -> dict:
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=json.dumps(body).encode())
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


@pytest.mark.parametrize("max_tokens", [3, 40])
def test_litellm_body_gets_exactly_its_max_tokens(server, max_tokens: int) -> None:
    # LiteLLM's triton/ provider: text_input, parameters, stream; no tensor.
    reply = http_generate(server, {"text_input": "Tell me a long story about a dragon.",
                                   "parameters": {"max_tokens": max_tokens, "ignore_eos": True},
                                   "stream": False, "return_num_output_tokens": True})
    assert reply["num_output_tokens"] == max_tokens


def test_readme_curl_with_temperature_0_in_parameters_is_deterministic(server) -> None:
    body = {"text_input": "What is Triton Inference Server?", "parameters": {"stream": False, "temperature": 0}}
    assert len({http_generate(server, body)["text_output"] for _ in range(3)}) == 1


def test_grpc_request_parameters_and_the_tensor_wins(server) -> None:
    flags = {"return_num_output_tokens": True}
    only_parameters = stream_request(server, vllm_inputs(PROMPT, False, None, **flags), {"max_tokens": 5, "ignore_eos": True})
    assert only_parameters[0][0].as_numpy("num_output_tokens")[0] == 5
    both = stream_request(server, vllm_inputs(PROMPT, False, {"max_tokens": 7, "ignore_eos": True}, **flags), {"max_tokens": 5})
    assert both[0][0].as_numpy("num_output_tokens")[0] == 7


def test_an_unknown_request_parameter_is_named(server) -> None:
    responses = stream_request(server, vllm_inputs(PROMPT, False, None), {"max_tokenz": 5})
    assert responses[0][1] is not None and "max_tokenz" in responses[0][1].message()
