"""The latency-variance trade of chunked prefill, measured: long-prompt TTFT against the chat
streams' ITL p99, for several ``itl_target_ms`` and for the fixed token budget (0).

Runs the load test's ``mixed`` profile (chat from 8 users, 2-4k-token RAG prompts among them;
loadtest/profiles.py) once per target, each against a server it starts with that target and
otherwise default settings, same seed, one after another. Prints and writes, per target: the
chat requests' ITL p50/p99 and TTFT p50/p99, the long prompts' TTFT p50/p99, output tokens/s,
and the cost model's step-time prediction error (median, p90) from the server's step records;
draws the trade as a picture.

    python -m benchmarks.itl_tradeoff --targets 0,100,150,250 --duration 2m \\
        --json benchmarks/results/itl_tradeoff-cpu.json --plot docs/img/loadtest/itl_tradeoff.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.serving import cpu_info
from loadtest.__main__ import parse_duration
from loadtest.runner import ROOT, LoadOptions, run_load
from loadtest.steps import step_stats
from loadtest.slots import STEPS_FILE, read_steps

CHAT, LONG = "chat", "rag-long"


def row(summary: Any, name: str) -> Any:
    found = summary.row(name)
    if found is None:
        raise SystemExit(f"the run has no {name!r} requests: make it longer")
    return found


def measure(target: float, args: argparse.Namespace, parent: Path) -> dict[str, Any]:
    run_dir = parent / f"itl_target_ms={target:g}"
    options = LoadOptions(profile="mixed", server="start", duration_s=args.duration, seed=args.seed, run_dir=run_dir,
                          params={"itl_target_ms": f"{target:g}"}, command="benchmarks.itl_tradeoff")
    result = run_load(options)
    chat, long = row(result.summary, CHAT), row(result.summary, LONG)
    steps = step_stats(read_steps(run_dir / STEPS_FILE))
    ms = lambda x: None if x is None else round(x * 1e3, 1)  # noqa: E731
    return {
        "itl_target_ms": target, "run_dir": str(run_dir),
        "chat_requests": chat.completed, "long_requests": long.completed,
        "failed": result.summary.overall.failed,
        "chat_itl_p50_ms": ms(chat.itl.p50), "chat_itl_p99_ms": ms(chat.itl.p99),
        "chat_ttft_p50_ms": ms(chat.ttft.p50), "chat_ttft_p99_ms": ms(chat.ttft.p99),
        "long_ttft_p50_ms": ms(long.ttft.p50), "long_ttft_p99_ms": ms(long.ttft.p99),
        "output_tok_s": round(result.summary.overall.output_throughput, 1),
        "prediction_error_p50": steps.prediction_error.p50, "prediction_error_p90": steps.prediction_error.p90,
        "prefill_chunk_p50": steps.prefill_chunk_tokens.p50,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = ["itl_target_ms", "chat ITL p50", "chat ITL p99", "p99/p50", "chat TTFT p50", "chat TTFT p99",
            "long TTFT p50", "long TTFT p99", "out tok/s", "pred. error p50 / p90", "requests chat/long"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        error = ("–" if r["prediction_error_p50"] is None
                 else f"{100 * r['prediction_error_p50']:.0f}% / {100 * r['prediction_error_p90']:.0f}%")
        lines.append("| " + " | ".join([
            f"{r['itl_target_ms']:g}" + (" (fixed budget)" if r["itl_target_ms"] == 0 else ""),
            f"{r['chat_itl_p50_ms']:.0f} ms", f"{r['chat_itl_p99_ms']:.0f} ms",
            f"{r['chat_itl_p99_ms'] / r['chat_itl_p50_ms']:.1f}x",
            f"{r['chat_ttft_p50_ms']:.0f} ms", f"{r['chat_ttft_p99_ms']:.0f} ms",
            f"{r['long_ttft_p50_ms'] / 1e3:.2f} s", f"{r['long_ttft_p99_ms'] / 1e3:.2f} s",
            f"{r['output_tok_s']:.0f}", error, f"{r['chat_requests']}/{r['long_requests']}"]) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, machine: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    rows = sorted(rows, key=lambda r: r["chat_itl_p99_ms"])
    xs = [r["chat_itl_p99_ms"] for r in rows]
    ys = [r["long_ttft_p50_ms"] / 1e3 for r in rows]
    ax.plot(xs, ys, "o-", color="tab:blue")
    for r, x, y in zip(rows, xs, ys):
        label = "fixed budget (0)" if r["itl_target_ms"] == 0 else f"{r['itl_target_ms']:g} ms"
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 6), fontsize=9)
    ax.set_xlabel("chat streams' ITL p99 (ms)")
    ax.set_ylabel("long prompts' TTFT p50 (s)")
    ax.set_title(f"itl_target_ms: the latency-variance trade\n{machine}", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="0,100,150,250", help="itl_target_ms values, comma-separated")
    p.add_argument("--duration", type=parse_duration, default=120.0, help="per target, e.g. 2m")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", type=Path, default=None, help="default: runs/<time>-itl-tradeoff")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", type=Path, default=None)
    args = p.parse_args(argv)
    parent = args.run_dir or ROOT / "runs" / time.strftime("%Y%m%d-%H%M%S-itl-tradeoff")
    rows = [measure(float(t), args, parent) for t in args.targets.split(",")]
    from backend.model.cpu_features import detect

    cpu = {**cpu_info(), "cpu_isa": detect().describe()}
    machine = f"{cpu['cpu_model']}, {cpu['cpu_cores']} cores, {cpu['cpu_isa']}"
    print(f"host CPU: {machine}")
    print(table(rows))
    if args.plot:
        plot(rows, args.plot, machine)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {"targets": args.targets, "duration_s": args.duration, "seed": args.seed,
                                  "profile": "mixed", **cpu,
                                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
                       "results": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
