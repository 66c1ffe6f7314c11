"""Start the real ``tritonserver`` binary from nvidia-pytriton on 127.0.0.1 with our model
repository, wait until the model is ready, stop cleanly on Ctrl-C / SIGTERM.

    python -m server.launch [--http-port 8000 --grpc-port 8001 --metrics-port 8002]
                            [--param batching=static --param max_waiting_requests=8]

``--param`` overrides an engine parameter of config.pbtxt in a temporary copy of the
repository (the checked-in one is never modified). Tests use ``TritonServer`` directly.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from server.stub.metric_names import REPORT_CUSTOM_METRICS

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = REPO_ROOT / "model_repository"
MODEL_NAME = "llm"


def terminate_with_parent(parent_pid: int) -> None:
    """In a child, between fork and exec (``preexec_fn=partial(terminate_with_parent,
    os.getpid())``): the kernel sends it SIGTERM when the *thread* that started it dies (Linux
    PR_SET_PDEATHSIG), so children are started from long-lived threads (the main thread, a
    server's supervisor). So a launcher killed with SIGKILL, which cannot stop its server itself,
    no longer leaves tritonserver running and holding its ports: the server drains
    (drain_timeout_s) and exits, as on Ctrl-C. A parent already gone before the call is caught
    by its pid. Elsewhere a no-op."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        os._exit(1)


# Ports for our servers are picked below the kernel's ephemeral range: the kernel hands ports in
# that range to outgoing connections, so a port found free there can be taken by any client's
# connect() before the server binds it (a replica once failed to start "already in use" so).
PORT_FLOOR = 20000
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_ports_handed_out: set[int] = set()
_ports_lock = threading.Lock()


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default if unreadable)."""
    try:
        low, high = (int(field) for field in EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1, below the ephemeral range where it leaves room
    (else the kernel's pick), held open together so they differ, and never one this process
    handed out before (a server launched from an earlier call may not have bound it yet)."""
    low = ephemeral_port_range()[0]
    candidates = list(range(PORT_FLOOR, low))
    random.shuffle(candidates)
    sockets: list[socket.socket] = []
    with _ports_lock:
        try:
            for port in candidates:
                if len(sockets) == n:
                    break
                if port in _ports_handed_out:
                    continue
                sock = socket.socket()
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    sock.close()
                    continue
                sockets.append(sock)
            while len(sockets) < n:   # no room below the ephemeral range
                sock = socket.socket()
                sock.bind(("127.0.0.1", 0))
                if sock.getsockname()[1] in _ports_handed_out:
                    sock.close()
                    continue
                sockets.append(sock)
            ports = [sock.getsockname()[1] for sock in sockets]
            _ports_handed_out.update(ports)
        finally:
            for sock in sockets:
                sock.close()
    return ports


def _pytriton_dirs() -> tuple[Path, Path]:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed (run `make setup`)")
    package = Path(list(spec.submodule_search_locations)[0])
    return package / "tritonserver", package.parent / "nvidia_pytriton.libs"


def backend_directory() -> Path:
    """A Triton backends folder holding the Python backend and the stub for this Python."""
    triton_dir, _ = _pytriton_dirs()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = triton_dir / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeError(f"nvidia-pytriton ships no Python backend stub for Python {version}")
    target = Path(tempfile.gettempdir()) / f"triton-backends-{os.getuid()}-{version}" / "python"
    target.mkdir(parents=True, exist_ok=True)
    for source in (triton_dir / "backends" / "python" / "libtriton_python.so",
                   triton_dir / "backends" / "python" / "triton_python_backend_utils.py", stub):
        dest = target / source.name
        if not dest.exists() or dest.stat().st_size != source.stat().st_size:
            shutil.copy2(source, dest)
    return target.parent


# Read once at import: sysconfig fills its variables lazily and not thread-safely, so two
# servers started from two threads could see LIBDIR missing, and the stub would then load the
# system's libpython instead of this interpreter's.
PYTHON_LIBDIR = sysconfig.get_config_var("LIBDIR") or ""


def server_environment() -> dict[str, str]:
    _, libs = _pytriton_dirs()
    env = dict(os.environ)
    # The server and the stub need pytriton's bundled libraries; the stub embeds *this*
    # interpreter's libpython and must see this environment's packages and the repo.
    lib_dirs = [str(libs), PYTHON_LIBDIR]
    env["LD_LIBRARY_PATH"] = ":".join(p for p in lib_dirs + [env.get("LD_LIBRARY_PATH", "")] if p)
    # The stub ignores PYTHONPATH but resolves `python3` on PATH as its executable: putting this
    # interpreter's bin/ first makes site.py find the virtual environment (pyvenv.cfg).
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env["LLM_PROJECT_ROOT"] = str(REPO_ROOT)
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    return env


# Triton's exit timeout sits this far above the model's drain deadline: the drain ends every
# stream itself, and Triton then needs a moment to finalize the model and close its endpoints.
EXIT_TIMEOUT_MARGIN_S = 10
SUPERVISE_INTERVAL_S = 0.5


def configured_drain_timeout(params: dict[str, str]) -> float:
    """drain_timeout_s as the server will run it: an override, else config.pbtxt's value."""
    if "drain_timeout_s" in params:
        return float(params["drain_timeout_s"])
    text = (MODEL_REPOSITORY / MODEL_NAME / "config.pbtxt").read_text()
    match = re.search(r'key:\s*"drain_timeout_s"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text)
    if match:
        return float(match.group(1))
    from backend.config import EngineConfig
    return EngineConfig.drain_timeout_s


def repository_with_params(params: dict[str, str], workdir: Path) -> Path:
    """Copy the model repository with engine parameters set in its config.pbtxt (replacing a
    parameter the file sets already, adding the others). Keys must be EngineConfig fields (or
    their earlier names, RENAMED_KEYS), or the model's own REPORT_CUSTOM_METRICS."""
    from backend.config import RENAMED_KEYS, EngineConfig

    known = {f.name for f in dataclasses.fields(EngineConfig)} | set(RENAMED_KEYS) | {REPORT_CUSTOM_METRICS}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(f"not engine parameters: {unknown}")
    target = workdir / "model_repository"
    shutil.copytree(MODEL_REPOSITORY, target, ignore=shutil.ignore_patterns("__pycache__"))
    config = target / MODEL_NAME / "config.pbtxt"
    text = config.read_text()
    for key, value in params.items():
        pattern = re.compile(r'(key:\s*"%s"\s*value:\s*\{\s*string_value:\s*)"[^"]*"' % re.escape(key))
        text, count = pattern.subn(lambda m: f'{m.group(1)}"{value}"', text)
        if count == 0:
            text += f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
    config.write_text(text)
    return target


STUB_NAME = "triton_python_b"   # the stub's process name as /proc shows it (15 characters)


def processes_in_group(pgid: int, name_prefix: str = "") -> list[int]:
    """Live (not zombie) processes of a process group, optionally by name prefix."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        state, _ppid, pgrp = text[text.rindex(")") + 2:].split()[:3]
        if int(pgrp) == pgid and state != "Z" and name.startswith(name_prefix):
            pids.append(int(stat.parent.name))
    return pids


class TritonServer:
    """The real tritonserver as a child process, in its own process group (so that nothing it
    started can outlive it).

    ``stop()`` is a graceful shutdown: SIGTERM to tritonserver alone (not to the Python stubs,
    which Triton itself must finalize); the model drains its streams for ``drain_timeout_s``
    and Triton's exit timeout is set just above that. Only a server still alive after both
    gets SIGKILL."""

    def __init__(self, http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 params: dict[str, str] | None = None, log_file: Path | None = None,
                 supervise: bool = False, env: dict[str, str] | None = None) -> None:
        """``env``: extra environment for tritonserver (e.g. LLM_INJECT_STEP_FAULT in tests)."""
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.params = params or {}
        self.extra_env = env or {}
        self.log_file = log_file
        self.process: subprocess.Popen | None = None
        self._workdir: tempfile.TemporaryDirectory | None = None
        self.drain_file: Path | None = None
        self.unhealthy_file: Path | None = None   # written by the model when its engine is unhealthy
        self.supervise = supervise
        self.restarts = 0
        self._repository = MODEL_REPOSITORY
        self._stopping = threading.Event()
        self._lifecycle = threading.Lock()   # restart vs stop
        self._supervisor: threading.Thread | None = None
        self._log = None
        self._restart_times: list[float] = []
        self._became_ready = False     # the current incarnation's model loaded (no restart backoff)
        self.drain_timeout_s = configured_drain_timeout(self.params)
        self.exit_timeout_s = int(self.drain_timeout_s + EXIT_TIMEOUT_MARGIN_S + 0.999)

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, timeout: float = 300.0) -> "TritonServer":
        self.launch()
        return self.finish_start(timeout)

    def launch(self) -> "TritonServer":
        """Start the process, without waiting for it. Call it on a thread that lives as long
        as the server should (the kernel stops the server when that thread ends; see
        terminate_with_parent), then ``finish_start`` from any thread."""
        self._workdir = tempfile.TemporaryDirectory(prefix="llm-server-")
        self.drain_file = Path(self._workdir.name) / "drain"
        self.unhealthy_file = Path(self._workdir.name) / "unhealthy"
        self._repository = MODEL_REPOSITORY
        if self.params:
            self._repository = repository_with_params(self.params, Path(self._workdir.name))
        self._spawn()
        return self

    def finish_start(self, timeout: float = 300.0) -> "TritonServer":
        """Wait until the launched server is ready (stopping it if it is not), then supervise it."""
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self._became_ready = True
        if self.supervise:
            self._supervisor = threading.Thread(target=self._supervise, name="triton-supervisor", daemon=True)
            self._supervisor.start()
        return self

    def _spawn(self) -> None:
        triton_dir, _ = _pytriton_dirs()
        cmd = [str(triton_dir / "bin" / "tritonserver"),
               f"--model-repository={self._repository}",
               f"--backend-directory={backend_directory()}",
               "--http-address=127.0.0.1", f"--http-port={self.http_port}",
               "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
               "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
               "--metrics-address=127.0.0.1", f"--metrics-port={self.metrics_port}",
               "--exit-on-error=true", "--log-verbose=0", f"--exit-timeout-secs={self.exit_timeout_s}",
               # config.pbtxt is complete: auto-complete would start a whole stub only to ask model.py
               "--disable-auto-complete-config"]
        if self._log is not None:
            self._log.close()
        self._log = out = open(self.log_file, "a" if self.restarts else "w") if self.log_file else None
        if self.drain_file is not None:   # a restarted server starts undrained
            self.drain_file.unlink(missing_ok=True)
            Path(str(self.drain_file) + ".done").unlink(missing_ok=True)
        if self.unhealthy_file is not None:
            self.unhealthy_file.unlink(missing_ok=True)
        env = {**server_environment(), **self.extra_env}
        env["LLM_DRAIN_FILE"] = str(self.drain_file)   # read by model_repository/llm/1/model.py
        env["LLM_UNHEALTHY_FILE"] = str(self.unhealthy_file)   # written by it
        env["LLM_SERVER_RESTARTS"] = str(self.restarts)  # exported as llm_server_restarts_total
        self.process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                        start_new_session=True,
                                        preexec_fn=functools.partial(terminate_with_parent, os.getpid()))

    def stub_pids(self) -> list[int]:
        """The Python backend stubs of this server (Triton 2.51 neither restarts a stub that
        died nor ends the streams it had open; see docs/reliability.md)."""
        return processes_in_group(self.process.pid, STUB_NAME) if self.process is not None else []

    def stub_alive(self) -> bool:
        return bool(self.stub_pids())

    def _supervise(self) -> None:
        try:
            self._supervise_until_stopped()
        finally:
            # A server this thread restarted gets SIGTERM from the kernel when the thread ends
            # (terminate_with_parent). Ending with stop()'s first step would signal it before
            # stop() has drained it: Triton then began to unload with the model undrained and
            # sat out its whole exit timeout, for every replica that had been restarted.
            # So the thread lasts until stop() has ended the server.
            if self.process is not None:
                self.process.wait()

    def _supervise_until_stopped(self) -> None:
        """Restart the server when its stub or the server itself dies, or when the model reports
        its engine unhealthy (after answering every stream it had). Killing the server ends a
        dead stub's streams at once (a transport error) instead of leaving them hung."""
        while not self._stopping.wait(SUPERVISE_INTERVAL_S):
            unhealthy = self.unhealthy_file is not None and self.unhealthy_file.exists()
            if self.process.poll() is None and self.stub_alive() and not unhealthy:
                continue
            with self._lifecycle:
                if self._stopping.is_set():
                    return
                reason = (f"tritonserver exited with {self.process.returncode}" if self.process.poll() is not None
                          else "the Python backend stub died" if not self.stub_alive()
                          else f"the engine is unhealthy ({self.unhealthy_file.read_text(errors='replace')})")
                print(f"supervisor: {reason}; restarting tritonserver", file=sys.stderr, flush=True)
                self._kill_group()
                # Back off when restarts come fast without the model ever loading: 0, 1, 2, 4 ...
                # 60 s. A server whose model became ready is not failing to load: count afresh.
                if self._became_ready:
                    self._restart_times = []
                recent = [t for t in self._restart_times if time.monotonic() - t < 600]
                self._restart_times = recent + [time.monotonic()]
                if recent and self._stopping.wait(min(60.0, 2.0 ** (len(recent) - 1))):
                    return
                self.restarts += 1
                self._spawn()
            try:
                self._became_ready = False
                self._wait_ready(300)
                self._became_ready = True
                print(f"supervisor: model '{MODEL_NAME}' is ready again (restart {self.restarts})",
                      file=sys.stderr, flush=True)
            except (RuntimeError, TimeoutError) as exc:
                print(f"supervisor: restart failed: {exc}", file=sys.stderr, flush=True)

    def _kill_group(self) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def wait_ready(self, timeout: float) -> None:
        """Until the model answers ready. Under supervision a server that died is being
        restarted, so that is waited out too."""
        self._wait_ready(timeout, through_restarts=self.supervise and self._supervisor is not None)

    def _wait_ready(self, timeout: float, through_restarts: bool = False) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{self.http_url}/v2/models/{MODEL_NAME}/ready"
        while time.monotonic() < deadline:
            if through_restarts and self._stopping.is_set():
                raise RuntimeError("the server is being stopped")
            if not through_restarts and self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} before it was ready"
                                   + (f"; see {self.log_file}" if self.log_file else ""))
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    model_ready = response.status == 200
                # Triton starts its metrics service after HTTP (a moment later): ready
                # means every endpoint answers.
                with urllib.request.urlopen(self.metrics_url, timeout=2) as response:
                    if model_ready and response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"model {MODEL_NAME!r} not ready after {timeout:.0f}s")

    def drain(self) -> bool:
        """Ask the model to drain (new requests get UNAVAILABLE, those in flight finish or are
        ended at drain_timeout_s) and wait until nothing is in flight. True when it drained."""
        if self.process is None or self.process.poll() is not None or self.drain_file is None:
            return False
        self.drain_file.touch()
        done = Path(str(self.drain_file) + ".done")
        deadline = time.monotonic() + self.drain_timeout_s + EXIT_TIMEOUT_MARGIN_S
        while time.monotonic() < deadline and self.process.poll() is None:
            if done.exists():
                return True
            time.sleep(0.1)
        return False

    def restart_gracefully(self) -> None:
        """A rolling restart of a supervised server: drain (readiness turns 0 at once, so a
        proxy stops sending), SIGTERM, and the supervisor starts it again when it has exited."""
        if not self.supervise:
            raise RuntimeError("restart_gracefully needs a supervised server")
        with self._lifecycle:
            if self.process is None or self.process.poll() is not None:
                return
            self._drain_and_terminate(self.exit_timeout_s + 10)   # the supervisor kills what is left

    def _drain_and_terminate(self, timeout: float) -> None:
        """Drain, SIGTERM, wait up to ``timeout`` for the exit. Triton 2.51 finishes unloading
        only once every client's gRPC stream has closed, and a stream may still be delivering
        the last responses of a drained request to a slow client through a proxy; killing it
        earlier cut those (docs/reliability.md), so the wait is Triton's own exit timeout."""
        if self.stub_alive():
            self.drain()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    @property
    def draining(self) -> bool:
        return self.drain_file is not None and self.drain_file.exists()

    def stop(self, timeout: float | None = None) -> None:
        """Graceful: drain the model first (Triton would otherwise start unloading with streams
        still open), then SIGTERM to tritonserver, which unloads the model and exits. SIGKILL
        to the whole group after ``timeout`` (default: Triton's exit timeout + 10 s)."""
        timeout = self.exit_timeout_s + 10 if timeout is None else timeout
        self._stopping.set()
        with self._lifecycle:   # not in the middle of a restart
            if self.process is not None and self.process.poll() is None:
                self._drain_and_terminate(timeout)
            # Whatever is left of the group (e.g. the stubs of a server that died on its own).
            self._kill_group()
            if self._log is not None:
                self._log.close()
                self._log = None
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def finish_starts(servers: list["TritonServer"], timeout: float = 300.0) -> None:
    """Wait for every launched server to be ready, the waits in parallel; raises the first
    failure. The processes must already be launched on the caller's (long-lived) thread: a
    process started on a thread that ends gets SIGTERM then (terminate_with_parent)."""
    errors: list[BaseException] = []

    def wait_ready(server: TritonServer) -> None:
        try:
            server.finish_start(timeout)
        except BaseException as exc:   # noqa: BLE001 - raised below
            errors.append(exc)

    threads = [threading.Thread(target=wait_ready, args=(server,)) for server in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    parser.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="override an engine parameter of config.pbtxt (or set REPORT_CUSTOM_METRICS)")
    args = parser.parse_args(argv)
    params = dict(p.split("=", 1) for p in args.param)
    server = TritonServer(args.http_port, args.grpc_port, args.metrics_port, params, supervise=True)
    stop_requested = False

    def request_stop(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    server.start()
    print(f"model '{MODEL_NAME}' is ready: HTTP {server.http_url}, gRPC {server.grpc_url}, "
          f"metrics {server.metrics_url}  (Ctrl-C stops)", flush=True)
    while not stop_requested:   # the supervisor restarts a server or stub that dies
        time.sleep(0.2)
    print(f"stopping: draining requests in flight (up to {server.drain_timeout_s:g} s)", flush=True)
    server.stop()
    print(f"tritonserver stopped ({server.restarts} restart(s) while it ran)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
