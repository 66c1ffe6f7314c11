"""prompt_logprobs through the real tritonserver (float32): the ``prompt_logprobs`` output, once
per request (streamed or not), equal to transformers' log_softmax of the prompt within 1e-4 at
every position, after a prefix-cache hit and over a prompt prefilled in chunks; out-of-range
values are INVALID_ARG naming the field."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from server.launch import TritonServer
from tests.grpc_requests import stream_request, tensor, vllm_inputs

pytestmark = pytest.mark.server

PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention stores keys"


@pytest.mark.parametrize("stream", [True, False])
def test_prompt_logprobs_output(server: TritonServer, hf_model, tokenizer, stream: bool) -> None:
    sampling = {"max_tokens": 6, "temperature": 0, "prompt_logprobs": 2}
    responses = stream_request(server, vllm_inputs(PROMPT, stream, sampling))
    assert all(error is None for _, error in responses), responses
    sent = [r.as_numpy("prompt_logprobs") for r, _ in responses if r.as_numpy("prompt_logprobs") is not None]
    assert len(sent) == 1, "once per request"
    positions = json.loads(sent[0][0])
    ids = tokenizer(PROMPT).input_ids
    assert len(positions) == len(ids) and positions[0] is None
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for i in range(1, len(ids)):
        entry = positions[i][str(ids[i])]
        assert abs(entry["logprob"] - expected[i - 1, ids[i]].item()) < 1e-4, i
        assert entry["decoded_token"] == tokenizer.decode([ids[i]])
        assert 2 <= len(positions[i]) <= 3   # the top 2, and the prompt token when not among them


def test_out_of_range_is_invalid_arg(server: TritonServer) -> None:
    """INVALID_ARG (HTTP 400) naming the field; the gRPC stream gets the same message."""
    responses = stream_request(server, vllm_inputs(PROMPT, True, {"max_tokens": 2, "prompt_logprobs": 21}))
    errors = [error for _, error in responses if error is not None]
    assert len(errors) == 1 and "prompt_logprobs" in str(errors[0])
    body = {"text_input": PROMPT, "sampling_parameters": json.dumps({"max_tokens": 2, "prompt_logprobs": -1})}
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=json.dumps(body).encode())
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 400 and "prompt_logprobs" in json.loads(info.value.read())["error"]


def test_after_a_prefix_cache_hit_every_position_is_computed(server: TritonServer, tokenizer) -> None:
    """The prompt's blocks are cached by a first request; the one asking for prompt logprobs reads
    none of them (num_cached_tokens 0) and gets every position, equal to a cold computation."""
    prompt = PROMPT + " and values in blocks of sixteen tokens, shared between requests by hash."
    flags = {"return_num_cached_tokens": True}
    cold = stream_request(server, vllm_inputs(prompt, False, {"max_tokens": 2, "prompt_logprobs": 1}, **flags))
    warm = stream_request(server, vllm_inputs(prompt, False, {"max_tokens": 2}, **flags))
    assert int(warm[-1][0].as_numpy("num_cached_tokens")[0]) > 0, "the cache did not hold the prompt"
    hit = stream_request(server, vllm_inputs(prompt, False, {"max_tokens": 2, "prompt_logprobs": 1}, **flags))
    assert int(hit[-1][0].as_numpy("num_cached_tokens")[0]) == 0

    def positions(responses) -> list:
        return json.loads(next(r.as_numpy("prompt_logprobs")[0] for r, _ in responses
                               if r.as_numpy("prompt_logprobs") is not None))

    first, again = positions(cold), positions(hit)
    assert len(again) == len(tokenizer(prompt).input_ids) and again[0] is None
    for a, b in zip(first[1:], again[1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[t]["logprob"] - b[t]["logprob"]) < 1e-4 for t in a)


def test_a_prompt_prefilled_in_chunks(server: TritonServer, hf_model, prose_ids: list[int]) -> None:
    """A prompt longer than the step's token budget (512 by default) is prefilled in chunks; every
    position still gets its logprob, equal to transformers' within 1e-4."""
    ids = prose_ids[:700]
    inputs = [tensor("input_ids", np.array(ids, dtype=np.int32), "INT32"),
              tensor("stream", np.array([False]), "BOOL"),
              tensor("sampling_parameters", np.array([json.dumps({"max_tokens": 1, "prompt_logprobs": 0}).encode()],
                                                     dtype=np.object_), "BYTES")]
    responses = stream_request(server, inputs)
    assert all(error is None for _, error in responses), responses
    positions = json.loads(next(r.as_numpy("prompt_logprobs")[0] for r, _ in responses
                                if r.as_numpy("prompt_logprobs") is not None))
    assert len(positions) == len(ids) and positions[0] is None
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    worst = max(abs(positions[i][str(ids[i])]["logprob"] - expected[i - 1, ids[i]].item()) for i in range(1, len(ids)))
    assert worst < 1e-4, worst
