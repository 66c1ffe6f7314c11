"""Raw gRPC stream requests in the vLLM backend's tensor layout, for the server tests."""

from __future__ import annotations

import json

import numpy as np
import tritonclient.grpc as grpcclient


def tensor(name: str, value: np.ndarray, dtype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def vllm_inputs(prompt: str, stream: bool, sampling: dict | None, **flags: bool | None) -> list[grpcclient.InferInput]:
    """text_input, stream, the sampling_parameters JSON (when given) and each flag that is
    not None, as the vLLM backend's clients build them."""
    inputs = [tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
              tensor("stream", np.array([stream]), "BOOL")]
    if sampling is not None:
        inputs.append(tensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"))
    inputs += [tensor(name, np.array([value]), "BOOL") for name, value in flags.items() if value is not None]
    return inputs


def stream_request(server, inputs: list[grpcclient.InferInput], parameters: dict | None = None) -> list[tuple]:
    """Every (result, error) of one request on a stream of its own (stop_stream waits for the end)."""
    responses: list[tuple] = []
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(lambda result, error: responses.append((result, error)))
        client.async_stream_infer("llm", inputs=inputs, parameters=parameters)
        client.stop_stream()
    assert responses
    return responses
