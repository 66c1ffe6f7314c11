"""The run report: Markdown table per scenario and overall, plots, summary.json.

    python -m loadtest report RUN_DIR [--slo-ttft S --slo-tpot S --slo-e2e S --min-attainment F]
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from loadtest import plots
from loadtest.analysis import GroupStats, Percentiles, Summary, summarize
from loadtest.profiles import DEFAULT_PROFILE, PROFILES, SLO
from loadtest.records import read_records
from loadtest.server_metrics import read_samples
from loadtest.slots import STEPS_FILE, read_steps
from loadtest.steps import attribution_lines, cpu_attribution, report_lines, step_stats

RECORDS = "records.jsonl"
SAMPLES = "metrics.jsonl"
RUN_META = "run.json"        # written by the runner (command, server, SLO)
LOCUST_META = "locust.json"  # written by the locustfile (what Locust ran)
SUMMARY = "summary.json"
STEP_STATS = "steps_summary.json"   # from the server's step records, when the run has them
REPORT = "report.md"
LATENCY_PNG = "latency_cdf.png"
TIMELINE_PNG = "timeline.png"


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, default=str))


def resolve_slo(run_dir: Path, override: SLO | None = None) -> SLO:
    if override is not None:
        return override
    meta = read_json(run_dir / RUN_META)
    if "slo" in meta:
        return SLO(**meta["slo"])
    profile = read_json(run_dir / LOCUST_META).get("profile", DEFAULT_PROFILE)
    return PROFILES[profile].slo


def _p(p: Percentiles, scale: float = 1.0, digits: int = 2) -> str:
    if not p.count:
        return "–"
    return " / ".join(f"{v * scale:.{digits}f}" for v in (p.p50, p.p90, p.p99, p.max))


def count(x: float | None) -> str:
    return "–" if x is None else f"{x:.0f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def _pct1(x: float) -> str:
    return f"{100 * x:.1f}%"   # for the verdict: 89.8% is not "90%, below 90%"


def table(summary: Summary) -> str:
    header = ["scenario", "requests", "failed", "cancelled", "prompt tok (mean)", "cached", "output tok (mean)",
              "TTFT s p50/p90/p99/max", "ITL ms p50/p90/p99/max", "TPOT ms p50/p90/p99/max",
              "E2E s p50/p90/p99/max", "req/s", "output tok/s", "goodput req/s (SLO met)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in summary.rows:
        n = max(row.requests, 1)
        name = f"**{row.name}**" if row is summary.overall else row.name
        cells = [name, str(row.requests), str(row.failed), str(row.cancelled), f"{row.prompt_tokens / n:.0f}",
                 _pct(row.cached_fraction), f"{row.output_tokens / n:.0f}", _p(row.ttft), _p(row.itl, 1000, 0),
                 _p(row.tpot, 1000, 0), _p(row.e2e), f"{row.request_throughput:.2f}",
                 f"{row.output_throughput:.1f}", f"{row.goodput:.2f} ({_pct(row.attainment)})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def priority_line(summary: Summary) -> str | None:
    premium, bulk = summary.row("priority:premium"), summary.row("priority:bulk")
    if not premium or not bulk or not premium.ttft.count or not bulk.ttft.count:
        return None
    return (f"Priority classes: premium TTFT p50 {premium.ttft.p50:.2f} s / p90 {premium.ttft.p90:.2f} s "
            f"vs bulk p50 {bulk.ttft.p50:.2f} s / p90 {bulk.ttft.p90:.2f} s "
            f"({premium.ttft.count} premium, {bulk.ttft.count} bulk requests).")


def server_lines(samples: list[dict], meta: dict) -> list[str]:
    rows = [s for s in samples if s.get("running") is not None]
    lines = []
    if rows:
        first, last = rows[0], rows[-1]

        def delta(key: str) -> float:
            return (last.get(key) or 0) - (first.get(key) or 0)

        lines.append(f"Server during the run ({len(rows)} scrapes of /metrics): peak running "
                     f"{max(s['running'] or 0 for s in rows):.0f}, peak waiting {max(s['waiting'] or 0 for s in rows):.0f}, "
                     f"peak KV usage {100 * max(s['kv_usage'] or 0 for s in rows):.0f}% of "
                     f"{first.get('kv_total') or 0:.0f} blocks, prefix-cache hit tokens {delta('prefix_hit_tokens'):.0f}, "
                     f"preemptions {delta('preemptions'):.0f}, generated tokens {delta('generation_tokens'):.0f}.")
        drafted, accepted = delta("spec_draft_tokens"), delta("spec_accepted_tokens")
        if drafted:
            verifications = delta("spec_verifications")
            lines.append(f"Speculative decoding: {drafted:.0f} draft tokens verified, {accepted:.0f} accepted "
                         f"({_pct(accepted / drafted)}), {delta('spec_emitted_tokens') / verifications:.2f} tokens "
                         f"emitted per request-step with drafts ({verifications:.0f} such request-steps).")
    lines += cluster_lines(rows)
    idle = meta.get("idle")
    if idle:
        lines.append(f"KV blocks used before the run {count(idle['before'])}, after it {count(idle['after'])} "
                     f"({'back to idle' if idle['before'] == idle['after'] else 'NOT back to idle'}).")
    if meta.get("server", {}).get("exit_code") is not None:
        lines.append(f"**tritonserver died during the run** (exit code {meta['server']['exit_code']}; see server.log).")
    return lines


def cluster_lines(rows: list[dict]) -> list[str]:
    """Per-replica view of a run behind a proxy: where requests went, how often each replica's
    prefix cache hit, how full its KV cache got (the samples' ``replicas`` rows)."""
    per_url: dict[str, list[dict]] = {}
    for row in rows:
        for url, replica_row in (row.get("replicas") or {}).items():
            per_url.setdefault(url, []).append(replica_row)
    if not per_url:
        return []
    lines = ["", "Cluster view (each replica's /metrics, first to last scrape of the run):", "",
             "| replica | requests finished | prefix-cache hit rate | peak KV usage | generated tokens | preemptions |",
             "|---|---|---|---|---|---|"]
    total_hit = total_queried = 0.0
    for url, samples in sorted(per_url.items()):
        first, last = samples[0], samples[-1]

        def delta(key: str) -> float:
            return (last.get(key) or 0) - (first.get(key) or 0)

        hit, queried = delta("prefix_hit_tokens"), delta("prefix_queried_tokens")
        total_hit, total_queried = total_hit + hit, total_queried + queried
        name = urlsplit(url).netloc or url
        lines.append(f"| {name} | {delta('finished_requests'):.0f} | "
                     f"{_pct(hit / queried) if queried else '-'} ({hit:.0f} / {queried:.0f} tokens) | "
                     f"{100 * max(s.get('kv_usage') or 0 for s in samples):.0f}% | {delta('generation_tokens'):.0f} | "
                     f"{delta('preemptions'):.0f} |")
    if total_queried:
        lines += ["", f"Prefix-cache hit rate over the cluster: {_pct(total_hit / total_queried)} of "
                      f"{total_queried:.0f} prompt tokens looked up."]
    return lines


def verdict(summary: Summary) -> str:
    overall, slo = summary.overall, summary.slo
    reasons = []
    if overall.failed:
        reasons.append(f"{overall.failed} failed requests")
    if overall.attainment is not None and overall.attainment < slo.min_attainment:
        reasons.append(f"SLO met by {_pct1(overall.attainment)} of requests, below {_pct1(slo.min_attainment)}")
    return "**PASS**" if summary.passed else "**FAIL**: " + "; ".join(reasons)


def slo_text(slo: SLO) -> str:
    parts = [f"TTFT ≤ {slo.ttft_s:g} s", f"TPOT ≤ {slo.tpot_s * 1000:g} ms"]
    if slo.e2e_s is not None:
        parts.append(f"E2E ≤ {slo.e2e_s:g} s")
    return ", ".join(parts) + f"; pass when ≥ {_pct(slo.min_attainment)} of requests meet it and none failed"


def describe_run(meta: dict, locust: dict) -> list[str]:
    lines = []
    if meta.get("command"):
        lines.append(f"Command: `{meta['command']}`")
    if meta.get("machine"):
        lines.append(f"Machine: {meta['machine']}")
    rate = locust.get("rate")
    mode = f"open loop, Poisson {rate:g} req/s, at most {locust.get('users')} in flight" if rate else \
        f"closed loop, {locust.get('users')} users"
    lines.append(f"Load: profile `{locust.get('profile')}`, {mode}, run time {locust.get('run_time')} s "
                 f"(+ drain up to {locust.get('stop_timeout')} s), seed {locust.get('seed')}, "
                 f"tags {locust.get('tags') or 'all'}.")
    server = meta.get("server")
    if server:
        params = ", ".join(f"{k}={v}" for k, v in server.get("params", {}).items()) or "config.pbtxt defaults"
        origin = "started by the load test" if server.get("started") else "already running"
        lines.append(f"Server: {locust.get('host')} ({origin}; {params}).")
    return lines


def write_report(run_dir: Path, slo: SLO | None = None) -> Summary:
    records = read_records(run_dir / RECORDS)
    summary = summarize(records, resolve_slo(run_dir, slo))
    samples = read_samples(run_dir / SAMPLES)
    meta, locust = read_json(run_dir / RUN_META), read_json(run_dir / LOCUST_META)
    plots.latency_cdfs(records, run_dir / LATENCY_PNG)
    plots.timeline(records, samples, summary.start, summary.window_s, run_dir / TIMELINE_PNG)
    interrupted = (f", {summary.interrupted} still running at the end of the drain (cancelled, left out)"
                   if summary.interrupted else "")
    parts = [f"# Load test report: {run_dir.name}", "", *describe_run(meta, locust), "",
             f"Window {summary.window_s:.1f} s (first scheduled send to last response){interrupted}. "
             f"SLO: {slo_text(summary.slo)}.", "",
             table(summary), "",
             "Latencies count from the scheduled send time; ITL is every gap between tokens; "
             "TPOT = (E2E − TTFT) / (tokens − 1); cancelled requests count for TTFT/ITL/tokens only.", ""]
    if line := priority_line(summary):
        parts += [line, ""]
    parts += [*server_lines(samples, meta), ""]
    if (run_dir / STEPS_FILE).exists():
        steps = read_steps(run_dir / STEPS_FILE)
        stats = step_stats(steps)
        parts += report_lines(stats)
        if (attribution := cpu_attribution(steps)) is not None and attribution.slow.steps:
            parts += attribution_lines(attribution)
        write_json(run_dir / STEP_STATS, stats.to_dict())
    parts += [f"Result: {verdict(summary)}", "",
              f"![TTFT and ITL CDFs]({LATENCY_PNG})", "", f"![Throughput, requests and KV cache]({TIMELINE_PNG})",
              "", "Locust's own report: `locust.html`, `locust_stats.json` (final), `locust_*.csv`; raw records: "
              "`records.jsonl`; engine gauges: `metrics.jsonl`.", ""]
    (run_dir / REPORT).write_text("\n".join(parts))
    write_json(run_dir / SUMMARY, summary.to_dict())
    return summary


def summary_from_dict(data: dict) -> Summary:
    """Inverse of Summary.to_dict (for comparisons of finished runs)."""
    rows = []
    for row in data["rows"]:
        fields = {k: v for k, v in row.items() if k in {f.name for f in dataclasses.fields(GroupStats)}}
        for key in ("ttft", "itl", "tpot", "e2e"):
            fields[key] = Percentiles(**fields[key])
        rows.append(GroupStats(**fields))
    return Summary(data["window_s"], data["start"], data["end"], data["interrupted"], SLO(**data["slo"]), rows)
