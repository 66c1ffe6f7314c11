"""Integration tests against the real tritonserver (started once per test session) with the
decoupled llm model: streaming over gRPC and HTTP, concurrency, cancellation, errors,
admission control and metrics."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backend import Engine, EngineConfig, SamplingParams
from client import NO_RETRY, LLMClient, LLMError, StreamChunk, http_generate_stream
from client.llm_client import build_inputs
from loadtest.server_metrics import scrape
from server.launch import TritonServer, free_ports
from tests.conftest import FIXED_BUDGET_PARAMS
from tests.grpc_requests import tensor

pytestmark = pytest.mark.server


@pytest.fixture(scope="session")
def engine(model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), num_kv_blocks=512))


@pytest.fixture(scope="session")
def client(server: TritonServer) -> LLMClient:
    return LLMClient(server.grpc_url)


def metrics(server: TritonServer) -> dict[str, float]:
    """{'name{labels}': value} for our families."""
    return scrape(server.metrics_url)


def metric(server: TritonServer, name: str, **labels: str) -> float:
    for key, value in metrics(server).items():
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return value
    raise KeyError(name)


def kv_used(server: TritonServer) -> float:
    return metric(server, "llm_kv_blocks_used")


def wait_for(predicate, timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes. A metric series not exported yet
    (``metric`` raises KeyError: a labelled series appears with its first count, at the next
    publish) counts as not holding yet, until the last try."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except KeyError:
            pass
        time.sleep(0.05)
    return predicate()


GREEDY = dict(temperature=0.0)


def test_grpc_and_http_streams_match_the_engine(client: LLMClient, server: TritonServer, engine: Engine) -> None:
    prompt = "Why is static batching slow? Explain in detail."
    expected = engine.generate([prompt], SamplingParams(max_tokens=40, **GREEDY))[0]
    chunks = list(client.stream(prompt, max_tokens=40, **GREEDY))
    assert "".join(c.text for c in chunks) == expected.text
    assert sum(c.num_output_tokens for c in chunks) == len(expected.token_ids)
    assert chunks[-1].final and chunks[-1].finish_reason == expected.finish_reason
    assert chunks[-1].num_input_tokens == expected.num_prompt_tokens
    assert len(chunks) > 5  # really streamed, not one lump
    http_chunks = list(http_generate_stream(prompt, url=server.http_url, max_tokens=40, **GREEDY))
    assert "".join(c.text for c in http_chunks) == expected.text
    assert http_chunks[-1].finish_reason == expected.finish_reason


def test_non_streaming_generate_returns_one_final_response(server: TritonServer, engine: Engine) -> None:
    prompt = "The capital of France is"
    expected = engine.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0]
    body = {"text_input": prompt, "sampling_parameters": json.dumps({"max_tokens": 12, **GREEDY}),
            "return_finish_reason": True, "return_num_output_tokens": True}
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=json.dumps(body).encode())
    reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
    # vLLM-backend convention: without exclude_input_in_output the prompt is echoed.
    assert reply["text_output"] == prompt + expected.text
    assert reply["finish_reason"] == expected.finish_reason
    assert reply["num_output_tokens"] == len(expected.token_ids)


def test_32_concurrent_streams_complete_correctly(client: LLMClient, server: TritonServer, engine: Engine) -> None:
    words = "paged attention keeps the cache in blocks so many requests share memory".split()
    prompts = [" ".join(words[: 2 + i % 11]) + f" (case {i})" * (1 + i % 4) for i in range(32)]
    lengths = [4 + (i * 7) % 29 for i in range(32)]
    expected = engine.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True, **GREEDY) for n in lengths])
    max_running = 0.0
    stop = threading.Event()

    def watch() -> None:
        nonlocal max_running
        while not stop.is_set():
            max_running = max(max_running, metric(server, "llm_num_requests_running"))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    texts: dict[str, str] = {}
    tokens: dict[str, int] = {}
    finals: dict[str, StreamChunk] = {}
    order: list[str] = []
    try:
        events = client.stream_many(prompts, [{"max_tokens": n, "ignore_eos": True, **GREEDY} for n in lengths],
                                    request_ids=[f"many-{i}" for i in range(32)])
        for event in events:
            assert not isinstance(event, tuple), f"request failed: {event}"
            if event.request_id not in texts:
                order.append(event.request_id)
            texts[event.request_id] = texts.get(event.request_id, "") + event.text
            tokens[event.request_id] = tokens.get(event.request_id, 0) + event.num_output_tokens
            if event.final:
                finals[event.request_id] = event
    finally:
        stop.set()
        watcher.join()
    assert len(finals) == 32
    for i, exp in enumerate(expected):
        rid = f"many-{i}"
        assert texts[rid] == exp.text, f"request {i}"
        assert tokens[rid] == lengths[i]
        assert finals[rid].finish_reason == "length"
    assert max_running > 1, "requests never ran concurrently"


def test_stream_many_over_one_connection(client: LLMClient) -> None:
    results: dict[str, str] = {}
    finals = 0
    for event in client.stream_many([f"Count to {i}:" for i in range(6)], {"max_tokens": 6, **GREEDY}):
        assert not isinstance(event, tuple), event
        results[event.request_id] = results.get(event.request_id, "") + event.text
        finals += event.final
    assert finals == 6 and len(results) == 6


def test_cancel_ends_with_cancelled_and_frees_blocks(client: LLMClient, server: TritonServer) -> None:
    assert wait_for(lambda: kv_used(server) == 0, 10)
    before = kv_used(server)
    events: list = []
    done = threading.Event()

    def on_response(rid, result, error) -> None:
        events.append((result, error))
        if error is not None or (result is not None and parse_final(result)):
            done.set()

    from client.llm_client import _Connection
    connection = _Connection(server.grpc_url, on_response)
    connection.send("llm", "to-cancel", build_inputs("Tell me a very long story about a dragon.",
                                                      {"max_tokens": 400, "ignore_eos": True, **GREEDY}))
    assert wait_for(lambda: len(events) >= 3, 60), "no tokens streamed"
    assert kv_used(server) > before or wait_for(lambda: kv_used(server) > before, 1)
    connection.close(cancel=True)
    cancelled_at = time.monotonic()
    assert wait_for(lambda: kv_used(server) == before, 1.5), "KV blocks not freed within a second of cancelling"
    assert time.monotonic() - cancelled_at < 1.5
    assert len(events) < 400
    # The server records the request as cancelled, not finished normally.
    assert wait_for(lambda: metric(server, "llm_request_finished_total", finish_reason="cancelled") >= 1, 2)


def parse_final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def test_cancel_over_client_stream_object_reports_cancelled(client: LLMClient, server: TritonServer) -> None:
    stream = client.stream("Write an endless poem about the sea.", max_tokens=400, ignore_eos=True, **GREEDY)
    received = 0
    for chunk in stream:
        received += 1
        if received == 3:
            break   # leaving the loop cancels the request
    assert wait_for(lambda: kv_used(server) == 0, 1.5)


def raw_request(server: TritonServer, inputs: list[grpcclient.InferInput], timeout: float = 60) -> tuple[list, list]:
    """Send one request on its own stream; return (results, errors) until final or error."""
    results, errors = [], []
    done = threading.Event()

    def callback(result, error) -> None:
        if error is not None:
            errors.append(error)
            done.set()
        else:
            results.append(result)
            if parse_final(result):
                done.set()

    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=callback)
    try:
        c.async_stream_infer("llm", inputs, request_id="raw", enable_empty_final_response=True)
        assert done.wait(timeout), "no final response or error"
    finally:
        c.stop_stream()
        c.close()
    return results, errors


def text_input(raw: bytes) -> grpcclient.InferInput:
    return tensor("text_input", np.array([raw], dtype=np.object_), "BYTES")


def params_input(raw: str | bytes) -> grpcclient.InferInput:
    raw = raw.encode() if isinstance(raw, str) else raw
    return tensor("sampling_parameters", np.array([raw], dtype=np.object_), "BYTES")


BAD_REQUESTS = {
    "empty prompt": ([text_input(b""), params_input('{"max_tokens": 4}')], "prompt"),
    "prompt too long": ([text_input(("word " * 9000).encode()), params_input('{"max_tokens": 4}')], "max_tokens"),
    "malformed JSON": ([text_input(b"Hello"), params_input('{"max_tokens": 4,')], "sampling_parameters"),
    "unknown sampling key": ([text_input(b"Hello"), params_input('{"max_tokenz": 4}')], "max_tokenz"),
    "max_tokens 0": ([text_input(b"Hello"), params_input('{"max_tokens": 0}')], "max_tokens"),
    "max_tokens negative": ([text_input(b"Hello"), params_input('{"max_tokens": -5}')], "max_tokens"),
    "temperature below 0": ([text_input(b"Hello"), params_input('{"temperature": -0.5}')], "temperature"),
    "top_p 0": ([text_input(b"Hello"), params_input('{"top_p": 0}')], "top_p"),
    "top_p above 1": ([text_input(b"Hello"), params_input('{"top_p": 1.5}')], "top_p"),
    "invalid UTF-8": ([text_input(b"caf\xc3\x28 \xff"), params_input('{"max_tokens": 4}')], "UTF-8"),
    "wrong JSON value type": ([text_input(b"Hello"), params_input('{"max_tokens": "ten"}')], "max_tokens"),
    "wrong tensor type": ([tensor("text_input", np.array([1], dtype=np.int32), "INT32")], "text_input"),
    "no prompt at all": ([params_input('{"max_tokens": 4}')], "text_input"),
    "logit_bias id beyond the vocabulary": ([text_input(b"Hello"), params_input('{"logit_bias": {"49152": 5}}')],
                                            "logit_bias"),
    "logit_bias not a number": ([text_input(b"Hello"), params_input('{"logit_bias": {"5": "up"}}')], "logit_bias"),
    "bad_words that tokenize to nothing": ([text_input(b"Hello"), params_input('{"bad_words": ["  "]}')],
                                           "bad_words"),
    "include_stop_str_in_output not a boolean": (
        [text_input(b"Hello"), params_input('{"include_stop_str_in_output": "sometimes"}')],
        "include_stop_str_in_output"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_a_clear_error_and_others_keep_streaming(case: str, client: LLMClient,
                                                                  server: TritonServer, engine: Engine) -> None:
    inputs, field = BAD_REQUESTS[case]
    expected = engine.generate(["Once upon a time"], SamplingParams(max_tokens=24, **GREEDY))[0].text
    healthy: dict[str, object] = {}

    def run_healthy() -> None:
        try:
            healthy["text"] = "".join(c.text for c in client.stream("Once upon a time", max_tokens=24, **GREEDY))
        except Exception as exc:  # noqa: BLE001
            healthy["error"] = exc

    thread = threading.Thread(target=run_healthy)
    thread.start()
    time.sleep(0.2)
    results, errors = raw_request(server, inputs)
    thread.join(120)
    assert not results and len(errors) == 1, f"{case}: expected one error, got {results} {errors}"
    message = str(errors[0])
    assert field in message, f"{case}: error {message!r} does not name {field!r}"
    assert healthy.get("text") == expected, f"parallel stream disturbed by {case}: {healthy}"


def openai_frontend_inputs(prompt: str, stream: bool, sampling: dict) -> list[grpcclient.InferInput]:
    """Exactly the tensors Triton's OpenAI frontend (python/openai, ``--backend vllm``) builds
    for a completion: names, dtypes, shapes, and a JSON with the keys it always sends."""
    return [text_input(prompt.encode()), tensor("stream", np.array([stream]), "BOOL"),
            tensor("exclude_input_in_output", np.array([True]), "BOOL"), params_input(json.dumps(sampling)),
            tensor("return_num_input_tokens", np.array([True]), "BOOL"),
            tensor("return_num_output_tokens", np.array([True]), "BOOL")]


# What the frontend's request models dump with exclude_none (chat completions omit best_of).
OPENAI_FRONTEND_SAMPLING = {"best_of": 1, "frequency_penalty": 0.0, "ignore_eos": False, "n": 1,
                            "presence_penalty": 0.0, "temperature": 0.0, "top_p": 1.0, "max_tokens": 12}


@pytest.mark.parametrize("stream", [True, False])
def test_openai_frontend_request_is_served(stream: bool, server: TritonServer, engine: Engine) -> None:
    prompt = "The capital of France is"
    expected = engine.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0]
    results, errors = raw_request(server, openai_frontend_inputs(prompt, stream, OPENAI_FRONTEND_SAMPLING))
    assert not errors, errors
    texts = [r.as_numpy("text_output") for r in results if r.as_numpy("text_output") is not None]
    assert b"".join(t[0] for t in texts).decode() == expected.text
    # The frontend reads both counts as UINT32 from every response and sums the output counts.
    outputs = [r.as_numpy("num_output_tokens") for r in results if r.as_numpy("num_output_tokens") is not None]
    inputs = [r.as_numpy("num_input_tokens") for r in results if r.as_numpy("num_input_tokens") is not None]
    assert all(o.dtype == np.uint32 for o in outputs + inputs)
    assert sum(int(o[0]) for o in outputs) == len(expected.token_ids)
    assert {int(i[0]) for i in inputs} == {expected.num_prompt_tokens}
    if not stream:   # one response with the whole text (the frontend accepts at most 2, the last final)
        assert len(texts) == 1 and len(results) <= 2


def test_openai_frontend_n_is_served_and_out_of_range_n_is_invalid_arg(server: TritonServer) -> None:
    results, errors = raw_request(server, openai_frontend_inputs("Hello", False, {**OPENAI_FRONTEND_SAMPLING, "n": 2}))
    assert not errors and results[-1].as_numpy("text_output").shape == (2,)
    results, errors = raw_request(server, openai_frontend_inputs("Hello", True, {**OPENAI_FRONTEND_SAMPLING, "n": 65}))
    assert not results and len(errors) == 1
    assert "n: must be an integer in [1, 64]" in str(errors[0])
    # Over HTTP the same request gets the code as a status: INVALID_ARG is 400.
    body = {"text_input": "Hello", "stream": False, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({**OPENAI_FRONTEND_SAMPLING, "n": 65}),
            "return_num_input_tokens": True, "return_num_output_tokens": True}
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=json.dumps(body).encode())
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 400 and "n: must be an integer in [1, 64]" in json.loads(info.value.read())["error"]


def test_logit_bias_bad_words_and_include_stop_str_are_served(client: LLMClient, server: TritonServer,
                                                               engine: Engine) -> None:
    """Each changes the greedy text as the engine's own run with it (the server drafts: the
    same text), and a bad value is INVALID_ARG naming it."""
    france, new_york = "The capital of France is", "New York is a city in"
    paris = engine.tokenizer.encode(" Paris", add_special_tokens=False)[0]
    cases = [(france, {"logit_bias": {paris: -100}}), (new_york, {"bad_words": ["New York"]}),
             (france, {"stop": ["answer"], "include_stop_str_in_output": True}),
             (france, {"stop": ["answer"], "include_stop_str_in_output": False})]
    texts = []
    for prompt, extra in cases:
        sampling = {"max_tokens": 12, **GREEDY, **extra}
        expected = engine.generate([prompt], SamplingParams.from_dict(json.loads(json.dumps(sampling))))[0]
        served = client.generate(prompt, **sampling)
        assert (served.text, served.finish_reason) == (expected.text, expected.finish_reason), extra
        texts.append(served.text)
    plain = {prompt: engine.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0].text
             for prompt in (france, new_york)}
    assert plain[france].startswith(" Paris") and not texts[0].startswith(" Paris")
    assert "New York" in plain[new_york] and "New York" not in texts[1]
    assert texts[2] == texts[3] + "answer" and texts[3].endswith("The ")
    # Over HTTP the code is the status: INVALID_ARG is 400 (a stream's error carries no code).
    body = {"text_input": "Hi", "sampling_parameters": json.dumps({"logit_bias": {"5": "up"}})}
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=json.dumps(body).encode())
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 400 and json.loads(info.value.read())["error"].startswith("logit_bias: ")


def test_error_codes_are_invalid_arg(server: TritonServer) -> None:
    """The HTTP status carries the Triton code: INVALID_ARG is 400."""
    body = {"text_input": "Hi", "sampling_parameters": json.dumps({"max_tokens": -1})}
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=json.dumps(body).encode())
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 400
    assert "max_tokens" in json.loads(info.value.read())["error"]


def test_metrics_families_after_traffic(server: TritonServer, client: LLMClient) -> None:
    before = metrics(server)
    completion = client.generate("Metrics are how operators see the engine.", max_tokens=10, ignore_eos=True, **GREEDY)
    assert completion.num_output_tokens == 10
    assert wait_for(lambda: metric(server, "llm_generation_tokens_total") >=
                    before.get('llm_generation_tokens_total{model="llm",version="1"}', 0) + 10, 2)
    after = metrics(server)
    names = {key.split("{")[0] for key in after}
    for family in ("llm_num_requests_running", "llm_num_requests_waiting", "llm_kv_blocks_used", "llm_kv_blocks_free",
                   "llm_kv_blocks_total", "llm_kv_cache_usage_ratio", "llm_prefix_cache_queried_tokens_total",
                   "llm_prefix_cache_hit_tokens_total", "llm_num_preemptions_total", "llm_prompt_tokens_total",
                   "llm_generation_tokens_total", "llm_time_to_first_token_seconds_count",
                   "llm_inter_token_latency_seconds_count", "llm_e2e_request_latency_seconds_count",
                   "nv_trt_llm_kv_cache_block_metrics", "llm_spec_decode_draft_tokens_total",
                   "llm_spec_decode_accepted_tokens_total", "llm_spec_decode_emitted_tokens_total",
                   "llm_spec_decode_acceptance_rate"):
        assert family in names, f"{family} missing from /metrics"
    labels = '{model="llm",version="1"}'
    assert after[f"llm_e2e_request_latency_seconds_count{labels}"] >= before.get(
        f"llm_e2e_request_latency_seconds_count{labels}", 0) + 1
    # Every generated token but the first of each request is one inter-token gap.
    assert after[f"llm_inter_token_latency_seconds_count{labels}"] >= 9
    # The default itl_target_ms sizes chunks by the step cost model: each step's prediction error.
    assert after[f"llm_step_time_prediction_error_ratio_count{labels}"] >= before.get(
        f"llm_step_time_prediction_error_ratio_count{labels}", 0) + 1
    assert after[f"llm_prompt_tokens_total{labels}"] >= completion.num_input_tokens
    total = after[f"llm_kv_blocks_total{labels}"]
    assert after['nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max",model="llm",version="1"}'] == total
    assert after['nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per",model="llm",version="1"}'] == 16
    # The names load-aware routers read for Triton (docs/scaling.md) carry the same values as ours.
    assert after['nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="llm",version="1"}'] == \
        after[f"llm_kv_cache_usage_ratio{labels}"]
    for request_type, ours in (("waiting", "llm_num_requests_waiting"), ("scheduled", "llm_num_requests_running")):
        assert after[f'nv_trt_llm_request_metrics{{model="llm",request_type="{request_type}",version="1"}}'] == \
            after[f"{ours}{labels}"]
    assert wait_for(lambda: kv_used(server) == 0, 2)
    assert after[f"llm_kv_blocks_free{labels}"] + after[f"llm_kv_blocks_used{labels}"] == total


FRESHNESS_BOUND_S = 0.5   # counters and gauges reach /metrics within this of the step that changed them


def test_metrics_are_fresh(server: TritonServer, client: LLMClient) -> None:
    """How it is measured: (1) requests that finished are counted when their final response
    arrives: one scrape right after it, no waiting (the vLLM backend's CI does this); (2)
    mid-stream, from a chunk's arrival at the client (just after the step that made it) until
    a scrape shows its tokens: at most FRESHNESS_BOUND_S; (3) after an HTTP client hangs up,
    once llm_num_requests_running reads 0 no more tokens are counted."""
    labels = '{model="llm",version="1"}'
    length = 'llm_request_finished_total{finish_reason="length",model="llm",version="1"}'
    before = metrics(server)
    finals = [c for c in client.stream_many([f"Question {i}:" for i in range(6)],
                                            {"max_tokens": 16, "ignore_eos": True, **GREEDY})
              if not isinstance(c, tuple) and c.final]
    after = metrics(server)    # at once
    assert len(finals) == 6
    assert after.get(length, 0) - before.get(length, 0) == 6
    assert after[f"llm_generation_tokens_total{labels}"] - before[f"llm_generation_tokens_total{labels}"] == 96
    assert after[f"llm_e2e_request_latency_seconds_count{labels}"] - \
        before[f"llm_e2e_request_latency_seconds_count{labels}"] == 6

    base = metric(server, "llm_generation_tokens_total")
    received, lags = 0, []
    for chunk in client.stream("A long answer:", max_tokens=120, ignore_eos=True, **GREEDY):
        arrived = time.monotonic()
        received += chunk.num_output_tokens
        if len(lags) < 4 and received >= 20 * (len(lags) + 1):
            assert wait_for(lambda: metric(server, "llm_generation_tokens_total") >= base + received, 5)
            lags.append(time.monotonic() - arrived)
            assert metric(server, "llm_num_requests_running") == 1
    assert len(lags) == 4 and max(lags) <= FRESHNESS_BOUND_S, lags

    body = json.dumps({"text_input": "Talk for a long time:", "stream": True,
                       "sampling_parameters": json.dumps({"max_tokens": 2000, "ignore_eos": True})}).encode()
    sock = socket.create_connection(("127.0.0.1", server.http_port))
    sock.sendall(f"POST /v2/models/llm/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    seen = b""
    while seen.count(b"data:") < 5:
        seen += sock.recv(65536)
    # Seen running first: a gauge of 0 read before the request's own step was published
    # would make the check below vacuous.
    assert wait_for(lambda: metric(server, "llm_num_requests_running") == 1, 5)
    sock.close()
    assert wait_for(lambda: metric(server, "llm_num_requests_running") == 0, 5)
    stopped_at = metric(server, "llm_generation_tokens_total")
    time.sleep(1.5)
    assert metric(server, "llm_generation_tokens_total") == stopped_at, "tokens counted after the request ended"


def test_speculative_decoding_shows_in_metrics(server: TritonServer, client: LLMClient, engine: Engine) -> None:
    prompt = "Copy this line: red green blue, red green blue, red green blue, red green blue, red"
    before = metric(server, "llm_spec_decode_accepted_tokens_total")
    completion = client.generate(prompt, max_tokens=24, ignore_eos=True, **GREEDY)
    reference = engine.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0))[0]
    assert completion.text == reference.text
    assert wait_for(lambda: metric(server, "llm_spec_decode_accepted_tokens_total") > before, 2)
    assert 0 < metric(server, "llm_spec_decode_acceptance_rate") <= 1
    assert metric(server, "llm_spec_decode_mean_accepted_length") > 1


def test_prefix_cache_hits_show_in_metrics(server: TritonServer, client: LLMClient) -> None:
    system = "You are a meticulous assistant who answers questions about distributed systems. " * 6
    first = client.generate(system + "What is a lease?", max_tokens=4, **GREEDY)
    hits_before = metric(server, "llm_prefix_cache_hit_tokens_total")
    second = client.generate(system + "What is a quorum?", max_tokens=4, **GREEDY)
    assert second.num_cached_tokens >= 64 and first.num_input_tokens > 64
    assert wait_for(lambda: metric(server, "llm_prefix_cache_hit_tokens_total") >= hits_before + second.num_cached_tokens, 2)


def test_queue_full_is_unavailable_at_once(model_dir: Path, tmp_path: Path) -> None:
    with TritonServer(*free_ports(3), params={"max_num_seqs": "1", "max_waiting_requests": "1", **FIXED_BUDGET_PARAMS},
                      log_file=tmp_path / "server.log") as srv:
        c = LLMClient(srv.grpc_url, retry=NO_RETRY)   # the refusal itself, not the client's retries
        long_running = c.stream("A long story:", max_tokens=300, ignore_eos=True, **GREEDY)
        chunks = iter(long_running)        # keep the iterator: dropping it cancels the request
        first = next(chunks)               # running now
        assert first.text is not None
        queued = c.stream("Second in line:", max_tokens=4, **GREEDY)   # takes the one waiting slot
        time.sleep(0.3)
        start = time.monotonic()
        with pytest.raises(LLMError) as info:
            list(c.stream("Third:", max_tokens=4, **GREEDY))
        assert time.monotonic() - start < 2.0
        assert "queue is full" in str(info.value) and info.value.retryable
        # Triton's HTTP generate endpoint reports any model error as 400, with our message.
        body = {"text_input": "Fourth", "sampling_parameters": json.dumps({"max_tokens": 2})}
        request = urllib.request.Request(f"http://{srv.http_url}/v2/models/llm/generate", data=json.dumps(body).encode())
        with pytest.raises(urllib.error.HTTPError) as http_info:
            urllib.request.urlopen(request, timeout=30)
        assert "queue is full" in json.loads(http_info.value.read())["error"]
        long_running.cancel()
        assert "".join(ch.text for ch in queued)  # the queued request still completes
        del chunks
