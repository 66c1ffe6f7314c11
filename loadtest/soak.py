"""Soak test: the Locust mix at a steady open-loop rate for a long time (default 30 min),
with the cancel scenario in the mix and a bad request every few seconds, against a
supervised server this command starts. Records the RSS of tritonserver and its Python stub,
the KV gauges (checking their invariants), and every request's outcome; writes soak.md,
soak.json and soak.png in the run folder. Not part of ``make test``:

    make soak DURATION=30m [RATE=2.0]
    python -m loadtest.soak --duration 30m --rate 2.0

Exit code 0 only if no request was lost, no invariant broke, the server never restarted and
the RSS drift after warm-up stayed under the limit.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loadtest import report
from loadtest.__main__ import parse_duration
from loadtest.profiles import PROFILES
from loadtest.records import CANCELLED, FAILED, INTERRUPTED, OK, RequestRecord
from loadtest.runner import ROOT, LoadOptions, machine_description, run_load
from loadtest.server_metrics import sample
from server.launch import TritonServer, free_ports

PROFILE = "cpu"
# Errors that are refusals with a reason (admission control), not losses.
REFUSALS = ("waiting queue is full", "shutting down")
MAX_RSS_DRIFT = 0.05
# What the bad-request thread sends, in turn (HTTP generate bodies); each must get a 400.
BAD_BODIES = [
    b'{"text_input": "", "sampling_parameters": "{\\"max_tokens\\": 4}"}',
    b'{"text_input": "hi", "sampling_parameters": "{\\"max_tokens\\": -1}"}',
    b'{"text_input": "hi", "sampling_parameters": "{\\"max_tokens\\": 4,"}',
    b'{"text_input": "hi", "sampling_parameters": "{\\"repetition_penalty\\": 18446744073709551616}"}',
    b'{"text_input": "hi", "sampling_parameters": "{\\"max_tokens\\\\u0000\\": 4}"}',
    b'{"text_input": "hi", "sampling_parameters": "' + b"[" * 5000 + b"]" * 5000 + b'"}',
    b'{"input_ids": [-5, 3], "sampling_parameters": "{\\"max_tokens\\": 4}"}',
    b'{"text_input": "' + b"word " * 60000 + b'"}',
]


@dataclass
class SoakState:
    samples: list[dict] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    bad_sent: int = 0
    bad_refused: int = 0            # a 400 with a message
    bad_other: list[str] = field(default_factory=list)


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_invariants(row: dict, max_num_seqs: int) -> list[str]:
    problems = []
    used, total, cached = row.get("kv_used"), row.get("kv_total"), row.get("kv_cached")
    if None in (used, total, row.get("running"), row.get("waiting")):
        return ["metrics missing"]
    if not 0 <= used <= total:
        problems.append(f"kv_used {used} outside [0, {total}]")
    if cached is not None and cached > total:
        problems.append(f"kv_cached {cached} > kv_total {total}")
    if row["running"] > max_num_seqs:
        problems.append(f"running {row['running']} > max_num_seqs {max_num_seqs}")
    if row["running"] == 0 and row["waiting"] == 0 and used != 0:
        problems.append(f"idle but kv_used = {used}")
    return problems


def sampler(server: TritonServer, state: SoakState, stop: threading.Event, interval: float, max_num_seqs: int) -> None:
    while not stop.wait(interval):
        try:
            row = sample(server.metrics_url)
        except OSError as exc:
            state.violations.append(f"{time.time():.0f}: metrics unreachable: {exc}")
            continue
        stubs = server.stub_pids()
        row["rss_server"] = rss_bytes(server.process.pid)
        row["rss_stub"] = sum(rss_bytes(p) or 0 for p in stubs) if stubs else None
        row["restarts"] = server.restarts
        state.samples.append(row)
        state.violations += [f"{row['t']:.0f}: {p}" for p in check_invariants(row, max_num_seqs)]


def bad_requests(server: TritonServer, state: SoakState, stop: threading.Event, interval: float) -> None:
    i = 0
    while not stop.wait(interval):
        body = BAD_BODIES[i % len(BAD_BODIES)]
        i += 1
        state.bad_sent += 1
        request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=body)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                state.bad_other.append(f"{body[:60]!r}: accepted ({response.status})")
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read() or b"{}").get("error", "")
            except ValueError:
                message = ""
            if exc.code == 400 and message:
                state.bad_refused += 1
            else:
                state.bad_other.append(f"{body[:60]!r}: {exc.code} {message[:100]}")
        except OSError as exc:
            state.bad_other.append(f"{body[:60]!r}: {exc}")


def rss_drift(samples: list[dict], key: str, warmup_s: float, window_s: float = 60.0) -> dict:
    """Mean RSS over the first window after warm-up vs the last window."""
    rows = [r for r in samples if r.get(key)]
    if not rows:
        return {"start": None, "end": None, "drift": None}
    t0 = rows[0]["t"]
    after = [r for r in rows if r["t"] - t0 >= warmup_s] or rows
    first = [r[key] for r in after if r["t"] - after[0]["t"] <= window_s]
    last = [r[key] for r in after if after[-1]["t"] - r["t"] <= window_s]
    start, end = sum(first) / len(first), sum(last) / len(last)
    return {"start": start, "end": end, "drift": (end - start) / start, "peak": max(r[key] for r in rows)}


def outcomes(run_dir: Path) -> dict:
    records = [RequestRecord.from_dict(json.loads(line))
               for line in (run_dir / report.RECORDS).read_text().splitlines() if line.strip()]
    answered = [r for r in records if r.outcome in (OK, CANCELLED)]
    failed = [r for r in records if r.outcome == FAILED]
    refused = [r for r in failed if r.error and any(m in r.error for m in REFUSALS)]
    # Everything else that failed is a loss: no final response (a timeout, a broken stream) or
    # an error that is not a refusal (INTERNAL).
    lost = [r for r in failed if r not in refused]
    interrupted = [r for r in records if r.outcome == INTERRUPTED]
    return {"sent": len(records), "answered": len(answered), "cancelled": sum(r.outcome == CANCELLED for r in records),
            "refused": len(refused), "refusal_reasons": sorted({(r.error or "")[:120] for r in refused})[:10],
            "lost": len(lost), "lost_errors": sorted({(r.error or "no error")[:160] for r in lost})[:10],
            "interrupted_at_stop": len(interrupted), "output_tokens": sum(r.output_tokens for r in records)}


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = samples[0]["t"]
    minutes = [(r["t"] - t0) / 60 for r in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for key, label in (("rss_server", "tritonserver"), ("rss_stub", "Python stub (engine)")):
        top.plot(minutes, [(r.get(key) or 0) / 2**20 for r in samples], label=label)
    top.set_ylabel("RSS (MiB)")
    top.legend()
    top.set_title("Soak: resident memory and KV cache over time")
    bottom.plot(minutes, [r.get("kv_used") or 0 for r in samples], label="KV blocks used")
    bottom.plot(minutes, [r.get("running") or 0 for r in samples], label="running requests")
    bottom.set_xlabel("minutes")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=parse_duration, default=parse_duration("30m"))
    parser.add_argument("--rate", type=float, default=2.0, help="requests/s, open loop (Poisson)")
    parser.add_argument("--bad-every", type=float, default=5.0, help="seconds between bad requests")
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument("--warmup", type=parse_duration, default=parse_duration("5m"),
                        help="RSS drift is measured from the end of the warm-up")
    parser.add_argument("--run-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    run_dir = args.run_dir or ROOT / "runs" / time.strftime("%Y%m%d-%H%M%S-soak")
    run_dir.mkdir(parents=True, exist_ok=True)
    params = dict(PROFILES[PROFILE].server_params)
    max_num_seqs = int(params.get("max_num_seqs", 64))
    server = TritonServer(*free_ports(3), params=params, log_file=run_dir / "server.log", supervise=True)
    print(f"starting a supervised tritonserver ({params}) ...", flush=True)
    server.start()
    state, stop = SoakState(), threading.Event()
    threads = [threading.Thread(target=sampler, args=(server, state, stop, args.sample_every, max_num_seqs), daemon=True),
               threading.Thread(target=bad_requests, args=(server, state, stop, args.bad_every), daemon=True)]
    for thread in threads:
        thread.start()
    command = "python -m loadtest.soak " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        result = run_load(LoadOptions(profile=PROFILE, host=server.grpc_url, metrics_url=server.metrics_url,
                                      server="existing", rate=args.rate, duration_s=args.duration,
                                      run_dir=run_dir / "load", command=command))
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        server.stop()
    counts = outcomes(run_dir / "load")
    drift = {key: rss_drift(state.samples, key, args.warmup) for key in ("rss_server", "rss_stub")}
    summary = {"command": command, "machine": machine_description(), "duration_s": args.duration, "rate": args.rate,
               "requests": counts, "bad_requests": {"sent": state.bad_sent, "refused_400": state.bad_refused,
                                                    "other": state.bad_other[:20]},
               "rss": drift, "invariant_violations": state.violations[:50],
               "num_invariant_violations": len(state.violations), "server_restarts": server.restarts,
               "idle_after": result.idle_after, "back_to_idle": result.back_to_idle}
    (run_dir / "soak.json").write_text(json.dumps({**summary, "samples": state.samples}, indent=1))
    if state.samples:
        plot(state.samples, run_dir / "soak.png")
    ok = (counts["lost"] == 0 and not state.violations and state.bad_refused == state.bad_sent and server.restarts == 0
          and all(d["drift"] is not None and abs(d["drift"]) < MAX_RSS_DRIFT for d in drift.values()))
    lines = [f"# Soak: {args.duration / 60:.0f} min at {args.rate:g} req/s ({PROFILE} mix), {time.strftime('%Y-%m-%d')}",
             "", f"`{command}` on {summary['machine']}", "",
             f"- requests sent {counts['sent']} = answered {counts['answered']} (of which cancelled by the client "
             f"{counts['cancelled']}) + refused with a reason {counts['refused']} + interrupted at the stop "
             f"{counts['interrupted_at_stop']}; lost {counts['lost']}",
             f"- bad requests: {state.bad_sent} sent, {state.bad_refused} refused with 400 and a message, "
             f"{len(state.bad_other)} otherwise",
             *(f"- RSS {key[4:]}: {d['start'] / 2**20:.0f} MiB after warm-up -> {d['end'] / 2**20:.0f} MiB at the end "
               f"(drift {d['drift'] * 100:+.2f}%, peak {d['peak'] / 2**20:.0f} MiB)"
               for key, d in drift.items() if d["drift"] is not None),
             f"- KV invariant violations: {len(state.violations)}; server restarts: {server.restarts}; "
             f"back to idle after: {result.back_to_idle}",
             f"- output tokens: {counts['output_tokens']}", "", "![soak](soak.png)", "",
             f"Verdict: {'PASS' if ok else 'FAIL'}"]
    (run_dir / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nReport: {run_dir / 'soak.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
