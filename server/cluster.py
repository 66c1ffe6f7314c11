"""N replicas of our Triton server on 127.0.0.1 behind HAProxy, which keeps requests that share
a prefix on the replica that already holds its KV blocks (docs/scaling.md).

    python -m server.cluster [--replicas 2] [--base-port 9000] [--balance prefix|roundrobin]
                             [--prometheus [--prometheus-port 9090]] [--log-dir DIR] [--param KEY=VALUE ...]
    python -m server.cluster --write-deploy     # regenerate deploy/haproxy and deploy/prometheus

Ports from the base (9000): the proxy's HTTP 9000, gRPC 9001, stats + its own metrics 9002;
replica i: HTTP 9100+10i, gRPC 9101+10i, metrics 9102+10i; Prometheus (``--prometheus``) 9090
(``--prometheus-port``, ``PROMETHEUS_PORT``). Logs go to ``--log-dir``; while it runs, the
launcher describes the cluster in a file of the temporary directory (``cluster_state_path``),
where a load test against the proxy finds the replicas' metrics.

The routing contract: a client sends ``x-prefix-key`` (a hash of the system prompt, a
conversation id: anything equal for requests that share a prefix), as an HTTP header or gRPC
metadata. HAProxy hashes it onto a consistent-hash ring with bounded load
(``hash-balance-factor``): a key stays on one replica unless that replica carries more than
150% of the mean load, and when a replica goes away only its keys move. Without the header,
HTTP requests are hashed on the first ``FALLBACK_PREFIX_BYTES`` bytes of ``text_input``; gRPC
requests (a binary body HAProxy cannot read) without it are spread round-robin.

The HAProxy and Prometheus configurations are rendered here, for this launcher and for the
docker-compose files under deploy/ (a test checks those are what this module renders).
"""

from __future__ import annotations

import argparse
import csv
import functools
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from client.llm_client import PREFIX_KEY_HEADER, SERVED_BY_HEADER
from server.launch import MODEL_NAME, REPO_ROOT, TritonServer, finish_starts, free_ports, terminate_with_parent
from server.stub.metric_names import READY_FAMILY

DEPLOY_DIR = REPO_ROOT / "deploy"
FALLBACK_PREFIX_BYTES = 256     # of text_input, hashed when a request carries no prefix key
HASH_BALANCE_FACTOR = 150       # a replica takes a key's request unless above 150% of the mean load
BALANCE_MODES = ("prefix", "roundrobin")
HEALTH_CHECK_INTERVAL_S = 1.0
DEFAULT_BASE_PORT = 9000
DEFAULT_PROMETHEUS_PORT = 9090
# While `make cluster` runs: its proxy and replicas, so that `make loadtest SERVER=<proxy>`
# finds every replica's metrics.
INSTALL_HINT = {
    "haproxy": "Debian/Ubuntu: apt-get install -y haproxy; Fedora/RHEL: dnf install haproxy; macOS: brew install haproxy",
    "prometheus": "Debian/Ubuntu: apt-get install -y prometheus; elsewhere: the release binary from prometheus.io",
}


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed ({INSTALL_HINT[name]}); `make setup-cluster` installs it here")
    return path


@dataclass(frozen=True)
class Endpoint:
    """Where one replica listens."""
    name: str           # the HAProxy server name and the Prometheus `replica` label
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"


@dataclass(frozen=True)
class ProxyPorts:
    http: int
    grpc: int
    stats: int          # HAProxy's stats page (/stats) and its Prometheus exporter (/metrics)


def replica_endpoints(n: int, base_port: int = DEFAULT_BASE_PORT, host: str = "127.0.0.1") -> list[Endpoint]:
    return [Endpoint(f"r{i}", host, base_port + 100 + 10 * i, base_port + 101 + 10 * i, base_port + 102 + 10 * i)
            for i in range(n)]


def haproxy_config(replicas: list[Endpoint], ports: ProxyPorts, balance: str = "prefix",
                   bind_address: str = "127.0.0.1", docker_dns: bool = False) -> str:
    """HAProxy configuration: an HTTP frontend (generate / generate_stream, SSE passes through),
    a gRPC frontend over h2 (tritonclient's streaming API), both hashed on the prefix key.
    ``docker_dns``: replicas are container names, resolved by Docker's DNS at run time (a
    replica that is not up yet, or comes back with a new address, is not a config error)."""
    if balance not in BALANCE_MODES:
        raise ValueError(f"balance must be one of {BALANCE_MODES}, not {balance!r}")
    if balance == "prefix":
        balance_lines = ["    balance hash var(txn.route_key)",
                         "    hash-type consistent",
                         f"    hash-balance-factor {HASH_BALANCE_FACTOR}"]
    else:
        balance_lines = ["    balance roundrobin"]
    inter = f"{int(HEALTH_CHECK_INTERVAL_S * 1000)}ms"
    fastinter = f"{int(HEALTH_CHECK_INTERVAL_S * 250)}ms"

    def servers(port_of: str, extra: str = "") -> list[str]:
        return [f"    server {r.name} {r.host}:{getattr(r, port_of)}{extra} check port {r.metrics_port} "
                f"inter {inter} fastinter {fastinter} fall 2 rise 2 observe layer4 error-limit 1 on-error mark-down"
                for r in replicas]

    dns = ["resolvers docker",
           "    nameserver dns 127.0.0.11:53",
           "    hold valid 10s",
           ""] if docker_dns else []
    lines = [
        f"# Rendered by server/cluster.py (balance: {balance}); docs/scaling.md explains it.",
        "# Do not edit by hand: `python -m server.cluster --write-deploy` writes deploy/.",
        "global",
        "    maxconn 4096",
        # A request body is buffered up to this size for the fallback key (a prompt of ~16k
        # tokens); a longer body is routed on what fits.
        "    tune.bufsize 65536",
        # One line per request on stdout (the launcher's haproxy.log): server, retries and the
        # termination state (e.g. SC-- = the server refused the connection) of each.
        "    log stdout format raw local0 info",
        "",
        *dns,
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    timeout connect 2s",
        "    timeout http-request 30s",
        "    timeout queue 60s",
        # A stream is idle between tokens only for a step, but a waiting request can be queued
        # for minutes; gRPC users keep one stream open between requests.
        "    timeout client 1h",
        "    timeout server 1h",
        # A replica that refuses the connection (killed, restarting) or answers 503 (draining,
        # queue full) before sending anything: try again, the last time on another replica.
        "    retries 2",
        "    option redispatch 1",
        "    retry-on conn-failure empty-response 503",
        # Health: the model's own readiness gauge on the metrics port. Triton's /v2/health/ready
        # stays 200 while the model drains or after its engine failed; llm_ready does not.
        "    option httpchk",
        "    http-check send meth GET uri /metrics",
        f"    http-check expect rstring '{READY_FAMILY}[{{][^}}]*[}}] 1'",
        *(["    default-server init-addr last,libc,none resolvers docker"] if docker_dns else []),
        "",
        "frontend llm_http",
        f"    bind {bind_address}:{ports.http}",
        "    option http-buffer-request",
        f"    http-request set-var(txn.route_key) req.hdr({PREFIX_KEY_HEADER})",
        "    http-request set-var(txn.route_key) req.body,json_query('$.text_input'),"
        f"bytes(0,{FALLBACK_PREFIX_BYTES}) if !{{ var(txn.route_key) -m found }}",
        "    default_backend triton_http",
        "",
        "frontend llm_grpc",
        f"    bind {bind_address}:{ports.grpc} proto h2",
        f"    http-request set-var(txn.route_key) req.hdr({PREFIX_KEY_HEADER})",
        "    default_backend triton_grpc",
        "",
        "backend triton_http",
        *balance_lines,
        # Which replica served: for clients, tests and debugging routing.
        f"    http-response set-header {SERVED_BY_HEADER} %s",
        *servers("http_port"),
        "",
        "backend triton_grpc",
        *balance_lines,
        f"    http-response set-header {SERVED_BY_HEADER} %s",
        # Health-checked over HTTP/1 on the replica's metrics port, like the HTTP backend.
        *servers("grpc_port", " proto h2 check-proto h1"),
        "",
        "frontend stats",
        f"    bind {bind_address}:{ports.stats}",
        "    http-request use-service prometheus-exporter if { path /metrics }",
        "    stats enable",
        "    stats uri /stats",
        "    stats refresh 5s",
        "",
    ]
    return "\n".join(lines)


def prometheus_config(replicas: list[Endpoint], proxy_stats: str | None, scrape_interval: str = "5s") -> str:
    """Prometheus scrape configuration: every replica's Triton metrics (labelled `replica`)
    and HAProxy's exporter. YAML written by hand: it is small and PyYAML is not a dependency."""
    lines = ["# Rendered by server/cluster.py; docs/scaling.md explains it.",
             "# Do not edit by hand: `python -m server.cluster --write-deploy` writes deploy/.",
             "global:",
             f"  scrape_interval: {scrape_interval}",
             f"  evaluation_interval: {scrape_interval}",
             "scrape_configs:",
             "  - job_name: triton",
             "    static_configs:"]
    for r in replicas:
        lines += [f"      - targets: ['{r.host}:{r.metrics_port}']",
                  "        labels:",
                  f"          replica: {r.name}"]
    if proxy_stats:
        lines += ["  - job_name: haproxy",
                  "    static_configs:",
                  f"      - targets: ['{proxy_stats}']"]
    return "\n".join(lines) + "\n"


def compose_endpoints(n: int) -> list[Endpoint]:
    """The replicas as docker-compose names them (service triton-<i>, Triton's default ports)."""
    return [Endpoint(f"r{i}", f"triton-{i}", 8000, 8001, 8002) for i in range(n)]


COMPOSE_REPLICAS = 2
COMPOSE_PROXY_PORTS = ProxyPorts(http=8000, grpc=8001, stats=8404)


def deploy_files() -> dict[Path, str]:
    """What deploy/ holds for docker-compose, rendered from the same functions as the local cluster."""
    endpoints = compose_endpoints(COMPOSE_REPLICAS)
    return {
        DEPLOY_DIR / "haproxy" / "haproxy.cfg": haproxy_config(endpoints, COMPOSE_PROXY_PORTS, bind_address="*",
                                                               docker_dns=True),
        DEPLOY_DIR / "prometheus" / "prometheus.yml": prometheus_config(
            endpoints, f"haproxy:{COMPOSE_PROXY_PORTS.stats}", scrape_interval="5s"),
    }


class ConfiguredProcess:
    """A binary run in the foreground, with a configuration rendered into a temporary folder:
    what HAProxy and Prometheus share. Subclasses name the binary and say how to run it
    (``command``) and when it is ready (``is_ready``)."""

    binary = ""
    config_name = ""
    stop_timeout_s = 10.0

    def __init__(self, log_file: Path | None = None) -> None:
        self.log_file = log_file
        self.process: subprocess.Popen | None = None
        self._workdir: tempfile.TemporaryDirectory | None = None
        self._log = None

    def render_config(self) -> str:
        raise NotImplementedError

    def command(self, binary: str, config: Path, workdir: Path) -> list[str]:
        raise NotImplementedError

    def is_ready(self) -> bool:
        raise NotImplementedError

    def _launch(self, timeout: float) -> None:
        """Write the configuration, start the binary, wait until ``is_ready`` (stop on failure)."""
        binary = require_binary(self.binary)
        self._workdir = tempfile.TemporaryDirectory(prefix=f"llm-{self.binary}-")
        workdir = Path(self._workdir.name)
        config = workdir / self.config_name
        config.write_text(self.render_config())
        self._check_config(binary, config)
        self._log = open(self.log_file, "w") if self.log_file else None
        self.process = subprocess.Popen(self.command(binary, config, workdir), stdout=self._log or subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=functools.partial(terminate_with_parent, os.getpid()))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {self.process.returncode}")
            if self.is_ready():
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.binary} was not ready within {timeout:.0f}s")

    def _check_config(self, binary: str, config: Path) -> None:
        """Refuse a configuration before starting, where the binary can check one."""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; the folder and log go."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None


class HAProxy(ConfiguredProcess):
    """HAProxy in the foreground as a child process, with the configuration rendered here.
    SIGTERM is its hard stop (SIGUSR1 would wait for every open stream)."""

    binary = "haproxy"
    config_name = "haproxy.cfg"

    def __init__(self, replicas: list[Endpoint], ports: ProxyPorts, balance: str = "prefix",
                 log_file: Path | None = None) -> None:
        super().__init__(log_file)
        self.replicas, self.ports, self.balance = replicas, ports, balance

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def stats_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.stats}/stats"

    def start(self, timeout: float = 30.0) -> "HAProxy":
        """Ready once every replica is UP in every backend."""
        self._launch(timeout)
        return self

    def render_config(self) -> str:
        return haproxy_config(self.replicas, self.ports, self.balance)

    def _check_config(self, binary: str, config: Path) -> None:
        check = subprocess.run([binary, "-c", "-q", "-f", str(config)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy rejected its configuration:\n{check.stdout}{check.stderr}")

    def command(self, binary: str, config: Path, workdir: Path) -> list[str]:
        # -db: foreground, no daemon; -W would add a master process we do not need.
        return [binary, "-db", "-f", str(config)]

    def is_ready(self) -> bool:
        states = self.server_states()
        return bool(states) and all(s == "UP" for backend in states.values() for s in backend.values())

    def stats_rows(self) -> list[dict[str, str]] | None:
        """HAProxy's stats CSV, a dict per proxy/server row; None while it does not answer."""
        try:
            with urllib.request.urlopen(f"{self.stats_url};csv", timeout=2) as response:
                text = response.read().decode()
        except (urllib.error.URLError, OSError):
            return None
        return list(csv.DictReader(io.StringIO(text.lstrip("# "))))

    def server_states(self) -> dict[str, dict[str, str]]:
        """{backend: {server: status}} from HAProxy's stats CSV ({} while it does not answer)."""
        states: dict[str, dict[str, str]] = {}
        for row in self.stats_rows() or []:
            if row["svname"] not in ("FRONTEND", "BACKEND"):
                states.setdefault(row["pxname"], {})[row["svname"]] = row["status"].split()[0]
        return states

    def sessions_in_flight(self, backend: str = "triton_http") -> int | None:
        """Streams the backend holds now (stats ``scur``); None while HAProxy does not answer."""
        for row in self.stats_rows() or []:
            if row["pxname"] == backend and row["svname"] == "BACKEND":
                return int(row["scur"] or 0)
        return None

    def wait_until_idle(self, backend: str = "triton_http", timeout: float = 5.0) -> bool:
        """Until no stream is in flight in ``backend``: a client reads a response's last byte
        a moment before HAProxy releases the stream and its server's load count."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sessions_in_flight(backend) == 0:
                return True
            time.sleep(0.002)
        return False

    def wait_for_state(self, server: str, state: str, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.server_states()
            if states and all(backend.get(server) == state for backend in states.values() if server in backend):
                return True
            time.sleep(0.2)
        return False


class Prometheus(ConfiguredProcess):
    """Debian's (or any) ``prometheus`` binary scraping the cluster, with an HTTP API query helper."""

    binary = "prometheus"
    config_name = "prometheus.yml"
    stop_timeout_s = 15.0

    def __init__(self, replicas: list[Endpoint], port: int, proxy_stats: str | None = None,
                 scrape_interval: str = "1s", log_file: Path | None = None) -> None:
        super().__init__(log_file)
        self.replicas, self.port, self.proxy_stats, self.scrape_interval = replicas, port, proxy_stats, scrape_interval

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "Prometheus":
        self._launch(timeout)
        return self

    def render_config(self) -> str:
        return prometheus_config(self.replicas, self.proxy_stats, self.scrape_interval)

    def command(self, binary: str, config: Path, workdir: Path) -> list[str]:
        return [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d"]

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def query(self, expr: str) -> list[dict]:
        """An instant query through the HTTP API: the result vector."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus query {expr!r} failed: {body}")
        return body["data"]["result"]


class Cluster:
    """Replicas (TritonServer each, ``cpu_threads`` split between them) plus HAProxy in front."""

    def __init__(self, replicas: int = 2, base_port: int | None = DEFAULT_BASE_PORT, balance: str = "prefix",
                 params: dict[str, str] | None = None, supervise: bool = False, log_dir: Path | None = None) -> None:
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        if base_port is None:    # tests: any free ports
            ports = free_ports(3 * replicas + 3)
            self.endpoints = [Endpoint(f"r{i}", "127.0.0.1", *ports[3 * i:3 * i + 3]) for i in range(replicas)]
            self.proxy_ports = ProxyPorts(*ports[-3:])
        else:
            self.endpoints = replica_endpoints(replicas, base_port)
            self.proxy_ports = ProxyPorts(base_port, base_port + 1, base_port + 2)
        # The replicas share this machine's cores: each gets its share (a config override wins).
        threads = max(1, (len(os.sched_getaffinity(0)) or 1) // replicas)
        self.params = {"cpu_threads": str(threads), **(params or {})}
        self.log_dir = log_dir
        self.servers = [TritonServer(e.http_port, e.grpc_port, e.metrics_port, dict(self.params),
                                     log_file=log_dir / f"{e.name}.log" if log_dir else None, supervise=supervise)
                        for e in self.endpoints]
        self.proxy = HAProxy(self.endpoints, self.proxy_ports, balance,
                             log_file=log_dir / "haproxy.log" if log_dir else None)

    def start(self, timeout: float = 300.0) -> "Cluster":
        require_binary("haproxy")    # before minutes of model loading
        # Processes are started here, on this (long-lived) thread: a process started on a
        # thread that ends gets SIGTERM then (terminate_with_parent). Only the waits are parallel.
        for server in self.servers:
            server.launch()
        try:
            finish_starts(self.servers, timeout)
            self.proxy.start()
        except BaseException:
            self.stop()
            raise
        return self

    def kill_replica(self, index: int) -> None:
        """SIGKILL a replica's whole process group (a crash, not a drain)."""
        process = self.servers[index].process
        if process is not None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def stop(self) -> None:
        self.proxy.stop()
        threads = [threading.Thread(target=s.stop) for s in self.servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cluster_state_path(grpc_address: str) -> Path:
    """Where a running cluster launcher describes itself (proxy addresses, replicas' metrics),
    keyed by the proxy's gRPC address: in the temporary directory, not in the checkout, and one
    file per cluster."""
    return Path(tempfile.gettempdir()) / f"llm-cluster-{grpc_address.replace(':', '-')}.json"


def read_cluster_state(grpc_address: str) -> dict | None:
    """The state of the cluster whose proxy serves gRPC at ``grpc_address``, if its launcher runs."""
    try:
        state = json.loads(cluster_state_path(grpc_address).read_text())
        os.kill(int(state["pid"]), 0)    # a launcher killed hard leaves its file behind
        return state
    except (OSError, ValueError, KeyError):
        return None


def write_deploy_files() -> list[Path]:
    written = []
    for path, text in deploy_files().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=int(os.environ.get("REPLICAS", 2)))
    parser.add_argument("--base-port", type=int, default=int(os.environ.get("BASE_PORT", DEFAULT_BASE_PORT)))
    parser.add_argument("--balance", choices=BALANCE_MODES, default="prefix")
    parser.add_argument("--prometheus", action="store_true", help="also run prometheus (on --prometheus-port)")
    parser.add_argument("--prometheus-port", type=int,
                        default=int(os.environ.get("PROMETHEUS_PORT", DEFAULT_PROMETHEUS_PORT)))
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="override an engine parameter of config.pbtxt on every replica")
    parser.add_argument("--log-dir", type=Path, default=REPO_ROOT / "runs" / "cluster")
    parser.add_argument("--write-deploy", action="store_true",
                        help="write deploy/haproxy/haproxy.cfg and deploy/prometheus/prometheus.yml and exit")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)
    if args.write_deploy:
        for path in write_deploy_files():
            print(f"wrote {path.relative_to(REPO_ROOT)}")
        return 0
    params = dict(p.split("=", 1) for p in args.param)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(args.replicas, args.base_port, args.balance, params, supervise=True, log_dir=args.log_dir)
    prometheus = None
    state_file: Path | None = None
    stop_requested = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.set())
    signal.signal(signal.SIGINT, lambda *_: stop_requested.set())
    cluster.start()
    try:
        if args.prometheus:
            prometheus = Prometheus(cluster.endpoints, args.prometheus_port,
                                    f"127.0.0.1:{cluster.proxy_ports.stats}", "5s",
                                    log_file=args.log_dir / "prometheus.log").start()
        metrics = ",".join(e.metrics_url for e in cluster.endpoints)
        state_file = cluster_state_path(cluster.proxy.grpc_url)
        state_file.write_text(json.dumps({"http": cluster.proxy.http_url, "grpc": cluster.proxy.grpc_url,
                                             "stats": cluster.proxy.stats_url, "pid": os.getpid(),
                                             "metrics_urls": [e.metrics_url for e in cluster.endpoints]}))
        print(f"{len(cluster.endpoints)} replicas of '{MODEL_NAME}' behind HAProxy ({args.balance}): "
              f"HTTP {cluster.proxy.http_url}, gRPC {cluster.proxy.grpc_url}, stats {cluster.proxy.stats_url}"
              + (f", Prometheus {prometheus.url}" if prometheus else ""), flush=True)
        for endpoint in cluster.endpoints:
            print(f"  {endpoint.name}: HTTP {endpoint.host}:{endpoint.http_port}, gRPC {endpoint.host}:"
                  f"{endpoint.grpc_port}, metrics {endpoint.metrics_url}", flush=True)
        print(f"load test: make loadtest SERVER={cluster.proxy.grpc_url} PREFIX_KEY=1  (replica metrics: {metrics})",
              flush=True)
        print(f"logs in {args.log_dir}; Ctrl-C stops", flush=True)
        while not stop_requested.wait(0.5):
            if cluster.proxy.process is not None and cluster.proxy.process.poll() is not None:
                print("haproxy exited; stopping the cluster", file=sys.stderr, flush=True)
                break
    finally:
        print("stopping: draining every replica", flush=True)
        if state_file is not None:
            state_file.unlink(missing_ok=True)
        if prometheus is not None:
            prometheus.stop()
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
