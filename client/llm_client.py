"""Client library over tritonclient's gRPC streaming API and Triton's HTTP generate_stream.

- ``LLMClient.stream(prompt, ...)``: one completion as text deltas on a stream of its own,
  so that ``cancel()`` (or leaving the loop early) cancels exactly that request.
- ``LLMClient.generate(prompt, ...)``: blocking; returns the whole completion.
- ``LLMClient.stream_many(prompts, ...)``: many concurrent requests multiplexed over one
  gRPC stream (one connection), chunks tagged with their request id.
- ``http_generate_stream(...)``: the same deltas over HTTP server-sent events.

Behind the cluster's proxy (server/cluster.py, docs/scaling.md), ``prefix_key=...`` sends
``x-prefix-key`` (HTTP header, gRPC metadata): requests with the same key go to the same
replica, whose prefix cache then holds their shared prefix. ``prefix_key_for(text)`` makes
one from a shared prefix such as a system prompt.
"""

from __future__ import annotations

import hashlib
import http.client
import itertools
import json
import queue
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc._infer_stream import _InferStream, _RequestIterator
from tritonclient.utils import InferenceServerException

DEFAULT_GRPC_URL = "127.0.0.1:8001"
DEFAULT_HTTP_URL = "127.0.0.1:8000"
DEFAULT_MODEL = "llm"
RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                "return_num_cached_tokens")


# The routing contract with the cluster's proxy (server/cluster.py renders it into HAProxy's
# configuration): requests with the same prefix key go to one replica, named in the response.
PREFIX_KEY_HEADER = "x-prefix-key"
SERVED_BY_HEADER = "x-served-by"


def prefix_key_for(text: str) -> str:
    """A routing key for requests that share ``text`` as their prefix (a system prompt, a
    document): short, and safe in a header whatever the text holds."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def routing_headers(prefix_key: str | None) -> dict[str, str]:
    return {PREFIX_KEY_HEADER: prefix_key} if prefix_key else {}


# finish_reason of a response that is not the last (the vLLM backend's convention, which we follow).
NOT_FINISHED = "None"


def _finish_reason(raw: str | bytes | None) -> str | None:
    text = raw.decode() if isinstance(raw, bytes) else raw
    return None if text in (None, NOT_FINISHED) else text


class LLMError(Exception):
    """The server ended a request with an error (message as Triton sent it), or the connection
    to it broke. ``retryable``: refused before any work was done (a draining replica, a full
    queue, no replica reachable); ``replica``: the proxy's name for the server, when known."""

    def __init__(self, message: str, retryable: bool = False, replica: str | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.replica = replica


# The server's UNAVAILABLE refusals (backend/errors.py: ShuttingDownError, QueueFullError,
# EngineUnhealthyError), and Triton's for a model that is not there right now. Triton passes a model's error to the client as text only (over HTTP as
# a 400), so the text is the contract; the server tests assert each refusal is retryable.
RETRYABLE_MESSAGES = ("server is shutting down", "waiting queue is full", "engine is unhealthy",
                      # Triton's own, while the model is unloading or loading, and after its stub died
                      "has no available versions", "Stub process")


def refusal(message: str, replica: str | None = None) -> LLMError:
    """An error the server sent in place of a response."""
    return LLMError(message, retryable=any(m in message for m in RETRYABLE_MESSAGES), replica=replica)


@dataclass(frozen=True)
class RetryPolicy:
    """Retry a request that was refused before its first token (``LLMError.retryable``): behind
    the cluster's proxy the retry reaches a live replica once the proxy has marked the failed
    one down (about 1.25 s, docs/scaling.md). Never after a token: that would repeat output."""
    retries: int = 3
    first_backoff_s: float = 0.25    # doubled each time: 0.25 + 0.5 + 1.0 s

    def backoff_s(self, attempt: int) -> float:
        return self.first_backoff_s * 2 ** attempt


NO_RETRY = RetryPolicy(retries=0)


@dataclass
class StreamChunk:
    request_id: str
    text: str                       # the delta
    num_output_tokens: int          # tokens in this delta
    final: bool
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_cached_tokens: int | None = None
    finish_message: str | None = None   # why the server cut it short (shutdown drain)
    served_by: str | None = None        # behind the cluster's proxy: the replica's name


@dataclass
class Completion:
    text: str
    finish_reason: str | None
    num_input_tokens: int | None
    num_output_tokens: int
    num_cached_tokens: int | None
    served_by: str | None = None


def build_inputs(prompt: str | list[int], sampling: dict[str, Any], stream: bool = True,
                 exclude_input_in_output: bool = True) -> list[grpcclient.InferInput]:
    def tensor(name: str, value: np.ndarray, dtype: str) -> grpcclient.InferInput:
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    if isinstance(prompt, str):
        inputs = [tensor("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES")]
    else:
        inputs = [tensor("input_ids", np.array(prompt, dtype=np.int32), "INT32")]
    inputs.append(tensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"))
    inputs.append(tensor("stream", np.array([stream]), "BOOL"))
    inputs.append(tensor("exclude_input_in_output", np.array([exclude_input_in_output]), "BOOL"))
    for flag in RETURN_FLAGS:
        inputs.append(tensor(flag, np.array([True]), "BOOL"))
    return inputs


def parse_result(request_id: str, result: Any) -> StreamChunk:
    """One Triton response -> StreamChunk (works for the empty final response too)."""
    response = result.get_response()
    final = response.parameters["triton_final_response"].bool_param if "triton_final_response" in response.parameters else True

    def scalar(name: str) -> Any:
        value = result.as_numpy(name)
        return None if value is None or value.size == 0 else value.reshape(-1)[0]

    text = scalar("text_output")
    finish = scalar("finish_reason")
    num_output = scalar("num_output_tokens")
    num_input = scalar("num_input_tokens")
    num_cached = scalar("num_cached_tokens")
    message = scalar("finish_message")
    return StreamChunk(request_id=request_id, text=text.decode("utf-8") if text is not None else "",
                       num_output_tokens=int(num_output) if num_output is not None else 0, final=final,
                       finish_reason=_finish_reason(finish),
                       num_input_tokens=int(num_input) if num_input is not None else None,
                       num_cached_tokens=int(num_cached) if num_cached is not None else None,
                       finish_message=message.decode("utf-8", "replace") if message is not None else None)


class _IdAwareStream(_InferStream):
    """tritonclient drops the request id of error responses on a stream; with several
    requests in flight on one stream we need it to tell whose error it is. Also keeps the
    proxy's ``x-served-by`` (the stream's initial metadata) to name the replica in errors."""

    served_by: str | None = None

    def _process_response(self) -> None:
        try:
            for response in self._response_iterator:
                if self.served_by is None:
                    self.served_by = dict(self._response_iterator.initial_metadata() or ()).get(SERVED_BY_HEADER, "")
                request_id = response.infer_response.id
                if response.error_message:
                    self._callback(request_id, None, refusal(response.error_message, self.served_by or None))
                else:
                    self._callback(request_id, grpcclient.InferResult(response.infer_response), None)
        except Exception as exc:  # grpc.RpcError: the stream itself broke
            self._active = False
            self._callback(None, None, self._broken(exc))

    def _broken(self, exc: Exception) -> LLMError:
        if isinstance(exc, grpc.RpcError):
            code, details = exc.code(), exc.details()
            reason = f"{code.name if code else 'UNKNOWN'}: {details}"
        else:
            code, reason = None, repr(exc)
        where = f" from replica {self.served_by}" if self.served_by else ""
        # Refused before anything came back (connection refused, the proxy had no replica):
        # nothing ran, so it is safe to send again.
        return LLMError(f"the stream{where} broke ({reason})", replica=self.served_by or None,
                        retryable=code == grpc.StatusCode.UNAVAILABLE and self.served_by is None)


class _Connection:
    """One gRPC channel with one bidirectional stream; responses routed by request id."""

    def __init__(self, url: str, on_response: Callable[[str | None, Any, LLMError | None], None],
                 headers: dict[str, str] | None = None) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.client._stream = _IdAwareStream(on_response, False)
        # Metadata goes with the stream's opening (one HTTP/2 request): a proxy routes the
        # whole stream, every request on it, by it.
        iterator = self.client._client_stub.ModelStreamInfer(_RequestIterator(self.client._stream),
                                                             metadata=tuple((headers or {}).items()) or None)
        self.client._stream._init_handler(iterator)

    def send(self, model: str, request_id: str, inputs: list[grpcclient.InferInput]) -> None:
        """Queue a request on the stream. If the stream has already broken, nothing is sent and
        the reason arrives through ``on_response`` (tritonclient's own exception says only
        that the stream is no longer valid)."""
        try:
            self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        except InferenceServerException:
            if self.client._stream._active:
                raise

    def close(self, cancel: bool = False) -> None:
        try:
            self.client.stop_stream(cancel_requests=cancel)
        finally:
            self.client.close()


class CompletionStream:
    """Iterate for StreamChunks; ``cancel()`` (or breaking out of the loop) cancels the request.
    A refusal before the first response is retried on a new stream (``RetryPolicy``)."""

    def __init__(self, url: str, model: str, request_id: str, inputs: list[grpcclient.InferInput],
                 headers: dict[str, str] | None = None, retry: RetryPolicy = NO_RETRY) -> None:
        self.request_id = request_id
        self._url, self._model, self._inputs, self._headers, self._retry = url, model, inputs, headers, retry
        self._connection: _Connection | None = None
        self._done = False
        self._queue = self._open()

    def _open(self) -> queue.Queue[tuple[Any, LLMError | None]]:
        events: queue.Queue[tuple[Any, LLMError | None]] = queue.Queue()
        self._connection = _Connection(self._url, lambda rid, result, error: events.put((result, error)),
                                       self._headers)
        self._connection.send(self._model, self.request_id, self._inputs)
        return events

    def __iter__(self) -> Iterator[StreamChunk]:
        attempt = 0
        responded = False
        try:
            while not self._done:
                result, error = self._queue.get()
                if error is not None:
                    if not responded and error.retryable and attempt < self._retry.retries:
                        self.close(cancel=True)
                        time.sleep(self._retry.backoff_s(attempt))
                        attempt += 1
                        self._queue = self._open()
                        continue
                    self._done = True
                    raise error
                responded = True
                chunk = parse_result(self.request_id, result)
                chunk.served_by = self._connection.client._stream.served_by or None if self._connection else None
                self._done = chunk.final
                if chunk.text or chunk.num_output_tokens or chunk.final:
                    yield chunk
        finally:
            self.close(cancel=not self._done)

    def cancel(self) -> None:
        self.close(cancel=True)

    def close(self, cancel: bool = False) -> None:
        if self._connection is not None:
            connection, self._connection = self._connection, None
            connection.close(cancel=cancel)


class LLMClient:
    """``retry``: how requests refused before their first token are retried (default: 3 times
    over 1.75 s; ``NO_RETRY`` to see every refusal)."""

    def __init__(self, url: str = DEFAULT_GRPC_URL, model: str = DEFAULT_MODEL,
                 retry: RetryPolicy = RetryPolicy()) -> None:
        self.url = url
        self.model = model
        self.retry = retry
        self._ids = itertools.count()

    def _next_id(self) -> str:
        return f"client-{id(self):x}-{next(self._ids)}"

    def stream(self, prompt: str | list[int], request_id: str | None = None, prefix_key: str | None = None,
               **sampling: Any) -> CompletionStream:
        return CompletionStream(self.url, self.model, request_id or self._next_id(),
                                build_inputs(prompt, sampling, stream=True), routing_headers(prefix_key), self.retry)

    def generate(self, prompt: str | list[int], prefix_key: str | None = None, **sampling: Any) -> Completion:
        chunks = list(self.stream(prompt, prefix_key=prefix_key, **sampling))
        final = chunks[-1]
        return Completion(text="".join(c.text for c in chunks), finish_reason=final.finish_reason,
                          num_input_tokens=final.num_input_tokens,
                          num_output_tokens=sum(c.num_output_tokens for c in chunks),
                          num_cached_tokens=final.num_cached_tokens, served_by=final.served_by)

    def stream_many(self, prompts: Iterable[str | list[int]], sampling: dict[str, Any] | list[dict[str, Any]] | None = None,
                    request_ids: list[str] | None = None,
                    prefix_key: str | None = None) -> Iterator[StreamChunk | tuple[str, LLMError]]:
        """Send every prompt at once over one stream (one connection) and yield chunks, or
        (request_id, error), in arrival order until every request has ended. ``sampling`` is
        one dict for all prompts or one dict per prompt. Behind a proxy the stream, and so
        every prompt on it, goes to one replica (the one ``prefix_key`` maps to). Nothing is
        retried here: each error is the caller's to handle."""
        prompts = list(prompts)
        per_request = sampling if isinstance(sampling, list) else [sampling or {}] * len(prompts)
        ids = request_ids or [self._next_id() for _ in prompts]
        if not len(per_request) == len(ids) == len(prompts):
            raise ValueError("need one sampling dict and one request id per prompt")
        events: queue.Queue[tuple[str | None, Any, LLMError | None]] = queue.Queue()
        connection = _Connection(self.url, lambda rid, result, error: events.put((rid, result, error)),
                                 routing_headers(prefix_key))
        pending: set[str] = set()
        try:
            for request_id, prompt, params in zip(ids, prompts, per_request):
                pending.add(request_id)
                connection.send(self.model, request_id, build_inputs(prompt, params, stream=True))
            while pending:
                request_id, result, error = events.get()
                if request_id is None:       # the stream broke: every pending request failed
                    for rid in sorted(pending):
                        yield rid, error
                    return
                if error is not None:
                    pending.discard(request_id)
                    yield request_id, error
                    continue
                chunk = parse_result(request_id, result)
                if chunk.final:
                    pending.discard(request_id)
                if chunk.text or chunk.num_output_tokens or chunk.final:
                    yield chunk
        finally:
            connection.close(cancel=bool(pending))


def http_generate_stream(prompt: str, url: str = DEFAULT_HTTP_URL, model: str = DEFAULT_MODEL,
                         timeout: float = 600.0, prefix_key: str | None = None,
                         retry: RetryPolicy = RetryPolicy(), **sampling: Any) -> Iterator[StreamChunk]:
    """Triton's HTTP generate_stream (server-sent events): one event per response. A refusal
    before the first event (no replica reachable, a draining one, a full queue) is retried per
    ``retry``; a stream that ends without its final event raises ``LLMError`` naming the replica."""
    body = {"text_input": prompt, "stream": True, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps(sampling), **{flag: True for flag in RETURN_FLAGS}}
    request = urllib.request.Request(f"http://{url}/v2/models/{model}/generate_stream",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **routing_headers(prefix_key)})
    for attempt in itertools.count():
        events = _sse_events(request, timeout)
        try:
            first = next(events)
        except LLMError as error:
            if error.retryable and attempt < retry.retries:
                time.sleep(retry.backoff_s(attempt))
                continue
            raise
        except StopIteration:
            return
        yield first
        yield from events
        return


def _sse_events(request: urllib.request.Request, timeout: float) -> Iterator[StreamChunk]:
    """One generate_stream request's events until the final one; every failure is an LLMError."""
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        # 503: the proxy had no replica up; Triton reports a model's refusal as 400 + its text.
        text = exc.read().decode("utf-8", "replace")
        try:
            message = json.loads(text).get("error", text)
        except ValueError:
            message = text.strip() or exc.reason
        error = refusal(f"HTTP {exc.code}: {message}", exc.headers.get(SERVED_BY_HEADER))
        error.retryable = error.retryable or exc.code == 503
        raise error from exc
    except (urllib.error.URLError, ConnectionError) as exc:
        raise LLMError(f"cannot reach {request.full_url}: {exc}", retryable=True) from exc
    served_by = response.headers.get(SERVED_BY_HEADER)
    where = f"replica {served_by}" if served_by else request.host
    received = 0
    with response:
        try:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[len("data:"):])
                if "error" in event:
                    error = refusal(event["error"], served_by)
                    error.retryable = error.retryable and received == 0
                    raise error
                received += 1
                finish = _finish_reason(event.get("finish_reason"))
                yield StreamChunk(request_id=event.get("id", ""), text=event.get("text_output", ""),
                                  num_output_tokens=int(event.get("num_output_tokens", 0)),
                                  final=finish is not None, finish_reason=finish,
                                  num_input_tokens=event.get("num_input_tokens"),
                                  num_cached_tokens=event.get("num_cached_tokens"), served_by=served_by)
                if finish is not None:
                    # Read to the end of the response before returning: until the server ends
                    # it, a proxy counts the request in flight, and its bounded-load hash sends
                    # this user's next request for the same key to another replica.
                    response.read()
                    return
        except (http.client.HTTPException, OSError) as exc:
            raise LLMError(f"the stream from {where} broke after {received} events ({exc!r})",
                           replica=served_by) from exc
    raise LLMError(f"the stream from {where} ended after {received} events without a final one "
                   "(the server or the connection went away)", replica=served_by)
