"""Prefix-affinity routing vs round-robin on a cluster behind HAProxy (docs/scaling.md).

    python -m benchmarks.prefix_routing [--replicas 2] [--groups 6] [--questions 4]
        [--prefix-tokens 256] [--concurrency 1] [--max-tokens 4] [--out benchmarks/results/...json]

Starts the replicas once and two HAProxy instances in front of them, one hashing
``x-prefix-key`` (consistent, bounded load) and one round-robin. The same shape of workload
(``groups`` system prompts of ``prefix_tokens`` tokens, ``questions`` distinct questions each,
in a seeded shuffled order) goes through each; the two runs use different system prompts so
that the first run's cache cannot help the second. Each replica's prefix-cache counters are
read before and after a run: with affinity a group misses about once, without it about once
per replica it lands on. TTFT is measured at the client from Triton's HTTP generate_stream.

The request helpers are shared with tests/test_cluster.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import DEFAULT_MODEL_DIR
from client.llm_client import http_generate_stream, prefix_key_for
from loadtest.prompts import PromptFactory
from loadtest.server_metrics import sample_one

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class PrefixRequest:
    group: int
    question: int
    prompt: str
    prefix_key: str


@dataclass
class RoutedResult:
    group: int
    question: int
    served_by: str | None        # HAProxy's x-served-by: the replica's name
    ttft_s: float | None
    e2e_s: float
    cached_tokens: int | None
    input_tokens: int | None
    error: str | None = None


def shared_prefix_requests(prompts: PromptFactory, groups: int, questions: int, prefix_tokens: int,
                           question_tokens: int, seed: int) -> list[PrefixRequest]:
    """groups x questions requests, group g's prompts sharing a ``prefix_tokens`` system prompt,
    in a seeded shuffled order (so that round-robin does not line up with the groups)."""
    rng = np.random.default_rng(seed)
    requests = []
    for group in range(groups):
        system = prompts.text(prefix_tokens, rng)
        for question in range(questions):
            requests.append(PrefixRequest(group, question, prompts.join(system, prompts.text(question_tokens, rng)),
                                          prefix_key_for(system)))
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


def send(http_url: str, request: PrefixRequest, max_tokens: int, send_key: bool = True,
         timeout: float = 300.0) -> RoutedResult:
    """One streamed request over HTTP generate_stream; TTFT at the first text event."""
    start = time.perf_counter()
    ttft = cached = inputs = served_by = None
    try:
        for chunk in http_generate_stream(request.prompt, url=http_url, timeout=timeout,
                                          prefix_key=request.prefix_key if send_key else None,
                                          max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
            served_by = chunk.served_by
            if ttft is None and chunk.text:
                ttft = time.perf_counter() - start
            cached = chunk.num_cached_tokens if chunk.num_cached_tokens is not None else cached
            inputs = chunk.num_input_tokens if chunk.num_input_tokens is not None else inputs
    except Exception as exc:  # noqa: BLE001 - recorded per request; the caller asserts on it
        return RoutedResult(request.group, request.question, served_by, ttft, time.perf_counter() - start,
                            cached, inputs, error=f"{type(exc).__name__}: {exc}")
    return RoutedResult(request.group, request.question, served_by, ttft, time.perf_counter() - start, cached, inputs)


def run_requests(http_url: str, requests: list[PrefixRequest], max_tokens: int, concurrency: int = 1,
                 send_key: bool = True) -> list[RoutedResult]:
    """Send in order, at most ``concurrency`` in flight; results in the order sent."""
    if concurrency <= 1:
        return [send(http_url, r, max_tokens, send_key) for r in requests]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda r: send(http_url, r, max_tokens, send_key), requests))


def prefix_counters(metrics_urls: list[str]) -> dict[str, tuple[float, float]]:
    """{metrics URL: (prefix-cache hit tokens, queried tokens)} of each replica."""
    rows = {url: sample_one(url) for url in metrics_urls}
    return {url: (row["prefix_hit_tokens"] or 0.0, row["prefix_queried_tokens"] or 0.0) for url, row in rows.items()}


def hit_rate(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> float:
    hit = sum(after[u][0] - before[u][0] for u in after)
    queried = sum(after[u][1] - before[u][1] for u in after)
    return hit / queried if queried else 0.0


def replicas_per_group(results: list[RoutedResult]) -> dict[int, set[str | None]]:
    groups: dict[int, set[str | None]] = {}
    for r in results:
        groups.setdefault(r.group, set()).add(r.served_by)
    return groups


def summarize(results: list[RoutedResult], rate: float) -> dict:
    ttfts = np.array([r.ttft_s for r in results if r.ttft_s is not None])
    pairs = {(r.group, r.served_by) for r in results}
    return {"requests": len(results), "errors": sum(r.error is not None for r in results),
            "prefix_hit_rate": rate, "group_replica_pairs": len(pairs),
            "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts.size else None,
            "ttft_p90_s": float(np.percentile(ttfts, 90)) if ttfts.size else None,
            "ttft_mean_s": float(ttfts.mean()) if ttfts.size else None,
            "requests_per_replica": {name: sum(r.served_by == name for r in results)
                                     for name in sorted({str(r.served_by) for r in results})}}


def main(argv: list[str] | None = None) -> int:
    from server.cluster import HAProxy, Cluster, ProxyPorts
    from server.launch import free_ports

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    prompts = PromptFactory.for_model(args.model_dir)
    cluster = Cluster(args.replicas, base_port=None)
    cluster.start()
    round_robin = HAProxy(cluster.endpoints, ProxyPorts(*free_ports(3)), balance="roundrobin")
    results: dict[str, dict] = {}
    try:
        round_robin.start()
        urls = [e.metrics_url for e in cluster.endpoints]
        for mode, proxy, seed in (("round-robin", round_robin, args.seed + 1), ("prefix-affinity", cluster.proxy, args.seed + 2)):
            requests = shared_prefix_requests(prompts, args.groups, args.questions, args.prefix_tokens,
                                              args.question_tokens, seed)
            before = prefix_counters(urls)
            run = run_requests(proxy.http_url, requests, args.max_tokens, args.concurrency)
            time.sleep(1.0)    # the counters are exported after the step that finished the last request
            results[mode] = {**summarize(run, hit_rate(before, prefix_counters(urls))),
                             "results": [asdict(r) for r in run]}
            print(f"{mode}: prefix-cache hit rate {results[mode]['prefix_hit_rate']:.1%}, "
                  f"TTFT p50 {results[mode]['ttft_p50_s']:.3f} s, mean {results[mode]['ttft_mean_s']:.3f} s, "
                  f"{results[mode]['group_replica_pairs']} (group, replica) pairs, "
                  f"per replica {results[mode]['requests_per_replica']}, errors {results[mode]['errors']}", flush=True)
    finally:
        round_robin.stop()
        cluster.stop()
    out = args.out or RESULTS_DIR / f"prefix_routing-{platform.node() or 'host'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "settings": {k: str(v) for k, v in vars(args).items()}, **results}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
