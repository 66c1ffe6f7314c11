"""Serving benchmark: drive already-running LLM servers over HTTP and compare them side by side.

Reproduce the side-by-side table (servers are measured one after another, never at once):

    python -m benchmarks.serving --server ours=triton@127.0.0.1:8000 \\
        --server llama.cpp=llamacpp@127.0.0.1:8080 --server vllm=openai@127.0.0.1:8100 \\
        --workloads A,B --concurrency 16 --num-requests 64 --seed 0 --json serving.json

Or start our server once per engine configuration, in turn (``--launch NAME:KEY=VALUE,...``):

    python -m benchmarks.serving --launch default: --launch fixed-budget:itl_target_ms=0 --workloads A,B

APIs: ``triton`` (Triton's HTTP generate_stream, model ``--model``), ``llamacpp`` (llama-server
``/completion``), ``openai`` (vLLM ``/v1/completions``; model from ``GET /v1/models`` unless
``--served-model``). Every request is greedy, ``ignore_eos``, streamed (server-sent events).

Workloads (token-id prompts from ``random.Random(seed)``, ids uniform in ``--id-range``):
  A: every prompt 64 tokens, every output 128 tokens.
  B: "mixed, seed 0": per request prompt length from {16, 64, 256, 512}, output from {16, 64, 256}.
  M: the seeds' mixed traffic, where static batching loses: prompt and output lengths lognormal
     (``MIXED_PROMPT``, ``MIXED_OUTPUT``; medians 300 and 80 tokens, sigma 1.3, clipped to the
     seeds' ranges of ~10-8192 prompt and 5-2048 output tokens). A batch of 32 then holds ~850
     tokens a request on average and ~5,000 in its longest (the seeds' example: 800 and 8,000).
  Ln: every prompt n tokens (e.g. L3072), one output token: time to first token of long fresh
     prompts, with ``--concurrency 1``.
The request list is built once per workload and is identical for every server; request i always
carries the same prompt. Closed loop: ``--concurrency`` workers, each sending its next request
as soon as its previous one ends. Two short unmeasured warm-up requests precede each run.

Metrics (over completed requests; a request whose streamed token count differs from the
requested output length, or from the count the server reports, is failed with the reason):
  TTFT  first event carrying >= 1 token - send time.
  ITL   for each token event after the first, the gap since the previous token event divided by
        the event's token count, one sample per token: a merged delta of n tokens counts as n
        inter-token gaps of gap/n (amortised), so servers that merge deltas compare fairly.
  TPOT  (last token event - first token event) / (tokens - 1).
  E2E   end of stream - send time.
  out tok/s  output tokens of completed requests / (last end - first send).
  CPU busy   100 * (1 - delta(idle + iowait) / delta(total)) of /proc/stat's aggregate line.
Percentiles use linear interpolation between closest ranks (numpy's default).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import math
import os
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator

APIS = ("triton", "llamacpp", "openai")
PROMPT_LENS_B, OUTPUT_LENS_B = (16, 64, 256, 512), (16, 64, 256)


@dataclass(frozen=True)
class Lognormal:
    """Token counts drawn lognormal around ``median`` and clipped to [low, high]."""
    median: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return int(min(self.high, max(self.low, rng.lognormvariate(math.log(self.median), self.sigma))))


MIXED_PROMPT = Lognormal(median=300, sigma=1.3, low=10, high=8192)
MIXED_OUTPUT = Lognormal(median=80, sigma=1.3, low=5, high=2048)


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[Request]


@dataclass
class Server:
    name: str
    api: str
    host: str
    port: int
    model: str = ""             # triton model name or the OpenAI served model


@dataclass
class Event:
    """One parsed server-sent event: tokens it carries, whether the stream ended, and the
    server's own total output-token count when it reports one."""
    tokens: int = 0
    done: bool = False
    reported: int | None = None


@dataclass
class Result:
    sent: float
    end: float = 0.0
    events: list[tuple[float, int]] = field(default_factory=list)   # (time, tokens) token events
    ok: bool = False
    error: str = ""

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.events)


@dataclass
class Summary:
    server: str
    api: str
    workload: str
    completed: int
    failed: int
    output_tokens: int
    wall_s: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    e2e_p50_ms: float
    cpu_busy_pct: float
    errors: list[str] = field(default_factory=list)    # the first few distinct failure reasons
    # One row per request, in workload order: where a percentile's time went (written to --json only).
    requests: list[dict[str, Any]] = field(default_factory=list)
    saturated_tok_s: float = float("nan")   # while every worker was busy (saturated_tok_s())


class StreamError(Exception):
    """The server reported an error inside the stream."""


# ----------------------------------------------------------------------------- workloads
def make_workload(name: str, num_requests: int = 64, seed: int = 0,
                  id_range: tuple[int, int] = (1000, 40000)) -> Workload:
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        if name == "A":
            prompt_len, output_len = 64, 128
        elif name == "B":
            prompt_len, output_len = rng.choice(PROMPT_LENS_B), rng.choice(OUTPUT_LENS_B)
        elif name == "M":
            prompt_len, output_len = MIXED_PROMPT.draw(rng), MIXED_OUTPUT.draw(rng)
        elif name[:1] == "L" and name[1:].isdigit():
            # Ln: fresh n-token prompts (random ids: no prefix hit) to their first token only,
            # for time to first token of long prompts (run with --concurrency 1).
            prompt_len, output_len = int(name[1:]), 1
        else:
            raise ValueError(f"unknown workload {name!r} (A, B, M or Ln, e.g. L3072)")
        requests.append(Request([rng.randrange(*id_range) for _ in range(prompt_len)], output_len))
    return Workload(name, requests)


# ----------------------------------------------------------------------------- protocols
def request_for(server: Server, req: Request) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one streamed, greedy, ignore_eos completion for the server's API."""
    if server.api == "triton":
        sampling = {"max_tokens": req.output_len, "temperature": 0, "ignore_eos": True}
        return (f"/v2/models/{server.model}/generate_stream",
                {"input_ids": req.prompt, "stream": True, "sampling_parameters": json.dumps(sampling),
                 "return_num_output_tokens": True, "exclude_input_in_output": True})
    if server.api == "llamacpp":
        return "/completion", {"prompt": req.prompt, "n_predict": req.output_len, "temperature": 0,
                               "ignore_eos": True, "stream": True, "cache_prompt": False,
                               "samplers": ["top_k"], "top_k": 1}
    return "/v1/completions", {"model": server.model, "prompt": req.prompt, "max_tokens": req.output_len,
                               "temperature": 0, "ignore_eos": True, "stream": True,
                               "stream_options": {"include_usage": True}}


def sse_data(lines: Iterable[bytes]) -> Iterator[str]:
    """The payloads of the ``data:`` lines of a server-sent-event byte stream."""
    for raw in lines:
        line = raw.decode("utf-8", errors="replace").strip()
        if line.startswith("data:"):
            yield line[len("data:"):].strip()


def parse_triton(payload: str) -> Event:
    obj = json.loads(payload)
    if "error" in obj:
        raise StreamError(str(obj["error"]))
    if "num_output_tokens" in obj:
        return Event(tokens=int(obj["num_output_tokens"]))
    return Event(tokens=1 if obj.get("text_output") else 0)     # server ignored the flag


def parse_llamacpp(payload: str) -> Event:
    obj = json.loads(payload)
    if "error" in obj:
        raise StreamError(str(obj["error"]))
    listed = len(obj["tokens"]) if isinstance(obj.get("tokens"), list) and obj["tokens"] else None
    if obj.get("stop"):
        return Event(tokens=listed or 0, done=True, reported=obj.get("tokens_predicted"))
    return Event(tokens=listed or 1)


def parse_openai(payload: str) -> Event:
    if payload == "[DONE]":
        return Event(done=True)
    obj = json.loads(payload)
    if "error" in obj or obj.get("object") == "error":
        raise StreamError(str(obj.get("error") or obj.get("message")))
    usage = obj.get("usage") or {}
    return Event(tokens=1 if obj.get("choices") else 0, reported=usage.get("completion_tokens"))


PARSERS: dict[str, Callable[[str], Event]] = {"triton": parse_triton, "llamacpp": parse_llamacpp,
                                              "openai": parse_openai}


def read_stream(api: str, lines: Iterable[bytes], result: Result, expected: int, deadline: float,
                clock: Callable[[], float] = time.perf_counter) -> None:
    """Consume one SSE reply into ``result`` (token events, end, ok/error)."""
    reported = None
    try:
        for payload in sse_data(lines):
            event, now = PARSERS[api](payload), clock()
            if event.tokens > 0:
                result.events.append((now, event.tokens))
            reported = event.reported if event.reported is not None else reported
            if event.done:
                break
            if now > deadline:
                raise StreamError("timeout")
    except (StreamError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.end = clock()
    if not result.error and result.tokens != expected:
        result.error = f"streamed {result.tokens} tokens, requested {expected}"
    elif not result.error and reported is not None and reported != result.tokens:
        result.error = f"streamed {result.tokens} tokens, server reports {reported}"
    result.ok = not result.error


def send(server: Server, req: Request, timeout: float) -> Result:
    path, body = request_for(server, req)
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    result = Result(sent=time.perf_counter())
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.read(300).decode(errors='replace')}"
        else:
            read_stream(server.api, response, result, req.output_len, result.sent + timeout)
    except Exception as exc:  # noqa: BLE001 - network errors, odd replies: a failure, never a crash
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    result.end = result.end or time.perf_counter()
    result.ok = result.ok and not result.error
    return result


def openai_model(server: Server, timeout: float) -> str:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        conn.request("GET", "/v1/models")
        return json.loads(conn.getresponse().read())["data"][0]["id"]
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as exc:
        print(f"warning: {server.name}: GET /v1/models failed ({exc})", file=sys.stderr)
        return "default"
    finally:
        conn.close()


# ----------------------------------------------------------------------------- statistics
def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def ttft(r: Result) -> float:
    return r.events[0][0] - r.sent


def itl_samples(r: Result) -> list[float]:
    samples = []
    for (t_prev, _), (t, n) in zip(r.events, r.events[1:]):
        samples += [(t - t_prev) / n] * n
    return samples


def tpot(r: Result) -> float | None:
    return (r.events[-1][0] - r.events[0][0]) / (r.tokens - 1) if r.tokens > 1 else None


def cpu_times() -> tuple[int, int]:
    """(idle + iowait, total) jiffies of /proc/stat's aggregate line (guest time is already
    inside user/nice, so it is left out of the total)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    return fields[3] + fields[4], sum(fields)


def cpu_info() -> dict[str, Any]:
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), model)
    except OSError:
        pass
    return {"cpu_model": model, "cpu_cores": os.cpu_count()}


def request_rows(workload: Workload, results: list[Result]) -> list[dict[str, Any]]:
    """Per request: its prompt and output lengths, when it was sent (from the run's first send),
    TTFT and E2E in ms (None when it failed)."""
    start = min((r.sent for r in results), default=0.0)
    return [{"prompt_len": len(req.prompt), "output_len": req.output_len, "sent_ms": round(1e3 * (r.sent - start), 1),
             "ttft_ms": round(1e3 * ttft(r), 1) if r.ok else None,
             "e2e_ms": round(1e3 * (r.end - r.sent), 1) if r.ok else None}
            for req, r in zip(workload.requests, results)]


def summarize(server: Server, workload: str, results: list[Result], cpu_busy: float) -> Summary:
    ok = [r for r in results if r.ok]
    wall = max(r.end for r in results) - min(r.sent for r in results) if results else 0.0
    tokens = sum(r.tokens for r in ok)
    ms = lambda xs, q: 1e3 * percentile(xs, q)  # noqa: E731
    ttfts, e2es = [ttft(r) for r in ok], [r.end - r.sent for r in ok]
    itls = [x for r in ok for x in itl_samples(r)]
    tpots = [x for x in map(tpot, ok) if x is not None]
    errors = list(dict.fromkeys(r.error for r in results if not r.ok))[:5]
    return Summary(server.name, server.api, workload, len(ok), len(results) - len(ok), tokens, wall,
                   tokens / wall if wall > 0 else 0.0, ms(ttfts, 50), ms(ttfts, 99), ms(itls, 50),
                   ms(itls, 99), ms(tpots, 50), ms(tpots, 99), ms(e2es, 50), cpu_busy, errors,
                   saturated_tok_s=saturated_tok_s(ok, results))


def saturated_tok_s(ok: list[Result], results: list[Result]) -> float:
    """Output tokens/s while every worker had a request in flight: the tokens streamed from the
    first send to the last one (after it the queue is empty and the run drains: the longest
    requests finish alone, which a finite closed-loop run pays once whatever the batching).
    NaN when the last request was sent with the first ones."""
    if not results:
        return float("nan")
    first, last = min(r.sent for r in results), max(r.sent for r in results)
    if last - first <= 0:
        return float("nan")
    return sum(n for r in ok for t, n in r.events if t <= last) / (last - first)


# ----------------------------------------------------------------------------- driver
def run_workload(server: Server, workload: Workload, concurrency: int = 16, timeout: float = 600.0,
                 warmup: int = 2, id_range: tuple[int, int] = (1000, 40000)) -> Summary:
    """Warm up (short prompts of their own), then run the workload closed-loop with
    ``concurrency`` workers; each worker takes the next unsent request index."""
    rng = random.Random(f"warmup-{workload.name}")
    for _ in range(warmup):
        r = send(server, Request([rng.randrange(*id_range) for _ in range(8)], 4), timeout)
        if not r.ok:
            print(f"warning: {server.name}: warm-up failed: {r.error}", file=sys.stderr)
    results: list[Result | None] = [None] * len(workload.requests)
    next_index, lock = iter(range(len(workload.requests))), threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            results[i] = send(server, workload.requests[i], timeout)

    idle0, total0 = cpu_times()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    idle1, total1 = cpu_times()
    busy = 100 * (1 - (idle1 - idle0) / (total1 - total0)) if total1 > total0 else float("nan")
    summary = summarize(server, workload.name, [r for r in results if r is not None], busy)
    if all(r is not None for r in results):
        summary.requests = request_rows(workload, results)   # type: ignore[arg-type]
    return summary


def parse_server(spec: str, model: str) -> Server:
    """NAME=API@HOST:PORT"""
    try:
        name, rest = spec.split("=", 1)
        api, address = rest.split("@", 1)
        host, port = address.rsplit(":", 1)
        assert api in APIS
        return Server(name, api, host, int(port), model if api == "triton" else "")
    except (ValueError, AssertionError):
        raise argparse.ArgumentTypeError(f"bad --server {spec!r}: want NAME=API@HOST:PORT, API in {APIS}")


def parse_params(text: str) -> dict[str, str]:
    """Engine parameters written ``KEY=VALUE,KEY=VALUE`` ("" for none)."""
    return dict(item.split("=", 1) for item in text.split(",") if item)


@contextlib.contextmanager
def our_server(params: dict[str, str]) -> Iterator[int]:
    """Our server started on free ports with these engine parameters; yields its HTTP port and
    stops it (drain included) on the way out."""
    from server.launch import TritonServer, free_ports

    http_port, grpc_port, metrics_port = free_ports(3)
    server = TritonServer(http_port, grpc_port, metrics_port, params=params).start()
    try:
        yield http_port
    finally:
        server.stop()


def no_nan(d: dict[str, Any]) -> dict[str, Any]:
    """NaN (no samples) as null, so the file is strict JSON."""
    return {k: None if isinstance(v, float) and v != v else v for k, v in d.items()}


def markdown_table(summaries: list[Summary]) -> str:
    head = ["server", "api", "workload", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
            "ITL p99 ms", "TPOT p50 ms", "TPOT p99 ms", "E2E p50 ms", "ok/failed", "host CPU busy %"]
    rows = [[s.server, s.api, s.workload, f"{s.output_tok_s:.1f}", f"{s.ttft_p50_ms:.1f}",
             f"{s.ttft_p99_ms:.1f}", f"{s.itl_p50_ms:.2f}", f"{s.itl_p99_ms:.2f}", f"{s.tpot_p50_ms:.2f}",
             f"{s.tpot_p99_ms:.2f}", f"{s.e2e_p50_ms:.0f}", f"{s.completed}/{s.failed}",
             f"{s.cpu_busy_pct:.0f}"] for s in summaries]
    return "\n".join("| " + " | ".join(row) + " |" for row in [head, ["---"] * len(head), *rows])


def main(argv: list[str] | None = None) -> list[Summary]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", action="append", default=[], help="NAME=API@HOST:PORT (repeatable)")
    p.add_argument("--launch", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="start our server with these engine parameters for this entry (repeatable)")
    p.add_argument("--workloads", default="A,B")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--id-range", default="1000,40000", help="LOW,HIGH: prompt ids in [LOW, HIGH)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--model", default="llm", help="Triton model name")
    p.add_argument("--served-model", default=None, help="OpenAI model name (default: first of /v1/models)")
    p.add_argument("--json", default=None, help="write config and summaries to this path")
    args = p.parse_args(argv)
    try:
        servers = [parse_server(s, args.model) for s in args.server]
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    launches = {}
    for spec in args.launch:
        name, _, params = spec.partition(":")
        launches[name] = parse_params(params)
        servers.append(Server(name, "triton", "127.0.0.1", 0, args.model))
    if not servers:
        p.error("give --server or --launch")
    low, high = (int(x) for x in args.id_range.split(","))
    workloads = [make_workload(w.strip(), args.num_requests, args.seed, (low, high))
                 for w in args.workloads.split(",")]
    cpu = cpu_info()
    print(f"host CPU: {cpu['cpu_model']} ({cpu['cpu_cores']} cores)", flush=True)
    summaries = []
    for server in servers:
        with our_server(launches[server.name]) if server.name in launches else contextlib.nullcontext() as port:
            if port is not None:
                server.port = port
            if server.api == "openai":
                server.model = args.served_model or openai_model(server, args.timeout)
            for workload in workloads:
                print(f"running {server.name} ({server.api}) workload {workload.name} ...", file=sys.stderr, flush=True)
                summaries.append(run_workload(server, workload, args.concurrency, args.timeout,
                                              id_range=(low, high)))
                for error in summaries[-1].errors:
                    print(f"  failure: {error}", file=sys.stderr)
    print(markdown_table(summaries))
    if args.json:
        config = {"workloads": args.workloads.split(","), "seed": args.seed, "concurrency": args.concurrency,
                  "num_requests": args.num_requests, "id_range": [low, high], "timeout_s": args.timeout,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "servers": [asdict(s) for s in servers], "launched": launches, **cpu}
        with open(args.json, "w") as f:
            json.dump({"config": config, "summaries": [no_nan(asdict(s)) for s in summaries]}, f, indent=2)
    return summaries


if __name__ == "__main__":
    main()
