"""N replicas of our Triton server on 127.0.0.1 behind NVIDIA Dynamo 1.6.1's own OpenAI frontend
and KV router: requests go to the replica that holds their prefix, learned from the replicas'
KV-cache events, with no key from the client (docs/scaling.md, "Routing by cached blocks").

    python -m server.dynamo_cluster [--replicas 2] [--base-port 9500] [--router-mode kv]
                                    [--migration-limit 3] [--log-dir DIR] [--param KEY=VALUE ...]
                                    [--frontend-arg=--router-prefill-load-scale=4 ...]

Processes: each replica is ``server/launch.py``'s ``TritonServer`` (supervised) with KV events
on; beside each, ``server/dynamo_worker.py`` (Dynamo's Python backend SDK, run by
``.venv-dynamo``'s Python) registers it with Dynamo, relays its events and forwards requests to
it; one ``python -m dynamo.frontend --router-mode kv`` serves the OpenAI API. Dynamo runs
without etcd or NATS: file discovery in a temporary folder of this cluster, ZMQ event plane,
TCP request plane, everything on 127.0.0.1 (Dynamo's own event-plane sockets bind every
interface; see docs/scaling.md).

Ports from the base (9500): Dynamo's frontend 9500 (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``); replica i: HTTP
9600+10i, gRPC 9601+10i, metrics 9602+10i, KV-event PUB socket 9605+10i.

Ready means: every replica's model is ready, the frontend lists the model with one instance per
replica, and an event from every replica has reached the frontend's router (a one-block probe
sent to each replica directly, counted in the frontend's
``dynamo_component_kv_cache_events_applied``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from server.cluster import Endpoint
from server.launch import MODEL_NAME, REPO_ROOT, TritonServer, finish_starts, free_ports, terminate_with_parent

DYNAMO_VENV = REPO_ROOT / ".venv-dynamo"
DYNAMO_PYTHON = DYNAMO_VENV / "bin" / "python"
WORKER_SCRIPT = REPO_ROOT / "server" / "dynamo_worker.py"
DEFAULT_BASE_PORT = 9500
DEFAULT_NAMESPACE = "llm"
ROUTER_MODES = ("kv", "round-robin", "random", "least-loaded")
SETUP_HINT = "run `make setup-dynamo-frontend` (ai-dynamo 1.6.1 in .venv-dynamo)"
# The frontend's count of KV events its router applied, by kind and outcome.
EVENTS_APPLIED = "dynamo_component_kv_cache_events_applied"
PROBE_FIRST_TOKEN = 40000     # probe prompts: token ids no text of ours starts with (vocabulary 49152)


def require_dynamo_frontend() -> Path:
    """.venv-dynamo's Python, once it can import Dynamo's frontend and worker SDK (and aiohttp)."""
    if not DYNAMO_PYTHON.is_file():
        raise RuntimeError(f"{DYNAMO_PYTHON} is missing: {SETUP_HINT}")
    check = subprocess.run([str(DYNAMO_PYTHON), "-c", "import dynamo.frontend.main, dynamo.common.backend, aiohttp"],
                           capture_output=True, text=True, cwd=REPO_ROOT)
    if check.returncode != 0:
        raise RuntimeError(f"{DYNAMO_PYTHON} cannot run Dynamo's frontend ({check.stderr.strip()[-400:]}): {SETUP_HINT}")
    return DYNAMO_PYTHON


def engine_limits(params: dict[str, str]) -> dict[str, int]:
    """The engine's block size and batch limits as the replicas will run them (config.pbtxt's
    overrides on EngineConfig's defaults): what the workers advertise to Dynamo's router."""
    from backend.config import EngineConfig

    config = EngineConfig.from_dict(params)
    model = Path(config.model) if Path(config.model).is_absolute() else REPO_ROOT / config.model
    max_model_len = config.max_model_len
    if max_model_len is None:
        max_model_len = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    return {"block_size": config.block_size, "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens, "context_length": max_model_len,
            "model_path": str(model)}


def metric_sum(text: str, family: str, **labels: str) -> float:
    """Sum of a family's samples whose labels include ``labels`` (0 when there are none)."""
    total = 0.0
    for match in re.finditer(rf"^{re.escape(family)}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE):
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def get_json(url: str, timeout: float = 2.0) -> object | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


class ChildProcess:
    """A Dynamo process (frontend or worker) in its own process group, logging to a file,
    stopped with SIGTERM (Dynamo's graceful shutdown), then SIGKILL."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_file: Path | None,
                 stop_timeout_s: float = 15.0) -> None:
        self.name, self.command, self.env, self.log_file = name, command, env, log_file
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen | None = None
        self._log = None

    def start(self) -> "ChildProcess":
        self._log = open(self.log_file, "w") if self.log_file else None
        self.process = subprocess.Popen(self.command, env=self.env, cwd=REPO_ROOT, stdin=subprocess.DEVNULL,
                                        stdout=self._log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                        start_new_session=True,
                                        preexec_fn=functools.partial(terminate_with_parent, os.getpid()))
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal_stop(self) -> None:
        if self.alive():
            self.process.terminate()

    def stop(self) -> None:
        self.signal_stop()
        if self.process is not None:
            try:
                self.process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


class DynamoCluster:
    """Replicas (TritonServer each, KV events on, ``cpu_threads`` split between them), one
    Dynamo worker per replica and Dynamo's frontend in front."""

    def __init__(self, replicas: int = 2, base_port: int | None = DEFAULT_BASE_PORT, params: dict[str, str] | None = None,
                 supervise: bool = False, log_dir: Path | None = None, router_mode: str = "kv",
                 served_model_name: str = MODEL_NAME, namespace: str = DEFAULT_NAMESPACE,
                 migration_limit: int = 3, frontend_args: list[str] | None = None) -> None:
        if replicas < 1:
            raise ValueError("replicas must be >= 1")
        if router_mode not in ROUTER_MODES:
            raise ValueError(f"router_mode must be one of {ROUTER_MODES}, not {router_mode!r}")
        if base_port is None:    # tests: any free ports
            ports = free_ports(4 * replicas + 1)
            self.frontend_port = ports[-1]
            self.endpoints = [Endpoint(f"r{i}", "127.0.0.1", *ports[4 * i:4 * i + 3]) for i in range(replicas)]
            self.kv_event_ports = [ports[4 * i + 3] for i in range(replicas)]
        else:
            self.frontend_port = base_port
            self.endpoints = [Endpoint(f"r{i}", "127.0.0.1", base_port + 100 + 10 * i, base_port + 101 + 10 * i,
                                       base_port + 102 + 10 * i) for i in range(replicas)]
            self.kv_event_ports = [base_port + 105 + 10 * i for i in range(replicas)]
        threads = max(1, (len(os.sched_getaffinity(0)) or 1) // replicas)
        self.params = {"cpu_threads": str(threads), **(params or {})}
        self.limits = engine_limits(self.params)
        self.log_dir = log_dir
        self.router_mode, self.served_model_name, self.namespace = router_mode, served_model_name, namespace
        self.migration_limit = migration_limit
        self.frontend_args = list(frontend_args or [])
        # The replica binds its PUB socket on every interface (`*`: vLLM's rule for a bound
        # endpoint); its worker connects to it on 127.0.0.1.
        self.servers = [TritonServer(e.http_port, e.grpc_port, e.metrics_port,
                                     {**self.params, "enable_kv_cache_events": "true",
                                      "kv_events_endpoint": f"tcp://*:{port}"},
                                     log_file=log_dir / f"{e.name}.log" if log_dir else None, supervise=supervise)
                        for e, port in zip(self.endpoints, self.kv_event_ports)]
        self.frontend: ChildProcess | None = None
        self.workers: list[ChildProcess] = []
        self._discovery: tempfile.TemporaryDirectory | None = None

    # ---- addresses ------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        """Dynamo's frontend (OpenAI API under /v1)."""
        return f"127.0.0.1:{self.frontend_port}"

    @property
    def metrics_urls(self) -> list[str]:
        return [e.metrics_url for e in self.endpoints]

    # ---- processes ------------------------------------------------------------------------------
    def dynamo_environment(self) -> dict[str, str]:
        """Dynamo without etcd or NATS, on loopback: file discovery in this cluster's own folder."""
        env = {k: v for k, v in os.environ.items() if k not in ("DYN_SYSTEM_PORT", "PYTHONPATH")}
        env.update({"DYN_FILE_KV": self._discovery.name, "DYN_DISCOVERY_BACKEND": "file",
                    "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
                    "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1",
                    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
                    # model cards go through the discovery folder, not an HTTP server of each worker
                    "DYN_SELF_HOST_METADATA": "0", "DYN_LOG": os.environ.get("DYN_LOG", "info"),
                    # A worker waits this long after unregistering before it drains (5 s by
                    # default), so that routers stop picking it; stop() ends the frontend first.
                    "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0"})
        return env

    def _frontend_command(self, python: Path) -> list[str]:
        return [str(python), "-m", "dynamo.frontend", "--router-mode", self.router_mode,
                "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq",
                "--http-host", "127.0.0.1", "--http-port", str(self.frontend_port), "--namespace", self.namespace,
                "--migration-limit", str(self.migration_limit), *self.frontend_args]

    def _worker_command(self, python: Path, index: int) -> list[str]:
        e, limits = self.endpoints[index], self.limits
        return [str(python), str(WORKER_SCRIPT), "--name", e.name, "--triton-url", f"{e.host}:{e.http_port}",
                "--metrics-url", e.metrics_url,
                "--kv-events-endpoint", f"tcp://127.0.0.1:{self.kv_event_ports[index]}",
                "--model-path", limits["model_path"], "--served-model-name", self.served_model_name,
                "--namespace", self.namespace, "--block-size", str(limits["block_size"]),
                "--context-length", str(limits["context_length"]), "--max-num-seqs", str(limits["max_num_seqs"]),
                "--max-num-batched-tokens", str(limits["max_num_batched_tokens"])]

    def start(self, timeout: float = 300.0) -> "DynamoCluster":
        python = require_dynamo_frontend()    # before minutes of model loading
        self._discovery = tempfile.TemporaryDirectory(prefix="llm-dynamo-discovery-")
        env = self.dynamo_environment()
        log = (lambda name: self.log_dir / f"{name}.log") if self.log_dir else (lambda name: None)

        try:
            # Processes start on this (long-lived) thread: see terminate_with_parent.
            for server in self.servers:
                server.launch()
            self.frontend = ChildProcess("frontend", self._frontend_command(python), env, log("frontend")).start()
            # A worker waits for its replica's model itself, then registers it.
            self.workers = [ChildProcess(f"worker-{e.name}", self._worker_command(python, i), env,
                                         log(f"worker-{e.name}")).start() for i, e in enumerate(self.endpoints)]
            finish_starts(self.servers, timeout)
            self._wait_registered(deadline=time.monotonic() + 120)
            if self.router_mode == "kv":
                for index in range(len(self.servers)):
                    self._probe_event_path(index)
        except BaseException:
            self.stop()
            raise
        return self

    def _check_alive(self) -> None:
        for child in [self.frontend, *self.workers]:
            if child is not None and not child.alive():
                raise RuntimeError(f"dynamo {child.name} exited with {child.process.returncode}"
                                   + (f"; see {child.log_file}" if child.log_file else ""))

    def generate_instances(self) -> int:
        """How many workers the frontend sees serving the model's generate endpoint."""
        health = get_json(f"http://{self.http_url}/health")
        if not isinstance(health, dict):
            return 0
        return sum(1 for i in health.get("instances", [])
                   if i.get("endpoint") == "generate" and i.get("namespace") == self.namespace)

    def model_listed(self) -> bool:
        models = get_json(f"http://{self.http_url}/v1/models")
        return isinstance(models, dict) and any(m.get("id") == self.served_model_name for m in models.get("data", []))

    def _wait_registered(self, deadline: float) -> None:
        while True:
            self._check_alive()
            if self.model_listed() and self.generate_instances() == len(self.servers):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Dynamo's frontend does not list '{self.served_model_name}' with "
                                   f"{len(self.servers)} workers ({self.generate_instances()} so far)")
            time.sleep(0.2)

    def frontend_metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.http_url}/metrics", timeout=5) as response:
            return response.read().decode()

    def events_applied(self, event_type: str = "stored", status: str = "ok") -> float:
        """KV events of that kind the frontend's router applied to its radix tree (all workers)."""
        return metric_sum(self.frontend_metrics(), EVENTS_APPLIED, event_type=event_type, status=status)

    def _probe_event_path(self, index: int, attempts: int = 10) -> None:
        """Until a one-block prompt served by replica ``index`` (directly, not through Dynamo)
        shows up in the router: its worker's ZMQ subscription is live (a subscriber misses what
        is published before it connects). Each attempt is a fresh block."""
        server, block = self.servers[index], self.limits["block_size"]
        for attempt in range(attempts):
            before = self.events_applied()
            first = PROBE_FIRST_TOKEN + 1000 * index + 40 * attempt
            body = {"input_ids": list(range(first, first + block + 1)), "exclude_input_in_output": True,
                    "sampling_parameters": json.dumps({"max_tokens": 1})}
            request = urllib.request.Request(f"http://{server.http_url}/v2/models/{MODEL_NAME}/generate",
                                             data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as response:
                response.read()
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                if self.events_applied() > before:
                    return
                time.sleep(0.05)
            self._check_alive()
        raise TimeoutError(f"no KV event of replica {self.endpoints[index].name} reached Dynamo's router "
                           f"(tcp://127.0.0.1:{self.kv_event_ports[index]})")

    def kill_replica(self, index: int) -> int:
        """SIGKILL replica ``index``'s tritonserver (a crash, not a drain; its worker stays up).
        A supervised replica is restarted by its supervisor. Returns the killed pid."""
        process = self.servers[index].process
        if process is None or process.poll() is not None:
            raise RuntimeError(f"replica {self.endpoints[index].name} is not running")
        os.kill(process.pid, signal.SIGKILL)
        return process.pid

    def stop(self) -> None:
        """The frontend and the workers first (no new requests reach a replica), then the replicas."""
        children = [c for c in [self.frontend, *self.workers] if c is not None]
        for child in children:
            child.signal_stop()
        stoppers = [threading.Thread(target=c.stop) for c in children]
        stoppers += [threading.Thread(target=s.stop) for s in self.servers]
        for t in stoppers[:len(children)]:
            t.start()
        for t in stoppers[:len(children)]:
            t.join()
        for t in stoppers[len(children):]:
            t.start()
        for t in stoppers[len(children):]:
            t.join()
        if self._discovery is not None:
            self._discovery.cleanup()
            self._discovery = None

    def __enter__(self) -> "DynamoCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=int(os.environ.get("REPLICAS", 2)))
    parser.add_argument("--base-port", type=int, default=int(os.environ.get("BASE_PORT", DEFAULT_BASE_PORT)))
    parser.add_argument("--router-mode", choices=ROUTER_MODES, default="kv",
                        help="Dynamo's routing (kv: by the replicas' cached blocks)")
    parser.add_argument("--migration-limit", type=int, default=3,
                        help="Dynamo's request migration: how often a request whose replica failed (refused "
                             "it, or died mid-stream) is continued on another worker (0: never)")
    parser.add_argument("--served-model-name", default=MODEL_NAME, help="the model name of the OpenAI API")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="override an engine parameter of config.pbtxt on every replica")
    parser.add_argument("--frontend-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for `python -m dynamo.frontend`, e.g. "
                             "--frontend-arg=--router-prefill-load-scale=4")
    parser.add_argument("--log-dir", type=Path, default=REPO_ROOT / "runs" / "dynamo-cluster")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)
    params = dict(p.split("=", 1) for p in args.param)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    cluster = DynamoCluster(args.replicas, args.base_port, params, supervise=True, log_dir=args.log_dir,
                            router_mode=args.router_mode, served_model_name=args.served_model_name,
                            migration_limit=args.migration_limit, frontend_args=args.frontend_arg)
    stop_requested = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.set())
    signal.signal(signal.SIGINT, lambda *_: stop_requested.set())
    cluster.start()
    try:
        url = f"http://{cluster.http_url}"
        print(f"{len(cluster.endpoints)} replicas of '{MODEL_NAME}' behind Dynamo's frontend "
              f"(router mode {args.router_mode}): OpenAI API {url}/v1, model '{args.served_model_name}'", flush=True)
        for endpoint, port in zip(cluster.endpoints, cluster.kv_event_ports):
            print(f"  {endpoint.name}: HTTP {endpoint.host}:{endpoint.http_port}, gRPC {endpoint.host}:"
                  f"{endpoint.grpc_port}, metrics {endpoint.metrics_url}, KV events tcp://127.0.0.1:{port}", flush=True)
        print(f"try: curl {url}/v1/completions -H 'Content-Type: application/json' -d "
              f"'{{\"model\": \"{args.served_model_name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'", flush=True)
        print(f"logs in {args.log_dir}; Ctrl-C stops", flush=True)
        while not stop_requested.wait(0.5):
            dead = [c for c in [cluster.frontend, *cluster.workers] if c is not None and not c.alive()]
            if dead:
                print(f"dynamo {dead[0].name} exited with {dead[0].process.returncode}; stopping the cluster "
                      f"(see {dead[0].log_file})", file=sys.stderr, flush=True)
                break
    finally:
        print("stopping: Dynamo's frontend and workers, then every replica (draining)", flush=True)
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
