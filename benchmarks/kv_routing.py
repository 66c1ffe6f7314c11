"""Routing by cached blocks (NVIDIA Dynamo's KV router) against HAProxy's key affinity and
round-robin, on a shared-prefix workload that sends no client key (docs/scaling.md).

    python -m benchmarks.kv_routing [--quick] [--modes dynamo-kv,haproxy-affinity,round-robin]
        [--replicas 2] [--concurrency 4] [--seed 0] [--out benchmarks/results/...json]
        (workload shape: --systems --documents --systems-per-document --questions
         --conversations --turns --system-tokens --document-tokens --question-tokens
         --turn-tokens --answer-tokens --max-tokens)

One set of replicas, started with KV-cache events on (server/dynamo_cluster.py), serves all
three routings in turn, each with its own seed (other system prompts, documents and
conversations, so that one run's cache cannot help the next):

- ``dynamo-kv``: Dynamo 1.6.1's frontend, ``--router-mode kv``, one Dynamo worker per replica
  relaying its events; requests are OpenAI ``/v1/completions`` (streamed) with the same text.
- ``haproxy-affinity``: server/cluster.py's HAProxy, consistent hashing with bounded load, on
  HTTP ``generate_stream`` without ``x-prefix-key``: the key is the prompt's first 256 bytes.
- ``round-robin``: the same HAProxy configuration with ``balance roundrobin``.

The workload, in sessions run by ``--concurrency`` users (a session's requests one after the
other, sessions shuffled with the seed):
- documents under different system prompts: each of ``--documents`` is asked ``--questions``
  questions under each of ``--systems-per-document`` system prompts: [system][document][question];
- conversations growing turn by turn, each under one system prompt:
  [system][user 1][assistant 1]...[user t] (the assistant turns are fixed texts, so that each
  turn's prompt starts with the previous turn's whole prompt).
System prompts are longer than 256 bytes, so HAProxy's fallback key is the system prompt alone.

Reported per routing: prefix-cache hit rate (prompt tokens served from the cache / looked up,
summed over the replicas' ``llm_prefix_cache_*_tokens_total``), TTFT p50 / p99 / mean at the
client (first streamed text), requests per replica (``llm_request_finished_total``), errors.
``--quick``: a small workload and replicas without the step-cost calibration, about a minute
in all; its figures mean nothing beyond "it runs".
"""

from __future__ import annotations

import argparse
import http.client
import json
import platform
import queue
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import DEFAULT_MODEL_DIR
from benchmarks.prefix_routing import hit_rate, prefix_counters
from client.llm_client import http_generate_stream
from loadtest.prompts import PromptFactory
from loadtest.server_metrics import sample_one

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MODES = ("dynamo-kv", "haproxy-affinity", "round-robin")
QUICK = dict(systems=2, documents=2, systems_per_document=2, questions=2, conversations=2, turns=3,
             system_tokens=64, document_tokens=192, question_tokens=12, turn_tokens=24, answer_tokens=16,
             max_tokens=4, concurrency=2)


@dataclass
class Request:
    session: str        # "doc<d>-sys<s>" or "conv<c>"
    kind: str           # "document" or "conversation"
    step: int           # question or turn number within its session
    prompt: str
    prompt_tokens: int  # as the tokenizer counts the text


@dataclass
class Result:
    session: str
    kind: str
    step: int
    prompt_tokens: int
    ttft_s: float | None
    e2e_s: float
    cached_tokens: int | None
    served_by: str | None = None     # HAProxy's x-served-by (Dynamo's frontend does not say)
    error: str | None = None


def workload(prompts: PromptFactory, args: argparse.Namespace, seed: int) -> list[list[Request]]:
    """The sessions (each a list of requests sent in order), shuffled with ``seed``."""
    rng = np.random.default_rng(seed)
    systems = [prompts.text(args.system_tokens, rng) for _ in range(args.systems)]
    documents = [prompts.text(args.document_tokens, rng) for _ in range(args.documents)]
    sessions: list[list[Request]] = []
    for d, document in enumerate(documents):
        chosen = rng.choice(args.systems, size=min(args.systems_per_document, args.systems), replace=False)
        for s in sorted(int(i) for i in chosen):
            steps = []
            for q in range(args.questions):
                text = prompts.join(systems[s], document, prompts.text(args.question_tokens, rng))
                steps.append(Request(f"doc{d}-sys{s}", "document", q, text, prompts.count(text)))
            sessions.append(steps)
    for c in range(args.conversations):
        history = [systems[c % args.systems]]
        steps = []
        for t in range(args.turns):
            history.append(prompts.text(args.turn_tokens, rng))               # the user's turn
            text = prompts.join(*history)
            steps.append(Request(f"conv{c}", "conversation", t, text, prompts.count(text)))
            history.append(prompts.text(args.answer_tokens, rng))             # the assistant's, fixed
        sessions.append(steps)
    order = rng.permutation(len(sessions))
    return [sessions[i] for i in order]


def send_triton(http_url: str, request: Request, max_tokens: int, timeout: float = 300.0) -> Result:
    """HTTP generate_stream through HAProxy, no prefix key; TTFT at the first text."""
    start = time.perf_counter()
    ttft = cached = served_by = None
    try:
        for chunk in http_generate_stream(request.prompt, url=http_url, timeout=timeout, max_tokens=max_tokens,
                                          temperature=0.0, ignore_eos=True):
            served_by = chunk.served_by
            if ttft is None and chunk.text:
                ttft = time.perf_counter() - start
            cached = chunk.num_cached_tokens if chunk.num_cached_tokens is not None else cached
    except Exception as exc:  # noqa: BLE001 - recorded per request
        return Result(request.session, request.kind, request.step, request.prompt_tokens, ttft,
                      time.perf_counter() - start, cached, served_by, f"{type(exc).__name__}: {exc}")
    return Result(request.session, request.kind, request.step, request.prompt_tokens, ttft,
                  time.perf_counter() - start, cached, served_by)


def openai_stream(http_url: str, body: dict, timeout: float = 300.0):
    """POST an OpenAI request with ``stream: true``; yields each server-sent event's JSON.
    An HTTP error raises RuntimeError with the server's message."""
    host, port = http_url.rsplit(":", 1)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request("POST", path, json.dumps({**body, "stream": True}),
                           {"Content-Type": "application/json", "Accept": "text/event-stream"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read().decode('utf-8', 'replace')[:500]}")
        for raw in response:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)
    finally:
        connection.close()


def send_openai(http_url: str, request: Request, max_tokens: int, model: str, timeout: float = 300.0) -> Result:
    """A streamed /v1/completions through Dynamo's frontend; TTFT at the first text."""
    start = time.perf_counter()
    ttft = cached = None
    body = {"model": model, "prompt": request.prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    try:
        for event in openai_stream(http_url, body, timeout):
            if "error" in event:
                raise RuntimeError(str(event["error"]))
            if ttft is None and any(choice.get("text") for choice in event.get("choices") or []):
                ttft = time.perf_counter() - start
            usage = event.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                cached = int(details["cached_tokens"])
    except Exception as exc:  # noqa: BLE001 - recorded per request
        return Result(request.session, request.kind, request.step, request.prompt_tokens, ttft,
                      time.perf_counter() - start, cached, error=f"{type(exc).__name__}: {exc}")
    return Result(request.session, request.kind, request.step, request.prompt_tokens, ttft,
                  time.perf_counter() - start, cached)


def run_sessions(sessions: list[list[Request]], send, concurrency: int) -> list[Result]:
    """``concurrency`` users, each taking the next session and sending its requests in order."""
    todo: queue.Queue[list[Request]] = queue.Queue()
    for session in sessions:
        todo.put(session)
    results: list[Result] = []
    lock = threading.Lock()

    def user() -> None:
        while True:
            try:
                session = todo.get_nowait()
            except queue.Empty:
                return
            for request in session:
                result = send(request)
                with lock:
                    results.append(result)

    users = [threading.Thread(target=user) for _ in range(max(1, concurrency))]
    for u in users:
        u.start()
    for u in users:
        u.join()
    return results


def finished_per_replica(metrics_urls: list[str]) -> list[float]:
    return [sample_one(url)["finished_requests"] or 0.0 for url in metrics_urls]


def summarize(results: list[Result], rate: float, per_replica: dict[str, float], wall_s: float) -> dict:
    ttfts = np.array([r.ttft_s for r in results if r.ttft_s is not None])

    def pct(q: float) -> float | None:
        return float(np.percentile(ttfts, q)) if ttfts.size else None

    return {"requests": len(results), "errors": sum(r.error is not None for r in results),
            "prefix_hit_rate": rate, "ttft_p50_s": pct(50), "ttft_p99_s": pct(99),
            "ttft_mean_s": float(ttfts.mean()) if ttfts.size else None, "wall_s": wall_s,
            "requests_per_replica": per_replica,
            "prompt_tokens": int(sum(r.prompt_tokens for r in results)),
            "cached_tokens_reported": int(sum(r.cached_tokens or 0 for r in results))}


def run_mode(mode: str, sessions: list[list[Request]], send, metrics_urls: list[str], names: list[str],
             concurrency: int) -> dict:
    before, finished_before = prefix_counters(metrics_urls), finished_per_replica(metrics_urls)
    start = time.perf_counter()
    results = run_sessions(sessions, send, concurrency)
    wall = time.perf_counter() - start
    time.sleep(1.0)    # the counters are exported after the step that finished the last request
    finished_after = finished_per_replica(metrics_urls)
    per_replica = {name: a - b for name, a, b in zip(names, finished_after, finished_before)}
    summary = summarize(results, hit_rate(before, prefix_counters(metrics_urls)), per_replica, wall)
    summary["results"] = [asdict(r) for r in results]
    errors = [r.error for r in results if r.error]
    print(f"{mode}: prefix-cache hit rate {summary['prefix_hit_rate']:.1%}, TTFT p50 "
          f"{_s(summary['ttft_p50_s'])}, p99 {_s(summary['ttft_p99_s'])}, mean {_s(summary['ttft_mean_s'])}; "
          f"{summary['requests']} requests in {wall:.1f} s, per replica {per_replica}, errors {len(errors)}"
          + (f" (first: {errors[0]})" if errors else ""), flush=True)
    return summary


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small workload, about a minute in all")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--systems", type=int, default=3)
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--systems-per-document", type=int, default=2)
    parser.add_argument("--questions", type=int, default=3, help="per (document, system prompt)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-tokens", type=int, default=80, help="> 256 bytes: HAProxy's whole fallback key")
    parser.add_argument("--document-tokens", type=int, default=384)
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--turn-tokens", type=int, default=48)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine parameter for every replica")
    parser.add_argument("--frontend-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for Dynamo's frontend (its router's weights, e.g. "
                             "--frontend-arg=--router-prefill-load-scale=4); Dynamo's defaults otherwise")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="the replicas', Dynamo's and HAProxy's logs (default: a new temporary folder)")
    parser.add_argument("--out", type=Path, default=None)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argument_parser()
    args = parser.parse_args(argv)
    if args.quick:    # the quick shape, except what was given on the command line
        given = {a.split("=", 1)[0] for a in (argv if argv is not None else sys.argv[1:])}
        for key, value in QUICK.items():
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    return args


def warm_up(cluster, prompts: PromptFactory, tokens: int, seed: int) -> None:
    """A prompt and a second one sharing its prefix on every replica, directly: the first
    routing measured must not pay for a cold start the others do not."""
    rng = np.random.default_rng(seed)
    for endpoint in cluster.endpoints:
        prefix = prompts.text(tokens, rng)
        for _ in range(2):
            request = Request("warm-up", "warm-up", 0, prompts.join(prefix, prompts.text(16, rng)), 0)
            result = send_triton(f"{endpoint.host}:{endpoint.http_port}", request, max_tokens=2)
            if result.error:
                raise RuntimeError(f"warming up {endpoint.name} failed: {result.error}")


def measure(cluster, args: argparse.Namespace, prompts: PromptFactory) -> dict[str, dict]:
    """Every routing of ``args.modes`` against a started DynamoCluster's replicas (HAProxy
    instances are started here for the two HAProxy routings)."""
    from server.cluster import HAProxy, ProxyPorts
    from server.launch import free_ports

    urls, names = cluster.metrics_urls, [e.name for e in cluster.endpoints]
    warm_up(cluster, prompts, args.system_tokens + args.document_tokens, args.seed + 100)
    results: dict[str, dict] = {}
    for mode in args.modes:
        sessions = workload(prompts, args, args.seed + 1 + MODES.index(mode))
        proxy = None
        try:
            if mode == "dynamo-kv":
                def send(request: Request) -> Result:
                    return send_openai(cluster.http_url, request, args.max_tokens, cluster.served_model_name)
            else:
                balance = "prefix" if mode == "haproxy-affinity" else "roundrobin"
                proxy = HAProxy(cluster.endpoints, ProxyPorts(*free_ports(3)), balance=balance,
                                log_file=args.log_dir / f"haproxy-{balance}.log" if args.log_dir else None).start()

                def send(request: Request, url: str = proxy.http_url) -> Result:
                    return send_triton(url, request, args.max_tokens)
            results[mode] = run_mode(mode, sessions, send, urls, names, args.concurrency)
        finally:
            if proxy is not None:
                proxy.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    from server.dynamo_cluster import DynamoCluster

    args = parse_args(argv)
    params = dict(p.split("=", 1) for p in args.param)
    if args.quick:
        params.setdefault("itl_target_ms", "0")    # no step-cost calibration at start-up
    if args.log_dir is None:    # the replicas', Dynamo's and HAProxy's logs, out of the way
        args.log_dir = Path(tempfile.mkdtemp(prefix="kv-routing-logs-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {args.log_dir}", flush=True)
    prompts = PromptFactory.for_model(args.model_dir)
    started = time.perf_counter()
    cluster = DynamoCluster(args.replicas, base_port=None, params=params, log_dir=args.log_dir,
                            frontend_args=args.frontend_arg)
    cluster.start()
    try:
        print(f"{args.replicas} replicas ready in {time.perf_counter() - started:.0f} s (Dynamo's frontend on "
              f"{cluster.http_url})", flush=True)
        results = measure(cluster, args, prompts)
    finally:
        cluster.stop()
    # A quick run's figures are not results: they go to the temporary directory unless --out.
    out = args.out or (Path(tempfile.gettempdir()) / "kv_routing-quick.json" if args.quick
                       else RESULTS_DIR / f"kv_routing-{platform.node() or 'host'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "settings": {k: str(v) for k, v in vars(args).items()}, "params": params,
                               **results}, indent=2))
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
