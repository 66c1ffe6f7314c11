"""One streaming gRPC connection per load-test user (tritonclient), one request at a time.

Written against blocking ``threading``/``queue`` so that it is testable without Locust; in the
Locust process those are gevent-patched and ``grpc.experimental.gevent.init_gevent()`` (see
locustfile.py) makes gRPC cooperate, so thousands of users cost greenlets, not threads.
"""

from __future__ import annotations

import queue
import time
from typing import Any

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.llm_client import RETRYABLE_MESSAGES, RetryPolicy, build_inputs, parse_result, routing_headers
from loadtest.records import CANCELLED, FAILED, INTERRUPTED, OK, RequestRecord
from loadtest.workload import RequestSpec


class TritonRequestError(Exception):
    """A request's error with its text. tritonclient's exception does not pass its message to
    ``Exception.__init__``, so its repr (which Locust's report shows) would be empty."""

    def __init__(self, message: str) -> None:
        super().__init__(message or "unknown error (empty message)")


def refused_before_any_work(error: BaseException) -> bool:
    """A request that got no response yet and this error can be sent again: the server refused
    it (draining, unhealthy, queue full), or the stream broke (its replica went away, the proxy
    had none up). Nothing reached the client, so nothing is repeated."""
    if isinstance(error, InferenceServerException) and error.status():
        return True      # a transport error: the stream itself broke
    return any(marker in str(describe(error)) for marker in RETRYABLE_MESSAGES)


def describe(error: BaseException) -> str:
    if isinstance(error, InferenceServerException):
        parts = [f"[{error.status()}]" if error.status() else "", error.message() or "",
                 error.debug_details() or ""]
        return " ".join(p for p in parts if p) or type(error).__name__
    return str(error) or type(error).__name__


class UserStream:
    """A tritonclient client with (at most) one open bidirectional stream. A cancelled or
    broken stream is closed and the next request opens a fresh one: gRPC cancels a whole
    stream, never a single request on it.

    With ``send_prefix_key`` a request's prefix key goes out as the stream's ``x-prefix-key``
    metadata; a proxy routes a whole stream at its opening, so a request with another key
    than the open stream's opens a new stream."""

    def __init__(self, url: str, model: str = "llm", request_timeout: float = 600.0,
                 send_prefix_key: bool = False, retry: RetryPolicy = RetryPolicy()) -> None:
        self.url, self.model, self.request_timeout = url, model, request_timeout
        self.send_prefix_key = send_prefix_key
        self.retry = retry
        self._client = grpcclient.InferenceServerClient(url)
        self._events: queue.Queue[tuple[float, Any, BaseException | None]] | None = None
        self._stream_key: str | None = None

    def _open(self, prefix_key: str | None) -> queue.Queue:
        events: queue.Queue = queue.Queue()

        def on_response(result: Any, error: BaseException | None) -> None:
            # Runs on tritonclient's reader thread: the timestamp is taken on arrival, not when
            # the user's greenlet gets round to it.
            events.put((time.time(), result, error))

        self._client.start_stream(callback=on_response, headers=routing_headers(prefix_key) or None)
        self._events, self._stream_key = events, prefix_key
        return events

    def _close_stream(self, cancel: bool) -> None:
        if self._events is not None:
            self._events = None
            try:
                self._client.stop_stream(cancel_requests=cancel)
            except Exception:  # noqa: BLE001 - a broken stream may fail to close; it is gone either way
                pass

    def close(self) -> None:
        self._close_stream(cancel=True)
        self._client.close()

    def _send(self, spec: RequestSpec, key: str | None) -> queue.Queue:
        """Send ``spec`` on the user's stream, opening one when there is none, the prefix key
        changed, or the open one broke while idle (its break is then the only event queued)."""
        if self._events is not None and (key != self._stream_key or not self._events.empty()):
            self._close_stream(cancel=False)    # nothing in flight on it: one request at a time
        events = self._events or self._open(key)
        # enable_empty_final_response: Triton marks the end of every stream, even when the
        # model's last response carried data or the model only sent the FINAL flag.
        self._client.async_stream_infer(self.model, build_inputs(spec.prompt, spec.sampling()),
                                        request_id=spec.request_id, enable_empty_final_response=True)
        return events

    def run(self, spec: RequestSpec, record: RequestRecord) -> None:
        """Send ``spec`` and fill ``record`` in place as responses arrive (so that a caller
        interrupted mid-request still holds what was measured)."""
        deadline = time.monotonic() + self.request_timeout
        record.sent_at = time.time()
        try:
            key = spec.prefix_key if self.send_prefix_key else None
            events = self._send(spec, key)
            while True:
                arrived, result, error = events.get(timeout=max(0.0, deadline - time.monotonic()))
                if error is not None:
                    self._close_stream(cancel=True)
                    if (not record.responses and record.retries < self.retry.retries
                            and refused_before_any_work(error)):
                        time.sleep(self.retry.backoff_s(record.retries))
                        record.retries += 1
                        events = self._send(spec, key)
                        continue
                    self._finish(record, FAILED, arrived, error=describe(error))
                    return
                chunk = parse_result(spec.request_id, result)
                if chunk.text or chunk.num_output_tokens:
                    record.responses.append([arrived, chunk.num_output_tokens])
                if chunk.num_input_tokens is not None:
                    record.prompt_tokens = chunk.num_input_tokens
                if chunk.num_cached_tokens is not None:
                    record.cached_tokens = chunk.num_cached_tokens
                if chunk.final:
                    record.final_response = True
                    record.finish_reason = chunk.finish_reason or record.finish_reason
                    self._finish(record, OK, arrived)
                    return
                if spec.cancel_after is not None and record.output_tokens >= spec.cancel_after:
                    self._close_stream(cancel=True)
                    self._finish(record, CANCELLED, time.time())
                    return
        except queue.Empty:
            self._close_stream(cancel=True)
            self._finish(record, FAILED, time.time(), error=f"no final response within {self.request_timeout:.0f}s")
        except InferenceServerException as exc:   # e.g. the stream could not send
            self._close_stream(cancel=True)
            self._finish(record, FAILED, time.time(), error=describe(exc))
        except BaseException:
            # Locust stopping a user after the drain timeout (GreenletExit) or Ctrl-C. Record
            # first: closing the stream joins its reader and may itself be interrupted.
            self._finish(record, INTERRUPTED, time.time())
            self._close_stream(cancel=True)
            raise

    @staticmethod
    def _finish(record: RequestRecord, outcome: str, at: float, error: str | None = None) -> None:
        record.outcome, record.end_at, record.error = outcome, at, error
