"""What the engine's step records say about a run: step times, prefill chunk sizes and how
well the scheduler's cost model predicted each step (``itl_target_ms`` > 0).

Each line of ``steps.jsonl`` (written by the server when ``step_trace_path`` is set; a load
test that starts its server sets it) has the step's rows ``[request, tokens, prefill?]``, its
measured time (``engine_ms``: Engine.step; ``ms``: the loop iteration around it) and the
predicted time (``predicted_ms``, null without a cost model). Newer lines also say where the
process's CPU time went (``threads_ms``, ``sys_ms``, ``steal_ms``: backend/engine/loop.CpuSnapshot);
``cpu_attribution`` compares the steps that ran over their prediction with the others on those.

    python -m loadtest.steps steps.jsonl [--over 1.05] [--min-ms MS] [--mixed] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from loadtest.analysis import Percentiles
from loadtest.slots import read_steps


@dataclass
class StepStats:
    steps: int
    steps_with_prefill: int
    step_ms: Percentiles
    prefill_chunk_tokens: Percentiles        # one sample per prefill row
    prefills_per_step: Percentiles           # over steps with a prefill
    prediction_error: Percentiles            # |predicted - measured| / measured, per step

    def to_dict(self) -> dict:
        return asdict(self)


def step_stats(steps: list[dict]) -> StepStats:
    measured = [s.get("engine_ms", s["ms"]) for s in steps]
    chunks = [tokens for s in steps for _, tokens, prefill in s["rows"] if prefill]
    per_step = [n for n in (sum(1 for _, _, prefill in s["rows"] if prefill) for s in steps) if n]
    errors = [abs(s["predicted_ms"] - m) / m for s, m in zip(steps, measured)
              if s.get("predicted_ms") is not None and m > 0]
    return StepStats(len(steps), len(per_step), Percentiles.of(measured), Percentiles.of(chunks),
                     Percentiles.of(per_step), Percentiles.of(errors))


def report_lines(stats: StepStats) -> list[str]:
    def pct(p: Percentiles, scale: float = 1.0, unit: str = "") -> str:
        if not p.count:
            return "–"
        return " / ".join(f"{v * scale:.3g}{unit}" for v in (p.p50, p.p90, p.p99, p.max))

    lines = ["## Engine steps (server's step records, `steps.jsonl`)", "",
             "| | p50 / p90 / p99 / max |", "|---|---|",
             f"| step time ({stats.steps} steps) | {pct(stats.step_ms, unit=' ms')} |",
             f"| prefill chunk tokens ({stats.prefill_chunk_tokens.count} chunks) | {pct(stats.prefill_chunk_tokens)} |",
             f"| prefills per step ({stats.steps_with_prefill} steps with one) | {pct(stats.prefills_per_step)} |"]
    if stats.prediction_error.count:
        lines.append(f"| step-time prediction error, \\|predicted − measured\\| / measured | "
                     f"{pct(stats.prediction_error, 100, '%')} |")
    return lines + [""]


@dataclass
class CpuShare:
    """Medians over a set of steps (ms per step)."""
    steps: int
    measured_over_predicted: float | None
    compute_on_core_ms: float | None    # the busiest thread: the engine's (or a kernel worker's)
    compute_waiting_ms: float | None    # the two busiest threads, runnable but off a core
    other_threads_ms: float | None      # every other thread of the process, on a core
    kernel_ms: float | None             # the process's time in the kernel (sys; None in older traces)
    stolen_ms: float | None             # the machine's stolen time (the hypervisor's)


@dataclass
class CpuAttribution:
    """Steps that ran ``over`` times their prediction or more, against the rest: if the slow
    ones' compute threads waited for a core, the process's own threads (or others on the
    machine) took it; if the host stole it, ``stolen_ms`` says so; if neither, the threads were
    on a core the whole step and simply ran slower."""
    over: float
    slow: CpuShare
    rest: CpuShare

    def to_dict(self) -> dict:
        return asdict(self)


def _median(values: list[float | None]) -> float | None:
    median = Percentiles.of([v for v in values if v is not None]).p50
    return None if median is None else round(median, 3)


def _cpu_share(steps: list[dict]) -> CpuShare:
    return CpuShare(
        len(steps),
        _median([s["engine_ms"] / s["predicted_ms"] for s in steps]),
        _median([s["threads_ms"][0][0] if s["threads_ms"] else 0.0 for s in steps]),
        _median([sum(t[1] for t in s["threads_ms"][:2]) for s in steps]),
        _median([sum(t[0] for t in s["threads_ms"][2:]) for s in steps]),
        _median([s.get("sys_ms") for s in steps]),
        _median([s["steal_ms"] for s in steps]))


def mixed_steps(steps: list[dict]) -> list[dict]:
    """The steps that held a prefill chunk beside decodes: the ones an ITL target sizes, and
    each one a gap in every decoding stream."""
    return [s for s in steps if any(prefill for _, _, prefill in s["rows"])
            and any(not prefill for _, _, prefill in s["rows"])]


def cpu_attribution(steps: list[dict], over: float = 1.05) -> CpuAttribution | None:
    """Over the predicted steps whose lines carry the CPU fields; None when there are none."""
    timed = [s for s in steps if s.get("predicted_ms") and "threads_ms" in s and "engine_ms" in s]
    if not timed:
        return None
    slow = [s for s in timed if s["engine_ms"] >= over * s["predicted_ms"]]
    rest = [s for s in timed if s["engine_ms"] < over * s["predicted_ms"]]
    return CpuAttribution(over, _cpu_share(slow), _cpu_share(rest))


def attribution_lines(attribution: CpuAttribution) -> list[str]:
    """A markdown table: the slow steps against the rest, one column each."""
    def cell(value: float | None, unit: str = " ms") -> str:
        return "–" if value is None else f"{value:.3g}{unit}"

    slow, rest = attribution.slow, attribution.rest
    rows = [("measured / predicted", slow.measured_over_predicted, rest.measured_over_predicted, ""),
            ("busiest thread on a core", slow.compute_on_core_ms, rest.compute_on_core_ms, " ms"),
            ("compute threads waiting for a core", slow.compute_waiting_ms, rest.compute_waiting_ms, " ms"),
            ("other threads on a core", slow.other_threads_ms, rest.other_threads_ms, " ms"),
            ("in the kernel (process)", slow.kernel_ms, rest.kernel_ms, " ms"),
            ("stolen by the hypervisor", slow.stolen_ms, rest.stolen_ms, " ms")]
    return ([f"Where the CPU time went, per step (medians): the {slow.steps} steps that ran {attribution.over:g}x "
             f"their prediction or more against the other {rest.steps}", "",
             "| | slow steps | the rest |", "|---|---|---|"]
            + [f"| {name} | {cell(a, unit)} | {cell(b, unit)} |" for name, a, b, unit in rows] + [""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="a step trace (EngineConfig.step_trace_path)")
    parser.add_argument("--over", type=float, default=1.05, help="a step this many times its prediction is slow")
    parser.add_argument("--min-ms", type=float, default=0.0, help="only steps that ran at least this long")
    parser.add_argument("--mixed", action="store_true", help="only steps with a prefill chunk beside decodes")
    parser.add_argument("--json", type=Path, help="write the statistics and the attribution here")
    args = parser.parse_args()
    steps = [s for s in read_steps(args.trace) if s.get("engine_ms", s["ms"]) >= args.min_ms]
    if args.mixed:
        steps = mixed_steps(steps)
    stats = step_stats(steps)
    attribution = cpu_attribution(steps, args.over)
    print("\n".join(report_lines(stats) + ([] if attribution is None else attribution_lines(attribution))))
    if args.json:
        args.json.write_text(json.dumps({"steps": stats.to_dict(),
                                         "cpu": None if attribution is None else attribution.to_dict()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
