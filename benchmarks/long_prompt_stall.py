"""A long prompt arriving among decoding streams: how long do the streams stall, and how long
do short prompts sent just after it wait for their first token?

The scenario of the mixed-length issue, over Triton's HTTP generate_stream:
  1. alone: one ``--long-len``-token prompt on an idle server, its TTFT;
  2. mixed: ``--streams`` requests decoding (64-token prompts, ``--stream-tokens`` outputs); after
     ``--settle`` seconds a fresh ``--long-len``-token prompt arrives, and ``--short-delay`` s
     later ``--shorts`` short prompts (``--short-len`` tokens) arrive at once.
Reported per repetition: the streams' inter-token gaps while the long prompt prefills (from its
send to its first token; raw gaps between token events, a merged delta counts once, as the user
sees it) at p50/p99/max, their gaps before it arrived (p50), the short prompts' TTFT (max), the
long prompt's TTFT and its ratio to the alone TTFT. Every prompt is a fresh set of random token
ids (no prefix-cache hit between phases or repetitions). Greedy, ignore_eos.

Against a running server:
    python -m benchmarks.long_prompt_stall --server 127.0.0.1:8000
Or one server per engine configuration, started in turn (the figures of docs/loadtest.md):
    python -m benchmarks.long_prompt_stall --launch itl_target_ms=150 --launch itl_target_ms=0 \\
        --json benchmarks/results/long_prompt_stall-cpu.json
With ``step_trace_path=FILE`` in a launch's parameters (a fresh file), the steps that held a
chunk beside decodes are split into those that ran 5% or more over their prediction and the rest,
with where each set's CPU time went (loadtest/steps.py): printed and kept in the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.serving import Request, Result, Server, cpu_info, our_server, parse_params, percentile, send
from loadtest.slots import read_steps
from loadtest.steps import CpuAttribution, attribution_lines, cpu_attribution, mixed_steps

ID_RANGE = (1000, 40000)


@dataclass
class Repetition:
    long_ttft_alone_ms: float
    long_ttft_ms: float
    long_ttft_ratio: float
    stream_gap_before_p50_ms: float
    stream_gap_p50_ms: float          # while the long prompt prefills
    stream_gap_p99_ms: float
    stream_gap_max_ms: float
    num_gaps: int
    short_ttft_ms: list[float]
    errors: list[str]


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*ID_RANGE) for _ in range(length)]


def in_thread(server: Server, request: Request, timeout: float, results: list[Result]) -> threading.Thread:
    def run() -> None:
        results.append(send(server, request, timeout))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)


def run_once(server: Server, args: argparse.Namespace, rng: random.Random) -> Repetition:
    errors: list[str] = []
    alone = send(server, Request(prompt(rng, args.long_len), args.long_tokens), args.timeout)
    if not alone.ok:
        errors.append(f"alone: {alone.error}")
    time.sleep(0.5)

    streams: list[Result] = []
    threads = [in_thread(server, Request(prompt(rng, 64), args.stream_tokens), args.timeout, streams)
               for _ in range(args.streams)]
    time.sleep(args.settle)
    longs: list[Result] = []
    threads.append(in_thread(server, Request(prompt(rng, args.long_len), args.long_tokens), args.timeout, longs))
    time.sleep(args.short_delay)
    shorts: list[Result] = []
    threads += [in_thread(server, Request(prompt(rng, args.short_len), args.short_tokens), args.timeout, shorts)
                for _ in range(args.shorts)]
    for thread in threads:
        thread.join()
    errors += [r.error for r in streams + longs + shorts if not r.ok]

    long = longs[0]
    start, first = long.sent, long.events[0][0] if long.events else long.end
    before, during = [], []
    for stream in streams:
        if stream.events and stream.events[-1][0] < first:
            errors.append("a stream ended before the long prompt's first token: raise --stream-tokens")
        times = [t for t, _ in stream.events]
        for t_prev, t in zip(times, times[1:]):
            if t <= start:
                before.append(t - t_prev)
            elif t_prev < first:
                during.append(t - t_prev)
    alone_ttft = alone.events[0][0] - alone.sent if alone.events else float("nan")
    long_ttft = first - start
    return Repetition(
        long_ttft_alone_ms=ms(alone_ttft), long_ttft_ms=ms(long_ttft), long_ttft_ratio=round(long_ttft / alone_ttft, 2),
        stream_gap_before_p50_ms=ms(percentile(before, 50)), stream_gap_p50_ms=ms(percentile(during, 50)),
        stream_gap_p99_ms=ms(percentile(during, 99)), stream_gap_max_ms=ms(max(during, default=float("nan"))),
        num_gaps=len(during), short_ttft_ms=[ms(r.events[0][0] - r.sent) if r.events else float("nan") for r in shorts],
        errors=list(dict.fromkeys(errors))[:5])


def run_config(server: Server, args: argparse.Namespace, label: str) -> dict[str, Any]:
    warm_rng = random.Random("warm-up")
    for _ in range(2):
        send(server, Request(prompt(warm_rng, 600), 4), args.timeout)
    reps = []
    for i in range(args.repeats):
        rep = run_once(server, args, random.Random(f"{args.seed}-{i}"))
        reps.append(rep)
        print(f"{label} #{i}: " + json.dumps(asdict(rep)), file=sys.stderr, flush=True)
    return {"config": label, "repetitions": [asdict(r) for r in reps]}


def mixed_step_cpu(trace: Path) -> CpuAttribution | None:
    """Where the CPU went in the steps that held a chunk beside decodes (the stream gaps), slow
    ones against the rest (loadtest/steps.py): from a launch with ``step_trace_path``, whose
    file should be fresh (the server appends)."""
    return cpu_attribution(mixed_steps(read_steps(trace)))


def table(results: list[dict[str, Any]]) -> str:
    head = ["config", "rep", "stream gap p50 before", "gap p50 during", "gap p99 during", "gap max", "short TTFT max",
            "long TTFT", "alone", "ratio"]
    rows = [head, ["---"] * len(head)]
    for result in results:
        for i, r in enumerate(result["repetitions"]):
            rows.append([result["config"], str(i), f"{r['stream_gap_before_p50_ms']:.0f}", f"{r['stream_gap_p50_ms']:.0f}",
                         f"{r['stream_gap_p99_ms']:.0f}", f"{r['stream_gap_max_ms']:.0f}",
                         f"{max(r['short_ttft_ms']):.0f}", f"{r['long_ttft_ms']:.0f}",
                         f"{r['long_ttft_alone_ms']:.0f}", f"{r['long_ttft_ratio']:.2f}"])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows) + "\n(milliseconds)"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", help="HOST:PORT of a running server's HTTP endpoint")
    where.add_argument("--launch", action="append", metavar="KEY=VALUE[,KEY=VALUE]",
                       help="start our server with these engine parameters (repeatable: one server each, in turn)")
    p.add_argument("--model", default="llm")
    p.add_argument("--long-len", type=int, default=3096)
    p.add_argument("--long-tokens", type=int, default=16)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--stream-tokens", type=int, default=400)
    p.add_argument("--settle", type=float, default=2.0, help="seconds the streams decode before the long prompt")
    p.add_argument("--shorts", type=int, default=4)
    p.add_argument("--short-len", type=int, default=40)
    p.add_argument("--short-tokens", type=int, default=16)
    p.add_argument("--short-delay", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cpu = cpu_info()
    print(f"host CPU: {cpu['cpu_model']} ({cpu['cpu_cores']} cores)", flush=True)
    results = []
    attributions: list[tuple[str, CpuAttribution]] = []   # per launch that traced its steps
    if args.server:
        host, port = args.server.rsplit(":", 1)
        results.append(run_config(Server("server", "triton", host, int(port), args.model), args, args.server))
    else:
        for spec in args.launch:
            params = parse_params(spec)
            with our_server(params) as http_port:
                results.append(run_config(Server("ours", "triton", "127.0.0.1", http_port, args.model), args, spec))
            if params.get("step_trace_path") and (attribution := mixed_step_cpu(Path(params["step_trace_path"]))):
                attributions.append((spec, attribution))
                results[-1]["mixed_step_cpu"] = attribution.to_dict()
    print(table(results))
    for spec, attribution in attributions:
        print("\n".join([f"{spec}, steps with a chunk beside decodes:", "", *attribution_lines(attribution)]))
    if args.json:
        config = {**{k: v for k, v in vars(args).items() if k not in ("json",)}, **cpu,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        with open(args.json, "w") as f:
            json.dump({"config": config, "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
