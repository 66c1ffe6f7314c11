"""Side-by-side report of the same seeded mix against batching=continuous and =static."""

from __future__ import annotations

from pathlib import Path

from loadtest import plots, report
from loadtest.analysis import GroupStats, Summary
from loadtest.records import read_records
from loadtest.slots import STEPS_FILE, read_steps, slot_timeline

MODES = ("continuous", "static")
COMPARE_MD = "compare.md"
COMPARE_PNG = "compare.png"
SLOTS_PNG = "slots.png"

# (label, attribute path in the overall row)
METRICS: list[tuple[str, str]] = [
    ("completed requests", "completed"),
    ("output tokens", "output_tokens"),
    ("output tokens/s", "output_throughput"),
    ("requests/s", "request_throughput"),
    ("goodput req/s", "goodput"),
    ("TTFT p50 (s)", "ttft.p50"),
    ("TTFT p99 (s)", "ttft.p99"),
    ("ITL p50 (ms)", "itl.p50"),
    ("TPOT p50 (ms)", "tpot.p50"),
    ("E2E p50 (s)", "e2e.p50"),
    ("E2E p99 (s)", "e2e.p99"),
]
MILLISECONDS = {"itl.p50", "tpot.p50"}


def _get(row: GroupStats, path: str) -> float | None:
    value: object = row
    for part in path.split("."):
        value = getattr(value, part)
    if value is None:
        return None
    return float(value) * (1000 if path in MILLISECONDS else 1)  # type: ignore[arg-type]


def _fmt(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:.0f}" if abs(x) >= 100 or float(x).is_integer() else f"{x:.2f}"


def comparison_table(summaries: dict[str, Summary]) -> str:
    first, second = MODES
    lines = [f"| metric (all scenarios) | {first} | {second} | {first} / {second} |", "|---|---|---|---|"]
    for label, path in METRICS:
        a, b = (_get(summaries[m].overall, path) for m in MODES)
        ratio = f"{a / b:.2f}x" if a is not None and b else "–"
        lines.append(f"| {label} | {_fmt(a)} | {_fmt(b)} | {ratio} |")
    return "\n".join(lines)


def headline(summaries: dict[str, Summary]) -> str:
    c, s = (summaries[m].overall for m in MODES)
    parts = []
    if s.output_throughput:
        parts.append(f"continuous batching delivered {c.output_throughput / s.output_throughput:.2f}x the "
                     f"output-token throughput of static batching")
    if c.ttft.p50 and s.ttft.p50 and c.ttft.p99 and s.ttft.p99:
        parts.append(f"TTFT p50 {s.ttft.p50 / c.ttft.p50:.1f}x and p99 {s.ttft.p99 / c.ttft.p99:.1f}x lower")
    return ("Same seeded mix: " + ", with ".join(parts) + ".") if parts else ""


def write_comparison(parent: Path, run_dirs: dict[str, Path]) -> Path:
    summaries = {m: report.summary_from_dict(report.read_json(d / report.SUMMARY)) for m, d in run_dirs.items()}
    runs = {}
    for mode, run_dir in run_dirs.items():
        summary = summaries[mode]
        runs[f"batching={mode}"] = (read_records(run_dir / report.RECORDS), summary.start, summary.window_s)
    plots.comparison(runs, parent / COMPARE_PNG)
    slots = slot_section(parent, run_dirs, summaries)
    meta = report.read_json(run_dirs[MODES[0]] / report.RUN_META)
    locust = report.read_json(run_dirs[MODES[0]] / report.LOCUST_META)
    parts = [f"# Continuous vs static batching: {parent.name}", "", *report.describe_run(meta, locust), "",
             "Both runs: the same profile, seed, users and duration; only the engine's `batching` parameter differs.",
             "", comparison_table(summaries), "", headline(summaries), "", f"![comparison]({COMPARE_PNG})", "",
             *slots,
             "Per-run reports: " + ", ".join(f"[{m}]({run_dirs[m].name}/{report.REPORT})" for m in MODES), ""]
    path = parent / COMPARE_MD
    path.write_text("\n".join(parts))
    return path


def slot_section(parent: Path, run_dirs: dict[str, Path], summaries: dict[str, Summary]) -> list[str]:
    """The slot timeline of both runs from the servers' step records (loadtest/slots.py), with
    each mode's measured occupancy next to the throughput ratio. Empty when a run has none."""
    if not all((run_dirs[m] / STEPS_FILE).exists() for m in MODES):
        return []
    timelines = {f"batching={m}": slot_timeline(read_steps(run_dirs[m] / STEPS_FILE)) for m in MODES}
    plots.slot_timelines(timelines, parent / SLOTS_PNG)
    (c, s) = (timelines[f"batching={m}"].occupancy for m in MODES)
    (tc, ts) = (summaries[m].overall.output_throughput for m in MODES)
    ratio = f"{tc / ts:.2f}x" if tc and ts else "–"
    return [f"Slot occupancy (busy slot-steps over all, from the engine's step records): continuous "
            f"**{c:.0%}**, static **{s:.0%}**; output tokens/s continuous / static: **{ratio}**.", "",
            f"![slots]({SLOTS_PNG})", ""]
