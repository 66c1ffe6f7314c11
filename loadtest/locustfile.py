"""Locust load test of the llm model over Triton's gRPC streaming API.

    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 3m --stop-timeout 120 \
        --host 127.0.0.1:8001 --load-profile cpu --run-dir runs/manual [--tags chat rag] [--rate 2]

(``python -m loadtest run`` / ``make loadtest`` wrap this, start a server when none is up,
scrape its metrics and write the report.)

Each user owns one gRPC stream and has one request in flight at a time. Scenarios are
Locust tasks tagged with their name, so ``--tags`` / ``--exclude-tags`` select them; the
order in which they are sent is not Locust's random pick but a seeded, evenly weighted
interleaving (workload.py), so a run is reproducible and a short one covers every scenario.
One Locust request event per request carries its end-to-end latency; the LLM metrics come
from the raw records (records.jsonl) the report reads.
"""

from __future__ import annotations

# gRPC must run on gevent's loop before any channel exists, or Locust's users block the
# process (Locust has already monkey-patched the standard library when it imports us).
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

from locust import TaskSet, User, constant, events, tag  # noqa: E402
from locust.env import Environment  # noqa: E402

# `locust -f loadtest/locustfile.py` puts loadtest/ on sys.path, not the project root.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from loadtest.grpc_stream import TritonRequestError, UserStream  # noqa: E402
from loadtest.profiles import DEFAULT_HOST, DEFAULT_PROFILE, PROFILES, SCENARIOS  # noqa: E402
from loadtest.prompts import PromptFactory, model_max_len  # noqa: E402
from loadtest.records import CANCELLED, FAILED, INTERRUPTED, RecordWriter, RequestRecord  # noqa: E402
from loadtest.server_metrics import MetricsSampler  # noqa: E402
from loadtest.workload import Arrivals, Workload, WeightedInterleave  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")   # no tokenizer thread pool beside gevent

DEFAULT_MODEL_DIR = ROOT / "models" / "smollm2-135m-instruct"
REQUEST_TYPE = "grpc-stream"
# After a failed request a user pauses this long, so that a server that is down does not turn
# the load test into a busy loop of instant connection errors.
FAILURE_BACKOFF_S = 1.0


@events.init_command_line_parser.add_listener
def add_options(parser: Any) -> None:
    group = parser.add_argument_group("LLM load test")
    group.add_argument("--load-profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE,
                       help="lengths, mix weights and SLOs (loadtest/profiles.py)")
    group.add_argument("--seed", type=int, default=0, help="seed of every request and of the arrival times")
    group.add_argument("--rate", type=float, default=0.0,
                       help="open loop: Poisson arrivals at this many requests/s (users cap the concurrency); "
                            "0 = closed loop")
    group.add_argument("--run-dir", default="", help="where records.jsonl and metrics.jsonl go")
    group.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR), help="the served model's folder (tokenizer)")
    group.add_argument("--model-name", default="llm", help="Triton model name")
    group.add_argument("--max-model-len", type=int, default=0, help="context to fit in (0: the model's)")
    group.add_argument("--metrics-url", default="", help="Prometheus endpoint to sample during the run")
    group.add_argument("--scrape-interval", type=float, default=1.0)
    group.add_argument("--request-timeout", type=float, default=600.0)
    group.add_argument("--prefix-key", action="store_true",
                       help="send x-prefix-key (the shared-prefix scenario: its group's system-prompt hash) so that "
                            "a proxy keeps each group on one replica (docs/scaling.md)")


@dataclass
class Shared:
    """Process-wide state of one run, shared by every user (greenlets: no locks needed)."""
    options: Any
    run_dir: Path
    workload: Workload
    weights: dict[str, int]
    arrivals: Arrivals
    writer: RecordWriter
    stopping: threading.Event = field(default_factory=threading.Event)
    interleave: WeightedInterleave | None = None
    sampler: MetricsSampler | None = None
    users: int = 0


STATE: Shared | None = None


@events.init.add_listener
def setup(environment: Environment, **_: Any) -> None:
    global STATE
    options = environment.parsed_options
    profile = PROFILES[options.load_profile]
    run_dir = Path(options.run_dir or ROOT / "runs" / time.strftime("locust-%Y%m%d-%H%M%S"))
    run_dir.mkdir(parents=True, exist_ok=True)
    prompts = PromptFactory.for_model(options.model_dir)
    max_len = options.max_model_len or model_max_len(options.model_dir)
    STATE = Shared(options=options, run_dir=run_dir,
                   workload=Workload(profile.scenarios(list(SCENARIOS)), prompts, options.seed, max_len),
                   weights={n: profile.weights.get(n, 0) for n in SCENARIOS},
                   arrivals=Arrivals(options.rate or None, options.seed),
                   writer=RecordWriter(run_dir / "records.jsonl"))


@events.test_start.add_listener
def on_test_start(environment: Environment, **_: Any) -> None:
    assert STATE is not None
    options = environment.parsed_options
    # Locust's web UI can start a test again in the same process: begin each one afresh
    # (records of all tests of the process go to the same records.jsonl).
    STATE.stopping.clear()
    STATE.arrivals = Arrivals(options.rate or None, options.seed)
    STATE.interleave = None
    if options.metrics_url:
        STATE.sampler = MetricsSampler(options.metrics_url, STATE.run_dir / "metrics.jsonl",
                                       options.scrape_interval).start()
    meta = {"started_at": time.time(), "host": environment.host, "profile": options.load_profile, "seed": options.seed,
            "rate": options.rate or None, "users": options.num_users, "run_time": options.run_time,
            "stop_timeout": environment.stop_timeout, "tags": options.tags, "exclude_tags": options.exclude_tags,
            "model_dir": options.model_dir, "max_model_len": STATE.workload.max_model_len,
            "prefix_key": options.prefix_key}
    (STATE.run_dir / "locust.json").write_text(json.dumps(meta, indent=2))


@events.test_stopping.add_listener
def on_test_stopping(**_: Any) -> None:
    if STATE is not None:
        STATE.stopping.set()    # open-loop users waiting for their arrival time give up


@events.test_stop.add_listener
def on_test_stop(**_: Any) -> None:
    if STATE is not None and STATE.sampler is not None:
        STATE.sampler.stop()
        STATE.sampler = None


@events.quit.add_listener
def on_quit(**_: Any) -> None:
    if STATE is not None:
        STATE.writer.close()


def _scenario_task(name: str) -> Callable[[TaskSet], None]:
    def run(taskset: TaskSet) -> None:
        taskset.user.send(name)

    run.__name__ = name.replace("-", "_")
    run.scenario = name  # type: ignore[attr-defined]
    return tag(name)(run)


class ScenarioMix(TaskSet):
    tasks = [_scenario_task(name) for name in SCENARIOS]

    def get_next_task(self) -> Callable:
        # self.tasks is what survived --tags / --exclude-tags; the first user builds the
        # shared interleaving from it.
        assert STATE is not None
        by_name = {task.scenario: task for task in self.tasks}
        if STATE.interleave is None:
            # Weight 0 leaves a scenario out of the mix, unless tags selected only such ones.
            weights = {n: STATE.weights.get(n, 0) for n in by_name}
            positive = {n: w for n, w in weights.items() if w > 0}
            STATE.interleave = WeightedInterleave(positive or {n: 1 for n in by_name})
        return by_name[STATE.interleave.next()]


class LLMUser(User):
    host = DEFAULT_HOST
    tasks = [ScenarioMix]
    wait_time = constant(0)

    def on_start(self) -> None:
        assert STATE is not None
        STATE.users += 1
        self.user_id = STATE.users
        self.stream = UserStream(self.host, STATE.options.model_name, STATE.options.request_timeout,
                                 send_prefix_key=STATE.options.prefix_key)

    def on_stop(self) -> None:
        self.stream.close()

    def send(self, scenario: str) -> None:
        assert STATE is not None
        # Build the prompt first: its tokenization is client work, not the server's latency.
        spec = STATE.workload.next(scenario)
        now = time.time()
        scheduled = STATE.arrivals.next_time(now)
        if scheduled > now and STATE.stopping.wait(scheduled - now):
            return                      # the run ended before this arrival
        if STATE.stopping.is_set():
            return
        record = RequestRecord(request_id=spec.request_id, scenario=spec.scenario, name=spec.name, user=self.user_id,
                               scheduled_at=scheduled, sent_at=scheduled, expected_prompt_tokens=spec.prompt_tokens,
                               max_tokens=spec.max_tokens, priority=spec.priority, cancel_after=spec.cancel_after)
        try:
            self.stream.run(spec, record)
        finally:
            STATE.writer.write(record)
            if record.outcome != INTERRUPTED:   # drained-out requests are neither successes nor failures
                self._report(record)
        if record.outcome == FAILED:
            STATE.stopping.wait(FAILURE_BACKOFF_S)

    def _report(self, record: RequestRecord) -> None:
        end = record.end_at or time.time()
        exception = TritonRequestError(record.error or "failed") if record.outcome == FAILED else None
        self.environment.events.request.fire(
            request_type=REQUEST_TYPE, name=record.name, start_time=record.scheduled_at,
            response_time=(end - record.scheduled_at) * 1000.0, response_length=record.output_tokens,
            exception=exception, response=None, url=None,
            context={"outcome": record.outcome, "cancelled": record.outcome == CANCELLED})

