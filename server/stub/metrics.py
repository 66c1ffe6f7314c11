"""Engine metrics exported through Triton's custom-metrics API (Prometheus, metrics port).

Takes the ``triton_python_backend_utils`` module as an argument rather than importing it,
so this file imports outside a Triton stub too. Cumulative engine counters are mirrored
as Prometheus counters by incrementing with the difference since the last update.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

from backend.engine.stats import EngineStats
from backend.engine.loop import LatencySample
from server.stub.metric_names import READY_FAMILY

# Seconds. Dense at the low end, where a CPU or GPU decode step lives.
LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0]

GAUGES = {  # metric name -> (description, EngineStats field)
    "llm_num_requests_running": ("Requests in the running batch", "num_running"),
    "llm_num_requests_waiting": ("Requests in the waiting queue", "num_waiting"),
    "llm_kv_blocks_used": ("KV-cache blocks referenced by live requests", None),
    "llm_kv_blocks_free": ("KV-cache blocks free (including cached, revivable ones)", "kv_blocks_free"),
    "llm_kv_blocks_total": ("KV-cache blocks in the pool", "kv_blocks_total"),
    "llm_kv_blocks_cached": ("KV-cache blocks registered in the prefix cache", "kv_blocks_cached"),
    "llm_kv_cache_usage_ratio": ("Fraction of KV-cache blocks in use (0-1)", "kv_usage"),
    "llm_spec_decode_acceptance_rate": ("Speculative decoding: drafts accepted / drafts verified, since start",
                                        "spec_acceptance_rate"),
    "llm_spec_decode_mean_accepted_length": ("Speculative decoding: tokens emitted per request-step that "
                                             "verified drafts, since start (1 = nothing accepted)",
                                             "spec_mean_accepted_length"),
}
COUNTERS = {
    "llm_prefix_cache_queried_tokens_total": ("Prompt tokens looked up in the prefix cache", "prefix_cache_queried_tokens"),
    "llm_prefix_cache_hit_tokens_total": ("Prompt tokens served from the prefix cache", "prefix_cache_hit_tokens"),
    "llm_num_preemptions_total": ("Requests preempted (recomputed later) for lack of KV blocks", "num_preemptions"),
    "llm_prompt_tokens_total": ("Prompt tokens computed (prefill, excluding cache hits)", "prompt_tokens_total"),
    "llm_generation_tokens_total": ("Tokens generated", "generation_tokens_total"),
    "llm_engine_steps_total": ("Engine iterations run", "num_steps"),
    "llm_spec_decode_draft_tokens_total": ("Speculative draft tokens verified", "spec_draft_tokens"),
    "llm_spec_decode_accepted_tokens_total": ("Speculative draft tokens accepted", "spec_accepted_tokens"),
    "llm_spec_decode_emitted_tokens_total": ("Tokens emitted by request-steps that verified drafts "
                                             "(accepted drafts + one each)", "spec_emitted_tokens"),
    "llm_spec_decode_verifications_total": ("Request-steps that verified drafts", "spec_verifications"),
}
# Relative error of the step-time prediction: 0.1 = off by 10%.
ERROR_BUCKETS = [0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0]
HISTOGRAMS = {  # LatencySample.kind -> (name, description, buckets)
    "ttft": ("llm_time_to_first_token_seconds", "Time from arrival to the first generated token", LATENCY_BUCKETS),
    "itl": ("llm_inter_token_latency_seconds", "Time between consecutive token outputs of a request",
            LATENCY_BUCKETS),
    "e2e": ("llm_e2e_request_latency_seconds", "Time from arrival to the final output", LATENCY_BUCKETS),
    "step": ("llm_engine_step_duration_seconds", "Duration of one engine iteration (schedule, forward pass, "
                                                 "sampling, outputs)", LATENCY_BUCKETS),
    "step_prediction_error": ("llm_step_time_prediction_error_ratio",
                              "|predicted - measured| / measured of each engine step's time, as the scheduler's "
                              "cost model predicted it (only with itl_target_ms > 0)", ERROR_BUCKETS),
}
# The families TensorRT-LLM's Triton backend exports, under their names: load-aware routers
# (the Gateway API inference extension's endpoint picker, Triton's ORCA header) read them for
# "Triton TensorRT-LLM" servers, so they read ours without renaming (docs/scaling.md).
TRTLLM_KV_FAMILY = "nv_trt_llm_kv_cache_block_metrics"
VLLM_LORA_INFO = "vllm:lora_requests_info"
LORA_LOAD_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
TRTLLM_REQUEST_FAMILY = "nv_trt_llm_request_metrics"

# The families of Triton's vLLM backend (its src/utils/metrics.py), with its names, types,
# descriptions, labels (model, version) and buckets, so that what reads them there (its metrics
# CI test, dashboards) reads ours. Each is fed as vLLM V1 feeds it; docs/vllm_backend_compat.md
# has how, and where ours differs.
VLLM_COUNTERS = {  # name -> (description, EngineStats field)
    # vLLM counts each request's whole prompt, prefix-cache hits included, at its first token.
    "vllm:prompt_tokens_total": ("Number of prefill tokens processed.", "started_prompt_tokens_total"),
    "vllm:generation_tokens_total": ("Number of generation tokens processed.", "generation_tokens_total"),
}
VLLM_SAMPLE_HISTOGRAMS = {  # LatencySample.kind -> (name, description, buckets)
    "ttft": ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
             [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]),
    # Per decode iteration of a request, as vLLM's inter-token latency: not divided by the
    # tokens an iteration emitted (speculative decoding emits several).
    "itl": ("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.",
            [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]),
    "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
            [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]),
}
VLLM_REQUEST_PROMPT_TOKENS = ("vllm:request_prompt_tokens", "Number of prefill tokens processed.")
VLLM_REQUEST_GENERATION_TOKENS = ("vllm:request_generation_tokens", "Number of generation tokens processed.")
VLLM_REQUEST_PARAMS_N = ("vllm:request_params_n", "Histogram of the n request parameter.")
VLLM_N_BUCKETS = [1, 2, 5, 10, 20]


def report_custom_metrics(value: str | None) -> bool:
    """The vLLM backend's rule for REPORT_CUSTOM_METRICS: on only when set to "true" (any case);
    absent or anything else is off."""
    return value is not None and value.lower() == "true"


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's build_1_2_5_buckets): the token-count
    buckets of the vLLM families, up to max_model_len."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class ChangedGauge:
    """A Triton gauge that sends a value only when it differs from the last one sent. Each
    set() is a round trip to tritonserver, and the stub holds the interpreter lock through it
    (docs/benchmarks.md, "Host work per step, and metric calls that hold the interpreter lock"),
    so the engine thread's Python waits on every call; most gauges do not change between two
    snapshots."""

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._value: float | None = None

    def set(self, value: float) -> None:
        if value != self._value:
            self._metric.set(value)
            self._value = value


class EngineMetrics:
    def __init__(self, pb_utils: Any, model: str, version: str, vllm_max_model_len: int | None = None,
                 lora_enabled: Callable[[], bool] = lambda: False) -> None:
        """``vllm_max_model_len``: export the vLLM backend's families too (REPORT_CUSTOM_METRICS
        on), their token-count buckets up to this length; None leaves them out. ``lora_enabled``:
        whether the model folder has LoRA adapters now (asked at each update: adapters can be
        added while serving)."""
        self._pb = pb_utils
        self._lora_enabled = lora_enabled
        self._labels = {"model": model, "version": version}
        self._lock = threading.Lock()           # the publisher and the sender thread both update
        self._published: EngineStats | None = None
        # Families must outlive their metrics (Triton invalidates a metric whose family is
        # garbage-collected), so they are kept here.
        self._families: dict[str, Any] = {}
        self._gauges = {name: ChangedGauge(self._family(name, desc, "GAUGE").Metric(labels=self._labels))
                        for name, (desc, _) in GAUGES.items()}
        vllm = vllm_max_model_len is not None
        counters = {**COUNTERS, **(VLLM_COUNTERS if vllm else {})}
        self._counters = {name: (self._family(name, desc, "COUNTER").Metric(labels=self._labels), field)
                          for name, (desc, field) in counters.items()}
        self._last: dict[str, float] = {name: 0 for name in counters}
        # LatencySample.kind -> the histograms that observe it (ours, and vLLM's where it has one)
        self._histograms: dict[str, list[Any]] = {kind: [self._histogram(name, desc, buckets)]
                                                  for kind, (name, desc, buckets) in HISTOGRAMS.items()}
        # Per finished request: vLLM's request_prompt_tokens, request_generation_tokens and request_params_n.
        self._request_histograms: tuple[Any, Any, Any] | None = None
        if vllm:
            for kind, (name, desc, buckets) in VLLM_SAMPLE_HISTOGRAMS.items():
                self._histograms[kind].append(self._histogram(name, desc, buckets))
            token_buckets = buckets_1_2_5(vllm_max_model_len)
            self._request_histograms = (self._histogram(*VLLM_REQUEST_PROMPT_TOKENS, token_buckets),
                                        self._histogram(*VLLM_REQUEST_GENERATION_TOKENS, token_buckets),
                                        self._histogram(*VLLM_REQUEST_PARAMS_N, VLLM_N_BUCKETS))
        self._finished_family = self._family("llm_request_finished_total", "Requests finished, by finish reason",
                                             "COUNTER")
        self._lora_families = {kind: self._family(f"llm_lora_requests_{kind}", f"Requests {kind}, per LoRA adapter",
                                                  "GAUGE") for kind in ("running", "waiting")}
        self._lora_gauges: dict[str, dict[str, Any]] = {"running": {}, "waiting": {}}
        self._lora_info_family = self._family(VLLM_LORA_INFO, "LoRA adapters running and waiting (vLLM's gauge; "
                                              "the value is when it was set)", "GAUGE")
        self._lora_info: dict[tuple[str, ...], Any] = {}
        self._lora_info_key: tuple[str, ...] | None = None
        self._lora_load = self._family("llm_lora_adapter_load_seconds", "Time to load a LoRA adapter's weights",
                                       "HISTOGRAM").Metric(labels=self._labels, buckets=LORA_LOAD_BUCKETS)
        self._finished: dict[str, Any] = {}
        # The family TensorRT-LLM's backend exports; Triton builds the ORCA
        # `endpoint-load-metrics` header (KV utilisation for load-aware routers) from it.
        kv_family = self._family(TRTLLM_KV_FAMILY, "KV cache block metrics", "GAUGE")
        self._kv_block = {kind: ChangedGauge(kv_family.Metric(labels={**self._labels,
                                                                      "kv_cache_block_type": kind}))
                          for kind in ("used", "free", "max", "tokens_per", "fraction")}
        request_family = self._family(TRTLLM_REQUEST_FAMILY, "Request counts (TensorRT-LLM backend names)", "GAUGE")
        self._requests = {kind: ChangedGauge(request_family.Metric(labels={**self._labels,
                                                                           "request_type": kind}))
                          for kind in ("waiting", "scheduled", "active")}

    def _family(self, name: str, description: str, kind: str) -> Any:
        family = self._pb.MetricFamily
        self._families[name] = family(name=name, description=description, kind=getattr(family, kind))
        return self._families[name]

    def _histogram(self, name: str, description: str, buckets: Sequence[float]) -> Any:
        return self._family(name, description, "HISTOGRAM").Metric(labels=self._labels, buckets=buckets)

    def _readiness_gauges(self) -> None:
        if hasattr(self, "_ready"):
            return
        self._draining = self._family("llm_draining", "1 while the model drains for shutdown (refuses new requests)",
                                      "GAUGE").Metric(labels=self._labels)
        self._healthy = self._family("llm_engine_healthy", "0 once the engine failed in a way it cannot isolate "
                                     "(refuses requests until the server restarts)", "GAUGE").Metric(labels=self._labels)
        # The one signal a proxy's health check reads (HAProxy's, server/cluster.py) and
        # server/ready.py's probe: taking new requests = not draining and healthy.
        self._ready = self._family(READY_FAMILY, "1 while the model takes new requests (not draining, engine healthy)",
                                   "GAUGE").Metric(labels=self._labels)
        self._is_draining, self._is_healthy = False, True

    def set_draining(self, draining: bool) -> None:
        """1 from the start of a drain (shutdown/unload): a readiness probe turns not-ready on it."""
        with self._lock:
            self._readiness_gauges()
            self._is_draining = draining
            self._publish_readiness()

    def _publish_readiness(self) -> None:
        self._draining.set(1 if self._is_draining else 0)
        self._healthy.set(1 if self._is_healthy else 0)
        self._ready.set(1 if self._is_healthy and not self._is_draining else 0)

    def count_server_restarts(self, restarts: int) -> None:
        """Counter of supervisor restarts of this server (a dead stub or server), set once at start."""
        family = self._family("llm_server_restarts_total",
                              "Times the launcher restarted tritonserver because it or its model stub died", "COUNTER")
        self._restarts = family.Metric(labels=self._labels)
        if restarts:
            self._restarts.increment(restarts)

    def count_finished(self, reason: str) -> None:
        with self._lock:
            if reason not in self._finished:
                self._finished[reason] = self._finished_family.Metric(labels={**self._labels, "finish_reason": reason})
            self._finished[reason].increment(1)

    def observe_request(self, num_prompt_tokens: int, num_generation_tokens: Sequence[int]) -> None:
        """A client request's final output, before it is sent: its prompt length and the tokens
        each of its n completions generated. vLLM counts each completion as a request of its own
        (prompt and generated tokens, like the e2e latency) and n once per client request."""
        if self._request_histograms is None:
            return
        prompt, generation, n = self._request_histograms
        with self._lock:
            for tokens in num_generation_tokens:
                prompt.observe(num_prompt_tokens)
                generation.observe(tokens)
            n.observe(len(num_generation_tokens))

    def update(self, stats: EngineStats, samples: deque[LatencySample], block_size: int,
               lora_loads: deque[float] | None = None) -> None:
        """Publish a statistics snapshot and the latency samples (and adapter load times)
        queued since the last call. Called by the publisher thread every 0.1 s and by the
        sender before a final response."""
        with self._lock:
            while lora_loads:
                self._lora_load.observe(lora_loads.popleft())
            if stats is self._published and not samples:
                return     # the loop has not replaced its snapshot since
            self._published = stats
            self._update(stats, samples, block_size)
            self._update_loras(stats)

    def _update_loras(self, stats: EngineStats) -> None:
        """Per-adapter request gauges, and vLLM's ``vllm:lora_requests_info`` (a gauge whose
        labels list the running and waiting adapters and whose value is the time it was set;
        the Gateway API inference extension routes by it), exported, as vLLM does, only where
        LoRA is on: the model folder has adapters (the vLLM backend's metrics CI counts no
        ``vllm:`` line at all with its families switched off)."""
        if not self._lora_enabled():
            return
        for kind, counts in (("running", stats.lora_running), ("waiting", stats.lora_waiting)):
            gauges = self._lora_gauges[kind]
            for name in counts.keys() - gauges.keys():
                gauges[name] = ChangedGauge(self._lora_families[kind].Metric(labels={**self._labels,
                                                                                     "lora_name": name}))
            for name, gauge in gauges.items():
                gauge.set(counts.get(name, 0))
        labels = {"running_lora_adapters": ",".join(sorted(stats.lora_running)),
                  "waiting_lora_adapters": ",".join(sorted(stats.lora_waiting)), "max_lora": str(stats.max_loras)}
        key = tuple(labels.values())
        if key != self._lora_info_key:
            if self._lora_info_key is not None:
                self._lora_info[self._lora_info_key].set(0)
            if key not in self._lora_info:
                self._lora_info[key] = self._lora_info_family.Metric(labels=labels)
            self._lora_info_key = key
        self._lora_info[key].set(time.time())

    def _update(self, stats: EngineStats, samples: deque[LatencySample], block_size: int) -> None:
        self._readiness_gauges()
        if self._is_healthy != (stats.health_error is None):
            self._is_healthy = stats.health_error is None
            self._publish_readiness()
        used = stats.kv_blocks_total - stats.kv_blocks_free
        for name, (_, field) in GAUGES.items():
            self._gauges[name].set(used if field is None else getattr(stats, field))
        for name, (counter, field) in self._counters.items():
            value = getattr(stats, field)
            if value > self._last[name]:
                counter.increment(value - self._last[name])
                self._last[name] = value
        self._kv_block["used"].set(used)
        self._kv_block["free"].set(stats.kv_blocks_free)
        self._kv_block["max"].set(stats.kv_blocks_total)
        self._kv_block["tokens_per"].set(block_size)
        self._kv_block["fraction"].set(stats.kv_usage)
        self._requests["waiting"].set(stats.num_waiting)
        self._requests["scheduled"].set(stats.num_running)
        self._requests["active"].set(stats.num_waiting + stats.num_running)
        while samples:
            sample = samples.popleft()
            for histogram in self._histograms[sample.kind]:
                histogram.observe(sample.value)
