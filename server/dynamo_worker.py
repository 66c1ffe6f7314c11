"""One of our replicas as a worker of NVIDIA Dynamo 1.6.1 (docs/scaling.md, "Routing by cached
blocks: Dynamo's frontend in front of the replicas").

    .venv-dynamo/bin/python server/dynamo_worker.py --triton-url 127.0.0.1:9600 \\
        --metrics-url http://127.0.0.1:9602/metrics --kv-events-endpoint tcp://127.0.0.1:9605 \\
        --model-path models/smollm2-135m-instruct [--served-model-name llm] [--namespace llm] \\
        [--block-size 16] ...    (server/dynamo_cluster.py starts one per replica)

Run by .venv-dynamo's Python (`make setup-dynamo-frontend`), never by the project's: it
imports Dynamo, aiohttp and the standard library, nothing of backend/ or torch. It is
Dynamo's own Python backend SDK (``dynamo.common.backend``: an ``LLMEngine`` driven by its
Rust ``Worker``) around a replica that runs elsewhere:

- **Registration.** The Worker registers a token-in, token-out model (``ModelInput.Tokens``,
  chat and completions) under ``<namespace>.backend.generate`` with the model folder as its
  card: the frontend reads the SmolLM2 tokenizer and chat template from it, tokenizes every
  request and sends token ids, which its KV router hashes into blocks of ``--block-size``.
- **KV events.** ``kv_event_sources`` names the replica's KV-event PUB socket
  (``enable_kv_cache_events``, docs/scaling.md "KV-cache events"); the Worker subscribes to
  it with Dynamo's ``KvEventPublisher`` (its ZMQ relay) and republishes every batch on
  Dynamo's event plane, where the frontend's KV router keeps its radix tree of each worker's
  blocks.
- **Requests.** ``generate`` forwards the token ids to the replica's Triton HTTP
  ``generate_stream`` as ``input_ids``, with ``logprobs: 0`` so that every streamed response
  names the ids of the tokens it carries (our server's responses carry text, and the
  frontend detokenizes ids itself), and streams them back as Dynamo chunks. A request that
  Dynamo cancels (the client went away, a stop string matched) closes the HTTP stream.
- **Health.** The replica's ``llm_ready`` gauge is read every 250 ms (``--metrics-url``): while
  the replica is not ready (draining, unhealthy, restarting) the worker is out of Dynamo's
  routing pool, as HAProxy takes a replica out (server/cluster.py).

What a request cannot have through this worker: OpenAI ``logprobs`` / ``top_logprobs`` (the
sampled token's id is the one unambiguous entry only with ``logprobs: 0``), ``n`` > 1 and
guided decoding; they are refused with InvalidArgument.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import time
import urllib.request
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import aiohttp

from dynamo._core import Context
from dynamo.common.backend import EngineConfig, LLMEngine, LlmRegistration, WorkerConfig
from dynamo.common.backend.publisher import KvEventSource, ZmqSource
from dynamo.common.backend.run import run
from dynamo.llm.exceptions import CannotConnect, EngineShutdown, InvalidArgument, StreamIncomplete, Unknown

logger = logging.getLogger("dynamo_worker")

MODEL_NAME = "llm"              # the Triton model (server/launch.py's MODEL_NAME)
COMPONENT, ENDPOINT = "backend", "generate"
# Sampling options the frontend sends that our server takes under the same name (vLLM's).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
# Our server's refusals that another replica (or the same one later) may accept: raised as
# CannotConnect, which Dynamo 1.6.1's request migration (--migration-limit) retries elsewhere
# (it returns WorkerUnavailable to the client as an HTTP 500, unretried).
RETRYABLE_MESSAGES = ("server is shutting down", "waiting queue is full", "engine is unhealthy",
                      "has no available versions", "Stub process")
# Our server's finish reasons (vLLM's) as Dynamo names them: "abort" is a drained request.
FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled"}
# The replica's readiness, as HAProxy checks it (server/cluster.py): the model's own gauge,
# 0 from the start of a drain and when its engine is unhealthy, absent until the model loaded
# (server/stub/metric_names.py's READY_FAMILY; not imported: this file runs in .venv-dynamo).
READY_FAMILY = "llm_ready"
HEALTH_INTERVAL_S = 0.25      # HAProxy's fastinter
HEALTH_FALL, HEALTH_RISE = 2, 2


def sampling_parameters(request: dict[str, Any]) -> dict[str, Any]:
    """Dynamo's preprocessed request (stop_conditions, sampling_options, output_options) as our
    server's sampling_parameters; what cannot be served is refused with InvalidArgument."""
    stop = request.get("stop_conditions") or {}
    sampling = request.get("sampling_options") or {}
    output = request.get("output_options") or {}
    if sampling.get("n") not in (None, 1):
        raise InvalidArgument("n > 1 is not served through the Dynamo worker")
    if sampling.get("guided_decoding") is not None:
        raise InvalidArgument("guided decoding is not served through the Dynamo worker")
    if output.get("logprobs") is not None or output.get("prompt_logprobs") is not None:
        raise InvalidArgument("logprobs are not served through the Dynamo worker")
    params: dict[str, Any] = {key: sampling[key] for key in SAMPLING_KEYS if sampling.get(key) is not None}
    if stop.get("max_tokens") is not None:
        params["max_tokens"] = int(stop["max_tokens"])
    if stop.get("min_tokens"):
        params["min_tokens"] = int(stop["min_tokens"])
    if stop.get("ignore_eos"):
        params["ignore_eos"] = True
    # Stop strings end the generation on the replica; the frontend also hides them from the
    # text it returns. The model's own end-of-sequence ids (stop_token_ids_hidden) are our
    # engine's too, from generation_config.json.
    if stop.get("stop"):
        params["stop"] = list(stop["stop"])
    token_ids = list(stop.get("stop_token_ids") or [])
    if not stop.get("ignore_eos"):
        token_ids += [t for t in stop.get("stop_token_ids_hidden") or [] if t not in token_ids]
    if token_ids:
        params["stop_token_ids"] = token_ids
    # The ids of the sampled tokens, one unambiguous entry per position (see the module docstring).
    params["logprobs"] = 0
    return params


def token_ids_of(event: dict[str, Any]) -> list[int]:
    """The ids of the tokens one streamed response carries: the keys of its logprobs
    positions (``logprobs: 0``: the sampled token alone)."""
    raw = event.get("logprobs")
    if raw in (None, "null", ""):
        return []
    positions = json.loads(raw) if isinstance(raw, str) else raw
    if isinstance(positions, list) and positions and isinstance(positions[0], str):   # one per completion
        positions = json.loads(positions[0])
    return [int(next(iter(position))) for position in positions or [] if position]


def error_message(body: str) -> str:
    """The message of an error response: ``{"error": ...}``, as JSON or as a server-sent event."""
    for line in body.splitlines() or [body]:
        text = line.strip()
        if text.startswith("data:"):
            text = text[len("data:"):].strip()
        try:
            parsed = json.loads(text)
        except ValueError:
            continue
        if isinstance(parsed, dict) and "error" in parsed:
            return str(parsed["error"])
    return body.strip() or "error"


def metric_value(metrics_url: str, family: str) -> float | None:
    """One unlabelled-or-first sample of a family on a Prometheus text page."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    match = re.search(rf"^{re.escape(family)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


class TritonReplicaEngine(LLMEngine):
    """Dynamo's engine contract, served by forwarding to one Triton replica."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base_url = f"http://{args.triton_url}/v2/models/{args.triton_model}"
        self.session: aiohttp.ClientSession | None = None
        self.endpoint = None                       # Dynamo's serving endpoint (on_endpoint_ready)
        self.routable = True                       # registered in discovery: the routers pick it
        self._refused = asyncio.Event()            # a connection to the replica was refused
        self._health: asyncio.Task | None = None

    @classmethod
    async def from_args(cls, argv: list[str] | None = None) -> tuple["TritonReplicaEngine", WorkerConfig]:
        args = argument_parser().parse_args(argv)
        args.model_path = str(Path(args.model_path).resolve())
        served = args.served_model_name or MODEL_NAME
        config = WorkerConfig(namespace=args.namespace, component=COMPONENT, endpoint=ENDPOINT,
                              model_name=args.model_path, served_model_name=served,
                              endpoint_types="chat,completions", discovery_backend=args.discovery_backend,
                              request_plane=args.request_plane, event_plane=args.event_plane,
                              enable_kv_routing=args.kv_events_endpoint is not None,
                              metrics_labels=[("replica", args.name)] if args.name else [])
        return cls(args), config

    async def start(self, worker_id: int) -> EngineConfig:
        args = self.args
        # No limit on connections to our own replica: every stream in flight holds one.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        await self._wait_ready(args.ready_timeout)
        total_blocks = await asyncio.to_thread(metric_value, args.metrics_url, "llm_kv_blocks_total") \
            if args.metrics_url else None
        logger.info("worker %s (%s): replica %s, KV events from %s, %s KV blocks of %d tokens", worker_id,
                    args.name or "-", args.triton_url, args.kv_events_endpoint or "nowhere (off)",
                    int(total_blocks) if total_blocks else "?", args.block_size)
        return EngineConfig(
            model=args.model_path, served_model_name=args.served_model_name or MODEL_NAME,
            llm=LlmRegistration(context_length=args.context_length, kv_cache_block_size=args.block_size,
                                total_kv_blocks=int(total_blocks) if total_blocks else None,
                                max_num_seqs=args.max_num_seqs,
                                max_num_batched_tokens=args.max_num_batched_tokens))

    async def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                async with self.session.get(f"{self.base_url}/ready") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise EngineShutdown(f"the replica at {self.args.triton_url} is not ready after {timeout:.0f} s")
            await asyncio.sleep(0.5)

    async def on_endpoint_ready(self, endpoint: Any) -> None:
        """Watch the replica's readiness from now on: out of the routing pool while it is not
        ready (draining, unhealthy, restarting after a crash), back once it is. Leaving the
        pool also drops this worker's blocks from the routers' radix trees, so a replica that
        restarted with an empty cache is not credited with its old one."""
        self.endpoint = endpoint
        if self.args.metrics_url:
            self._health = asyncio.create_task(self._watch_health(), name="replica-health")

    async def _replica_ready(self) -> bool:
        try:
            async with self.session.get(self.args.metrics_url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                text = await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False
        match = re.search(rf"^{READY_FAMILY}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        return match is not None and float(match.group(1)) == 1.0

    async def _watch_health(self) -> None:
        streak = 0
        while True:
            try:
                await asyncio.wait_for(self._refused.wait(), HEALTH_INTERVAL_S)
            except asyncio.TimeoutError:
                pass
            refused, ready = self._refused.is_set(), await self._replica_ready()
            self._refused.clear()
            if ready == self.routable and not (refused and self.routable):
                streak = 0
                continue
            streak += 1
            # Like HAProxy's observe layer4: one refused connection takes the replica out at once.
            if self.routable and (refused or streak >= HEALTH_FALL):
                await self.endpoint.unregister_endpoint_instance()
                self.routable, streak = False, 0
                logger.warning("replica %s is not ready: out of Dynamo's routing pool", self.args.name or "-")
            elif not self.routable and ready and streak >= HEALTH_RISE:
                await self.endpoint.register_endpoint_instance()
                self.routable, streak = True, 0
                logger.warning("replica %s is ready again: back in Dynamo's routing pool", self.args.name or "-")

    async def kv_event_sources(self) -> list[KvEventSource]:
        endpoint = self.args.kv_events_endpoint
        return [ZmqSource(endpoint=endpoint, topic="")] if endpoint else []

    async def generate(self, request: dict[str, Any], context: Context) -> AsyncGenerator[dict[str, Any], None]:
        token_ids = [int(t) for t in request["token_ids"]]
        body = {"input_ids": token_ids, "stream": True, "exclude_input_in_output": True,
                "sampling_parameters": json.dumps(sampling_parameters(request)),
                "return_finish_reason": True, "return_num_input_tokens": True,
                "return_num_cached_tokens": True, "return_logprobs": True}
        generated = 0
        try:
            response = await self.session.post(f"{self.base_url}/generate_stream", json=body)
        except aiohttp.ClientError as exc:
            self._refused.set()
            raise CannotConnect(f"replica {self.args.name or self.args.triton_url} unreachable: {exc}") from exc
        async with response:
            if response.status != 200:
                # Triton refuses a request (INVALID_ARG, and UNAVAILABLE for a draining or full
                # replica) with HTTP 400 and the error as one server-sent event or a JSON body.
                raise self._refusal(error_message(await response.text()), before_tokens=True,
                                    invalid=response.status == 400)
            lines = response.content.__aiter__()
            while True:
                try:
                    raw = await lines.__anext__()
                except StopAsyncIteration:
                    break
                except aiohttp.ClientError as exc:    # the replica died or closed the stream
                    self._refused.set()
                    raise StreamIncomplete(f"the stream from replica {self.args.name or self.args.triton_url} "
                                           f"broke after {generated} tokens ({exc!r})") from exc
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[len("data:"):])
                if "error" in event:
                    raise self._refusal(event["error"], before_tokens=generated == 0)
                ids = token_ids_of(event)
                generated += len(ids)
                finish = event.get("finish_reason")
                if isinstance(finish, list):
                    finish = finish[0]
                chunk: dict[str, Any] = {"token_ids": ids, "index": 0}
                if finish not in (None, "None"):
                    prompt = int(event.get("num_input_tokens") or len(token_ids))
                    cached = event.get("num_cached_tokens")
                    if isinstance(cached, list):
                        cached = cached[0]
                    chunk["finish_reason"] = FINISH_REASONS.get(finish, finish)
                    chunk["completion_usage"] = {
                        "prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
                        "prompt_tokens_details": {"cached_tokens": int(cached or 0)}}
                    yield chunk
                    return
                yield chunk
        raise StreamIncomplete(f"the stream from replica {self.args.name or self.args.triton_url} ended without a "
                               f"final response after {generated} tokens")

    def _refusal(self, message: str, before_tokens: bool, invalid: bool = False) -> Exception:
        """The error for Dynamo: CannotConnect where another replica may serve the request
        (nothing was streamed yet), InvalidArgument for a request our server refused as such."""
        where = f"replica {self.args.name or self.args.triton_url}"
        if before_tokens and any(m in message for m in RETRYABLE_MESSAGES):
            return CannotConnect(f"{where}: {message}")
        if invalid:
            return InvalidArgument(message)
        return Unknown(f"{where}: {message}")

    async def cleanup(self) -> None:
        if self._health is not None:
            self._health.cancel()
            self._health = None
        if self.session is not None:
            await self.session.close()
            self.session = None


def argument_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--triton-url", required=True, help="the replica's HTTP host:port")
    parser.add_argument("--triton-model", default=MODEL_NAME)
    parser.add_argument("--metrics-url", default=None, help="the replica's metrics page (its KV pool size)")
    parser.add_argument("--kv-events-endpoint", default=None,
                        help="the replica's KV-event PUB socket to subscribe to (tcp://127.0.0.1:PORT); "
                             "without it the router only predicts what the replica caches")
    parser.add_argument("--model-path", required=True, help="the model folder: tokenizer and chat template")
    parser.add_argument("--served-model-name", default=None, help=f"the OpenAI model name (default {MODEL_NAME})")
    parser.add_argument("--name", default="", help="the replica's name, for logs and metric labels")
    parser.add_argument("--namespace", default=env("DYN_NAMESPACE", "llm"))
    parser.add_argument("--discovery-backend", default=env("DYN_DISCOVERY_BACKEND", "file"))
    parser.add_argument("--request-plane", default=env("DYN_REQUEST_PLANE", "tcp"))
    parser.add_argument("--event-plane", default=env("DYN_EVENT_PLANE", "zmq"))
    parser.add_argument("--block-size", type=int, default=16, help="the engine's block_size")
    parser.add_argument("--context-length", type=int, default=None, help="the engine's max_model_len")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    return parser


if __name__ == "__main__":
    run(TritonReplicaEngine)
