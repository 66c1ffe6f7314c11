"""The engine core: request intake and validation, then each step: schedule, run the model,
sample, update the scheduler.

Output assembly (stop checks, detokenization) is ``backend.engine.output_processor``'s; what
happens when a step fails is ``backend.engine.failure_isolation``'s. Single-threaded by
design: whoever calls ``step()`` owns the scheduler and KV state. The serving layer runs it on
its own thread (see ``backend.engine.loop``).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Sequence

from backend.config import EngineConfig
from backend.core.kv_cache_manager import KVCacheManager
from backend.core.request import Request, RequestStatus
from backend.core.scheduler import Scheduler
from backend.core.scheduler_output import SchedulerOutput
from backend.core.step_cost import StepCostModel
from backend.engine.failure_isolation import EngineHealth, find_culprits, readers_of_unwritten
from backend.engine.output_processor import OutputProcessor
from backend.engine.overlap import HostTokenBuffers, InFlightStep, overlappable
from backend.engine.stats import EngineStats, StepRecord, count_loras
from backend.engine.tokenizer import eos_token_ids, load_tokenizer
from backend.engine.validation import Prompt, RequestValidator
from backend.lora.registry import LoRARegistry
from backend.errors import InvalidRequestError, QueueFullError, is_device_error
from backend.model.architecture import ModelArchitecture
from backend.outputs import RequestOutput
from backend.sample.constraints import AllowedTokenIds
from backend.sample.grammar import GrammarService
from backend.sample.sampler import Sampler, SamplerOutput
from backend.sampling_params import SamplingParams
from backend.sample.prompt_logprobs import fill_prompt_logprobs
from backend.worker.model_runner import ModelRunner
from backend.worker.step_calibration import fit_step_cost

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, cost_model: StepCostModel | None = None) -> None:
        """``cost_model``: the step-time predictor for ``itl_target_ms`` (default: fitted from a
        calibration run now; tests hand in one with fixed coefficients)."""
        self.config = config
        self.arch = ModelArchitecture.from_folder(config.model)
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        self.runner = ModelRunner(config, self.arch)
        self.max_model_len = self.runner.max_model_len
        self.kv_cache = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                       self.arch.release_window)
        # KV-cache events (docs/scaling.md). Off (the default), nothing is started and pyzmq is not imported.
        self.kv_events = None
        if config.enable_kv_cache_events:
            from backend.engine.kv_event_publisher import start_kv_events
            self.kv_events = start_kv_events(config, self.kv_cache)
        self.sampler = Sampler(config.seed)
        # The scheduler's clock when prefill chunks are sized to an ITL target.
        self.cost_model = cost_model
        self.cost_model_origin = "handed in" if cost_model is not None else ""   # for the start-up log
        if self.cost_model is None and config.itl_target_ms > 0:
            # Timed on the worker side (backend/worker/step_calibration.py), or read from its cache.
            self.cost_model, self.cost_model_origin = fit_step_cost(self.runner, self.sampler, config,
                                                                    self.max_model_len)
        self.scheduler = Scheduler(config, self.kv_cache, on_constraint_error=self._constraint_failed,
                                   cost_model=self.cost_model)
        # LoRA adapters by name (multi_lora.json in the model folder), resolved at validation.
        self.loras = LoRARegistry(config.model, self.arch, self.runner.dtype, self.runner.device,
                                 config.max_lora_rank)
        self.validator = self.make_validator()
        self._grammars: GrammarService | None = None   # built on the first structured-output request
        self.requests: dict[str, Request] = {}      # live (waiting or running) requests
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self._pending_outputs: list[RequestOutput] = []   # e.g. aborts, reported by the next step()
        self._arrivals = itertools.count()
        self.num_steps = 0
        self.last_step: StepRecord | None = None   # for the loop's step trace and metrics
        self.prompt_tokens_total = 0
        self.started_prompt_tokens_total = 0   # EngineStats.started_prompt_tokens_total
        self.spec_counts = {"spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_emitted_tokens": 0,
                            "spec_verifications": 0}
        self.health = EngineHealth()
        # async_scheduling (backend/engine/overlap.py): the step on the device whose tokens are unread.
        self._in_flight: InFlightStep | None = None
        self.num_overlapped_steps = 0   # steps launched before the step before was read
        self._host_tokens = (HostTokenBuffers(self.runner.max_logits_rows(), self.runner.device)
                             if config.async_scheduling else None)

    @property
    def health_error(self) -> str | None:
        """Set once the engine cannot be trusted any more (``EngineHealth``)."""
        return self.health.error

    @health_error.setter
    def health_error(self, reason: str | None) -> None:
        self.health.error = reason

    # ---- intake ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request. Raises InvalidRequestError (bad input, including a
        request that could never fit) or QueueFullError (admission control)."""
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        if params.n != 1:
            # The engine schedules sequences; a parent with n completions is fanned out into n
            # requests above it (backend/engine/parallel_sampling.py).
            raise InvalidRequestError("n", "the engine takes one sequence per request: submit n > 1 through "
                                           "EngineLoop.submit, or submit child_params(params, i) for each i")
        validated = self.validator.validate(prompt, params)
        prompt_ids, max_tokens = validated.prompt_token_ids, validated.max_tokens
        if len(self.scheduler.waiting) >= self.config.max_waiting_requests:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting_requests} requests); retry later")
        request = Request(request_id=request_id, prompt_token_ids=prompt_ids, sampling_params=params,
                          arrival_seq=next(self._arrivals),
                          arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                          max_tokens=max_tokens, eos_token_ids=self.eos_token_ids)
        if validated.lora is not None:
            request.lora, request.lora_id = validated.lora, validated.lora.lora_id
        request.bad_words = validated.bad_words
        if params.allowed_token_ids is not None:
            request.constraint = AllowedTokenIds(params.allowed_token_ids, self.arch.vocab_size)
        if params.grammar_spec is not None:   # compiled off this thread; the request waits for it
            request.pending_constraint = self.grammars.constraint_for(params.grammar_spec)
        self.requests[request_id] = request
        self.output_processor.add_request(request)
        self.scheduler.add_request(request)

    @property
    def grammars(self) -> GrammarService:
        """Structured outputs' grammar compiler. Built on first use (it builds xgrammar's
        view of the vocabulary), so that engines never asked for one do not pay for it."""
        if self._grammars is None:
            self._grammars = GrammarService.for_tokenizer(self.tokenizer, self.arch.vocab_size,
                                                          sorted(self.eos_token_ids))
        return self._grammars

    def _constraint_failed(self, request: Request, error: Exception) -> None:
        """The scheduler could not build a waiting request's constraint (its grammar did not
        compile) and finished it; its final output goes out with the next step's."""
        output = self._fail_request(request, error)
        if isinstance(error, InvalidRequestError):
            output.error = error
        self._pending_outputs.append(output)

    def make_validator(self, tokenizer: Any | None = None) -> RequestValidator:
        """A validator with this engine's limits; pass a separate tokenizer to use it from
        another thread (tokenizer objects are not shared across threads)."""
        return RequestValidator(tokenizer or self.tokenizer, self.arch.vocab_size, self.max_model_len,
                                self.config.block_size, self.kv_cache.num_blocks, self.loras)

    def abort(self, request_id: str, message: str | None = None) -> bool:
        """Stop a request now and free its blocks. Its final output (finish_reason "abort",
        ``finish_message`` = ``message``) is returned by the next ``step()``. Returns False if
        the request is not in flight."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        del self.requests[request_id]
        self._pending_outputs.append(self.output_processor.final_output(request, request.status.finish_reason,
                                                                        message))
        return True

    # ---- the loop --------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs) or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Run one iteration: schedule, one forward pass, sample, update. Returns an output for
        every request that produced tokens or finished.

        If the forward pass or sampling raises, the requests responsible are found and failed
        (finish_reason "error"); the others run again and get the tokens they would have got.
        A failure no single request explains fails every request of the step (not the queue).

        With async_scheduling the step is launched before the tokens of the step before are read,
        and returns those (backend/engine/overlap.py)."""
        started = time.perf_counter()
        outputs, self._pending_outputs = self._pending_outputs, []
        sched = self.scheduler.schedule()
        overlap = self.config.async_scheduling and not sched.is_empty and self._may_overlap(sched)
        launch_error: Exception | None = None
        if overlap:
            rng = self.sampler.rng_state(sched.requests)
            try:
                launched = self._launch(sched)
            except Exception as exc:  # noqa: BLE001 - isolated below, as a synchronous step's failure
                if is_device_error(exc):
                    self.health.device_failed(exc)
                    raise
                self.sampler.restore_rng_state(rng)
                launch_error = exc
            else:
                return outputs + self._after_launch(sched, launched, started)
        if self._in_flight is not None:
            outputs += self._finish_in_flight()
            # Those that ended there (their last token was on the device when this step was scheduled).
            survivors = [r for r in sched.requests if not r.status.is_finished]
            if launch_error is not None and len(survivors) < len(sched.requests):
                # The launch may have failed on a request that has just ended: the others run
                # again, and are isolated if they fail on their own.
                logger.warning("launching a step failed (%r) with requests that have since ended; "
                               "running the others again", launch_error)
                launch_error = None
            sched.requests = survivors
        if not sched.requests:
            return outputs
        rows = self._trace_rows(sched)
        failed = False
        # The generators as they were before this step: a failed step may have drawn from some.
        rng = self.sampler.rng_state(sched.requests)
        computed = sched.requests
        try:
            if launch_error is not None:   # the overlapped launch of this step failed: the same as here
                raise launch_error
            sampling, sampled = self._run_batch(computed, sched)
        except Exception as exc:  # noqa: BLE001 - isolated below
            if is_device_error(exc):   # the device is unusable: nothing to isolate, no point retrying
                self.health.device_failed(exc)
                raise
            logger.warning("engine step failed (%r); isolating the requests responsible", exc)
            computed, sampling, sampled = self._isolate_failure(sched, exc, rng, outputs)
            failed = True
        if not failed:
            self.health.step_succeeded()
        self._count_prompt_tokens(sched, computed)
        self.scheduler.update_after_step(sched, computed)
        self.num_steps += 1
        for row, request in enumerate(sampling):
            drafts = sched.spec_token_ids.get(request.request_id)
            if drafts:
                self._count_speculation(request, len(drafts), len(sampled.token_ids[row]))
            try:
                outputs.append(self._append_tokens(request, sampled.token_ids[row], sampled.logprobs[row]))
            except Exception as exc:  # noqa: BLE001 - e.g. detokenization: this request only
                logger.exception("processing the token of %s failed", request.request_id)
                outputs.append(self._fail_request(request, exc))
        measured = time.perf_counter() - started
        error = None
        if self.cost_model is not None and not failed:   # a step re-run after a failure says nothing
            error = self.cost_model.observe(sched.features, measured)
        self.last_step = StepRecord(measured, sched.predicted_seconds, error, rows)
        return outputs

    def _trace_rows(self, sched: SchedulerOutput) -> dict[str, tuple[int, bool]]:
        """The step trace's rows (step_trace_path): tokens and prefill? per request, before the step."""
        if not self.config.step_trace_path:
            return {}
        return {r.request_id: (sched.num_scheduled_tokens[r.request_id], r.num_computed_tokens < r.num_prompt_tokens)
                for r in sched.requests}

    def _count_prompt_tokens(self, sched: SchedulerOutput, computed: list[Request]) -> None:
        """Prompt tokens the step computes, counted before the scheduler's counters move."""
        for request in computed:
            self.prompt_tokens_total += max(0, min(sched.num_scheduled_tokens[request.request_id],
                                                   request.num_prompt_tokens - request.num_computed_tokens))

    def _may_overlap(self, sched: SchedulerOutput) -> bool:
        processors = self.sampler.processors
        return all(overlappable(request, processors) for request in sched.requests)

    def _launch(self, sched: SchedulerOutput) -> InFlightStep | None:
        """Pack, run and sample ``sched`` without waiting for the device; None when no request
        samples in it (prefill chunks only). Changes no scheduling state."""
        requests = sched.requests
        block_ids = {r.request_id: self.kv_cache.block_ids_of(r.request_id) for r in requests}
        pending = self._in_flight.pending if self._in_flight is not None else None
        input_ids, meta, sampling = self.runner.prepare(requests, sched.num_scheduled_tokens, block_ids,
                                                        pending=pending)
        logits = self.runner.execute(input_ids, meta)
        if not sampling:
            return None
        _, tokens = self.sampler.choose(logits, self.sampler.prepare(sampling, None, logits.shape[-1], logits.device))
        return InFlightStep.launch(sampling, tokens, self._host_tokens)

    def _after_launch(self, sched: SchedulerOutput, launched: InFlightStep | None,
                      started: float) -> list[RequestOutput]:
        """The launched step counts as run; the step before it is read: its outputs."""
        rows = self._trace_rows(sched)
        self.health.step_succeeded()
        self._count_prompt_tokens(sched, sched.requests)
        self.scheduler.update_after_step(sched)
        self.num_steps += 1
        self.num_overlapped_steps += self._in_flight is not None
        for request in launched.sampling if launched is not None else ():
            request.num_pending_tokens += 1
        outputs = self._finish_in_flight() if self._in_flight is not None else []
        self._in_flight = launched
        # The host's time for the step; the cost model learns only from steps it can time whole.
        self.last_step = StepRecord(time.perf_counter() - started, sched.predicted_seconds, None, rows)
        return outputs

    def _finish_in_flight(self) -> list[RequestOutput]:
        """Read the step on the device and process its tokens as a synchronous step would."""
        flight, self._in_flight = self._in_flight, None
        outputs = []
        for request, token in zip(flight.sampling, flight.read()):
            request.num_pending_tokens -= 1
            if self.requests.get(request.request_id) is not request:
                continue   # it ended (or was aborted) after the step was launched: the token is not its
            try:
                outputs.append(self._append_tokens(request, [token], None))
            except Exception as exc:  # noqa: BLE001 - e.g. detokenization: this request only
                logger.exception("processing the token of %s failed", request.request_id)
                outputs.append(self._fail_request(request, exc))
        return outputs

    def _count_speculation(self, request: Request, num_drafts: int, num_emitted: int) -> None:
        """The counter and blocks of a request that verified drafts: only accepted ones count."""
        self.scheduler.finish_speculation(request, num_drafts, num_emitted - 1)
        self.spec_counts["spec_draft_tokens"] += num_drafts
        self.spec_counts["spec_accepted_tokens"] += num_emitted - 1
        self.spec_counts["spec_emitted_tokens"] += num_emitted
        self.spec_counts["spec_verifications"] += 1

    def _run_batch(self, requests: list[Request], sched: SchedulerOutput,
                   ) -> tuple[list[Request], SamplerOutput | None]:
        """Forward pass + sampling for ``requests`` (scheduled in ``sched``). Touches no
        scheduling state: only the K/V slots of these requests and the RNGs."""
        block_ids = {r.request_id: self.kv_cache.block_ids_of(r.request_id) for r in requests}
        input_ids, meta, sampling = self.runner.prepare(requests, sched.num_scheduled_tokens, block_ids,
                                                        sched.spec_token_ids)
        logits = self.runner.execute(input_ids, meta)
        prompt_rows = self.runner.prompt_logprob_rows
        if prompt_rows:     # rows after the sampling ones (ModelRunner._prompt_logprob_rows)
            num_prompt_rows = sum(part.count for part in prompt_rows)
            fill_prompt_logprobs(logits[logits.shape[0] - num_prompt_rows:], prompt_rows)
            logits = logits[:logits.shape[0] - num_prompt_rows]
        drafts = [sched.spec_token_ids.get(r.request_id, []) for r in sampling]
        return sampling, (self.sampler(logits, sampling, drafts) if sampling else None)

    def _isolate_failure(self, sched: SchedulerOutput, error: Exception, rng: list, outputs: list[RequestOutput],
                         ) -> tuple[list[Request], list[Request], SamplerOutput | None]:
        """A step failed: fail the requests that fail on their own (backend/engine/failure_isolation.py),
        recompute those that read what they were to write, and run the step again without
        either. RNG states are restored before every run, so seeded requests draw the same
        noise as they would have. Returns what ``step`` continues with."""

        def run(group: list[Request]) -> None:
            self.sampler.restore_rng_state(rng)
            self._run_batch(group, sched)

        culprits = find_culprits(sched.requests, run, error)
        if len(culprits) == len(sched.requests) > 1:
            logger.error("engine step failed and no single request explains it: %r", error)
        self.health.step_failed(len(culprits), len(sched.requests), error)
        # Blocks this step was to write: once nobody who would write them holds them, their
        # prefix-cache entries must go (nothing valid is behind them).
        pending = [self.kv_cache.uncomputed_blocks(r) for r in sched.requests]
        culprit_requests = [r for r in sched.requests if r.request_id in culprits]
        survivors = [r for r in sched.requests if r.request_id not in culprits]
        for request in readers_of_unwritten(self.kv_cache, culprit_requests, survivors):
            survivors.remove(request)
            self.scheduler.preempt(request, sched)
        for request in culprit_requests:
            logger.error("request %s failed in an engine step: %r", request.request_id, culprits[request.request_id])
            outputs.append(self._fail_request(request, culprits[request.request_id]))
        self.kv_cache.forget_unwritten(pending)
        self.sampler.restore_rng_state(rng)
        sampling, sampled = self._run_batch(survivors, sched) if survivors else ([], None)
        return survivors, sampling, sampled

    def _fail_request(self, request: Request, error: BaseException) -> RequestOutput:
        """End one request with finish_reason "error" (its blocks are freed; unwritten ones
        leave the prefix cache)."""
        if not request.status.is_finished:
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR)
        self.requests.pop(request.request_id, None)
        return self.output_processor.error_output(request, error)

    def _append_tokens(self, request: Request, token_ids: list[int], logprobs: dict | None) -> RequestOutput:
        if request.num_output_tokens == 0:   # its first token (a preempted request keeps its tokens)
            self.started_prompt_tokens_total += request.num_prompt_tokens
        output = self.output_processor.append_tokens(request, token_ids, logprobs)
        if output.finish_reason is not None:
            self.scheduler.finish_request(request, RequestStatus.finished_with(output.finish_reason))
            del self.requests[request.request_id]
        return output

    # ---- convenience and introspection -------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Submit all prompts at once, run to completion, return final outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        ids = [f"generate-{next(self._arrivals)}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params_list):
            self.add_request(request_id, prompt, p)
        finals: dict[str, RequestOutput] = {}
        while len(finals) < len(ids):
            for output in self.step():
                if output.finished:
                    finals[output.request_id] = output
        return [finals[i] for i in ids]

    def stats(self) -> EngineStats:
        kv = self.kv_cache
        used = kv.num_blocks - kv.num_free_blocks
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=kv.num_blocks, kv_blocks_free=kv.num_free_blocks,
            kv_blocks_cached=kv.num_cached_blocks, kv_usage=used / kv.num_blocks,
            prefix_cache_queried_tokens=self.kv_cache.prefix_queried_tokens,
            prefix_cache_hit_tokens=self.kv_cache.prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions, num_steps=self.num_steps,
            prompt_tokens_total=self.prompt_tokens_total,
            started_prompt_tokens_total=self.started_prompt_tokens_total,
            generation_tokens_total=self.output_processor.generation_tokens_total,
            health_error=self.health_error, lora_running=count_loras(self.scheduler.running),
            lora_waiting=count_loras(self.scheduler.waiting), max_loras=self.config.max_loras, **self.spec_counts)

    def check_invariants(self) -> None:
        """Raise AssertionError if block accounting is inconsistent."""
        live = {r.request_id: r for r in self.scheduler.running}
        for request in self.scheduler.waiting:
            if self.kv_cache.holds_blocks(request.request_id):
                raise AssertionError(f"waiting request {request.request_id} holds KV blocks")
        self.kv_cache.check_invariants(live)
        if set(live) | {r.request_id for r in self.scheduler.waiting} != set(self.requests):
            raise AssertionError("engine and scheduler disagree on the live requests")
        if not self.requests and self.kv_cache.num_free_blocks != self.kv_cache.num_blocks:
            raise AssertionError("no request is live but some KV blocks are not free")
