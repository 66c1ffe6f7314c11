"""Property-based input test against the real server: arbitrary JSON values for every
sampling parameter and arbitrary tensors for every input, over gRPC (many requests on one
stream) and HTTP generate. Every request must end with a clear error or a valid answer:
never INTERNAL, never a step failure, never a hang; afterwards the server is alive and its
KV cache idle."""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from backend import SamplingParams
from client import LLMClient
from client.llm_client import _Connection
from loadtest.server_metrics import scrape
from server.launch import TritonServer, free_ports
from tests.conftest import FIXED_BUDGET_PARAMS

pytestmark = pytest.mark.server

BATCH = 25
EXAMPLES = 21          # x BATCH = 525 requests per transport, 1,050 in all
NUM_REQUESTS = {"grpc": 0, "http": 0, "http_frontend_500": 0}
TRITON_FRONTEND_PARSE_ERRORS = ("Unable to parse", "failed to parse the request JSON")
BOOL_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
               "return_num_output_tokens", "return_num_cached_tokens", "return_logprobs")
INTERNAL_MARKERS = ("internal error", "engine step", "Traceback")


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir: Path):
    # A short context bounds every valid answer (<= 64 tokens), so that 1,000 requests take seconds.
    log = tmp_path_factory.mktemp("triton-fuzz") / "server.log"
    srv = TritonServer(*free_ports(3), log_file=log, params={"max_model_len": "64", "max_waiting_requests": "4096",
                                                                **FIXED_BUDGET_PARAMS})
    srv.start(timeout=300)
    yield srv
    srv.stop()
    text = log.read_text()
    assert "engine step failed" not in text and "failed in an engine step" not in text, "a step failed"


# ---- strategies ----------------------------------------------------------------------------------
EDGE_VALUES = [0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, -2**64, 10**400, -10**400, 0.5, 1e308, -0.0, "\x00",
               "max_tokens\x00", "\ud800", [2**64], ["\ud800"], ["a"] * 100, [-1], None, True, {"a": 1}]
edge_values = st.sampled_from(EDGE_VALUES)
json_scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**70, max_value=2**70)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20) | edge_values)
json_values = st.recursive(json_scalars, lambda children: st.lists(children, max_size=4)
                           | st.dictionaries(st.text(max_size=8), children, max_size=3), max_leaves=8)
param_names = sorted(SamplingParams.field_names()) + ["max_tokens\x00", "beam_width", ""]
# Mostly small valid-looking values, so that many requests pass validation and really run.
plausible = {"max_tokens": st.integers(1, 8), "temperature": st.sampled_from([0.0, 0.7, 1.0]),
             "seed": st.integers(0, 2**63 - 1), "top_k": st.integers(-1, 60000), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3)}


@st.composite
def sampling_json(draw) -> str | bytes:
    kind = draw(st.sampled_from(["object", "object", "object", "edge", "raw", "deep"]))
    if kind == "edge":  # one parameter at a boundary of its type: huge ints, NUL bytes, ...
        return json.dumps({draw(st.sampled_from(param_names)): draw(edge_values), "max_tokens": 2})
    if kind == "raw":   # not JSON, or JSON that is not an object, or invalid UTF-8
        return draw(st.binary(max_size=40) | st.just(b"[1,") | st.just(b"\xff\xfe") | json_values.map(json.dumps))
    if kind == "deep":  # nesting far beyond the JSON parser's recursion limit
        depth = draw(st.integers(500, 200_000))
        return '{"stop": ' + "[" * depth + "]" * depth + "}"
    keys = draw(st.lists(st.sampled_from(param_names), max_size=5, unique=True))
    values = {}
    for key in keys:
        strategy = plausible.get(key)
        values[key] = draw(strategy | json_values if strategy is not None else json_values)
    values.setdefault("max_tokens", draw(st.integers(1, 6)))
    return json.dumps(values, allow_nan=True)


@st.composite
def request_inputs(draw) -> dict[str, tuple[np.ndarray, str]]:
    """name -> (array, Triton dtype) of one request's inputs."""
    inputs: dict[str, tuple[np.ndarray, str]] = {}
    prompt = draw(st.sampled_from(["text", "text", "bytes", "ids", "none"]))
    if prompt == "text":
        inputs["text_input"] = (np.array([draw(st.text(max_size=60)).encode("utf-8", "surrogatepass")],
                                         dtype=np.object_), "BYTES")
    elif prompt == "bytes":
        inputs["text_input"] = (np.array(draw(st.lists(st.binary(max_size=30), min_size=0, max_size=2)) or [b""],
                                         dtype=np.object_), "BYTES")
    elif prompt == "ids":
        ids = draw(st.lists(st.integers(-2**31, 2**31 - 1) | st.integers(0, 49151), max_size=70))
        inputs["input_ids"] = (np.array(ids, dtype=np.int32), "INT32")
    if draw(st.booleans()):
        inputs["sampling_parameters"] = (np.array([draw(sampling_json())], dtype=np.object_), "BYTES")
    for name in draw(st.lists(st.sampled_from(BOOL_INPUTS), max_size=3, unique=True)):
        inputs[name] = (np.array(draw(st.lists(st.booleans(), min_size=0, max_size=2)), dtype=bool), "BOOL")
    return inputs


def _is_internal(message: str) -> bool:
    return not message.strip() or any(marker in message for marker in INTERNAL_MARKERS)


def _edge_batch() -> list[dict[str, tuple[np.ndarray, str]]]:
    """Every sampling parameter (and some unknown keys) at every edge value, explicitly."""
    batch = []
    for name in param_names:
        for value in EDGE_VALUES:
            params = json.dumps({name: value, "max_tokens": 2} if name != "max_tokens" else {name: value})
            batch.append({"text_input": (np.array([b"Edge"], dtype=np.object_), "BYTES"),
                          "sampling_parameters": (np.array([params.encode()], dtype=np.object_), "BYTES")})
    return batch


# ---- gRPC: a batch of requests on one stream -----------------------------------------------------
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(batch=st.lists(request_inputs(), min_size=BATCH, max_size=BATCH))
@example(batch=_edge_batch())
def test_grpc_fuzzed_requests_get_an_error_or_an_answer(server: TritonServer, batch: list) -> None:
    events: queue.Queue = queue.Queue()
    connection = _Connection(server.grpc_url, lambda rid, result, error: events.put((rid, result, error)))
    pending = {}
    try:
        for i, inputs in enumerate(batch):
            tensors = []
            for name, (array, dtype) in inputs.items():
                tensor = grpcclient.InferInput(name, list(array.shape), dtype)
                tensor.set_data_from_numpy(array)
                tensors.append(tensor)
            pending[f"fuzz-{i}"] = inputs
            connection.send("llm", f"fuzz-{i}", tensors)
        deadline = time.monotonic() + 120
        while pending:
            request_id, result, error = events.get(timeout=max(0.1, deadline - time.monotonic()))
            assert request_id is not None, f"the stream broke: {error}"
            if error is not None:
                assert not _is_internal(str(error)), f"{pending[request_id]} -> {error}"
                pending.pop(request_id)
            elif result.get_response().parameters["triton_final_response"].bool_param:
                pending.pop(request_id)
    except queue.Empty:
        pytest.fail(f"no final response for {len(pending)} request(s), e.g. {next(iter(pending.values()))}")
    finally:
        connection.close()
    NUM_REQUESTS["grpc"] += len(batch)


# ---- HTTP generate: the same inputs as JSON, 8 at a time ----------------------------------------
def _http_body(inputs: dict[str, tuple[np.ndarray, str]], extra: dict[str, Any]) -> bytes:
    body: dict[str, Any] = {}
    for name, (array, _) in inputs.items():
        values = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v if isinstance(v, str) else v.item()
                  for v in array.reshape(-1)]
        body[name] = values[0] if len(values) == 1 and name != "input_ids" else values
    body.update(extra)
    return json.dumps(body).encode()


def _http_call(server: TritonServer, body: bytes) -> tuple[int, str]:
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=body)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.tuples(request_inputs(), st.dictionaries(st.sampled_from(["stream", "text_input", "x"]),
                                                                   json_values, max_size=1)),
                      min_size=BATCH, max_size=BATCH))
def test_http_fuzzed_requests_get_an_error_or_an_answer(server: TritonServer, batch: list) -> None:
    bodies = [_http_body(inputs, extra) for inputs, extra in batch]
    bodies[0] = b'{"text_input": "hi", "sampling_parameters": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda body: _http_call(server, body), bodies))
    bad = []
    for body, (status, text) in zip(bodies, answers):
        message = json.loads(text).get("error", "") if status != 200 else ""
        if status == 500 and message.startswith(TRITON_FRONTEND_PARSE_ERRORS):
            # Triton's HTTP frontend itself answers 500 to a JSON field of the wrong type for
            # an input ("text_input": {}); the request never reaches the model.
            NUM_REQUESTS["http_frontend_500"] += 1
            continue
        if status not in (200, 400, 503) or (status != 200 and (not message or _is_internal(message))):
            bad.append(f"{body[:200]!r} -> {status} {text[:200]}")
    assert not bad, "\n".join(bad)
    NUM_REQUESTS["http"] += BATCH


def test_after_the_fuzzing_the_server_is_alive_and_idle(server: TritonServer) -> None:
    assert NUM_REQUESTS["grpc"] + NUM_REQUESTS["http"] >= 1000, NUM_REQUESTS
    assert server.process.poll() is None and server.stub_alive()

    def idle() -> bool:
        values = scrape(server.metrics_url)
        used = [v for k, v in values.items() if k.startswith("llm_kv_blocks_used")]
        running = [v for k, v in values.items() if k.startswith("llm_num_requests_running")]
        return used == [0] and running == [0]
    deadline = time.monotonic() + 10
    while not idle() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert idle(), "KV cache or running batch not back to idle"
    # ignore_eos: greedy may pick EOS first (it does in bfloat16, dtype=auto's choice on a CPU with native bf16).
    completion = LLMClient(server.grpc_url).generate("Still there?", max_tokens=4, temperature=0.0, ignore_eos=True)
    assert completion.num_output_tokens == 4
