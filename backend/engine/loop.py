"""Runs an Engine on a thread of its own, for servers.

Thread ownership:
- The loop thread is the only one that touches the Engine (scheduler, KV cache, model).
- Callers (e.g. Triton's ``execute``) call ``submit`` / ``abort`` from any thread: both
  only validate and enqueue a command, then wake the loop; they never wait for a step.
- Outputs are handed to each request's callback *on the loop thread*; callbacks must not
  block (the Triton adapter puts them on its own sender thread's queue). With
  ``stream_interval`` > 1 a running request's outputs are held and merged until that many
  tokens have gathered; its first token, its end and any error go out at once.
- When there is nothing to do the loop sleeps on a condition variable: an idle server
  uses no CPU.
- ``drain`` (shutdown or model unload) refuses new submissions, lets what is in flight
  finish until a deadline, then aborts the rest with a message: every request gets a
  final output, none is left to a transport error.
"""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import os
import resource
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from backend.config import EngineConfig
from backend.core.request import RequestStatus
from backend.engine.engine import Engine
from backend.engine.stats import EngineStats
from backend.engine.tokenizer import load_tokenizer
from backend.engine.parallel_sampling import ParallelOutput, ParentRequest, child_params
from backend.engine.validation import Prompt, ValidatedPrompt
from backend.errors import EngineUnhealthyError, QueueFullError, ShuttingDownError
from backend.outputs import FinishReason, RequestOutput
from backend.sampling_params import SamplingParams
from backend.worker.fault_injection import install_from_environment

logger = logging.getLogger(__name__)

# Receives each RequestOutput of the request, or one exception that ends it.
OutputCallback = Callable[[RequestOutput | BaseException], None]
# The same for a request with n > 1 (all its children in each output).
ParallelCallback = Callable[[ParallelOutput | BaseException], None]


# glibc keeps freed heap memory (steps of ever-different shapes leave it fragmented) instead
# of returning it: a long soak grew the stub's RSS with no live object behind it,
# and malloc_trim(0) gave it all back. The loop trims this often, between steps.
TRIM_INTERVAL_S = 30.0

# When requests are in flight but a step had nothing to run (every one is waiting for its
# grammar to compile), the loop waits this long, or until a submission or abort, before it
# looks again: a compile takes milliseconds to seconds, and spinning would take a core from it.
NOTHING_TO_RUN_WAIT_S = 0.002


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")   # /proc/stat's unit


@dataclass(frozen=True)
class CpuSnapshot:
    """For the step trace: each thread of this process's time on a core and time runnable but
    waiting for one (Linux schedstat, ns; a thread that ended in between is not seen), and the
    machine's stolen time (/proc/stat, clock ticks: time the hypervisor ran something else on a
    virtual CPU, which no thread's schedstat sees). Empty where /proc does not have them."""
    threads: dict[int, tuple[int, int]]
    steal_ticks: int

    @staticmethod
    def take() -> "CpuSnapshot":
        threads: dict[int, tuple[int, int]] = {}
        try:
            for tid in os.listdir("/proc/self/task"):
                try:
                    with open(f"/proc/self/task/{tid}/schedstat") as f:
                        on_cpu, waiting, _ = f.read().split()
                except (OSError, ValueError):   # the thread ended meanwhile
                    continue
                threads[int(tid)] = (int(on_cpu), int(waiting))
            with open("/proc/stat") as f:
                fields = f.readline().split()
            steal = int(fields[8]) if len(fields) > 8 else 0
        except OSError:
            return CpuSnapshot({}, 0)
        return CpuSnapshot(threads, steal)

    def since(self, before: "CpuSnapshot") -> dict:
        """Per thread that ran at least 1 ms: [ms on a core, ms runnable and waiting], the
        busiest first; and the machine's stolen ms."""
        rows = []
        for tid, (on_cpu, waiting) in self.threads.items():
            on0, wait0 = before.threads.get(tid, (0, 0))
            if on_cpu - on0 >= 1_000_000:
                rows.append([round((on_cpu - on0) / 1e6, 2), round((waiting - wait0) / 1e6, 2)])
        rows.sort(reverse=True)
        return {"threads_ms": rows, "steal_ms": (self.steal_ticks - before.steal_ticks) * 1000 // _CLOCK_TICKS}


def build_engine(config: EngineConfig) -> Engine:
    """``Engine(config)``, built on a short-lived thread of its own, for an engine that a loop
    thread will run.

    Why: torch's CPU kernels run on libgomp, which keeps one pool of worker threads per thread
    that ever started a parallel region. Loading a model does, so built on the caller's
    thread (Triton's stub main thread) the engine leaves an idle pool there; the loop thread
    then starts a second one, libgomp counts more of its threads than cores and throttles
    every worker's spin-wait to almost nothing, and the workers fall asleep between the ~250
    parallel regions of a step, which made a served bfloat16 decode step markedly slower
    (docs/benchmarks.md). A pool dies with its thread, so building here leaves the loop
    thread's the only one."""
    built: list[Engine] = []
    failed: list[BaseException] = []

    def build() -> None:
        try:
            built.append(Engine(config))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=build, name="engine-build")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    install_from_environment(built[0].runner)   # LLM_INJECT_STEP_FAULT: health tests, chaos runs
    return built[0]


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):   # not glibc: nothing to do
        return None


class EngineStepError(RuntimeError):
    """A request failed inside an engine step: alone (the others of the step went on), or
    together with every in-flight request when the failure could not be pinned on any."""


@dataclass
class _Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    callback: OutputCallback
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


@dataclass
class LatencySample:
    kind: str        # "ttft" | "itl" | "e2e" | "step" (one engine iteration), in seconds;
                     # "step_prediction_error": |predicted - measured| / measured of a step's time
    value: float


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # A tokenizer of its own: validation runs on callers' threads, detokenization on ours.
        self.validator = engine.make_validator(load_tokenizer(engine.config.model))
        self._cond = threading.Condition()
        self._inbox: deque[_Submit | _Abort] = deque()
        self._num_pending_submits = 0
        self._stopping = False
        self._drain_deadline: float | None = None   # monotonic time; set once draining
        self._idle = threading.Event()              # set while no request is in flight
        self._children: dict[str, list[str]] = {}   # n > 1: parent id -> child ids, until it ends
        # Written once by the loop thread when the engine turns unhealthy, read by any: from
        # then on every request is refused (EngineUnhealthyError) until the server restarts.
        self.health_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # Loop-thread state.
        self._malloc_trim = _load_malloc_trim()
        self._step_trace = None   # opened on the loop thread (EngineConfig.step_trace_path)
        # With the step trace on: seconds the garbage collector ran (any thread; it holds the
        # GIL), so that each step's line says how much of it was a collection.
        self._gc_seconds = 0.0
        self._gc_started: float | None = None
        self._step_trace_on = bool(engine.config.step_trace_path)
        if self._step_trace_on:
            gc.callbacks.append(self._on_gc)
        self._last_trim = time.monotonic()
        self._callbacks: dict[str, OutputCallback] = {}
        self._arrival: dict[str, float] = {}
        self._last_token_time: dict[str, float] = {}
        self._stream_interval = engine.config.stream_interval
        self._held: dict[str, RequestOutput] = {}   # stream_interval > 1: outputs not handed out yet
        self._preemptions_seen = 0   # the scheduler's count when held outputs were last checked
        # Read by other threads: a snapshot replaced (never mutated) after every iteration,
        # and latency samples appended here and drained by a metrics reader.
        self.stats: EngineStats = engine.stats()
        self.latency_samples: deque[LatencySample] = deque(maxlen=100_000)

    # ---- any thread -------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, request_id: str, prompt: Prompt, params: SamplingParams,
               callback: OutputCallback | ParallelCallback) -> ValidatedPrompt:
        """Validate and enqueue. Raises InvalidRequestError or QueueFullError at once; after a
        successful return every outcome (outputs or an error) arrives through ``callback``.
        With ``params.n > 1`` the request fans out into n children (backend/engine/
        parallel_sampling.py), which count against the queue limit, and ``callback`` receives
        ``ParallelOutput``s."""
        validated = self.validator.validate(prompt, params)
        now = time.monotonic()
        if params.n == 1:
            submits = [_Submit(request_id, validated.prompt_token_ids, params, callback, now)]
        else:
            parent = ParentRequest(request_id, params.n, len(validated.prompt_token_ids),
                                   self._parent_callback(request_id, callback))
            submits = [_Submit(child, validated.prompt_token_ids, child_params(params, i), parent.child_callback(i), now)
                       for i, child in enumerate(parent.child_ids)]
        with self._cond:
            if self._stopping or self._drain_deadline is not None:
                raise ShuttingDownError("server is shutting down; retry on another replica")
            if self.health_error is not None:
                raise EngineUnhealthyError(self.health_error)
            # The engine's own queue length is read without its thread's cooperation; it is an
            # estimate, and the engine re-checks when the command is applied.
            waiting = self._num_pending_submits + len(self.engine.scheduler.waiting)
            if waiting + len(submits) > self.engine.config.max_waiting_requests:
                raise QueueFullError(f"waiting queue is full ({self.engine.config.max_waiting_requests} "
                                     f"requests); retry later")
            if params.n > 1:
                self._children[request_id] = [submit.request_id for submit in submits]
            self._inbox.extend(submits)
            self._num_pending_submits += len(submits)
            self._idle.clear()
            self._cond.notify()
        return validated

    def _parent_callback(self, request_id: str, callback: ParallelCallback) -> ParallelCallback:
        """The parent's callback, which also forgets the parent once it ended and aborts the
        other children when one failed."""
        def deliver(item: ParallelOutput | BaseException) -> None:
            if isinstance(item, BaseException) or item.finished:
                with self._cond:
                    children = self._children.pop(request_id, [])
                if isinstance(item, BaseException):
                    for child in children:
                        self.abort(child)
            callback(item)
        return deliver

    def abort(self, request_id: str) -> None:
        """Ask the loop to abort a request (all its children when it has n > 1); its callback
        then receives a final "abort" output."""
        with self._cond:
            for target in self._children.get(request_id, [request_id]):
                self._inbox.append(_Abort(target))
            self._cond.notify()

    def drain(self, timeout: float) -> None:
        """Refuse new submissions from now on; requests in flight may finish for ``timeout``
        seconds, after which the loop aborts them (finish_reason "abort" with a message)."""
        with self._cond:
            if self._drain_deadline is None:
                self._drain_deadline = time.monotonic() + timeout
                logger.warning("draining: %d request(s) in flight, deadline in %.1f s",
                               len(self._callbacks) + self._num_pending_submits, timeout)
            self._cond.notify()

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is in flight (True) or ``timeout`` passes (False)."""
        return self._idle.wait(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything in flight (each callback gets its final output) and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.engine.kv_events is not None and not self._thread.is_alive():   # no step records any more
            self.engine.kv_events.close()

    # ---- the loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self._stopping and not self.engine.has_unfinished_requests():
                    self._idle.set()
                    self._cond.wait()
                self._idle.clear()
                commands = list(self._inbox)
                self._inbox.clear()
                self._num_pending_submits = 0
                stopping = self._stopping
                drain_expired = self._drain_deadline is not None and time.monotonic() >= self._drain_deadline
            for command in commands:
                self._apply(command)
            if stopping:
                self._abort_all("server is shutting down: generation stopped")
                if self._step_trace is not None:
                    self._step_trace.close()
                if self._on_gc in gc.callbacks:
                    gc.callbacks.remove(self._on_gc)
                self._idle.set()
                return
            if drain_expired and self.engine.requests:
                try:
                    self._abort_all("server is shutting down: generation stopped at the drain deadline")
                except Exception as exc:  # noqa: BLE001 - every stream must still get its end
                    logger.exception("aborting at the drain deadline failed")
                    self._fail_all(EngineStepError(f"server is shutting down; aborting failed: {exc!r}"))
                continue
            started = time.monotonic()
            gc_before = self._gc_seconds
            usage_before = resource.getrusage(resource.RUSAGE_SELF) if self._step_trace_on else None
            cpu_before = CpuSnapshot.take() if self._step_trace_on else None
            steps_before = self.engine.num_steps
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - the engine could not isolate it
                logger.exception("engine step failed")
                self._become_unhealthy(self.engine.health_error or f"a failed step could not be isolated: {exc!r}")
                continue
            nothing_ran = self.engine.num_steps == steps_before and not outputs
            if not nothing_ran:
                self.latency_samples.append(LatencySample("step", time.monotonic() - started))
            if self.engine.num_steps != steps_before:
                record = self.engine.last_step
                if record is not None and record.prediction_error is not None:
                    self.latency_samples.append(LatencySample("step_prediction_error", record.prediction_error))
                if self._step_trace_on:
                    self._trace_step(started, time.monotonic() - started, self._gc_seconds - gc_before, usage_before,
                                     cpu_before)
            # The snapshot first: whoever sees an output (a final response, and a client that
            # then reads /metrics) finds its step already in the statistics.
            self.stats = self.engine.stats()
            self._deliver(outputs)
            if self.engine.health_error is not None and self.health_error is None:
                self._become_unhealthy(self.engine.health_error)
                self.stats = self.engine.stats()
            if nothing_ran:
                with self._cond:
                    if not self._inbox and not self._stopping:
                        self._cond.wait(NOTHING_TO_RUN_WAIT_S)
            if self._malloc_trim is not None and time.monotonic() - self._last_trim > TRIM_INTERVAL_S:
                self._malloc_trim(0)
                self._last_trim = time.monotonic()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            self._gc_seconds += time.perf_counter() - self._gc_started
            self._gc_started = None

    def _trace_step(self, started: float, seconds: float, gc_seconds: float,
                    usage_before: resource.struct_rusage | None, cpu_before: CpuSnapshot | None) -> None:
        """One JSON line per step: its number, start (monotonic s), duration of the loop
        iteration (ms), the engine step's own measured and predicted time (ms; predicted null
        without a cost model), what else happened in the process meanwhile (the garbage
        collector's time in ms, minor page faults, involuntary context switches: threads of this
        process put off a core for another, the process's time in the kernel; per busy thread
        its ms on a core and ms waiting for one, and the machine's stolen ms: CpuSnapshot) and
        rows ``[request id, tokens, prefill?]`` (loadtest/slots.py draws the slot timeline from
        it, loadtest/steps.py the chunk sizes, errors and where slow steps' CPU time went)."""
        if self._step_trace is None:
            self._step_trace = open(self.engine.config.step_trace_path, "a", buffering=1)
        record = self.engine.last_step
        assert record is not None and usage_before is not None and cpu_before is not None
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = CpuSnapshot.take().since(cpu_before)
        rows = [[request_id, tokens, prefill] for request_id, (tokens, prefill) in record.rows.items()]
        predicted = None if record.predicted_s is None else round(record.predicted_s * 1e3, 3)
        self._step_trace.write(json.dumps({"step": self.engine.num_steps, "t": round(started, 6),
                                           "ms": round(seconds * 1e3, 3), "engine_ms": round(record.measured_s * 1e3, 3),
                                           "predicted_ms": predicted, "gc_ms": round(gc_seconds * 1e3, 3),
                                           "minor_faults": usage.ru_minflt - usage_before.ru_minflt,
                                           "preempted": usage.ru_nivcsw - usage_before.ru_nivcsw,
                                           "sys_ms": round((usage.ru_stime - usage_before.ru_stime) * 1e3, 2),
                                           **cpu,
                                           "rows": rows}) + "\n")

    def _apply(self, command: _Submit | _Abort) -> None:
        if isinstance(command, _Abort):
            self.engine.abort(command.request_id)
            return
        if self.health_error is not None:   # queued before the engine turned unhealthy
            command.callback(EngineUnhealthyError(self.health_error))
            return
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                    arrival_time=command.arrival_time)
        except Exception as exc:  # e.g. duplicate id or queue full: tell this request only
            command.callback(exc)
            return
        self._callbacks[command.request_id] = command.callback
        self._arrival[command.request_id] = command.arrival_time

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            request_id = output.request_id
            callback = self._callbacks.get(request_id)
            if callback is None:
                continue
            first_tokens = False
            if output.new_token_ids:
                last = self._last_token_time.get(request_id)
                first_tokens = last is None
                if first_tokens:
                    self.latency_samples.append(LatencySample("ttft", now - self._arrival[request_id]))
                else:
                    self.latency_samples.append(LatencySample("itl", now - last))
                self._last_token_time[request_id] = now
            if output.finished:
                self.latency_samples.append(LatencySample("e2e", now - self._arrival[request_id]))
                del self._callbacks[request_id], self._arrival[request_id]
                self._last_token_time.pop(request_id, None)
            if self._stream_interval > 1:
                output = self._hold_or_release(output, callback, first_tokens)
                if output is None:
                    continue
            self._hand_out(output, callback)
        if self._held:
            self._release_preempted()

    def _release_preempted(self) -> None:
        """Hand out what is held for requests that this step preempted: they produce nothing
        until they are scheduled again, which under memory pressure may be long."""
        preemptions = self.engine.scheduler.num_preemptions
        if preemptions == self._preemptions_seen:
            return
        self._preemptions_seen = preemptions
        for request_id in list(self._held):
            request = self.engine.requests.get(request_id)
            if request is not None and request.status is RequestStatus.WAITING:
                self._hand_out(self._held.pop(request_id), self._callbacks[request_id])

    def _hold_or_release(self, output: RequestOutput, callback: OutputCallback, first_tokens: bool,
                         ) -> RequestOutput | None:
        """stream_interval > 1: the output to hand out now (merged with what was held), or None
        while a running request has fewer than stream_interval tokens gathered."""
        held = self._held.pop(output.request_id, None)
        failed = output.error is not None or output.finish_reason is FinishReason.ERROR
        if held is not None:
            if failed:   # the tokens before the failure still reach the client, then the error
                self._hand_out(held, callback)
            else:
                output = held.merged_with(output)
        if output.finished or first_tokens or len(output.new_token_ids) >= self._stream_interval:
            return output
        self._held[output.request_id] = output
        return None

    def _hand_out(self, output: RequestOutput, callback: OutputCallback) -> None:
        try:
            if output.error is not None:
                callback(output.error)   # e.g. its grammar did not compile: the request's fault
            elif output.finish_reason is FinishReason.ERROR:   # failed inside a step, alone: an error, not text
                callback(EngineStepError(f"request failed in an engine step: {output.finish_message}"))
            else:
                callback(output)
        except Exception:
            logger.exception("output callback of %s failed", output.request_id)

    def _abort_all(self, message: str) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id, message)
        self._deliver(self.engine.step())
        self.stats = self.engine.stats()

    def _become_unhealthy(self, reason: str) -> None:
        """Refuse everything from now on and end what is in flight with the reason; the
        serving layer reports not-ready and its supervisor restarts the server."""
        self.engine.health_error = reason
        self.health_error = reason
        logger.error("engine is unhealthy: %s; refusing requests until the server is restarted", reason)
        self._fail_all(EngineUnhealthyError(reason))

    def _fail_all(self, error: BaseException) -> None:
        callbacks = dict(self._callbacks)
        try:
            for request_id in list(self.engine.requests):
                self.engine.abort(request_id)
            self.engine.step()  # collects the abort outputs; nothing else is left to run
        except Exception:  # noqa: BLE001 - the callbacks below must still run
            logger.exception("cleaning up after a failed step failed")
        self._callbacks.clear()
        self._arrival.clear()
        self._last_token_time.clear()
        held, self._held = self._held, {}
        for request_id, callback in callbacks.items():
            if request_id in held:   # tokens generated before the failure still go out first
                self._hand_out(held[request_id], callback)
            try:
                callback(error)
            except Exception:
                logger.exception("error callback of %s failed", request_id)
        self.stats = self.engine.stats()
