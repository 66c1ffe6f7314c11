"""Scale-out behind HAProxy (docs/scaling.md): two real Triton replicas on 127.0.0.1, the real
haproxy in front (prefix affinity, and a second instance round-robin for comparison), the
real prometheus scraping them. Runs in file order: the failover test kills a replica, last."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from benchmarks.prefix_routing import (
    hit_rate, prefix_counters, replicas_per_group, run_requests, send, shared_prefix_requests,
)
from client import NO_RETRY, LLMClient, LLMError, http_generate_stream, prefix_key_for
from loadtest.prompts import PromptFactory
from loadtest.runner import LoadOptions, run_load
from loadtest.server_metrics import sample_one
from server.cluster import (
    DEPLOY_DIR, Cluster, HAProxy, Prometheus, ProxyPorts, deploy_files, haproxy_config, replica_endpoints,
)
from server.launch import REPO_ROOT, free_ports
from server.stub.metrics import COUNTERS, GAUGES, HISTOGRAMS

pytestmark = pytest.mark.server

GROUPS, QUESTIONS, PREFIX_TOKENS, QUESTION_TOKENS, MAX_TOKENS = 6, 4, 256, 16, 2
BURST = 16    # concurrent requests per protocol right after a replica is killed


# --- configuration: no servers needed ----------------------------------------------------------

def test_deploy_files_are_what_the_launcher_renders() -> None:
    for path, text in deploy_files().items():
        assert path.read_text() == text, f"{path} is stale: run `python -m server.cluster --write-deploy`"


@pytest.mark.parametrize("balance", ["prefix", "roundrobin"])
def test_haproxy_accepts_the_rendered_configuration(balance: str, tmp_path: Path) -> None:
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config(replica_endpoints(3), ProxyPorts(9000, 9001, 9002), balance))
    check = subprocess.run(["haproxy", "-c", "-f", str(config)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    text = config.read_text()
    assert ("balance hash var(txn.route_key)" in text) == (balance == "prefix")
    assert text.count("server r2 127.0.0.1:9121") == 1    # replica 2's gRPC port from the base
    docker = subprocess.run(["haproxy", "-c", "-f", str(DEPLOY_DIR / "haproxy" / "haproxy.cfg")],
                            capture_output=True, text=True)
    assert docker.returncode == 0, docker.stdout + docker.stderr


def test_prometheus_accepts_the_deploy_configuration() -> None:
    check = subprocess.run(["promtool", "check", "config", str(DEPLOY_DIR / "prometheus" / "prometheus.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_docker_compose_mounts_what_exists() -> None:
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"triton-0", "triton-1", "haproxy", "prometheus", "grafana", "openai"} <= set(services)
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (REPO_ROOT / source).exists(), f"{name} mounts {source}, which is not in the repository"
    assert "--backend vllm" in services["openai"]["command"]
    # The proxy's ports in compose are the ones its rendered configuration binds.
    haproxy_cfg = (DEPLOY_DIR / "haproxy" / "haproxy.cfg").read_text()
    for port in services["haproxy"]["ports"]:
        assert f"bind *:{port.split(':')[-1]}" in haproxy_cfg


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY_DIR / "grafana" / "dashboards" / "llm-serving.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_dashboard_queries_name_only_exported_families() -> None:
    exported = set(GAUGES) | set(COUNTERS) | {name for name, _, _ in HISTOGRAMS.values()} | {"llm_request_finished_total"}
    used = {name for expr in dashboard_exprs() for name in re.findall(r"\b(llm_[a-z0-9_]+)", expr)}
    used = {re.sub(r"_(bucket|count|sum)$", "", name) for name in used}
    assert used and used <= exported, used - exported
    for quantity in ("llm_time_to_first_token_seconds", "llm_inter_token_latency_seconds",
                     "llm_e2e_request_latency_seconds", "llm_kv_cache_usage_ratio", "llm_num_preemptions_total",
                     "llm_prefix_cache_hit_tokens_total", "llm_num_requests_waiting", "llm_generation_tokens_total"):
        assert quantity in used, f"the dashboard does not show {quantity}"


# --- a real cluster ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory) -> Cluster:
    logs = tmp_path_factory.mktemp("cluster")
    with Cluster(2, base_port=None, log_dir=logs) as running:
        yield running


@pytest.fixture(scope="module")
def round_robin(cluster: Cluster, tmp_path_factory) -> HAProxy:
    proxy = HAProxy(cluster.endpoints, ProxyPorts(*free_ports(3)), balance="roundrobin",
                    log_file=tmp_path_factory.mktemp("rr") / "haproxy.log").start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> PromptFactory:
    return PromptFactory.for_model(model_dir)


def metrics_urls(cluster: Cluster) -> list[str]:
    return [e.metrics_url for e in cluster.endpoints]


def run_mode(cluster: Cluster, proxy: HAProxy, prompts: PromptFactory, seed: int):
    requests = shared_prefix_requests(prompts, GROUPS, QUESTIONS, PREFIX_TOKENS, QUESTION_TOKENS, seed)
    before = prefix_counters(metrics_urls(cluster))
    results = []
    for request in requests:
        # One at a time as the proxy sees it: the bounded-load hash counts a finished request
        # until HAProxy releases its stream, a moment after the client read its last byte, and
        # with that one in flight a key's replica is over 150% of the mean of two.
        assert proxy.wait_until_idle(), "a request stayed in flight at the proxy"
        results.append(send(proxy.http_url, request, MAX_TOKENS))
    time.sleep(0.5)   # the replicas export their counters after the step that ended each request
    return results, hit_rate(before, prefix_counters(metrics_urls(cluster)))


def test_prefix_affinity_keeps_each_group_on_one_replica_and_raises_the_hit_rate(
        cluster: Cluster, round_robin: HAProxy, prompts: PromptFactory) -> None:
    # Different seeds: different system prompts, so the first run's cache cannot help the second.
    rr_results, rr_rate = run_mode(cluster, round_robin, prompts, seed=101)
    affinity_results, affinity_rate = run_mode(cluster, cluster.proxy, prompts, seed=102)
    for results in (rr_results, affinity_results):
        assert [r.error for r in results if r.error] == []
        assert {r.served_by for r in results} == {"r0", "r1"}

    groups = replicas_per_group(affinity_results)
    assert all(len(replicas) == 1 for replicas in groups.values()), groups
    assert {next(iter(r)) for r in groups.values()} == {"r0", "r1"}, "the keys should spread over both replicas"
    # Each group misses once (its first request), and every later request hits the whole prefix.
    for group in range(GROUPS):
        cached = [r.cached_tokens for r in affinity_results if r.group == group]
        assert cached[0] == 0 and all(c == PREFIX_TOKENS for c in cached[1:]), (group, cached)

    # Round-robin spreads groups over both replicas: a miss per (group, replica) pair.
    rr_pairs = {(r.group, r.served_by) for r in rr_results}
    assert len(rr_pairs) > GROUPS
    misses = [r for r in rr_results if r.cached_tokens == 0]
    assert len(misses) == len(rr_pairs)
    assert affinity_rate > rr_rate + 0.15, (affinity_rate, rr_rate)
    expected_affinity = (GROUPS * (QUESTIONS - 1) * PREFIX_TOKENS) / (GROUPS * QUESTIONS * (PREFIX_TOKENS + QUESTION_TOKENS))
    assert abs(affinity_rate - expected_affinity) < 0.05, (affinity_rate, expected_affinity)


def finished(cluster: Cluster) -> list[float]:
    return [sample_one(url)["finished_requests"] or 0.0 for url in metrics_urls(cluster)]


def wait_for_counts(cluster: Cluster, previous: list[float], total: float, timeout: float = 5.0) -> list[float]:
    deadline = time.monotonic() + timeout
    while True:
        now = finished(cluster)
        if sum(now) - sum(previous) >= total or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def test_grpc_streams_through_the_proxy_follow_the_prefix_key(cluster: Cluster) -> None:
    client = LLMClient(cluster.proxy.grpc_url)
    placements: dict[str, set[int]] = {}
    for key in [prefix_key_for(f"system prompt {i}") for i in range(6)]:
        for _ in range(2):
            before = finished(cluster)
            completion = client.generate("Where does this request go?", prefix_key=key, max_tokens=3,
                                         ignore_eos=True, temperature=0.0)
            assert completion.num_output_tokens == 3 and completion.finish_reason == "length"
            after = wait_for_counts(cluster, before, 1)
            served = [i for i, (a, b) in enumerate(zip(after, before)) if a > b]
            assert len(served) == 1, (before, after)
            placements.setdefault(key, set()).add(served[0])
    assert all(len(replicas) == 1 for replicas in placements.values()), placements
    assert set().union(*placements.values()) == {0, 1}

    # Many requests on one stream: one replica (the stream's key), every request answered.
    before = finished(cluster)
    chunks = list(client.stream_many(["one", "two", "three"], {"max_tokens": 2, "ignore_eos": True},
                                     prefix_key="stream-key"))
    assert sum(1 for c in chunks if not isinstance(c, tuple) and c.final) == 3
    after = wait_for_counts(cluster, before, 3)
    assert sorted(a - b for a, b in zip(after, before)) == [0, 3]


def test_prometheus_scrapes_every_replica(cluster: Cluster, tmp_path: Path) -> None:
    with_proxy = f"127.0.0.1:{cluster.proxy_ports.stats}"
    prometheus = Prometheus(cluster.endpoints, free_ports(1)[0], with_proxy, "1s",
                            log_file=tmp_path / "prometheus.log").start()
    try:
        # Targets are scraped at staggered offsets: wait for the first scrape of every one.
        deadline = time.monotonic() + 60
        series: list[dict] = []
        up: dict[str, float] = {}
        while time.monotonic() < deadline:
            series = prometheus.query("llm_kv_blocks_total")
            up = {s["metric"]["job"]: float(s["value"][1]) for s in prometheus.query("min by (job) (up)")}
            if {s["metric"].get("replica") for s in series} == {"r0", "r1"} and len(up) == 2:
                break
            time.sleep(0.5)
        assert {s["metric"].get("replica") for s in series} == {"r0", "r1"}, series
        assert all(float(s["value"][1]) > 0 for s in series)
        assert up == {"triton": 1.0, "haproxy": 1.0}
        routed = prometheus.query('haproxy_server_http_responses_total{proxy="triton_http"}')
        assert {s["metric"]["server"] for s in routed} == {"r0", "r1"}
        # Every query of the Grafana dashboard is valid PromQL over what is scraped here.
        for expr in dashboard_exprs():
            prometheus.query(expr.replace("$__rate_interval", "1m").replace("$replica", ".*"))
    finally:
        prometheus.stop()


def test_load_test_against_the_proxy_reports_each_replica(cluster: Cluster, tmp_path: Path) -> None:
    urls = ",".join(metrics_urls(cluster))
    result = run_load(LoadOptions(profile="smoke", host=cluster.proxy.grpc_url, metrics_url=urls, server="existing",
                                  duration_s=15, tags=["shared-prefix", "chat"], run_dir=tmp_path / "run",
                                  prefix_key=True))
    assert result.summary.overall.failed == 0 and result.summary.interrupted == 0
    assert result.back_to_idle
    report = (result.run_dir / "report.md").read_text()
    assert "Cluster view" in report
    for endpoint in cluster.endpoints:
        assert f"| 127.0.0.1:{endpoint.metrics_port} |" in report


def keys_served_by(cluster: Cluster, replica: str, count: int) -> list[str]:
    """``count`` prefix keys that the proxy routes to ``replica`` (probed over HTTP; the gRPC
    backend has the same servers, so the same ring)."""
    keys: list[str] = []
    for i in range(50 * count):
        key = f"failover-key-{i}"
        # Idle first: a probe still counted at the proxy puts its replica over the bounded
        # load, and the next key would be reported on the other one (see run_mode).
        assert cluster.proxy.wait_until_idle(), "a probe stayed in flight at the proxy"
        chunks = list(http_generate_stream("hi", url=cluster.proxy.http_url, prefix_key=key, max_tokens=1))
        if chunks[-1].served_by == replica:
            keys.append(key)
            if len(keys) == count:
                return keys
    raise AssertionError(f"fewer than {count} keys map to {replica}")


class Streaming(threading.Thread):
    """A long request streaming from the replica that is about to die (HTTP or gRPC)."""

    def __init__(self, cluster: Cluster, key: str, grpc: bool) -> None:
        super().__init__(daemon=True)
        self.cluster, self.key, self.grpc = cluster, key, grpc
        self.first_token = threading.Event()
        self.served_by: str | None = None
        self.error: LLMError | None = None
        self.final = False

    def run(self) -> None:
        sampling = {"max_tokens": 2000, "ignore_eos": True, "retry": NO_RETRY}
        try:
            chunks = (LLMClient(self.cluster.proxy.grpc_url, retry=NO_RETRY).stream(
                          "Tell me a very long story.", prefix_key=self.key, max_tokens=2000, ignore_eos=True)
                      if self.grpc else
                      http_generate_stream("Tell me a very long story.", url=self.cluster.proxy.http_url,
                                           prefix_key=self.key, **sampling))
            for chunk in chunks:
                self.served_by = chunk.served_by
                self.first_token.set()
                self.final = chunk.final
        except LLMError as exc:
            self.error = exc
        finally:
            self.first_token.set()


def test_failover_under_a_burst_loses_nothing(cluster: Cluster, prompts: PromptFactory) -> None:
    """Kill a replica, then at once send a burst of its keys over HTTP and gRPC (no client
    retries): the proxy marks it down on the first refused connection and sends every request
    to the survivor. Streams that were running on the dead replica end with an error naming it.
    Keys of the survivor never move."""
    by_group: dict[int, list] = {}
    for request in shared_prefix_requests(prompts, GROUPS, 2, 64, QUESTION_TOKENS, seed=103):
        by_group.setdefault(request.group, []).append(request)
    before_kill = run_requests(cluster.proxy.http_url, [by_group[g][0] for g in range(GROUPS)], MAX_TOKENS)
    assert [r.error for r in before_kill if r.error] == []
    placement = {r.group: r.served_by for r in before_kill}
    assert set(placement.values()) == {"r0", "r1"}
    victim, survivor = "r1", "r0"
    burst_keys = keys_served_by(cluster, victim, 2 * BURST)
    running = [Streaming(cluster, key, grpc) for key, grpc in zip(burst_keys[:2], (False, True))]
    for stream in running:
        # The same reason: the last probe must no longer count against the victim.
        assert cluster.proxy.wait_until_idle("triton_grpc" if stream.grpc else "triton_http")
        stream.start()
        assert stream.first_token.wait(60) and stream.error is None, stream.error
        assert stream.served_by == victim, cluster.proxy.server_states()

    cluster.kill_replica(1)

    def http_request(key: str) -> str | None:
        chunks = list(http_generate_stream("After the crash:", url=cluster.proxy.http_url, prefix_key=key,
                                           retry=NO_RETRY, max_tokens=4, ignore_eos=True))
        assert chunks[-1].final and sum(c.num_output_tokens for c in chunks) == 4
        return chunks[-1].served_by

    def grpc_request(key: str) -> str | None:
        completion = LLMClient(cluster.proxy.grpc_url, retry=NO_RETRY).generate(
            "After the crash:", prefix_key=key, max_tokens=4, ignore_eos=True)
        assert completion.num_output_tokens == 4
        return completion.served_by

    with ThreadPoolExecutor(2 * BURST) as pool:
        burst = ([pool.submit(http_request, key) for key in burst_keys[:BURST]]
                 + [pool.submit(grpc_request, key) for key in burst_keys[BURST:]])
        errors, served = [], []
        for future in burst:
            try:
                served.append(future.result())
            except Exception as exc:   # noqa: BLE001 - collected, asserted below
                errors.append(repr(exc))
    assert errors == [] and served == [survivor] * (2 * BURST), (errors, served)

    for stream in running:
        stream.join(30)
        assert not stream.final and stream.error is not None, "a stream from the dead replica was cut silently"
        assert stream.error.replica == victim and f"replica {victim}" in str(stream.error), str(stream.error)
        assert not stream.error.retryable

    # One at a time too, and the survivor's keys stay where they were.
    after_kill = run_requests(cluster.proxy.http_url, [by_group[g][1] for g in range(GROUPS)], MAX_TOKENS)
    assert [r.error for r in after_kill if r.error] == []
    for r in after_kill:
        expected = survivor if placement[r.group] == victim else placement[r.group]
        assert r.served_by == expected, (r.group, placement[r.group], r.served_by)
    assert cluster.proxy.wait_for_state(victim, "DOWN", timeout=10)
