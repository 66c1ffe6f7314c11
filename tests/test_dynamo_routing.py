"""NVIDIA Dynamo 1.6.1's own frontend, with its KV router, in front of two real replicas
(server/dynamo_cluster.py, server/dynamo_worker.py; docs/scaling.md, "Routing by cached
blocks"): a request that shares a long prefix with an earlier one lands on the replica that
served the earlier one, with no key from the client, because that replica's KV-cache events
told the router what it holds. Needs `make setup-dynamo-frontend` (a missing or broken Dynamo
is a failure here, never a skip)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks.kv_routing import MODES, Request, measure, openai_stream, parse_args, send_openai
from benchmarks.prefix_routing import prefix_counters
from loadtest.prompts import PromptFactory
from server.dynamo_cluster import DynamoCluster, require_dynamo_frontend
from tests.conftest import FIXED_BUDGET_PARAMS

pytestmark = pytest.mark.server

PREFIX_TOKENS, QUESTION_TOKENS, BLOCK = 400, 16, 16


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory) -> DynamoCluster:
    try:
        require_dynamo_frontend()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    logs = tmp_path_factory.mktemp("dynamo-cluster")
    # No step-cost calibration at start-up (conftest.FIXED_BUDGET): routing is not about chunk sizes.
    with DynamoCluster(2, base_port=None, params=dict(FIXED_BUDGET_PARAMS), log_dir=logs) as running:
        yield running


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> PromptFactory:
    return PromptFactory.for_model(model_dir)


def counters_after(cluster: DynamoCluster, before: dict, queried: int, timeout: float = 5.0) -> dict:
    """The replicas' (hit, queried) prefix-cache counters once ``queried`` more prompt tokens
    were looked up: they are exported after the step that finished a request."""
    deadline = time.monotonic() + timeout
    while True:
        now = prefix_counters(cluster.metrics_urls)
        if sum(now[u][1] - before[u][1] for u in now) >= queried or time.monotonic() > deadline:
            return now


def served(cluster: DynamoCluster, send) -> tuple[int, float, object]:
    """Send one request; which replica looked its prompt up, how many tokens it hit, the result."""
    before = prefix_counters(cluster.metrics_urls)
    result, prompt_tokens = send()
    after = counters_after(cluster, before, prompt_tokens)
    moved = [i for i, url in enumerate(cluster.metrics_urls) if after[url][1] > before[url][1]]
    assert len(moved) == 1, (before, after)
    url = cluster.metrics_urls[moved[0]]
    return moved[0], after[url][0] - before[url][0], result


def completion(cluster: DynamoCluster, prompts: PromptFactory, text: str):
    def send():
        request = Request("test", "document", 0, text, prompts.count(text))
        result = send_openai(cluster.http_url, request, max_tokens=2, model=cluster.served_model_name)
        assert result.error is None and result.ttft_s is not None, result
        return result, request.prompt_tokens
    return send


def chat(cluster: DynamoCluster, system: str, question: str):
    def send():
        body = {"model": cluster.served_model_name, "max_tokens": 3, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                "stream_options": {"include_usage": True}}
        events = list(openai_stream(cluster.http_url, body))
        text = "".join((c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices") or [])
        usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
        assert text and any(c.get("finish_reason") for e in events for c in e.get("choices") or []), events
        return usage, usage["prompt_tokens"]
    return send


def test_a_request_sharing_a_long_prefix_lands_on_the_replica_that_holds_it(
        cluster: DynamoCluster, prompts: PromptFactory) -> None:
    rng = np.random.default_rng(50)
    stored_before = cluster.events_applied()
    homes = []
    # Three prefixes (two documents through /v1/completions, a system prompt through streamed
    # /v1/chat/completions), each followed by two requests that share it: six placements that
    # a router blind to the caches would get right by chance once in 64 runs.
    for kind in ("completion", "completion", "chat"):
        prefix = prompts.text(PREFIX_TOKENS, rng)
        if kind == "completion":
            sends = [completion(cluster, prompts, prompts.join(prefix, prompts.text(QUESTION_TOKENS, rng)))
                     for _ in range(3)]
        else:
            sends = [chat(cluster, prefix, prompts.text(QUESTION_TOKENS, rng)) for _ in range(3)]
        home, first_hits, _ = served(cluster, sends[0])
        assert first_hits == 0, (kind, first_hits)      # a fresh prefix: nothing cached anywhere
        homes.append(home)
        for send in sends[1:]:
            replica, hits, result = served(cluster, send)
            assert replica == home, f"{kind}: the request sharing {PREFIX_TOKENS} tokens went to r{replica}, " \
                                    f"its prefix is on r{home}"
            assert hits >= PREFIX_TOKENS // BLOCK * BLOCK, (kind, hits)
            cached = (result.cached_tokens if kind == "completion"
                      else result.get("prompt_tokens_details", {}).get("cached_tokens"))
            assert cached == hits, (kind, cached, hits)     # what the OpenAI response reports
    # The router learned those blocks from the replicas' events (not by predicting its own routing).
    assert cluster.events_applied() > stored_before
    assert cluster.events_applied(status="parent_block_not_found") == 0


def test_the_quick_measurement_runs_every_routing(cluster: DynamoCluster, prompts: PromptFactory,
                                                   tmp_path: Path) -> None:
    """benchmarks/kv_routing.py --quick's workload through Dynamo, HAProxy's key affinity and
    round-robin on this cluster's replicas: every request answered, each routing reported. The
    figures of so small a run mean nothing; docs/scaling.md has the measured ones."""
    args = parse_args(["--quick", "--seed", "7"])
    args.log_dir = tmp_path
    results = measure(cluster, args, prompts)
    assert set(results) == set(MODES)
    for mode, summary in results.items():
        assert summary["errors"] == 0, (mode, [r["error"] for r in summary["results"] if r["error"]][:3])
        assert summary["requests"] == len(summary["results"]) > 0
        assert 0 < summary["prefix_hit_rate"] < 1 and summary["ttft_p50_s"] > 0, (mode, summary)
        assert sum(summary["requests_per_replica"].values()) == summary["requests"], (mode, summary)
        assert 0 < summary["spread_sessions_hit_rate"] <= summary["single_cache_hit_rate"] < 1, (mode, summary)
