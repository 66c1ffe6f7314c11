"""Shutdown and crash recovery of the real server: SIGTERM to the launcher drains every open
stream to a final response and leaves no process behind; a Python stub killed with SIGKILL
ends its streams with an error within seconds and the supervisor brings the model back."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest

from backend.worker.fault_injection import FAULT_FILE_ENV
from client import NO_RETRY, LLMClient, LLMError
from loadtest.server_metrics import scrape, value
from server.launch import REPO_ROOT, TritonServer, free_ports, processes_in_group
from server.ready import is_ready
from tests.conftest import FIXED_BUDGET_PARAMS

pytestmark = pytest.mark.server

DRAIN_TIMEOUT_S = 8.0


def _tritonserver_pid(http_port: int) -> int | None:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"tritonserver") and f"--http-port={http_port}".encode() in args:
            return int(cmdline.parent.name)
    return None


def start_launcher(tmp_path: Path, http: int, grpc: int, metrics: int, drain_timeout_s: float,
                   ) -> tuple[subprocess.Popen, IO[str]]:
    """``python -m server.launch`` as a user runs it, on these ports, ready; its output in a log."""
    log = open(tmp_path / "launcher.log", "w")
    launcher = subprocess.Popen([sys.executable, "-m", "server.launch", f"--http-port={http}", f"--grpc-port={grpc}",
                                 f"--metrics-port={metrics}", f"--param=drain_timeout_s={drain_timeout_s:g}",
                                 *(f"--param={k}={v}" for k, v in FIXED_BUDGET_PARAMS.items())],
                                cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        TritonServer(http, grpc, metrics).wait_ready(300)
    except BaseException:
        launcher.kill()
        log.close()
        raise
    return launcher, log


class StreamRecord:
    """One streaming request on a thread: tokens, how it ended, and when."""

    def __init__(self, client: LLMClient, max_tokens: int) -> None:
        self.tokens = 0
        self.final = None
        self.error: Exception | None = None
        self.ended_at: float | None = None
        self.first_token = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(client, max_tokens), daemon=True)
        self._thread.start()

    def _run(self, client: LLMClient, max_tokens: int) -> None:
        try:
            for chunk in client.stream("Tell me a long story about a lighthouse.", max_tokens=max_tokens,
                                       ignore_eos=True, temperature=0.0):
                self.tokens += chunk.num_output_tokens
                if self.tokens:
                    self.first_token.set()
                if chunk.final:
                    self.final = chunk
        except Exception as exc:  # noqa: BLE001 - recorded and asserted on
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.first_token.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def test_sigterm_drains_every_open_stream_and_leaves_no_process(model_dir: Path, tmp_path: Path) -> None:
    http, grpc, metrics = free_ports(3)
    launcher, log = start_launcher(tmp_path, http, grpc, metrics, DRAIN_TIMEOUT_S)
    try:
        server_pid = _tritonserver_pid(http)
        assert server_pid is not None
        pgid = os.getpgid(server_pid)
        client = LLMClient(f"127.0.0.1:{grpc}")
        streams = [StreamRecord(client, 40 if i < 2 else 5000) for i in range(8)]
        for stream in streams:
            assert stream.first_token.wait(60) and stream.error is None, stream.error

        metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        assert is_ready(f"127.0.0.1:{http}", metrics_url) == (True, "ready")
        sigterm_at = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert is_ready(f"127.0.0.1:{http}", metrics_url) == (False, "draining")   # the readiness probe
        with pytest.raises(LLMError, match="shutting down") as refused:   # no new work once draining
            LLMClient(f"127.0.0.1:{grpc}", retry=NO_RETRY).generate("Are you still taking requests?", max_tokens=4)
        assert refused.value.retryable
        for stream in streams:
            stream.join(DRAIN_TIMEOUT_S + 10)

        for i, stream in enumerate(streams):
            assert stream.error is None, f"stream {i} got an error instead of a final response: {stream.error}"
            assert stream.final is not None, f"stream {i} ended without a final response"
            assert stream.ended_at - sigterm_at <= DRAIN_TIMEOUT_S + 2.0, f"stream {i} ended late"
        for stream in streams[2:]:
            assert stream.final.finish_reason == "abort"
            assert "shutting down" in stream.final.finish_message
        assert launcher.wait(30) == 0
        assert time.monotonic() - sigterm_at <= DRAIN_TIMEOUT_S + 15
        assert processes_in_group(pgid) == [], "tritonserver or its stub outlived the launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        log.close()


def test_a_sigkilled_launcher_takes_its_server_down(model_dir: Path, tmp_path: Path) -> None:
    """SIGKILL cannot be caught, so the launcher cannot stop its server: the kernel tells the
    server instead (PR_SET_PDEATHSIG: SIGTERM), which drains and exits with its stub, and the
    ports are free again."""
    http, grpc, metrics = free_ports(3)
    launcher, log = start_launcher(tmp_path, http, grpc, metrics, 2.0)
    try:
        server_pid = _tritonserver_pid(http)
        assert server_pid is not None
        pgid = os.getpgid(server_pid)
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 30
        while processes_in_group(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_in_group(pgid) == [], "tritonserver or its stub outlived a SIGKILLed launcher"
        for port in (http, grpc, metrics):
            with socket.socket() as sock:
                # Free again: nothing listens on it (SO_REUSEADDR, as a server restarting on the
                # port sets: the connections the server closed may still be in TIME_WAIT).
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen()
    finally:
        if launcher.poll() is None:
            launcher.kill()
        log.close()


def test_a_killed_stub_ends_its_streams_and_the_server_recovers(model_dir: Path, tmp_path: Path) -> None:
    server = TritonServer(*free_ports(3), params=FIXED_BUDGET_PARAMS, log_file=tmp_path / "server.log",
                          supervise=True).start()
    try:
        client = LLMClient(server.grpc_url)
        streams = [StreamRecord(client, 5000) for _ in range(3)]
        for stream in streams:
            assert stream.first_token.wait(60) and stream.error is None
        stubs = server.stub_pids()
        assert stubs, "no Python backend stub found"
        killed_at = time.monotonic()
        for pid in stubs:
            os.kill(pid, signal.SIGKILL)
        for stream in streams:
            stream.join(15)
            assert stream.error is not None, "a stream of the dead stub did not end with an error"
            assert stream.ended_at - killed_at <= 10.0
        server.wait_ready(300)
        completion = client.generate("Back again?", max_tokens=5, temperature=0.0)
        assert completion.num_output_tokens == 5
        restarts = [v for k, v in scrape(server.metrics_url).items() if k.startswith("llm_server_restarts_total")]
        assert restarts == [1]
        # The restarted server, started by the supervisor's thread, is drained before Triton gets
        # its SIGTERM (not signalled by the kernel as that thread ends).
        server.stop()
        log = (tmp_path / "server.log").read_text()
        restarted = log[log.rindex("Started GRPCInferenceService"):]
        assert "draining:" in restarted and "Signal (15) received" in restarted, restarted[-2000:]
        assert restarted.index("draining:") < restarted.index("Signal (15) received"), restarted[-2000:]
    finally:
        server.stop()


def test_an_unhealthy_engine_turns_not_ready_and_the_supervisor_restarts_it(model_dir: Path, tmp_path: Path) -> None:
    """Injected: every engine step fails (LLM_INJECT_STEP_FAULT), as on a broken device. After a
    few steps that failed all their requests the engine is unhealthy: requests are refused as
    retryable, llm_ready and llm_engine_healthy read 0 (what HAProxy's health check and
    server/ready.py look at), the log says why, and the supervisor restarts the server."""
    fault = tmp_path / "fault"
    with TritonServer(*free_ports(3), params=FIXED_BUDGET_PARAMS, supervise=True, env={FAULT_FILE_ENV: str(fault)},
                      log_file=tmp_path / "server.log") as server:
        client = LLMClient(server.grpc_url, retry=NO_RETRY)
        assert client.generate("Before the fault:", max_tokens=2).num_output_tokens == 2
        assert is_ready(server.http_url, server.metrics_url) == (True, "ready")

        readiness: list[tuple[float | None, float | None, str]] = []
        watching = threading.Event()

        def watch() -> None:   # the not-ready window lasts until the supervisor restarts the server
            while not watching.wait(0.03):
                try:
                    values = scrape(server.metrics_url)
                except Exception:  # noqa: BLE001 - the server is restarting
                    continue
                readiness.append((value(values, "llm_ready"), value(values, "llm_engine_healthy"),
                                  is_ready(server.http_url, server.metrics_url)[1]))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        fault.touch()
        errors: list[LLMError] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(e.retryable for e in errors):
            try:
                for item in client.stream_many(["one", "two"], {"max_tokens": 8, "ignore_eos": True}):
                    if isinstance(item, tuple):
                        errors.append(item[1])
            except Exception as exc:  # noqa: BLE001 - the supervisor may already be restarting it
                errors.append(LLMError(repr(exc)))
                break
        fault.unlink()
        refused = [e for e in errors if "engine is unhealthy" in str(e)]
        assert refused and all(e.retryable for e in refused), [str(e) for e in errors]
        assert any("injected step fault" in str(e) for e in errors), [str(e) for e in errors]

        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (server.restarts >= 1 and is_ready(server.http_url,
                                                                                    server.metrics_url)[0]):
            time.sleep(0.2)
        watching.set()
        watcher.join()
        assert server.restarts == 1
        assert (0.0, 0.0, "engine unhealthy") in readiness, readiness
        assert client.generate("After the restart:", max_tokens=2).num_output_tokens == 2
        assert value(scrape(server.metrics_url), "llm_ready") == 1.0
    log = (tmp_path / "server.log").read_text()
    assert "engine is unhealthy" in log and "steps in a row failed every request" in log
