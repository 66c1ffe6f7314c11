"""Routing by cached blocks (NVIDIA Dynamo's KV router) against HAProxy's key affinity and
round-robin, on a shared-prefix workload that sends no client key (docs/scaling.md).

    python -m benchmarks.kv_routing [--quick] [--modes dynamo-kv,haproxy-affinity,round-robin]
        [--replicas 2] [--concurrency 4] [--think-time 0] [--seed 0] [--rounds 1]
        [--frontend-arg=--router-...] [--out benchmarks/results/...json]
    python -m benchmarks.kv_routing --references [workload shape, --rounds N]
    python -m benchmarks.kv_routing --kill-burst [--burst 12] [--burst-prompt-tokens 256]
        [--burst-max-tokens 256] [--kill-variants after-first-token,before-first-token,burst-after-kill]
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
summed over the replicas' ``llm_prefix_cache_*_tokens_total``) beside the most any routing could
reach (``single_cache_hit_rate``: one never-evicting cache, which keeping each system prompt's
sessions on one replica also reaches) and what balancing by load reaches when it never splits a
session (``spread_sessions_hit_rate``: each session to the replica sent the fewest tokens, so a
system prompt is prefilled on both), TTFT p50 / p99 / mean at the client (first streamed text),
requests per replica (``llm_request_finished_total``), errors. ``--references`` computes the two
references alone, for the workloads a run with the same arguments would send (no cluster).
``--rounds N`` runs every routing N times (new seeds, the order rotating) and pools them: the
hit rate averaged, TTFT percentiles over all requests, each round kept.
``--quick``: a small workload and replicas without the step-cost calibration, about a minute
in all; its figures mean nothing beyond "it runs".

``--kill-burst`` measures something else on the same kind of cluster (supervised replicas,
Dynamo's frontend with the launcher's migration limit): a replica killed under a burst, and
what is lost. Each variant sends ``--burst`` concurrent streamed /v1/completions (distinct
prompts of ``--burst-prompt-tokens``, ``--burst-max-tokens`` greedy tokens each, ignore_eos)
and SIGKILLs one replica's tritonserver (the busier one; its supervisor restarts it):

- ``after-first-token``: once every request has streamed its first token;
- ``before-first-token``: once a quarter of them have, so that some have not started;
- ``burst-after-kill``: the replica is killed first and the burst sent at once (the shape of
  the HAProxy cluster's failover test).

Every request is accounted for: completed in full (how many tokens; migrated, i.e. routed to
the killed replica, by the worker id the frontend reports once per request with
``nvext.extra_fields: ["worker_id"]``, and completed anyway: Dynamo's request migration
continued it on another), failed after streaming tokens, failed before any; with the
frontend's migration counter and what its log says of each migration and failure; and the
recovery: when the killed replica's worker left Dynamo's routing pool (the frontend's
/health), when the replica was ready again, when its worker rejoined.
Results go to ``benchmarks/results/kv_routing_kill-<host>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import platform
import queue
import re
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from backend.config import EngineConfig
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


def run_sessions(sessions: list[list[Request]], send, concurrency: int, think_s: float = 0.0) -> list[Result]:
    """``concurrency`` users, each taking the next session and sending its requests in order,
    ``think_s`` apart (from one's end to the next's start)."""
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
            for step, request in enumerate(session):
                if step and think_s:
                    time.sleep(think_s)
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
             concurrency: int, think_s: float = 0.0) -> dict:
    before, finished_before = prefix_counters(metrics_urls), finished_per_replica(metrics_urls)
    start = time.perf_counter()
    results = run_sessions(sessions, send, concurrency, think_s)
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


# ---- a replica killed under a burst (--kill-burst) ----------------------------------------------

KILL_VARIANTS = ("after-first-token", "before-first-token", "burst-after-kill")
KILL_QUICK = dict(burst=4, burst_prompt_tokens=64, burst_max_tokens=48)
WORKER_ID_FIELDS = {"nvext": {"extra_fields": ["worker_id"]}}    # Dynamo's per-response worker ids


@dataclass
class BurstRequest:
    """One streamed request of a burst, as the client saw it (times in seconds from the
    variant's start; the kill's time is in the variant's summary)."""
    index: int
    prompt_tokens: int
    sent_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    ended_s: float | None = None
    text_chunks: int = 0                 # streamed events that carried text (one token each here)
    text_chunks_before_kill: int = 0
    completion_tokens: int | None = None     # the final usage chunk (the frontend's count)
    cached_tokens: int | None = None
    finish_reason: str | None = None
    workers: list[str] = field(default_factory=list)   # Dynamo worker ids reported (the first worker's only)
    error: str | None = None
    gap_across_kill_s: float | None = None   # last text before the kill to the first after it
    outcome: str = ""                    # completed / failed-after-tokens / failed-before-tokens
    on_killed_replica: bool | None = None    # routed to the killed replica's worker
    migrated: bool | None = None         # on the killed replica and completed: continued on another


def worker_id_of(event: dict) -> str | None:
    """The worker id the frontend reports in ``nvext.worker_id`` (a number, or a map of
    prefill/decode worker ids: the decode one here). Dynamo 1.6.1 reports it once per request,
    for the worker it was first routed to, and not again after a migration."""
    value = (event.get("nvext") or {}).get("worker_id")
    if isinstance(value, dict):
        value = next((value[k] for k in ("decode_worker_id", "worker_id", "prefill_worker_id")
                      if value.get(k) is not None), None)
    return None if value is None else str(value)


def stream_burst_request(http_url: str, model: str, request: BurstRequest, prompt: str, max_tokens: int,
                         t0: float, kill: dict, lock: threading.Lock, worker_ids: bool) -> None:
    """Send one streamed completion and record, as it goes, what arrives (the main thread reads
    ``first_token_s`` to decide when to kill)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **(WORKER_ID_FIELDS if worker_ids else {})}
    try:
        for event in openai_stream(http_url, body, timeout=600):
            now = time.perf_counter() - t0
            if "error" in event:
                raise RuntimeError(str(event["error"]))
            worker = worker_id_of(event)
            text = any(c.get("text") for c in event.get("choices") or [])
            with lock:
                if worker is not None and (not request.workers or request.workers[-1] != worker):
                    request.workers.append(worker)
                if text:
                    killed_at = kill.get("t_s")
                    if killed_at is None or now < killed_at:
                        request.text_chunks_before_kill += 1
                    elif request.gap_across_kill_s is None:
                        request.gap_across_kill_s = now - (request.last_token_s if request.last_token_s is not None
                                                           else killed_at)
                    request.text_chunks += 1
                    request.last_token_s = now
                    if request.first_token_s is None:
                        request.first_token_s = now
                for choice in event.get("choices") or []:
                    if choice.get("finish_reason"):
                        request.finish_reason = choice["finish_reason"]
                usage = event.get("usage") or {}
                if usage.get("completion_tokens") is not None:
                    request.completion_tokens = int(usage["completion_tokens"])
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    request.cached_tokens = int(details["cached_tokens"])
        if request.finish_reason is None:
            raise RuntimeError("the stream ended without a finish_reason")
    except Exception as exc:  # noqa: BLE001 - recorded per request
        with lock:
            request.error = f"{type(exc).__name__}: {exc}"[:500]
    with lock:
        request.ended_s = time.perf_counter() - t0


def generate_instance_ids(cluster) -> set[str]:
    """The workers Dynamo's frontend routes the model to now (its /health)."""
    from server.dynamo_cluster import get_json

    health = get_json(f"http://{cluster.http_url}/health", timeout=1.0)
    if not isinstance(health, dict):
        return set()
    return {str(i.get("instance_id", json.dumps(i, sort_keys=True))) for i in health.get("instances", [])
            if i.get("endpoint") == "generate" and i.get("namespace") == cluster.namespace}


def replica_ready(endpoint, timeout: float = 0.5) -> bool:
    from server.launch import MODEL_NAME

    try:
        with urllib.request.urlopen(f"http://{endpoint.host}:{endpoint.http_port}/v2/models/{MODEL_NAME}/ready",
                                    timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class PoolWatch(threading.Thread):
    """Every 50 ms from before the kill: which workers the frontend routes to, and whether the
    killed replica answers ready; until its worker has rejoined and it is ready again."""

    def __init__(self, cluster, victim: int, t0: float, before: set[str], timeout_s: float) -> None:
        super().__init__(name="pool-watch", daemon=True)
        self.cluster, self.endpoint, self.t0, self.before = cluster, cluster.endpoints[victim], t0, before
        self.timeout_s = timeout_s
        self.killed_s: float | None = None
        self.left_s = self.rejoined_s = self.down_s = self.ready_s = None
        self.left_ids: set[str] = set()
        self.transitions: list[dict] = []
        self._halt = threading.Event()

    def run(self) -> None:
        last = None
        while not self._halt.wait(0.05):
            ids, ready = generate_instance_ids(self.cluster), replica_ready(self.endpoint)
            now = time.perf_counter() - self.t0
            state = (sorted(ids), ready)
            if state != last:
                self.transitions.append({"t_s": round(now, 3), "instances": sorted(ids), "replica_ready": ready})
                last = state
            if self.killed_s is None:
                continue
            if self.left_s is None and self.before - ids:
                self.left_s, self.left_ids = now, self.before - ids
            if self.left_s is not None and self.rejoined_s is None and self.left_ids <= ids:
                self.rejoined_s = now
            if self.down_s is None and not ready:
                self.down_s = now
            if self.down_s is not None and self.ready_s is None and ready:
                self.ready_s = now
            recovered = self.ready_s is not None and (self.rejoined_s is not None
                                                      or (self.left_s is None and now - self.ready_s > 10))
            if recovered or now - self.killed_s > self.timeout_s:
                return

    def stop(self) -> None:
        self._halt.set()

    def summary(self) -> dict:
        def since_kill(t: float | None) -> float | None:
            return None if t is None or self.killed_s is None else round(t - self.killed_s, 3)

        return {"left_pool_s": since_kill(self.left_s), "replica_not_ready_s": since_kill(self.down_s),
                "replica_ready_again_s": since_kill(self.ready_s), "rejoined_pool_s": since_kill(self.rejoined_s),
                "killed_worker_ids": sorted(self.left_ids), "transitions": self.transitions}


def migration_counts(cluster) -> dict[str, float]:
    """The frontend's request migrations so far, by type (Dynamo's ``*model_migration_total``:
    ``ongoing_request``, a stream cut mid-way; ``new_request``, a worker that refused one)."""
    counts: dict[str, float] = {}
    try:
        text = cluster.frontend_metrics()
    except OSError:
        return counts
    for match in re.finditer(r"^\w*model_migration_total(?:\{([^}]*)\})? (\S+)$", text, re.MULTILINE):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        kind = labels.get("migration_type", "all")
        counts[kind] = counts.get(kind, 0.0) + float(match.group(2))
    return counts


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def log_lines_since(path: Path | None, offset: int, pattern: str, keep: int = 8) -> tuple[int, list[str]]:
    """How many lines written to ``path`` after ``offset`` match ``pattern``, and the first ``keep``
    (without terminal colours)."""
    if path is None or not path.is_file():
        return 0, []
    with open(path, "rb") as log:
        log.seek(offset)
        lines = [ANSI.sub("", line.decode("utf-8", "replace")).rstrip() for line in log]
    found = [line for line in lines if re.search(pattern, line)]
    return len(found), [line[:600] for line in found[:keep]]


def frontend_log_since(path: Path | None, offset: int) -> dict:
    """What Dynamo's frontend logged about the variant's failures: migrations scheduled (with the
    tokens each request had streamed), routed requests that failed by error type, and the
    diagnostics of the failures it returned to clients."""
    _, scheduled = log_lines_since(path, offset, r"migration retry scheduled", keep=10**6)
    _, failed = log_lines_since(path, offset, r"route request failed", keep=10**6)
    _, returned = log_lines_since(path, offset, r"Semantic streaming failure", keep=10**6)
    types: dict[str, int] = {}
    for line in failed:
        match = re.search(r'error\.type="([^"]+)"', line)
        types[match.group(1) if match else "?"] = types.get(match.group(1) if match else "?", 0) + 1
    return {"migrations_scheduled": len(scheduled),
            "migrated_after_tokens": sorted(int(m.group(1)) for line in scheduled
                                            if (m := re.search(r"migration\.tokens_completed=(\d+)", line))),
            "route_failures_by_type": types,
            "errors_returned": [m.group(1) if (m := re.search(r"diagnostic=(.*?) method=", line)) else line[-200:]
                                for line in returned]}


def log_size(path: Path | None) -> int:
    return path.stat().st_size if path is not None and path.is_file() else 0


def busiest_replica(cluster) -> tuple[int, list[float]]:
    """The replica with the most requests running or waiting (the first on a tie)."""
    loads = []
    for url in cluster.metrics_urls:
        row = sample_one(url)
        loads.append((row["running"] or 0.0) + (row["waiting"] or 0.0))
    return max(range(len(loads)), key=lambda i: (loads[i], -i)), loads


def kill_variant(cluster, variant: str, args: argparse.Namespace, prompts: PromptFactory, seed: int,
                 worker_ids: bool) -> dict:
    """One burst, one SIGKILL, every request accounted for (see the module docstring)."""
    rng = np.random.default_rng(seed)
    texts = [prompts.text(args.burst_prompt_tokens, rng) for _ in range(args.burst)]
    before_ids = generate_instance_ids(cluster)
    if len(before_ids) != len(cluster.endpoints):
        raise RuntimeError(f"{variant}: the frontend routes to {sorted(before_ids)}, not one worker per replica")
    migrations_before = migration_counts(cluster)
    finished_before = finished_per_replica(cluster.metrics_urls)
    frontend_log = cluster.log_dir / "frontend.log" if cluster.log_dir else None
    worker_logs = [cluster.log_dir / f"worker-{e.name}.log" if cluster.log_dir else None for e in cluster.endpoints]
    offsets = [log_size(frontend_log)] + [log_size(p) for p in worker_logs]
    restarts_before = [s.restarts for s in cluster.servers]
    lock, kill = threading.Lock(), {}
    t0 = time.perf_counter()
    requests = [BurstRequest(i, args.burst_prompt_tokens, 0.0) for i in range(args.burst)]

    def start_burst() -> list[threading.Thread]:
        threads = []
        for request, text in zip(requests, texts):
            request.sent_s = time.perf_counter() - t0
            thread = threading.Thread(target=stream_burst_request, daemon=True,
                                      args=(cluster.http_url, cluster.served_model_name, request, text,
                                            args.burst_max_tokens, t0, kill, lock, worker_ids))
            thread.start()
            threads.append(thread)
        return threads

    def do_kill(victim: int) -> tuple[PoolWatch, int]:
        watch = PoolWatch(cluster, victim, t0, before_ids, timeout_s=args.recovery_timeout)
        watch.start()
        with lock:
            pid = cluster.kill_replica(victim)
            kill["t_s"] = watch.killed_s = time.perf_counter() - t0
        return watch, pid

    loads: list[float] = []
    if variant == "burst-after-kill":
        victim = 0
        watch, pid = do_kill(victim)
        threads = start_burst()
    else:
        threads = start_burst()
        need = args.burst if variant == "after-first-token" else max(1, args.burst // 4)
        deadline = time.monotonic() + 300
        while True:
            with lock:
                started = sum(r.first_token_s is not None for r in requests)
                ended = sum(r.ended_s is not None for r in requests)
            if started >= need:
                break
            if ended or time.monotonic() > deadline:
                raise RuntimeError(f"{variant}: {started} of {args.burst} requests streamed a token and {ended} "
                                   "ended before the kill (see the results' errors)")
            time.sleep(0.005)
        victim, loads = busiest_replica(cluster)
        watch, pid = do_kill(victim)
    killed_s = kill["t_s"]
    for thread in threads:
        thread.join(timeout=900)
    watch.join(timeout=args.recovery_timeout + 30)
    watch.stop()
    time.sleep(1.0)    # the counters are exported after the step that finished the last request
    finished_after = []
    for url in cluster.metrics_urls:
        try:
            finished_after.append(sample_one(url)["finished_requests"] or 0.0)
        except OSError:     # a replica that did not come back
            finished_after.append(float("nan"))
    migrations_after = migration_counts(cluster)
    recovery = watch.summary()
    killed_ids = set(recovery["killed_worker_ids"])
    for r in requests:
        r.outcome = ("completed" if r.error is None else
                     "failed-after-tokens" if r.text_chunks else "failed-before-tokens")
        if r.workers and killed_ids:
            r.on_killed_replica = r.workers[0] in killed_ids
        elif worker_ids and r.outcome == "failed-before-tokens":
            r.on_killed_replica = None      # no response at all: the frontend's log says where it went
        if r.on_killed_replica is not None:
            # Completed after the kill, with the killed replica down for seconds: continued elsewhere.
            r.migrated = bool(r.on_killed_replica and r.outcome == "completed")
    completed = [r for r in requests if r.outcome == "completed"]
    migrated = [r for r in requests if r.migrated]
    on_victim = [r for r in requests if r.on_killed_replica]
    gaps = [r.gap_across_kill_s for r in migrated if r.gap_across_kill_s is not None]
    frontend_log_summary = frontend_log_since(frontend_log, offsets[0])
    worker_count, worker_lines = log_lines_since(worker_logs[victim], offsets[1 + victim], r"routing pool")
    summary = {
        "variant": variant, "killed_replica": cluster.endpoints[victim].name, "killed_pid": pid,
        "killed_at_s": round(killed_s, 3), "load_at_kill_running_plus_waiting": loads,
        "sent": len(requests),
        "had_first_token_at_kill": sum(r.text_chunks_before_kill > 0 for r in requests),
        "completed": len(completed),
        "completed_full_length": sum(r.completion_tokens == args.burst_max_tokens for r in completed),
        "completion_tokens": sorted({r.completion_tokens for r in completed if r.completion_tokens is not None}),
        "on_killed_replica": len(on_victim) if worker_ids else None,
        "migrated": len(migrated) if worker_ids else None,
        "migrated_completed": sum(r.outcome == "completed" for r in migrated) if worker_ids else None,
        "on_killed_replica_without_token_at_kill": (sum(r.text_chunks_before_kill == 0 for r in on_victim)
                                                    if worker_ids else None),
        "migrated_with_tokens_before_kill": sum(r.text_chunks_before_kill > 0 for r in migrated) if worker_ids else None,
        "failed_after_tokens": sum(r.outcome == "failed-after-tokens" for r in requests),
        "failed_before_tokens": sum(r.outcome == "failed-before-tokens" for r in requests),
        "migrated_stall_s": {"max": max(gaps), "median": float(np.median(gaps))} if gaps else None,
        "ttft_max_s": max((r.first_token_s - r.sent_s for r in requests if r.first_token_s is not None), default=None),
        "wall_s": round(max((r.ended_s or 0.0) for r in requests), 3),
        "recovery": recovery,
        "supervisor_restarts": [s.restarts - b for s, b in zip(cluster.servers, restarts_before)],
        "frontend_migrations": {k: migrations_after.get(k, 0.0) - migrations_before.get(k, 0.0)
                                for k in sorted(set(migrations_after) | set(migrations_before))},
        "worker_ids": sorted(before_ids),
        # requests each replica finished during the variant; the killed one's counter starts
        # again at 0 with its restart, so its figure counts from then
        "finished_per_replica": {e.name: a if i == victim else a - b for i, (e, a, b)
                                 in enumerate(zip(cluster.endpoints, finished_after, finished_before))},
        "frontend_log": frontend_log_summary,
        "killed_worker_log": {"matching_lines": worker_count, "first": worker_lines},
        "errors": sorted({r.error for r in requests if r.error})[:8],
        "requests": [asdict(r) for r in requests],
    }
    print(f"{variant}: killed {summary['killed_replica']} at {killed_s:.2f} s ({summary['had_first_token_at_kill']}"
          f"/{len(requests)} had a token); completed {len(completed)} ({summary['completed_full_length']} of "
          f"{args.burst_max_tokens} tokens), on the killed replica {summary['on_killed_replica']}, migrated "
          f"{summary['migrated']}, failed after tokens {summary['failed_after_tokens']}, before tokens "
          f"{summary['failed_before_tokens']}; worker left the pool {_s(recovery['left_pool_s'])}, replica ready "
          f"{_s(recovery['replica_ready_again_s'])}, rejoined {_s(recovery['rejoined_pool_s'])} after the kill; "
          f"frontend migrations {summary['frontend_migrations']}"
          + (f"; errors: {summary['errors'][:2]}" if summary["errors"] else ""), flush=True)
    return summary


def wait_recovered(cluster, timeout: float = 300.0) -> None:
    """Every replica ready and the frontend routing to one worker per replica."""
    deadline = time.monotonic() + timeout
    while not (len(generate_instance_ids(cluster)) == len(cluster.endpoints)
               and all(replica_ready(e) for e in cluster.endpoints)):
        if time.monotonic() > deadline:
            raise TimeoutError("the cluster did not recover: " + str(sorted(generate_instance_ids(cluster))))
        time.sleep(0.2)


def probe_worker_ids(cluster) -> bool:
    """Whether the frontend reports worker ids (``nvext.extra_fields``) on this Dynamo."""
    body = {"model": cluster.served_model_name, "prompt": "Hello", "max_tokens": 2, "temperature": 0.0,
            "stream_options": {"include_usage": True}, **WORKER_ID_FIELDS}
    try:
        return any(worker_id_of(event) for event in openai_stream(cluster.http_url, body, timeout=120))
    except Exception as exc:  # noqa: BLE001 - the measurement goes on without them
        print(f"no worker ids from the frontend ({exc}); migrations are counted, not attributed", flush=True)
        return False


def measure_kill_burst(cluster, args: argparse.Namespace, prompts: PromptFactory) -> dict[str, dict]:
    worker_ids = probe_worker_ids(cluster)
    results: dict[str, dict] = {"worker_ids_reported": worker_ids}
    for n, variant in enumerate(args.kill_variants):
        wait_recovered(cluster)
        time.sleep(2.0)
        results[variant] = kill_variant(cluster, variant, args, prompts, args.seed + 1000 + n, worker_ids)
    return results


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
    parser.add_argument("--think-time", type=float, default=0.0,
                        help="seconds between a response's end and the session's next request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every routing this many times (new seeds, the order rotating); "
                             "the figures pooled over the rounds, each round kept")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine parameter for every replica")
    parser.add_argument("--frontend-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for Dynamo's frontend (its router's weights, e.g. "
                             "--frontend-arg=--router-prefill-load-scale=4); Dynamo's defaults otherwise")
    parser.add_argument("--references", action="store_true",
                        help="no cluster: the hit-rate references (one cache; whole sessions spread by "
                             "load) of the workloads a run with these arguments would send")
    parser.add_argument("--kill-burst", action="store_true",
                        help="measure a replica killed under a burst instead of the routings")
    parser.add_argument("--kill-variants", default=",".join(KILL_VARIANTS),
                        help=f"comma-separated, of {', '.join(KILL_VARIANTS)}")
    parser.add_argument("--burst", type=int, default=12, help="--kill-burst: concurrent requests per variant")
    parser.add_argument("--burst-prompt-tokens", type=int, default=256)
    parser.add_argument("--burst-max-tokens", type=int, default=256)
    parser.add_argument("--recovery-timeout", type=float, default=300.0,
                        help="--kill-burst: how long to wait for the killed replica to rejoin")
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
        for key, value in {**QUICK, **(KILL_QUICK if args.kill_burst else {})}.items():
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    args.kill_variants = [v.strip() for v in args.kill_variants.split(",") if v.strip()]
    unknown = set(args.kill_variants) - set(KILL_VARIANTS)
    if unknown:
        parser.error(f"unknown kill variants {sorted(unknown)}; choose from {KILL_VARIANTS}")
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


def _served_from_cache(ids: list[int], cache: set[tuple[int, ...]], block_size: int) -> int:
    """Prompt tokens the engine serves from ``cache``, counted as it counts them: whole blocks
    of a cached chain, never the prompt's last token (it must be computed). The prompt's full
    blocks then join the cache, which never evicts."""
    chains = [tuple(ids[:end]) for end in range(block_size, len(ids) + 1, block_size)]
    usable = min((len(ids) - 1) // block_size, len(chains))
    matched = 0
    while matched < usable and chains[matched] in cache:
        matched += 1
    cache.update(chains)
    return matched * block_size


def placed_hit_rate(prompts: PromptFactory, sessions: list[list[Request]], replica_of: list[int],
                    block_size: int) -> float:
    """The hit rate when session i is served whole by replica ``replica_of[i]``, one session
    after another, each replica with a cache that never evicts."""
    caches: dict[int, set[tuple[int, ...]]] = {}
    hit = queried = 0
    for session, replica in zip(sessions, replica_of, strict=True):
        cache = caches.setdefault(replica, set())
        for request in session:
            ids = prompts.tokenizer.encode(request.prompt).ids
            hit += _served_from_cache(ids, cache, block_size)
            queried += len(ids)
    return hit / queried if queried else 0.0


def single_cache_hit_rate(prompts: PromptFactory, sessions: list[list[Request]], block_size: int) -> float:
    """The hit rate of one replica whose prefix cache never evicts, serving the same requests
    one session after another: the most any routing of them can reach (concurrency aside).
    Routing every system prompt's sessions to one replica reaches it too: sessions under
    different system prompts share no block."""
    return placed_hit_rate(prompts, sessions, [0] * len(sessions), block_size)


def spread_sessions_hit_rate(prompts: PromptFactory, sessions: list[list[Request]], block_size: int,
                             replicas: int = 2) -> float:
    """A reference for routings that balance load: each session whole (never split) to the
    replica sent the fewest prompt tokens so far, blind to what the replicas hold. Every
    replica then prefills each system prompt once, where the single cache prefills it once
    in all; that is what balancing costs on this workload, before any session is split."""
    sent = [0] * replicas
    replica_of = []
    for session in sessions:
        replica = sent.index(min(sent))
        replica_of.append(replica)
        sent[replica] += sum(request.prompt_tokens for request in session)
    return placed_hit_rate(prompts, sessions, replica_of, block_size)


def pooled(mode: str, rounds: list[dict]) -> dict:
    """One routing's rounds together: the requests pooled (TTFT percentiles over all of them),
    the hit rate and the single-cache bound averaged over the rounds, each round kept."""
    results = [Result(**r) for summary in rounds for r in summary["results"]]
    per_replica: dict[str, float] = {}
    for summary in rounds:
        for name, count in summary["requests_per_replica"].items():
            per_replica[name] = per_replica.get(name, 0.0) + count
    summary = summarize(results, float(np.mean([s["prefix_hit_rate"] for s in rounds])), per_replica,
                        float(sum(s["wall_s"] for s in rounds)))
    for reference in ("single_cache_hit_rate", "spread_sessions_hit_rate"):
        summary[reference] = float(np.mean([s[reference] for s in rounds]))
    summary["rounds"] = [{k: v for k, v in s.items() if k != "results"} for s in rounds]
    each = ", ".join(f"{s['prefix_hit_rate']:.1%}" for s in rounds)
    print(f"{mode}, {len(rounds)} rounds: prefix-cache hit rate {summary['prefix_hit_rate']:.1%} "
          f"(rounds {each}; one unbounded cache "
          f"{summary['single_cache_hit_rate']:.1%}, whole sessions spread by load "
          f"{summary['spread_sessions_hit_rate']:.1%}), TTFT p50 {_s(summary['ttft_p50_s'])}, p99 "
          f"{_s(summary['ttft_p99_s'])}, errors {summary['errors']}", flush=True)
    summary["results"] = [asdict(r) for r in results]
    return summary


def references(prompts: PromptFactory, sessions: list[list[Request]], block_size: int, replicas: int) -> dict:
    return {"single_cache_hit_rate": single_cache_hit_rate(prompts, sessions, block_size),
            "spread_sessions_hit_rate": spread_sessions_hit_rate(prompts, sessions, block_size, replicas)}


def round_seed(args: argparse.Namespace, mode: str, round_index: int) -> int:
    """Each (routing, round) has a workload of its own: other system prompts, documents and
    conversations, so that no run's cache helps another."""
    return args.seed + 1 + MODES.index(mode) + len(MODES) * round_index


def workload_references(args: argparse.Namespace, prompts: PromptFactory) -> dict:
    """``--references``: the hit-rate references of the workloads a run with these arguments
    would send, per routing and round, and averaged per routing as the run reports them;
    computed from the prompts alone (the engine's default block size), no cluster."""
    block_size = EngineConfig.block_size
    out: dict[str, dict] = {}
    for mode in args.modes:
        rounds = []
        for round_index in range(args.rounds):
            seed = round_seed(args, mode, round_index)
            rounds.append({"seed": seed, **references(prompts, workload(prompts, args, seed), block_size,
                                                      args.replicas)})
        out[mode] = {key: float(np.mean([r[key] for r in rounds])) for key in rounds[0] if key != "seed"}
        out[mode]["rounds"] = rounds
        print(f"{mode}, {args.rounds} rounds: one cache {out[mode]['single_cache_hit_rate']:.1%}, whole "
              f"sessions spread by load over {args.replicas} replicas "
              f"{out[mode]['spread_sessions_hit_rate']:.1%}", flush=True)
    return {"block_size": block_size, "replicas": args.replicas, "references": out}


def measure(cluster, args: argparse.Namespace, prompts: PromptFactory) -> dict[str, dict]:
    """Every routing of ``args.modes`` against a started DynamoCluster's replicas, ``args.rounds``
    times, the routings' order rotating each round (HAProxy instances are started here for the
    two HAProxy routings). Each (routing, round) has its own seed."""
    from server.cluster import HAProxy, ProxyPorts
    from server.launch import free_ports

    urls, names = cluster.metrics_urls, [e.name for e in cluster.endpoints]
    warm_up(cluster, prompts, args.system_tokens + args.document_tokens, args.seed + 100)
    rounds: dict[str, list[dict]] = {mode: [] for mode in args.modes}
    for round_index in range(args.rounds):
        shift = round_index % len(args.modes)
        for mode in args.modes[shift:] + args.modes[:shift]:
            seed = round_seed(args, mode, round_index)
            sessions = workload(prompts, args, seed)
            proxy = None
            try:
                if mode == "dynamo-kv":
                    def send(request: Request) -> Result:
                        return send_openai(cluster.http_url, request, args.max_tokens, cluster.served_model_name)
                else:
                    balance = "prefix" if mode == "haproxy-affinity" else "roundrobin"
                    proxy = HAProxy(cluster.endpoints, ProxyPorts(*free_ports(3)), balance=balance,
                                    log_file=args.log_dir / f"haproxy-{balance}.log" if args.log_dir else None
                                    ).start()

                    def send(request: Request, url: str = proxy.http_url) -> Result:
                        return send_triton(url, request, args.max_tokens)
                summary = run_mode(mode, sessions, send, urls, names, args.concurrency, args.think_time)
            finally:
                if proxy is not None:
                    proxy.stop()
            summary["seed"] = seed
            summary.update(references(prompts, sessions, cluster.limits["block_size"], len(cluster.endpoints)))
            rounds[mode].append(summary)
    if args.rounds == 1:
        return {mode: rs[0] for mode, rs in rounds.items()}
    return {mode: pooled(mode, rs) for mode, rs in rounds.items()}


def main(argv: list[str] | None = None) -> int:
    from server.dynamo_cluster import DynamoCluster

    args = parse_args(argv)
    params = dict(p.split("=", 1) for p in args.param)
    prompts = PromptFactory.for_model(args.model_dir)
    if args.references:
        out = args.out or RESULTS_DIR / "kv_routing_references.json"
        out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                   "command": "python -m benchmarks.kv_routing " + " ".join(argv or sys.argv[1:]),
                                   "settings": {k: str(v) for k, v in vars(args).items()},
                                   **workload_references(args, prompts)}, indent=2))
        print(f"wrote {out}")
        return 0
    if args.quick:
        params.setdefault("itl_target_ms", "0")    # no step-cost calibration at start-up
    if args.log_dir is None:    # the replicas', Dynamo's and HAProxy's logs, out of the way
        args.log_dir = Path(tempfile.mkdtemp(prefix="kv-routing-logs-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {args.log_dir}", flush=True)
    started = time.perf_counter()
    # --kill-burst: supervised replicas (the supervisor restarts the one killed), the launcher's
    # migration limit (DynamoCluster's default, as `make dynamo-cluster`).
    cluster = DynamoCluster(args.replicas, base_port=None, params=params, log_dir=args.log_dir,
                            frontend_args=args.frontend_arg, supervise=args.kill_burst)
    cluster.start()
    try:
        print(f"{args.replicas} replicas ready in {time.perf_counter() - started:.0f} s (Dynamo's frontend on "
              f"{cluster.http_url})", flush=True)
        results = measure_kill_burst(cluster, args, prompts) if args.kill_burst else measure(cluster, args, prompts)
    finally:
        cluster.stop()
    name = "kv_routing_kill" if args.kill_burst else "kv_routing"
    # A quick run's figures are not results: they go to the temporary directory unless --out.
    out = args.out or (Path(tempfile.gettempdir()) / f"{name}-quick.json" if args.quick
                       else RESULTS_DIR / f"{name}-{platform.node() or 'host'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                               "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "settings": {k: str(v) for k, v in vars(args).items()}, "params": params,
                               "migration_limit": cluster.migration_limit, **results}, indent=2))
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
