"""Triton Python-backend adapter (decoupled): translates Triton requests into engine calls
and engine outputs into Triton responses. Nothing else lives here.

Threads: Triton's ``execute`` parses, validates and submits, then returns at once; the
engine runs on the EngineLoop thread; responses are sent by one sender thread (``send``
is a blocking round trip to the server); a poller thread checks cancellation, pushes
engine statistics into Triton metrics and notices when Triton starts unloading the model.

Shutdown (docs/reliability.md): Triton does not call ``finalize`` while a decoupled model
still has open response senders, and it starts unloading without telling the model. So the
poller drains when the launcher's drain file appears (before tritonserver is signalled) or,
as a fallback, when the model turns not-ready: new requests get UNAVAILABLE, those in flight
may finish for ``drain_timeout_s``, the rest end with finish_reason "abort" and a
``finish_message``. Then Triton can finalize.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import itertools
import json
import logging
import os
import queue
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

# The engine lives in the project, not in this folder (which may be a temporary copy).
PROJECT_ROOT = Path(os.environ.get("LLM_PROJECT_ROOT", Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(PROJECT_ROOT))

from backend import (EngineConfig, EngineUnhealthyError, InvalidRequestError, QueueFullError, RequestOutput,
                     SamplingParams, ShuttingDownError)
from backend.engine.loop import EngineLoop, build_engine
from backend.engine.parallel_sampling import ParallelOutput
from server.stub import vllm_protocol
from server.stub.metric_names import REPORT_CUSTOM_METRICS
from server.stub.metrics import EngineMetrics, report_custom_metrics

# What a stream receives: one request's output, all n completions' outputs (n > 1), or the
# error that ends it.
Result = RequestOutput | ParallelOutput | BaseException
POLL_INTERVAL_S = 0.1
LOCK_TIMEOUT_S = 2.0
UNLOAD_CONFIRM_POLLS = 3
# Set by the launcher (server/launch.py): when this file appears the model drains, and it
# writes DRAIN_FILE + ".done" once nothing is in flight; only then is tritonserver signalled.
DRAIN_FILE_ENV = "LLM_DRAIN_FILE"
# Also set by the launcher: the model writes this file (the reason) once its engine turned
# unhealthy and the streams it failed have been answered; the supervisor then restarts it.
UNHEALTHY_FILE_ENV = "LLM_UNHEALTHY_FILE"
# UNAVAILABLE: refused before any work, worth retrying elsewhere or later.
REFUSALS = (QueueFullError, ShuttingDownError, EngineUnhealthyError)
BOOL_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
               "return_num_output_tokens", "return_num_cached_tokens", "return_logprobs",
               "return_cumulative_logprob")
logger = logging.getLogger("llm")


@dataclass
class _Stream:
    """Per-request state shared by execute (creates), the sender (removes) and the poller."""
    request_id: str
    sender: Any
    flags: dict[str, bool]
    prompt_text: str
    num_prompt_tokens: int
    logprobs_asked: bool = False   # the client's sampling parameters asked for logprobs
    prompt_logprobs_sent: bool = False   # sent once, on the first response that has them
    cancelled: bool = False
    # Triton deletes a sender's response factory once the FINAL flag is sent; calling
    # is_cancelled() on it after that (or while it happens) crashes tritonserver (SIGSEGV in
    # TRITONBACKEND_ResponseFactoryIsCancelled). `done` is set under `lock` before the final
    # send, and the poller only asks is_cancelled() under the same lock while not done.
    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def mark_done(self) -> None:
        # The lock is held across is_cancelled(), which can hang while Triton shuts down;
        # a final response must still go out then (the poller makes no new calls by that time).
        acquired = self.lock.acquire(timeout=LOCK_TIMEOUT_S)
        self.done = True
        if acquired:
            self.lock.release()
        else:
            logger.warning("%s: a cancellation check is stuck; sending its final response anyway",
                           self.request_id)


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        # `kill -USR1 <stub pid>` prints every thread's Python stack to the server log: the
        # first thing to look at when a stream hangs.
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise pb_utils.TritonModelException("the llm model must use the decoupled transaction policy")
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        # The vLLM backend's switch for its vllm:* metric families: a model parameter, not an engine one.
        report_vllm_metrics = report_custom_metrics(params.pop(REPORT_CUSTOM_METRICS, None))
        config = EngineConfig.from_dict(params)
        if not Path(config.model).is_absolute():
            config.model = str(PROJECT_ROOT / config.model)
        self.engine = build_engine(config)   # off this thread: see its docstring
        self.loop = EngineLoop(self.engine).start()
        for note in self.engine.runner.startup_notes:   # dtype, linear layers, fused ops: what was chosen and why
            print(f"llm: {note}", file=sys.stderr, flush=True)
        print(f"llm: {self.loop.validator.describe_limits()}", file=sys.stderr, flush=True)
        if config.async_scheduling:
            print("llm: async_scheduling: each step is launched before the tokens of the step before are read",
                  file=sys.stderr, flush=True)
        if self.engine.cost_model is not None:
            print(f"llm: prefill chunks sized to itl_target_ms={config.itl_target_ms:g} (at least "
                  f"{config.itl_target_decode_multiple:g}x the decodes' own time) by the step cost model "
                  f"({self.engine.cost_model.describe()}; calibration {self.engine.cost_model_origin})", file=sys.stderr,
                  flush=True)
        self.model_name, self.model_version = args["model_name"], args["model_version"]
        self.metrics = EngineMetrics(pb_utils, model=self.model_name, version=self.model_version,
                                     vllm_max_model_len=self.loop.validator.max_model_len if report_vllm_metrics
                                     else None, lora_enabled=self.engine.loras.path.exists)
        # The launcher's supervisor restarts the server when the stub dies and says how often.
        self.metrics.count_server_restarts(int(os.environ.get("LLM_SERVER_RESTARTS", "0")))
        self.metrics.set_draining(False)
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._outbox: queue.Queue[tuple[_Stream, Result] | None] = queue.Queue()
        self._stop = threading.Event()
        self._seen_ready = False
        self._not_ready_polls = 0
        self._unload_seen = False
        self._drain_file = os.environ.get(DRAIN_FILE_ENV) or None
        self._drain_reported = False
        self._unhealthy_file = os.environ.get(UNHEALTHY_FILE_ENV) or None
        self._unhealthy_reported = False
        self._sender = threading.Thread(target=self._send_loop, name="llm-sender", daemon=True)
        self._poller = threading.Thread(target=self._poll_loop, name="llm-poller", daemon=True)
        self._publisher = threading.Thread(target=self._publish_loop, name="llm-metrics", daemon=True)
        self._sender.start()
        self._poller.start()
        self._publisher.start()

    # ---- Triton's thread --------------------------------------------------------------------
    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except InvalidRequestError as exc:
                self._send_error(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
            except REFUSALS as exc:
                self._send_error(sender, str(exc), pb_utils.TritonError.UNAVAILABLE)
            except Exception as exc:  # noqa: BLE001 - one bad request must not disturb the rest
                logger.exception("failed to submit a request")
                self._send_error(sender, f"internal error: {exc!r}", pb_utils.TritonError.INTERNAL)
        return None

    def _submit(self, request: Any, sender: Any) -> None:
        given = {name: _bool_input(request, name) for name in BOOL_INPUTS}
        vllm_protocol.check_stream_flags(bool(given["stream"]), given["exclude_input_in_output"])
        flags = {name: bool(value) for name, value in given.items()}
        prompt_text, prompt = _prompt_input(request, self.loop.validator.max_model_len,
                                            self.loop.validator.max_prompt_bytes)
        params = _sampling_params(request)
        logprobs_asked = params.logprobs is not None
        if flags["return_cumulative_logprob"] and not logprobs_asked:
            params = dataclasses.replace(params, logprobs=0)   # the sampled tokens' logprobs, summed
        request_id = f"{request.request_id() or 'req'}-{next(self._ids)}"
        stream = _Stream(request_id, sender, flags, prompt_text, 0, logprobs_asked)
        with self._lock:
            self._streams[request_id] = stream
        try:
            validated = self.loop.submit(request_id, prompt, params, lambda item: self._outbox.put((stream, item)))
        except BaseException:
            with self._lock:
                del self._streams[request_id]
            stream.mark_done()   # execute() sends the final error next
            raise
        stream.num_prompt_tokens = len(validated.prompt_token_ids)

    # ---- sender thread ----------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            # Everything queued since the last round: while the sender was busy, a stream may
            # have gained several deltas, which go out as one response (num_output_tokens says
            # how many tokens it carries).
            items = [self._outbox.get()]
            while not self._outbox.empty():
                items.append(self._outbox.get_nowait())
            stopping = None in items
            for stream, result in _coalesce([item for item in items if item is not None]):
                try:
                    self._send_result(stream, result)
                except Exception as exc:  # noqa: BLE001 - e.g. the client went away: stop generating for it
                    logger.exception("sending a response of %s failed", stream.request_id)
                    self.loop.abort(stream.request_id)
                    if isinstance(result, BaseException) or result.finished:
                        self._end_after_failed_send(stream, exc)
            if stopping:
                return

    def _end_after_failed_send(self, stream: _Stream, exc: Exception) -> None:
        """A final response could not be built or sent: try a final error instead, so the
        stream (and Triton's unload) is not left waiting."""
        try:
            self._send_error(stream.sender, f"internal error: sending the final response failed: {exc!r}",
                             pb_utils.TritonError.INTERNAL)
        except Exception:  # noqa: BLE001 - the client is gone
            logger.exception("sending the final error of %s failed", stream.request_id)
        finally:
            with self._lock:
                self._streams.pop(stream.request_id, None)

    def _send_result(self, stream: _Stream, result: Result) -> None:
        final = isinstance(result, BaseException) or result.finished
        if final:
            stream.mark_done()   # no cancellation check on this sender from now on
            # A client that scrapes /metrics as soon as its request ended finds it counted
            # (the loop's statistics include the step that ended it before it is delivered).
            self._publish_metrics(finished=result)
            try:
                self._send_response(stream, result)
            finally:   # out of the live streams only once sent (the drain waits for it)
                with self._lock:
                    self._streams.pop(stream.request_id, None)
        else:
            self._send_response(stream, result)

    def _send_response(self, stream: _Stream, result: Result) -> None:
        final = isinstance(result, BaseException) or result.finished
        if isinstance(result, BaseException):
            code = (pb_utils.TritonError.UNAVAILABLE if isinstance(result, REFUSALS) else
                    pb_utils.TritonError.INVALID_ARG if isinstance(result, InvalidRequestError) else
                    pb_utils.TritonError.INTERNAL)
            if code == pb_utils.TritonError.INTERNAL:
                self.metrics.count_finished("error")
            self._send_error(stream.sender, str(result), code)
            return
        completions = _completions(result)
        if stream.cancelled and not final:
            return  # the client is gone: only the final (CANCELLED) response is still due
        if stream.cancelled and any(c.finish_reason == "abort" for c in completions):
            self.metrics.count_finished("cancelled")
            self._send_error(stream.sender, "request cancelled", pb_utils.TritonError.CANCELLED)
            return
        if result.finished:
            for completion in completions:
                self.metrics.count_finished(completion.finish_reason)
        streaming = stream.flags["stream"]
        if not streaming and not final:
            return  # non-streaming: exactly one response, carrying the final flag
        response = pb_utils.InferenceResponse(output_tensors=self._output_tensors(stream, result, streaming))
        stream.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    def _output_tensors(self, stream: _Stream, result: RequestOutput | ParallelOutput,
                        streaming: bool) -> list[Any]:
        """The vLLM backend's outputs (server/stub/vllm_protocol.py): each requested one on every
        response, one element per completion (n of them); streaming sends deltas, a single
        response the whole completions."""
        flags = stream.flags
        completions = _completions(result)
        if streaming:
            texts = [c.new_text for c in completions]
            num_output = [len(c.new_token_ids) for c in completions]
            logprobs = [c.new_logprobs for c in completions]
        else:
            prefix = "" if flags["exclude_input_in_output"] else stream.prompt_text
            texts = [prefix + c.text for c in completions]
            num_output = [len(c.token_ids) for c in completions]
            logprobs = [c.logprobs for c in completions]
        tensors = [_string_tensor("text_output", texts)]
        messages = sorted({c.finish_message for c in completions if c.finished and c.finish_message})
        # A response the server cut short always says so, asked or not.
        if flags["return_finish_reason"] or messages:
            tensors.append(_string_tensor("finish_reason",
                                          [vllm_protocol.finish_reason_text(c.finish_reason) for c in completions]))
        if messages:
            tensors.append(_string_tensor("finish_message", ["; ".join(messages)]))
        if flags["return_num_input_tokens"]:
            tensors.append(pb_utils.Tensor("num_input_tokens", np.array([completions[0].num_prompt_tokens],
                                                                         dtype=np.uint32)))
        if flags["return_num_output_tokens"]:
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array(num_output, dtype=np.uint32)))
        if flags["return_num_cached_tokens"]:
            tensors.append(pb_utils.Tensor("num_cached_tokens",
                                           np.array([c.num_cached_tokens for c in completions], dtype=np.uint32)))
        if flags["return_cumulative_logprob"]:
            values = [c.cumulative_logprob if c.cumulative_logprob is not None else float("nan") for c in completions]
            tensors.append(pb_utils.Tensor("cumulative_logprob", np.array(values, dtype=np.float32)))
        if flags["return_logprobs"]:
            tensors.append(_string_tensor("logprobs", [vllm_protocol.logprobs_json(positions if stream.logprobs_asked
                                                                                   else None)
                                                       for positions in logprobs]))
        prompt_logprobs = next((c.prompt_logprobs for c in completions if c.prompt_logprobs is not None), None)
        if prompt_logprobs is not None and not stream.prompt_logprobs_sent:
            # Once per request (the prompt is the completions' common one): a long prompt's
            # positions on every streamed token would cost O(prompt) per token.
            tensors.append(_string_tensor("prompt_logprobs", [vllm_protocol.logprobs_json(prompt_logprobs)]))
            stream.prompt_logprobs_sent = True
        return tensors

    @staticmethod
    def _send_error(sender: Any, message: str, code: Any) -> None:
        # A NUL would cut the message short in transport (an empty gRPC error message reads as
        # success to tritonclient): escape it, and never send an empty message.
        error = pb_utils.TritonError(message.replace("\x00", "\\x00") or "error", code)
        sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    # ---- poller thread ----------------------------------------------------------------------
    def _poll_loop(self) -> None:
        while not self._stop.wait(POLL_INTERVAL_S):
            # Drain first: once Triton unloads, is_cancelled() below may never return.
            if not self.loop.draining:
                if self._drain_requested():
                    self._start_drain(unloading=False)
                elif self._unloading():
                    self._start_drain(unloading=True)
            if (self.loop.draining and not self._drain_reported and self.loop.wait_idle(0)
                    and self._outbox.empty() and not self._streams):
                self._report_drained()
            if (self.loop.health_error is not None and not self._unhealthy_reported and self._outbox.empty()
                    and not self._streams):
                self._report_unhealthy(self.loop.health_error)
            if not self._unload_seen:
                self._check_cancellations()

    def _publish_loop(self) -> None:
        """Metrics on a thread of their own: a cancellation check that blocks (it is a round
        trip to Triton per stream) must not leave them stale."""
        while not self._stop.wait(POLL_INTERVAL_S):
            self._publish_metrics()

    def _publish_metrics(self, finished: Result | None = None) -> None:
        """Push the loop's latest statistics (EngineMetrics.update skips a snapshot it has
        already published, so calling this often is cheap), and the request that ``finished``."""
        try:
            self.metrics.update(self.loop.stats, self.loop.latency_samples, self.engine.config.block_size,
                                self.engine.loras.load_seconds)
            if finished is not None and not isinstance(finished, BaseException):
                completions = _completions(finished)
                self.metrics.observe_request(completions[0].num_prompt_tokens,
                                             [c.num_output_tokens for c in completions])
        except Exception:  # noqa: BLE001 - metrics must never take the server down
            logger.exception("metrics update failed")

    def _check_cancellations(self) -> None:
        with self._lock:
            streams = list(self._streams.values())
        for stream in streams:
            try:
                with stream.lock:
                    newly_cancelled = not stream.done and not stream.cancelled and stream.sender.is_cancelled()
                if newly_cancelled:
                    stream.cancelled = True
                    self.loop.abort(stream.request_id)
            except Exception:  # noqa: BLE001
                logger.exception("cancellation check of %s failed", stream.request_id)

    def _start_drain(self, unloading: bool) -> None:
        # During an unload, cancellation checks stop (is_cancelled() can hang then); a drain
        # the launcher asked for keeps honouring client cancellations.
        self._unload_seen = unloading
        self.loop.drain(self.engine.config.drain_timeout_s)
        self.metrics.set_draining(True)

    def _drain_requested(self) -> bool:
        return self._drain_file is not None and os.path.exists(self._drain_file)

    def _report_drained(self) -> None:
        self._drain_reported = True
        logger.warning("drained: no request in flight")
        if self._drain_file is not None:
            Path(self._drain_file + ".done").touch()

    def _report_unhealthy(self, reason: str) -> None:
        self._unhealthy_reported = True
        if self._unhealthy_file is not None:
            Path(self._unhealthy_file).write_text(reason)

    def _unloading(self) -> bool:
        """Triton marks the model not-ready as soon as it starts unloading it (SIGTERM, or an
        unload through the repository API); nothing else tells a decoupled model. Not-ready
        before it was ever ready is still loading."""
        try:
            ready = pb_utils.is_model_ready(model_name=self.model_name, model_version=self.model_version)
        except Exception as exc:  # noqa: BLE001 - a stopping server answers "Server not ready"
            if "not ready" not in str(exc):
                logger.warning("model readiness check failed: %s", exc)
                return False
            ready = False
        self._seen_ready = self._seen_ready or ready
        # Not-ready several polls in a row: one odd answer must not drain a healthy replica.
        self._not_ready_polls = 0 if ready else self._not_ready_polls + 1
        return self._seen_ready and self._not_ready_polls >= UNLOAD_CONFIRM_POLLS

    def finalize(self) -> None:
        self._stop.set()
        self._poller.join(5)
        self._publisher.join(5)
        self.loop.stop()            # every open stream gets its final ("abort") output
        self._outbox.put(None)      # ...which the sender flushes before it exits
        self._sender.join(30)
        # Metric families released now, while the stub can still write to Triton's shared
        # memory: left to the stub's own teardown, their destructors ran after it had gone
        # and the stub segfaulted on every shutdown (after the drain; no request was affected).
        if not any(t.is_alive() for t in (self._sender, self._poller, self._publisher)):
            self.metrics = None


def _coalesce(items: list[tuple[_Stream, Result]]) -> list[tuple[_Stream, Result]]:
    """Merge each stream's consecutive outputs, in order; errors are never merged."""
    result: list[tuple[_Stream, Result]] = []
    open_output: dict[str, int] = {}   # request id -> index in result of its unfinished output
    for stream, item in items:
        index = open_output.pop(stream.request_id, None)
        if index is not None and not isinstance(item, BaseException):
            result[index] = (stream, result[index][1].merged_with(item))
        else:
            index = len(result)
            result.append((stream, item))
        if not isinstance(item, BaseException) and not item.finished:
            open_output[stream.request_id] = index
    return result


# ---- input parsing ------------------------------------------------------------------------------
def _string_tensor(name: str, texts: list[str]) -> Any:
    return pb_utils.Tensor(name, np.array([text.encode("utf-8") for text in texts], dtype=np.object_))


def _completions(result: RequestOutput | ParallelOutput) -> list[RequestOutput]:
    return result.outputs if isinstance(result, ParallelOutput) else [result]


def _bool_input(request: Any, name: str) -> bool | None:
    """The flag's value, or None when the request does not send it."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise InvalidRequestError(name, "must hold exactly one boolean")
    return bool(values[0])


def _prompt_input(request: Any, max_ids: int, max_bytes: int) -> tuple[str, str | list[int]]:
    """Returns (prompt text for echoing, prompt for the engine: text or token ids). Sizes are
    checked before anything is converted (a huge tensor must not stall Triton's thread)."""
    text_tensor = pb_utils.get_input_tensor_by_name(request, "text_input")
    ids_tensor = pb_utils.get_input_tensor_by_name(request, "input_ids")
    if text_tensor is not None:
        values = text_tensor.as_numpy().reshape(-1)
        if values.size != 1:
            raise InvalidRequestError("text_input", "must hold exactly one string")
        raw = values[0]
        if len(raw) > max_bytes:
            raise InvalidRequestError("text_input", f"is longer than {max_bytes} bytes")
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidRequestError("text_input", f"is not valid UTF-8 ({exc.reason} at byte {exc.start})")
        return raw, raw
    if ids_tensor is not None:
        ids = ids_tensor.as_numpy().reshape(-1)
        if ids.size >= max_ids:
            raise InvalidRequestError("input_ids", f"has {ids.size} token ids; max_model_len is {max_ids}, "
                                                   f"leaving no room to generate")
        return "", ids.tolist()
    raise InvalidRequestError("text_input", "missing: send text_input (BYTES) or input_ids (INT32)")


def _sampling_params(request: Any) -> SamplingParams:
    """From the sampling_parameters tensor and Triton's request parameters (the tensor's keys
    win), as Triton's vLLM backend takes them."""
    tensor = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
    tensor_json = None
    if tensor is not None:
        raw = tensor.as_numpy().reshape(-1)
        if raw.size != 1:
            raise InvalidRequestError("sampling_parameters", "must hold exactly one JSON string")
        tensor_json = raw[0]
    return vllm_protocol.sampling_params(tensor_json, request.parameters())
