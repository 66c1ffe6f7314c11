"""Run a load test end to end: find (or start) the server, run Locust headless in a child
process, check the server went back to idle, write the report. ``compare`` does that twice,
with ``batching=continuous`` and ``batching=static``, and writes a side-by-side report.

Locust runs in its own process because it monkey-patches the standard library for gevent
at import; this process stays an ordinary one that can start and stop tritonserver.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

from loadtest import report
from loadtest.analysis import Summary
from loadtest.profiles import DEFAULT_HOST, DEFAULT_PROFILE, PROFILES, SLO, Profile
from loadtest.server_metrics import wait_until_idle
from loadtest.slots import STEPS_FILE

ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"
DEFAULT_METRICS_PORT = 8002
MODEL = "llm"


@dataclass
class LoadOptions:
    profile: str = DEFAULT_PROFILE
    host: str = DEFAULT_HOST                 # gRPC address
    metrics_url: str | None = None           # default: same host, port 8002 (or the started server's)
    users: int | None = None                 # default: the profile's
    duration_s: float | None = None          # default: the profile's
    rate: float | None = None                # open loop (requests/s); None = closed loop
    tags: list[str] = field(default_factory=list)
    seed: int = 0
    run_dir: Path | None = None
    server: str = "auto"                     # auto: use a running server, else start one; start; existing
    params: dict[str, str] = field(default_factory=dict)   # engine parameters for a started server
    drain_timeout_s: float | None = None     # default: the profile's
    slo: SLO | None = None                   # default: the profile's
    command: str = ""                        # how the run was invoked, for the report
    prefix_key: bool = False                 # send x-prefix-key (a proxy routes shared prefixes by it)

    @property
    def profile_def(self) -> Profile:
        return PROFILES[self.profile]

    def resolved_slo(self) -> SLO:
        return self.slo or self.profile_def.slo


@dataclass
class RunResult:
    run_dir: Path
    summary: Summary
    idle_before: float | None
    idle_after: float | None          # None: the metrics endpoint did not answer after the run
    locust_exit: int
    server_exit: int | None = None    # a server we started died during the run

    @property
    def back_to_idle(self) -> bool:
        return self.idle_before is not None and self.idle_before == self.idle_after

    @property
    def exit_code(self) -> int:
        ok = (self.summary.passed and self.back_to_idle and self.server_exit is None and self.locust_exit == 0
              and self.summary.interrupted == 0)
        return 0 if ok else 1


def model_ready(host: str, timeout: float = 3.0) -> bool:
    import tritonclient.grpc as grpcclient

    try:
        client = grpcclient.InferenceServerClient(host)
        try:
            return bool(client.is_model_ready(MODEL, client_timeout=timeout))
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - unreachable, not ready, or no such model: all "not up"
        return False


def running_cluster_metrics(grpc_host: str) -> str | None:
    """Comma-separated metrics URLs of the replicas behind ``grpc_host`` when it is the proxy
    of a cluster that `make cluster` runs (server.cluster.cluster_state_path, while it is up)."""
    from server.cluster import read_cluster_state

    state = read_cluster_state(grpc_host)
    if state and state.get("grpc") == grpc_host:
        return ",".join(state["metrics_urls"])
    return None


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    return f"{cpu}, {os.cpu_count()} CPU cores, {platform.system()}; OMP_NUM_THREADS={threads}"


class ServerHandle:
    """The server under test: one already running, or a tritonserver this run starts."""

    def __init__(self, options: LoadOptions, log_file: Path) -> None:
        self.options, self.log_file = options, log_file
        self.process = None
        self.params: dict[str, str] = {}
        self.host = options.host
        self.metrics_url = options.metrics_url

    def __enter__(self) -> "ServerHandle":
        opts = self.options
        if opts.server != "start" and model_ready(opts.host):
            if opts.params:
                print(f"note: a server is already up at {opts.host}; --param is ignored", file=sys.stderr)
            hostname = urlsplit(f"//{opts.host}").hostname or "127.0.0.1"
            # The proxy of a cluster started by `make cluster`: every replica's metrics.
            self.metrics_url = (opts.metrics_url or running_cluster_metrics(opts.host)
                                or f"http://{hostname}:{DEFAULT_METRICS_PORT}/metrics")
            return self
        if opts.server == "existing":
            raise SystemExit(f"no server with a ready {MODEL!r} model at {opts.host}")
        from server.launch import TritonServer, free_ports

        parsed = urlsplit(f"//{opts.host}")
        if parsed.hostname not in ("127.0.0.1", "localhost"):
            raise SystemExit(f"no server at {opts.host}, and only a local one can be started")
        # The engine's step records (loadtest/slots.py, loadtest/steps.py) go with the run.
        self.params = {**opts.profile_def.server_params, "step_trace_path": str(self.log_file.parent.resolve() / STEPS_FILE),
                       **opts.params}
        http_port, fallback_grpc_port, metrics_port = free_ports(3)
        grpc_port = parsed.port or fallback_grpc_port
        if opts.server == "start" and opts.host == DEFAULT_HOST:
            grpc_port = fallback_grpc_port   # compare: never collide with a server someone left running
        self.process = TritonServer(http_port, grpc_port, metrics_port, params=self.params, log_file=self.log_file)
        print(f"starting tritonserver ({', '.join(f'{k}={v}' for k, v in self.params.items())}) ...", flush=True)
        self.process.start(timeout=300)
        self.host, self.metrics_url = self.process.grpc_url, self.process.metrics_url
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.stop()   # also ends the Python stubs of a server that died on its own

    @property
    def started(self) -> bool:
        return self.process is not None

    @property
    def exit_code(self) -> int | None:
        """The started server's exit code if it died (None while it runs, or if not ours)."""
        if self.process is None or self.process.process is None:
            return None
        return self.process.process.poll()


def locust_command(options: LoadOptions, host: str, metrics_url: str, run_dir: Path) -> list[str]:
    profile = options.profile_def
    users = options.users or profile.users
    duration = options.duration_s or profile.duration_s
    drain = options.drain_timeout_s if options.drain_timeout_s is not None else profile.drain_timeout_s
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
           "--users", str(users), "--spawn-rate", str(users), "--run-time", f"{int(round(duration))}s",
           "--stop-timeout", f"{int(round(drain))}", "--host", host,
           # The CSVs are Locust's once-a-second snapshots (the last second can be missing);
           # locust_stats.json holds the final numbers.
           "--csv", str(run_dir / "locust"), "--html", str(run_dir / "locust.html"),
           "--json-file", str(run_dir / "locust_stats"),
           "--load-profile", options.profile, "--seed", str(options.seed), "--run-dir", str(run_dir),
           "--metrics-url", metrics_url, "--exit-code-on-error", "0"]
    if options.rate:
        cmd += ["--rate", str(options.rate)]
    if options.prefix_key:
        cmd += ["--prefix-key"]
    if options.tags:
        cmd += ["--tags", *options.tags]
    return cmd


def run_load(options: LoadOptions) -> RunResult:
    run_dir = options.run_dir or ROOT / "runs" / time.strftime(f"%Y%m%d-%H%M%S-{options.profile}")
    run_dir.mkdir(parents=True, exist_ok=True)
    with ServerHandle(options, run_dir / "server.log") as server:
        assert server.metrics_url is not None
        before = wait_until_idle(server.metrics_url)["kv_used"]
        meta = {"command": options.command, "machine": machine_description(),
                "server": {"host": server.host, "metrics_url": server.metrics_url, "started": server.started,
                           "params": server.params},
                "slo": asdict(options.resolved_slo()), "options": {**asdict(options), "run_dir": str(run_dir),
                                                                    "slo": None}}
        report.write_json(run_dir / report.RUN_META, meta)
        cmd = locust_command(options, server.host, server.metrics_url, run_dir)
        print(f"locust: {shlex.join(cmd[2:])}", flush=True)
        with open(run_dir / "locust.log", "w") as log:
            env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
        server_exit = server.exit_code
        try:
            after = wait_until_idle(server.metrics_url, idle_kv_used=before or 0.0)["kv_used"]
        except OSError:
            after = None
        meta["idle"] = {"before": before, "after": after}
        meta["server"]["exit_code"] = server_exit
        report.write_json(run_dir / report.RUN_META, meta)
    if server_exit is not None:
        print(f"tritonserver DIED during the run (exit code {server_exit}); see {run_dir / 'server.log'}",
              file=sys.stderr)
    if not (run_dir / report.RECORDS).exists():
        raise SystemExit(f"locust wrote no records (exit code {code}); see {run_dir / 'locust.log'}")
    summary = report.write_report(run_dir, options.slo)
    return RunResult(run_dir, summary, before, after, code, server_exit)


def print_result(result: RunResult) -> None:
    print()
    print(report.table(result.summary))
    print()
    if line := report.priority_line(result.summary):
        print(line)
    print(f"KV blocks used before/after the run: {report.count(result.idle_before)}/{report.count(result.idle_after)}"
          + ("" if result.back_to_idle else "  <- NOT back to idle"))
    if result.server_exit is not None:
        print(f"tritonserver died during the run (exit code {result.server_exit})")
    print(f"Result: {report.verdict(result.summary)}".replace("**", ""))
    print(f"Report: {result.run_dir / report.REPORT}")


def run_compare(options: LoadOptions) -> tuple[dict[str, RunResult], Path]:
    from loadtest import compare

    parent = options.run_dir or ROOT / "runs" / time.strftime(f"%Y%m%d-%H%M%S-compare-{options.profile}")
    results = {}
    for batching in compare.MODES:
        print(f"\n=== batching={batching} ===", flush=True)
        run_dir = parent / batching
        run_dir.mkdir(parents=True, exist_ok=True)
        # The engine's step records draw the slot timeline (loadtest/slots.py).
        results[batching] = run_load(replace(options, server="start", run_dir=run_dir,
                                             params={**options.params, "batching": batching}))
        print_result(results[batching])
    return results, compare.write_comparison(parent, {m: r.run_dir for m, r in results.items()})
