"""benchmarks/serving.py: workloads, the three SSE parsers, the statistics, and an end-to-end
run against a fake Triton generate_stream server (http.server on a free local port)."""

from __future__ import annotations

import io
import itertools
import json
import math
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from benchmarks import serving
from benchmarks.serving import Request, Result, Server, Workload

REPO_ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- workloads
def test_workload_a_is_fixed_shape() -> None:
    w = serving.make_workload("A")
    assert w.name == "A" and len(w.requests) == 64
    assert all(len(r.prompt) == 64 and r.output_len == 128 for r in w.requests)
    assert all(1000 <= t < 40000 for r in w.requests for t in r.prompt)
    assert len({tuple(r.prompt) for r in w.requests}) == 64          # every prompt distinct


def test_workload_b_is_deterministic_and_uses_allowed_lengths() -> None:
    b1, b2 = serving.make_workload("B", seed=0), serving.make_workload("B", seed=0)
    assert b1 == b2 and len(b1.requests) == 64
    assert {len(r.prompt) for r in b1.requests} <= {16, 64, 256, 512}
    assert {r.output_len for r in b1.requests} <= {16, 64, 256}
    assert len({len(r.prompt) for r in b1.requests}) > 1 and len({r.output_len for r in b1.requests}) > 1
    assert len({tuple(r.prompt) for r in b1.requests}) == 64
    assert serving.make_workload("B", seed=1) != b1
    assert all(5 <= t < 9 for r in serving.make_workload("B", 8, 0, (5, 9)).requests for t in r.prompt)
    with pytest.raises(ValueError):
        serving.make_workload("C")


# ----------------------------------------------------------------------------- SSE parsers
def sse(*payloads: str) -> io.BytesIO:
    """A canned server-sent-event byte stream, with a comment line and blank separators."""
    return io.BytesIO(b": keep-alive\n\n" + b"".join(f"data: {p}\n\n".encode() for p in payloads))


def read(api: str, stream: io.BytesIO, expected: int) -> Result:
    clock = itertools.count(1).__next__                  # event k arrives at time k
    result = Result(sent=0.0)
    serving.read_stream(api, stream, result, expected, deadline=math.inf, clock=clock)
    return result


def test_triton_merged_delta_and_empty_final_event() -> None:
    stream = sse('{"text_output": "a", "num_output_tokens": 1}',
                 '{"text_output": "bcd", "num_output_tokens": 3}',
                 '{"text_output": "", "num_output_tokens": 0}')
    r = read("triton", stream, expected=4)
    assert r.ok and r.error == "" and r.tokens == 4
    assert r.events == [(1, 1), (2, 3)]                  # the empty final event is no token event
    assert r.end == 4


def test_triton_error_event_and_count_mismatch() -> None:
    r = read("triton", sse('{"text_output": "a", "num_output_tokens": 1}', '{"error": "boom"}'), 4)
    assert not r.ok and "boom" in r.error
    r = read("triton", sse('{"text_output": "ab", "num_output_tokens": 2}'), 4)
    assert not r.ok and "streamed 2 tokens, requested 4" in r.error


def test_llamacpp_stop_event() -> None:
    events = ['{"content": "x", "stop": false}', '{"content": "y", "stop": false, "tokens": [7, 8]}',
              '{"content": "", "stop": true, "tokens_predicted": 3, "timings": {"predicted_n": 3}}',
              '{"content": "never read", "stop": false}']
    r = read("llamacpp", sse(*events), 3)
    assert r.ok and r.events == [(1, 1), (2, 2)]
    events[2] = events[2].replace('"tokens_predicted": 3', '"tokens_predicted": 4')
    r = read("llamacpp", sse(*events), 3)
    assert not r.ok and "server reports 4" in r.error
    r = read("llamacpp", sse('{"error": {"code": 500, "message": "ctx full"}}'), 3)
    assert not r.ok and "ctx full" in r.error


def test_openai_usage_chunk_and_done() -> None:
    chunk = '{"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "t", "finish_reason": null}]}'
    usage = '{"id": "c", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}'
    r = read("openai", sse(chunk, chunk, usage, "[DONE]", chunk), 2)
    assert r.ok and r.events == [(1, 1), (2, 1)] and r.end == 5
    r = read("openai", sse(chunk, chunk, usage.replace('"completion_tokens": 2', '"completion_tokens": 3'),
                           "[DONE]"), 2)
    assert not r.ok and "server reports 3" in r.error


def test_request_bodies() -> None:
    req = Request([1, 2, 3], 5)
    path, body = serving.request_for(Server("s", "triton", "h", 1, "llm"), req)
    assert path == "/v2/models/llm/generate_stream" and body["input_ids"] == [1, 2, 3]
    assert json.loads(body["sampling_parameters"]) == {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    path, body = serving.request_for(Server("s", "llamacpp", "h", 1), req)
    assert path == "/completion" and body["n_predict"] == 5 and body["cache_prompt"] is False
    path, body = serving.request_for(Server("s", "openai", "h", 1, "m"), req)
    assert path == "/v1/completions" and body["model"] == "m" and body["stream_options"] == {"include_usage": True}
    s = serving.parse_server("vllm=openai@10.0.0.1:8100", "llm")
    assert (s.name, s.api, s.host, s.port) == ("vllm", "openai", "10.0.0.1", 8100)
    with pytest.raises(Exception):
        serving.parse_server("x=grpc@h:1", "llm")


# ----------------------------------------------------------------------------- statistics
def test_itl_amortisation_tpot_ttft() -> None:
    r = Result(sent=0.0, end=0.7, events=[(0.1, 1), (0.3, 1), (0.6, 3)], ok=True)
    assert serving.ttft(r) == pytest.approx(0.1)
    assert serving.itl_samples(r) == pytest.approx([0.2, 0.1, 0.1, 0.1])   # 0.3 s over 3 tokens
    assert serving.tpot(r) == pytest.approx(0.5 / 4)
    assert serving.tpot(Result(sent=0.0, events=[(0.1, 1)])) is None


def test_percentile_linear_interpolation() -> None:
    assert serving.percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert serving.percentile(list(range(101)), 99) == pytest.approx(99)
    assert serving.percentile([1, 2], 99) == pytest.approx(1.99)
    assert serving.percentile([7], 99) == 7
    assert math.isnan(serving.percentile([], 50))


def test_summarize() -> None:
    ok1 = Result(sent=0.0, end=1.0, events=[(0.2, 1), (0.6, 2), (1.0, 1)], ok=True)
    ok2 = Result(sent=0.5, end=1.5, events=[(1.0, 2), (1.5, 2)], ok=True)
    bad = Result(sent=1.0, end=2.0, events=[(1.5, 1)], error="boom")
    s = serving.summarize(Server("x", "triton", "h", 1), "A", [ok1, ok2, bad], cpu_busy=50.0)
    assert (s.completed, s.failed, s.output_tokens, s.errors) == (2, 1, 8, ["boom"])
    assert s.wall_s == pytest.approx(2.0) and s.output_tok_s == pytest.approx(4.0)
    assert s.ttft_p50_ms == pytest.approx(350.0)                       # TTFTs 200 and 500 ms
    # ITL samples: 0.2, 0.2 (ok1's merged pair), 0.4, 0.25, 0.25 -> median 0.25 s
    assert s.itl_p50_ms == pytest.approx(250.0)
    assert s.tpot_p50_ms == pytest.approx(1e3 * (0.8 / 3 + 0.5 / 3) / 2)
    assert s.e2e_p50_ms == pytest.approx(1000.0)
    idle, total = serving.cpu_times()
    assert 0 <= idle <= total


# ----------------------------------------------------------------------------- end to end
class FakeTriton(BaseHTTPRequestHandler):
    """Triton's generate_stream over chunked SSE: deltas of up to 3 tokens, then an empty final
    event. max_tokens 13 answers with an error event; 11 streams one token short."""
    protocol_version = "HTTP/1.1"
    seen: list[dict] = []

    def log_message(self, *args: object) -> None:
        pass

    def chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/v2/models/llm/generate_stream"
        assert body["stream"] and body["return_num_output_tokens"] and body["exclude_input_in_output"]
        sampling = json.loads(body["sampling_parameters"])
        FakeTriton.seen.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = sampling["max_tokens"] - (sampling["max_tokens"] == 11)
        if sampling["max_tokens"] == 13:
            self.chunk(b'data: {"error": "out of KV blocks"}\n\n')
        else:
            for k in range(0, n, 3):
                event = {"text_output": "x" * min(3, n - k), "num_output_tokens": min(3, n - k)}
                self.chunk(f"data: {json.dumps(event)}\n\n".encode())
            self.chunk(b'data: {"text_output": "", "num_output_tokens": 0, "finish_reason": "length"}\n\n')
        self.chunk(b"")


@pytest.fixture()
def fake_server():
    FakeTriton.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeTriton)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_cli_end_to_end(fake_server: int, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "serving.json"
    summaries = serving.main(["--server", f"fake=triton@127.0.0.1:{fake_server}", "--workloads", "A",
                              "--num-requests", "4", "--concurrency", "2", "--json", str(out)])
    (s,) = summaries
    assert (s.server, s.workload, s.completed, s.failed, s.output_tokens) == ("fake", "A", 4, 0, 4 * 128)
    assert s.output_tok_s > 0 and s.ttft_p50_ms > 0 and s.tpot_p50_ms > 0 and s.itl_p99_ms >= s.itl_p50_ms
    measured = [b["input_ids"] for b in FakeTriton.seen[2:]]               # after the 2 warm-ups
    assert len(FakeTriton.seen) == 6 and sorted(measured) == sorted(r.prompt for r in serving.make_workload("A", 4).requests)
    stdout = capsys.readouterr().out
    assert "| fake | triton | A |" in stdout and "host CPU:" in stdout
    saved = json.loads(out.read_text())
    assert saved["config"]["concurrency"] == 2 and saved["config"]["servers"][0]["port"] == fake_server
    assert saved["summaries"][0]["output_tokens"] == 512


def test_failures_are_recorded_not_fatal(fake_server: int) -> None:
    workload = Workload("tiny", [Request([1000 + i] * 4, n) for i, n in enumerate([5, 13, 1, 11, 7])])
    server = Server("fake", "triton", "127.0.0.1", fake_server, "llm")
    s = serving.run_workload(server, workload, concurrency=3, timeout=30)
    assert (s.completed, s.failed, s.output_tokens) == (3, 2, 13)
    assert any("out of KV blocks" in e for e in s.errors)
    assert any("streamed 10 tokens, requested 11" in e for e in s.errors)
    down = Server("down", "triton", "127.0.0.1", 1, "llm")                  # nothing listens there
    s = serving.run_workload(down, Workload("tiny", workload.requests[:2]), concurrency=2, timeout=5)
    assert (s.completed, s.failed, s.output_tokens) == (0, 2, 0)


def test_module_help_runs() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.serving", "--help"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--server" in done.stdout
