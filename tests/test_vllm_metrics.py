"""Triton's vLLM backend's metric families (server/stub/metrics.py): names, types, descriptions,
labels and buckets as that backend declares them (src/utils/metrics.py at 8de0c148, copied
below), the REPORT_CUSTOM_METRICS switch, and through the real server the values a few
requests imply, read right after the last response (as that backend's metrics CI reads them)."""

from __future__ import annotations

import re
import threading
import urllib.request
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from backend import Engine, EngineConfig, SamplingParams
from backend.engine.loop import LatencySample
from backend.engine.stats import EngineStats
from server.launch import TritonServer, free_ports, repository_with_params
from server.stub.metrics import EngineMetrics, buckets_1_2_5, report_custom_metrics
from tests.conftest import FIXED_BUDGET, FIXED_BUDGET_PARAMS
from tests.grpc_requests import stream_request, vllm_inputs
from tests.tiny_models import save_tiny_model

# The vLLM backend's declarations, verbatim: name -> (type, description, buckets).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
E2E_BUCKETS = [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
TOKEN_BUCKETS_8192 = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]   # build_1_2_5_buckets(8192)
VLLM_FAMILIES = {
    "vllm:prompt_tokens_total": ("counter", "Number of prefill tokens processed.", None),
    "vllm:generation_tokens_total": ("counter", "Number of generation tokens processed.", None),
    "vllm:time_to_first_token_seconds": ("histogram", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "vllm:time_per_output_token_seconds": ("histogram", "Histogram of time per output token in seconds.",
                                           TPOT_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("histogram", "Histogram of end to end request latency in seconds.",
                                         E2E_BUCKETS),
    "vllm:request_prompt_tokens": ("histogram", "Number of prefill tokens processed.", TOKEN_BUCKETS_8192),
    "vllm:request_generation_tokens": ("histogram", "Number of generation tokens processed.", TOKEN_BUCKETS_8192),
    "vllm:request_params_n": ("histogram", "Histogram of the n request parameter.", [1, 2, 5, 10, 20]),
}
LABELS = {"model": "llm", "version": "1"}
STREAM_INTERVAL = 4   # the vLLM-metrics server hands streams their tokens 4 at a time


# ---- the stub side, with a stand-in for triton_python_backend_utils ---------------------------------
class FakeMetric:
    def __init__(self, labels: dict[str, str], buckets: list[float] | None) -> None:
        self.labels, self.buckets = labels, buckets
        self.value = 0.0
        self.observed: list[float] = []

    def increment(self, value: float) -> None:
        self.value += value

    def set(self, value: float) -> None:
        self.value = value

    def observe(self, value: float) -> None:
        self.observed.append(value)


def fake_pb_utils() -> Any:
    families: dict[str, Any] = {}

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name: str, description: str, kind: str) -> None:
            self.name, self.description, self.kind = name, description, kind
            self.metrics: list[FakeMetric] = []
            families[name] = self

        def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> FakeMetric:
            self.metrics.append(FakeMetric(labels, buckets))
            return self.metrics[-1]

    return SimpleNamespace(MetricFamily=MetricFamily, families=families)


def engine_stats(**counters: int) -> EngineStats:
    fields = dict(num_running=0, num_waiting=0, kv_blocks_total=64, kv_blocks_free=64, kv_blocks_cached=0,
                  kv_usage=0.0, prefix_cache_queried_tokens=0, prefix_cache_hit_tokens=0, num_preemptions=0,
                  num_steps=0, prompt_tokens_total=0, generation_tokens_total=0)
    return EngineStats(**{**fields, **counters})


def only(pb: Any, name: str) -> FakeMetric:
    (metric,) = pb.families[name].metrics
    return metric


def test_the_switch_reads_like_the_vllm_backend() -> None:
    """On only for "true" in any case; absent or any other value is off (its default)."""
    assert all(report_custom_metrics(value) for value in ("true", "True", "TRUE"))
    assert not any(report_custom_metrics(value) for value in (None, "", "false", "1", "yes", "on", " true"))


def test_token_buckets_are_vllms_1_2_5_series() -> None:
    assert buckets_1_2_5(8192) == TOKEN_BUCKETS_8192
    assert buckets_1_2_5(1) == [1]
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]


def test_switched_on_the_eight_families_are_the_vllm_backends() -> None:
    pb = fake_pb_utils()
    EngineMetrics(pb, model="llm", version="1", vllm_max_model_len=8192)
    ours = {name for name in pb.families if name.startswith("vllm:")} - {"vllm:lora_requests_info"}
    assert ours == set(VLLM_FAMILIES)
    for name, (kind, description, buckets) in VLLM_FAMILIES.items():
        family = pb.families[name]
        assert (family.kind, family.description) == (kind, description), name
        (metric,) = family.metrics
        assert metric.labels == LABELS and metric.buckets == buckets, name


def test_switched_off_there_is_none_of_them() -> None:
    pb = fake_pb_utils()
    metrics = EngineMetrics(pb, model="llm", version="1")
    assert not set(VLLM_FAMILIES) & set(pb.families)
    metrics.observe_request(5, [3, 4])    # a no-op, not an error
    metrics.update(engine_stats(generation_tokens_total=3), deque([LatencySample("ttft", 0.1)]), 16)
    assert only(pb, "llm_generation_tokens_total").value == 3
    assert only(pb, "llm_time_to_first_token_seconds").observed == [0.1]


def test_engine_statistics_feed_the_vllm_families_and_ours() -> None:
    pb = fake_pb_utils()
    metrics = EngineMetrics(pb, model="llm", version="1", vllm_max_model_len=8192)
    samples = deque([LatencySample("ttft", 0.2), LatencySample("itl", 0.05), LatencySample("itl", 0.07),
                     LatencySample("e2e", 0.9), LatencySample("step", 0.01)])
    metrics.update(engine_stats(prompt_tokens_total=20, started_prompt_tokens_total=30, generation_tokens_total=3),
                   samples, 16)
    assert not samples
    # vLLM counts whole prompts (cache hits included); ours counts the prefill computed.
    assert only(pb, "vllm:prompt_tokens_total").value == 30 and only(pb, "llm_prompt_tokens_total").value == 20
    assert only(pb, "vllm:generation_tokens_total").value == 3
    assert only(pb, "vllm:time_to_first_token_seconds").observed == [0.2]
    assert only(pb, "vllm:time_per_output_token_seconds").observed == [0.05, 0.07]
    assert only(pb, "llm_inter_token_latency_seconds").observed == [0.05, 0.07]
    assert only(pb, "vllm:e2e_request_latency_seconds").observed == [0.9]
    assert only(pb, "llm_engine_step_duration_seconds").observed == [0.01]
    metrics.update(engine_stats(started_prompt_tokens_total=41, generation_tokens_total=9), deque(), 16)
    assert only(pb, "vllm:prompt_tokens_total").value == 41 and only(pb, "vllm:generation_tokens_total").value == 9


def test_a_request_with_n_completions_is_n_requests_and_one_n() -> None:
    """vLLM V1 runs n completions as n child requests: each child's prompt and generated tokens
    are observed, n once per client request."""
    pb = fake_pb_utils()
    metrics = EngineMetrics(pb, model="llm", version="1", vllm_max_model_len=8192)
    metrics.observe_request(7, [5, 3])
    metrics.observe_request(4, [6])
    assert only(pb, "vllm:request_prompt_tokens").observed == [7, 7, 4]
    assert only(pb, "vllm:request_generation_tokens").observed == [5, 3, 6]
    assert only(pb, "vllm:request_params_n").observed == [2, 1]


def test_each_prompt_counts_once_through_preemptions(tmp_path: Path, tokenizer_dir: Path,
                                                     prose_ids: list[int]) -> None:
    """vllm:prompt_tokens_total's source: a request's whole prompt at its first token, not again
    when a preemption makes the engine compute it again (a tiny random model: only the counts matter)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                         eos_token_id=2, bos_token_id=1)
    save_tiny_model(LlamaForCausalLM(config), tmp_path, tokenizer_dir)
    engine = Engine(EngineConfig(model=str(tmp_path), dtype="float32", block_size=4, num_kv_blocks=24,
                                 max_num_seqs=8, max_num_batched_tokens=64, **FIXED_BUDGET))
    prompts = [prose_ids[i * 30:i * 30 + 20 + i] for i in range(4)]
    engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0))
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.started_prompt_tokens_total == sum(map(len, prompts)) == 86


def test_the_launcher_takes_the_switch_as_a_param(tmp_path: Path) -> None:
    config = repository_with_params({"REPORT_CUSTOM_METRICS": "true"}, tmp_path) / "llm" / "config.pbtxt"
    assert 'parameters: { key: "REPORT_CUSTOM_METRICS" value: { string_value: "true" } }' in config.read_text()
    with pytest.raises(ValueError, match="report_custom_metrics"):
        repository_with_params({"report_custom_metrics": "true"}, tmp_path / "other")   # the key is case-sensitive


# ---- the real server ---------------------------------------------------------------------------------
def scrape(url: str) -> tuple[dict[str, str], dict[str, str], dict[tuple[str, frozenset], float]]:
    """(HELP by family, TYPE by family, value by (sample name, labels)) of the Prometheus text."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    helps, types, values = {}, {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, description = line[len("# HELP "):].partition(" ")
            helps[name] = description
        elif line.startswith("# TYPE "):
            name, kind = line[len("# TYPE "):].split(" ")
            types[name] = kind
        elif line:
            match = re.fullmatch(r'([^{ ]+)(?:\{(.*)\})? (\S+)', line)
            assert match, line
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            values[match.group(1), labels] = float(match.group(3))
    return helps, types, values


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, model_dir: Path):
    """The server with REPORT_CUSTOM_METRICS on (speculative decoding off, its default: one token
    per decode iteration, so the time_per_output_token count is known), streams' tokens
    handed out 4 at a time (stream_interval), and each step launched before the tokens of the
    step before are read (async_scheduling): the families still count every token once."""
    log = tmp_path_factory.mktemp("triton-vllm-metrics") / "server.log"
    srv = TritonServer(*free_ports(3), log_file=log,
                       params={"REPORT_CUSTOM_METRICS": "true", "dtype": "float32",
                               "stream_interval": str(STREAM_INTERVAL), "async_scheduling": "true",
                               **FIXED_BUDGET_PARAMS})
    srv.start(timeout=300)
    assert "llm: async_scheduling: each step is launched before" in log.read_text()
    yield srv
    srv.stop()


def run(server: TritonServer, prompt: str, stream: bool, sampling: dict) -> tuple[int, list[int], int]:
    """One request on a stream of its own: (prompt tokens, tokens generated per completion,
    responses)."""
    inputs = vllm_inputs(prompt, stream, sampling, exclude_input_in_output=True, return_num_input_tokens=True,
                         return_num_output_tokens=True)
    responses = stream_request(server, inputs)
    assert all(error is None for _, error in responses), responses
    prompt_tokens = int(responses[-1][0].as_numpy("num_input_tokens").reshape(-1)[0])
    generated = np.sum([result.as_numpy("num_output_tokens") for result, _ in responses], axis=0)
    return prompt_tokens, [int(tokens) for tokens in generated], len(responses)


@pytest.mark.server
def test_the_families_count_what_the_requests_imply(vllm_server: TritonServer) -> None:
    """A non-streaming request, a streamed one and one with n=2 at once; one scrape as soon as the
    last response arrived, no waiting: every counter, count and sum is exact then."""
    shared = "A paged key-value cache stores attention state in fixed-size blocks, like virtual memory. " * 2
    requests = [("The capital of France is", False, {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}),
                ("Why is static batching slow?", True, {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}),
                # Longer than a block: the second child reads the prompt's blocks from the prefix cache.
                (shared + "Summarise:", False, {"max_tokens": 5, "n": 2, "temperature": 0.8, "seed": 7,
                                                "ignore_eos": True})]
    _, _, before = scrape(vllm_server.metrics_url)
    results: dict[int, tuple[int, list[int], int]] = {}

    def send(i: int) -> None:
        results[i] = run(vllm_server, *requests[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    helps, types, after = scrape(vllm_server.metrics_url)
    assert [results[i][1] for i in range(3)] == [[8], [6], [5, 5]]
    assert results[1][2] == 3   # streamed, 6 tokens: the first, 4 gathered, the last with the end

    def delta(name: str, **labels: str) -> float:
        key = (name, frozenset({**LABELS, **labels}.items()))
        return after[key] - before.get(key, 0.0)

    # Each completion is a request of its own in vLLM: its whole prompt, its tokens.
    prompts = [prompt_tokens for prompt_tokens, per_completion, _ in results.values() for _ in per_completion]
    generated = [tokens for _, per_completion, _ in results.values() for tokens in per_completion]
    assert len(prompts) == len(generated) == 4
    assert delta("vllm:prompt_tokens_total") == sum(prompts)
    # ... while ours counts the prefill computed: the n=2 prompt's cached blocks once.
    assert delta("llm_prompt_tokens_total") < sum(prompts)
    assert delta("vllm:generation_tokens_total") == sum(generated) == delta("llm_generation_tokens_total") == 24
    assert delta("vllm:time_to_first_token_seconds_count") == 4
    assert delta("vllm:time_per_output_token_seconds_count") == sum(tokens - 1 for tokens in generated) == 20
    assert delta("vllm:e2e_request_latency_seconds_count") == 4
    for name in ("vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                 "vllm:e2e_request_latency_seconds"):
        assert delta(f"{name}_sum") > 0
    assert delta("vllm:e2e_request_latency_seconds_sum") > delta("vllm:time_to_first_token_seconds_sum")
    observed = {"vllm:request_prompt_tokens": prompts, "vllm:request_generation_tokens": generated,
                "vllm:request_params_n": [1, 1, 2]}
    for name, values in observed.items():
        assert delta(f"{name}_count") == len(values) and delta(f"{name}_sum") == sum(values), name
        for bound in VLLM_FAMILIES[name][2]:
            assert delta(f"{name}_bucket", le=f"{bound:g}") == sum(v <= bound for v in values), (name, bound)
        assert delta(f"{name}_bucket", le="+Inf") == len(values)

    for name, (kind, description, buckets) in VLLM_FAMILIES.items():
        assert (types[name], helps[name]) == (kind, description), name
        series = [(sample, dict(labels)) for sample, labels in after if sample.startswith(name)]
        assert series and all({k: v for k, v in labels.items() if k != "le"} == LABELS for _, labels in series)
        if buckets is not None:
            bounds = [labels["le"] for sample, labels in series if sample == f"{name}_bucket"]
            assert sorted(float(b) for b in bounds) == [*map(float, buckets), float("inf")], name


@pytest.mark.server
def test_switched_off_the_server_exports_none_of_them(server: TritonServer) -> None:
    """The session's server runs config.pbtxt as it is: no REPORT_CUSTOM_METRICS."""
    assert run(server, "The capital of France is", True, {"max_tokens": 3, "ignore_eos": True})[1] == [3]
    helps, types, values = scrape(server.metrics_url)
    assert "llm_generation_tokens_total" in types
    exported = set(types) | {sample for sample, _ in values}
    assert not {name for name in exported if any(name.startswith(family) for family in VLLM_FAMILIES)}


def test_lora_gauge_only_where_lora_is_on() -> None:
    """vllm:lora_requests_info, as vLLM exports it, only where the model folder has adapters:
    with the vLLM families switched off and no adapters, no vllm: metric at all (what the
    vLLM backend's metrics CI counts)."""
    for enabled in (False, True):
        pb = fake_pb_utils()
        metrics = EngineMetrics(pb, model="llm", version="1", lora_enabled=lambda: enabled)
        metrics.update(engine_stats(), deque(), 16)
        exported = [name for name, family in pb.families.items() if name.startswith("vllm:") and family.metrics]
        assert exported == (["vllm:lora_requests_info"] if enabled else []), enabled


def test_a_gauge_is_sent_only_when_its_value_changes() -> None:
    """Each metric call is a round trip to tritonserver holding the interpreter lock: a snapshot
    that leaves a gauge as it was sends nothing for it, and one that changes it sends it once."""
    pb = fake_pb_utils()
    metrics = EngineMetrics(pb, model="llm", version="1", vllm_max_model_len=8192)
    sets: list[tuple[str, float]] = []
    for name, family in pb.families.items():
        for metric in family.metrics:
            metric.set = (lambda value, name=name, metric=metric:
                          sets.append((name, value)) or FakeMetric.set(metric, value))
    metrics.update(engine_stats(num_running=2, kv_blocks_free=60), deque(), 16)
    first = len(sets)
    assert only(pb, "llm_num_requests_running").value == 2 and only(pb, "llm_kv_blocks_free").value == 60
    metrics.update(engine_stats(num_running=2, kv_blocks_free=60, num_steps=5), deque(), 16)
    assert len(sets) == first                     # a new snapshot, no gauge changed
    metrics.update(engine_stats(num_running=3, kv_blocks_free=60, num_steps=6), deque(), 16)
    changed = sets[first:]
    assert ("llm_num_requests_running", 3) in changed
    assert all(value in (3, 3.0) for _, value in changed)    # running, scheduled, active: nothing else
    assert only(pb, "llm_num_requests_running").value == 3
