"""Chaos soak: the Locust mix through HAProxy against supervised replicas while a seeded
schedule kills, drains and restarts them (docs/reliability.md). Not part of ``make test``
at full length (a 2-minute run is, tests/test_chaos.py):

    make chaos [DURATION=10m] [REPLICAS=2] [SEED=1]
    python -m loadtest.chaos --duration 10m --replicas 2 --seed 1 [--rate 1.5] [--every 30]

Faults, one replica at a time (the next one waits until every replica is UP in HAProxy):
- ``kill-server``: SIGKILL to a replica's tritonserver (a crash); the supervisor restarts it;
- ``kill-stub``: SIGKILL to its Python backend stub (the engine's process); the supervisor
  notices within 0.5 s, restarts the server;
- ``drain-restart``: a rolling restart: drain (llm_ready turns 0, HAProxy takes the replica
  out), SIGTERM, the supervisor starts it again.

Every request is accounted for from the Locust records: answered (a final response; the
cancel scenario's own cancellations included), refused (an error before its first token),
ended with an error (a stream cut after tokens, with the error naming why), interrupted by
the end of the run, or lost (no final response and no error: a timeout). Writes chaos.md,
chaos.json and chaos.png into the run folder; exit code 0 only if nothing was lost or
interrupted and every replica's KV cache was idle at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from loadtest import report
from loadtest.__main__ import parse_duration
from loadtest.profiles import PROFILES
from loadtest.records import CANCELLED, FAILED, INTERRUPTED, OK, RequestRecord
from loadtest.runner import ROOT, LoadOptions, machine_description, run_load
from loadtest.server_metrics import sample_one
from loadtest.soak import rss_bytes
from server.cluster import Cluster

PROFILE = "cpu"
ACTIONS = ("kill-server", "kill-stub", "drain-restart")
SAMPLE_EVERY_S = 2.0
RECOVERY_TIMEOUT_S = 180.0
DRAIN_TIMEOUT_S = 60.0    # Locust's wait for requests in flight at the end; anything still running is reported


@dataclass
class Fault:
    at_s: float              # planned, seconds after the load started
    action: str
    replica: int
    started_s: float | None = None     # when it was applied (later than planned if waiting for recovery)
    recovered_s: float | None = None   # when every replica was UP in HAProxy again


def schedule(seed: int, duration_s: float, every_s: float, replicas: int, first_s: float = 15.0,
             actions: tuple[str, ...] = ACTIONS) -> list[Fault]:
    """Faults at ``first_s`` and then every ``every_s`` (+-25%); actions and replicas each cycle
    through a seeded order, so that a short run sees every kind of fault and every replica."""
    rng = np.random.default_rng(seed)
    faults, t, i = [], first_s, 0
    actions = [actions[j] for j in rng.permutation(len(actions))]
    targets = [int(j) for j in rng.permutation(replicas)]
    while t < duration_s - 20:   # leave the end of the run for recovery
        faults.append(Fault(round(t, 1), actions[i % len(actions)], targets[i % len(targets)]))
        t += every_s * rng.uniform(0.75, 1.25)
        i += 1
    return faults


def apply(cluster: Cluster, fault: Fault) -> None:
    server = cluster.servers[fault.replica]
    if fault.action == "kill-server":
        if server.process is not None and server.process.poll() is None:
            os.kill(server.process.pid, signal.SIGKILL)
    elif fault.action == "kill-stub":
        for pid in server.stub_pids():
            os.kill(pid, signal.SIGKILL)
    else:
        server.restart_gracefully()


def all_up(cluster: Cluster) -> bool:
    states = cluster.proxy.server_states()
    return bool(states) and all(s == "UP" for backend in states.values() for s in backend.values())


@dataclass
class ChaosState:
    samples: list[dict] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def run_faults(cluster: Cluster, state: ChaosState, started: float, stop: threading.Event) -> None:
    for fault in state.faults:
        if stop.wait(max(0.0, started + fault.at_s - time.monotonic())):
            return
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while not all_up(cluster) and time.monotonic() < deadline:    # one replica down at a time
            if stop.wait(0.5):
                return
        fault.started_s = round(time.monotonic() - started, 1)
        print(f"chaos: t={fault.started_s:.0f}s {fault.action} r{fault.replica}", flush=True)
        try:
            apply(cluster, fault)
        except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
            state.errors.append(f"{fault.action} r{fault.replica}: {exc!r}")
        time.sleep(2.0)    # let HAProxy see it go before waiting for it to come back
        while not all_up(cluster) and time.monotonic() < deadline and not stop.is_set():
            time.sleep(0.5)
        if all_up(cluster):
            fault.recovered_s = round(time.monotonic() - started, 1)


def sample_replicas(cluster: Cluster, state: ChaosState, started: float, stop: threading.Event) -> None:
    while not stop.wait(SAMPLE_EVERY_S):
        row: dict = {"t": round(time.monotonic() - started, 1), "replicas": []}
        states = cluster.proxy.server_states()
        for endpoint, server in zip(cluster.endpoints, cluster.servers):
            try:
                metrics = sample_one(endpoint.metrics_url)
            except OSError:
                metrics = {}
            process = server.process
            pids = ([process.pid] if process is not None and process.poll() is None else []) + server.stub_pids()
            row["replicas"].append({
                "name": endpoint.name, "haproxy": states.get("triton_grpc", {}).get(endpoint.name),
                "running": metrics.get("running"), "waiting": metrics.get("waiting"),
                "kv_used": metrics.get("kv_used"), "finished": metrics.get("finished_requests"),
                "rss": sum(rss_bytes(p) or 0 for p in pids) or None, "restarts": server.restarts})
        state.samples.append(row)


def classify(records: list[RequestRecord]) -> dict:
    """Every request in exactly one bucket; "lost" is what must be 0."""
    buckets: dict[str, list[RequestRecord]] = {"answered": [], "refused": [], "ended_with_error": [],
                                               "interrupted_at_stop": [], "lost": []}
    for r in records:
        if r.outcome in (OK, CANCELLED) and (r.final_response or r.outcome == CANCELLED):
            buckets["answered"].append(r)
        elif r.outcome == INTERRUPTED:
            buckets["interrupted_at_stop"].append(r)
        elif r.outcome == FAILED and r.error and not r.error.startswith("no final response"):
            buckets["refused" if r.output_tokens == 0 else "ended_with_error"].append(r)
        else:
            buckets["lost"].append(r)
    counts = {name: len(rs) for name, rs in buckets.items()}
    counts["sent"] = len(records)
    counts["cancelled_by_client"] = sum(r.outcome == CANCELLED for r in records)
    counts["retried"] = sum(r.retries > 0 for r in records)
    counts["retries"] = sum(r.retries for r in records)
    for name in ("refused", "ended_with_error", "lost"):
        reasons: dict[str, int] = {}
        for r in buckets[name]:
            key = (r.error or "no error")[:140]
            reasons[key] = reasons.get(key, 0) + 1
        counts[f"{name}_reasons"] = dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:8])
    return counts


def per_replica(state: ChaosState, cluster: Cluster) -> list[dict]:
    rows = []
    for i, endpoint in enumerate(cluster.endpoints):
        series = [s["replicas"][i] for s in state.samples]
        finished, last = 0.0, None
        for value in (p["finished"] for p in series if p["finished"] is not None):
            if last is not None:   # counters restart from 0 with every server: sum the increases
                finished += value - last if value >= last else value
            last = value
        rss = [p["rss"] for p in series if p["rss"]]
        rows.append({"name": endpoint.name, "faults": [f"{f.action}@{f.started_s:.0f}s" for f in state.faults
                                                       if f.replica == i and f.started_s is not None],
                     "restarts": cluster.servers[i].restarts, "finished_requests": int(finished),
                     "rss_first_mib": rss[0] / 2**20 if rss else None, "rss_last_mib": rss[-1] / 2**20 if rss else None,
                     "rss_peak_mib": max(rss) / 2**20 if rss else None})
    return rows


def idle_at_end(cluster: Cluster, timeout: float = 60.0) -> dict[str, dict]:
    """Each replica's gauges once every replica is back: nothing running or waiting, no KV."""
    deadline = time.monotonic() + timeout
    while True:
        rows = {}
        for endpoint in cluster.endpoints:
            try:
                rows[endpoint.name] = sample_one(endpoint.metrics_url)
            except OSError:
                rows[endpoint.name] = {}
        idle = {name: row.get("running") == 0 and row.get("waiting") == 0 and row.get("kv_used") == 0
                for name, row in rows.items()}
        if all(idle.values()) or time.monotonic() > deadline:
            return {name: {"idle": idle[name], "running": row.get("running"), "waiting": row.get("waiting"),
                           "kv_used": row.get("kv_used")} for name, row in rows.items()}
        time.sleep(0.5)


def plot(state: ChaosState, records: list[RequestRecord], started_epoch: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    bins = np.arange(0, max([s["t"] for s in state.samples] + [10]) + 10, 10)
    ends = {"answered": [], "refused": [], "ended with error": [], "lost": []}
    for r in records:
        t = (r.end_at or r.sent_at) - started_epoch
        key = ("answered" if r.outcome in (OK, CANCELLED) and (r.final_response or r.outcome == CANCELLED) else
               "lost" if r.outcome != FAILED or not r.error or r.error.startswith("no final response") else
               "refused" if r.output_tokens == 0 else "ended with error")
        if r.outcome != INTERRUPTED:
            ends[key].append(t)
    for label, times in ends.items():
        counts, _ = np.histogram(times, bins=bins)
        top.step(bins[:-1], counts / 10.0, where="post", label=label)
    top.set_ylabel("requests ended /s")
    top.set_title("Chaos soak: outcomes, load and memory per replica (dashed: faults)")
    top.legend(fontsize=8)
    times = [s["t"] for s in state.samples]
    names = [r["name"] for r in state.samples[0]["replicas"]] if state.samples else []
    for i, name in enumerate(names):
        middle.plot(times, [s["replicas"][i]["running"] or 0 for s in state.samples], label=f"{name} running")
        bottom.plot(times, [(s["replicas"][i]["rss"] or 0) / 2**20 for s in state.samples], label=f"{name} RSS")
    middle.set_ylabel("running requests")
    middle.legend(fontsize=8)
    bottom.set_ylabel("RSS, server + stub (MiB)")
    bottom.set_xlabel("seconds")
    bottom.legend(fontsize=8)
    for fault in state.faults:
        if fault.started_s is not None:
            for axis in (top, middle, bottom):
                axis.axvline(fault.started_s, color="grey", linestyle="--", linewidth=0.8)
            top.annotate(f"{fault.action} r{fault.replica}", (fault.started_s, 0), rotation=90, fontsize=7,
                         va="bottom", color="grey")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=parse_duration, default=parse_duration("10m"))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rate", type=float, default=1.5, help="requests/s, open loop (Poisson)")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between faults (+-25%%)")
    parser.add_argument("--actions", default=",".join(ACTIONS), help=f"faults to use (of {', '.join(ACTIONS)})")
    parser.add_argument("--drain-timeout", type=float, default=None,
                        help="the replicas' drain_timeout_s (default: config.pbtxt's); a drain-restart takes "
                             "about this + 10 s (Triton's exit timeout) + a start")
    parser.add_argument("--run-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    actions = tuple(a for a in args.actions.split(",") if a)
    if not actions or set(actions) - set(ACTIONS):
        parser.error(f"--actions must name some of {', '.join(ACTIONS)}")
    command = "python -m loadtest.chaos " + shlex.join(sys.argv[1:] if argv is None else argv)
    run_dir = args.run_dir or ROOT / "runs" / time.strftime("%Y%m%d-%H%M%S-chaos")
    run_dir.mkdir(parents=True, exist_ok=True)
    params = dict(PROFILES[PROFILE].server_params)
    if args.drain_timeout is not None:
        params["drain_timeout_s"] = f"{args.drain_timeout:g}"
    cluster = Cluster(args.replicas, base_port=None, params=params, supervise=True, log_dir=run_dir)
    print(f"starting {args.replicas} supervised replicas behind HAProxy ...", flush=True)
    cluster.start()
    state = ChaosState(faults=schedule(args.seed, args.duration, args.every, args.replicas, actions=actions))
    stop = threading.Event()
    started, started_epoch = time.monotonic(), time.time()
    threads = [threading.Thread(target=run_faults, args=(cluster, state, started, stop), daemon=True),
               threading.Thread(target=sample_replicas, args=(cluster, state, started, stop), daemon=True)]
    for thread in threads:
        thread.start()
    try:
        result = run_load(LoadOptions(profile=PROFILE, host=cluster.proxy.grpc_url,
                                      metrics_url=",".join(e.metrics_url for e in cluster.endpoints),
                                      server="existing", rate=args.rate, duration_s=args.duration, seed=args.seed,
                                      run_dir=run_dir / "load", command=command, prefix_key=True,
                                      drain_timeout_s=DRAIN_TIMEOUT_S))
        stop.set()
        for thread in threads:
            thread.join(RECOVERY_TIMEOUT_S + 10)
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while not all_up(cluster) and time.monotonic() < deadline:
            time.sleep(0.5)
        idle = idle_at_end(cluster)
        replicas = per_replica(state, cluster)
    finally:
        stop.set()
        cluster.stop()
    records = [RequestRecord.from_dict(json.loads(line))
               for line in (run_dir / "load" / report.RECORDS).read_text().splitlines() if line.strip()]
    counts = classify(records)
    ok = counts["lost"] == 0 and counts["interrupted_at_stop"] == 0 and all(r["idle"] for r in idle.values())
    summary = {"command": command, "machine": machine_description(), "duration_s": args.duration,
               "replicas": args.replicas, "rate": args.rate, "seed": args.seed, "requests": counts,
               "faults": [asdict(f) for f in state.faults], "fault_errors": state.errors,
               "per_replica": replicas, "idle_at_end": idle, "verdict": "PASS" if ok else "FAIL",
               "locust_summary": {"passed_slo": result.summary.passed}}
    (run_dir / "chaos.json").write_text(json.dumps({**summary, "samples": state.samples}, indent=1))
    if state.samples:
        plot(state, records, started_epoch, run_dir / "chaos.png")
    (run_dir / "chaos.md").write_text(markdown(summary))
    print(markdown(summary))
    print(f"Report: {run_dir / 'chaos.md'}")
    return 0 if ok else 1


def markdown(summary: dict) -> str:
    c = summary["requests"]
    minutes = summary["duration_s"] / 60
    lines = [f"# Chaos soak: {minutes:.{0 if minutes == int(minutes) else 1}f} min, {summary['replicas']} replicas, "
             f"{summary['rate']:g} req/s ({PROFILE} mix), seed {summary['seed']}", "",
             f"`{summary['command']}` on {summary['machine']}", "",
             f"- requests sent {c['sent']} = answered {c['answered']} (cancelled by the client "
             f"{c['cancelled_by_client']}) + refused with an error {c['refused']} + ended with an error after tokens "
             f"{c['ended_with_error']} + interrupted at the stop {c['interrupted_at_stop']} + **lost {c['lost']}**",
             f"- retried by the client before their first token: {c['retried']} requests ({c['retries']} retries)",
             "", "| fault | replica | planned (s) | applied (s) | all UP again (s) |", "|---|---|---|---|---|"]
    for f in summary["faults"]:
        applied = "-" if f["started_s"] is None else f"{f['started_s']:.0f}"
        back = "-" if f["recovered_s"] is None else f"{f['recovered_s']:.0f}"
        lines.append(f"| {f['action']} | r{f['replica']} | {f['at_s']:.0f} | {applied} | {back} |")
    lines += ["", "| replica | faults | restarts | requests finished | RSS first / last / peak (MiB) | idle at end |",
              "|---|---|---|---|---|---|"]
    for r in summary["per_replica"]:
        idle = summary["idle_at_end"][r["name"]]
        rss = ("-" if r["rss_first_mib"] is None else
               f"{r['rss_first_mib']:.0f} / {r['rss_last_mib']:.0f} / {r['rss_peak_mib']:.0f}")
        lines.append(f"| {r['name']} | {len(r['faults'])} | {r['restarts']} | {r['finished_requests']} | {rss} | "
                     f"{'yes' if idle['idle'] else 'NO'} (KV used {idle['kv_used']}) |")
    for name in ("refused", "ended_with_error", "lost"):
        if c[f"{name}_reasons"]:
            lines += ["", f"{name.replace('_', ' ')}, by error:"]
            lines += [f"- {n} x `{reason}`" for reason, n in c[f"{name}_reasons"].items()]
    if summary["fault_errors"]:
        lines += ["", "faults that could not be applied: " + "; ".join(summary["fault_errors"])]
    lines += ["", "![chaos](chaos.png)", "", f"Verdict: {summary['verdict']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
