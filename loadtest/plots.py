"""PNG plots of a run (latency CDFs, timeline) and of a continuous-vs-static comparison."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # files only; no display on servers and CI

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadtest.analysis import OVERALL, in_flight_series, request_metrics, row_order, throughput_series  # noqa: E402
from loadtest.records import INTERRUPTED, RequestRecord  # noqa: E402
from loadtest.slots import SlotTimeline  # noqa: E402

DPI = 90


def _cdf(ax: plt.Axes, values: list[float], label: str, **style) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values))
    ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=f"{label} (n={xs.size})", **style)


def _latencies(records: list[RequestRecord]) -> dict[str, tuple[list[float], list[float]]]:
    """name -> (TTFTs, ITLs), plus the overall row."""
    by_name: dict[str, tuple[list[float], list[float]]] = {}
    for record in records:
        if record.outcome == INTERRUPTED:
            continue
        m = request_metrics(record)
        for name in (record.name, OVERALL):
            ttft, itl = by_name.setdefault(name, ([], []))
            if m.ttft is not None:
                ttft.append(m.ttft)
            itl.extend(m.itl)
    return by_name


def latency_cdfs(records: list[RequestRecord], path: Path) -> Path:
    data = _latencies(records)
    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=(11, 4))
    for name in row_order(set(data) - {OVERALL}) + [OVERALL]:
        ttft, itl = data[name]
        style = {"color": "black", "linewidth": 2} if name == OVERALL else {}
        _cdf(ax_ttft, ttft, name, **style)
        _cdf(ax_itl, [v * 1000 for v in itl], name, **style)
    ax_ttft.set(title="Time to first token", xlabel="seconds", ylabel="fraction of requests", xscale="log")
    ax_itl.set(title="Inter-token latency (every gap)", xlabel="milliseconds", ylabel="fraction of gaps", xscale="log")
    for ax in (ax_ttft, ax_itl):
        ax.grid(True, which="both", alpha=0.3)
    ax_ttft.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _bin_seconds(window_s: float) -> float:
    return max(1.0, round(window_s / 60))


def timeline(records: list[RequestRecord], samples: list[dict], start: float, window_s: float, path: Path) -> Path:
    fig, (ax_tok, ax_run, ax_kv) = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    t, rate = throughput_series(records, start, _bin_seconds(window_s))
    ax_tok.step(t, rate, where="mid")
    ax_tok.set(title="Output tokens/s (client-side)", ylabel="tokens/s")
    t, flight = in_flight_series(records, start, 0.5)
    ax_run.step(t, flight, where="post", label="in flight (client)", alpha=0.7)
    rows = [s for s in samples if s.get("running") is not None]
    ts = np.array([s["t"] - start for s in rows])
    if rows:
        ax_run.plot(ts, [s["running"] for s in rows], label="running (server)")
        ax_run.plot(ts, [s["waiting"] or 0 for s in rows], label="waiting (server)")
        ax_kv.plot(ts, [100 * (s["kv_usage"] or 0) for s in rows], label="KV blocks in use")
        if all(s.get("kv_cached") is not None and s.get("kv_total") for s in rows):
            ax_kv.plot(ts, [100 * s["kv_cached"] / s["kv_total"] for s in rows], label="blocks in the prefix cache",
                       linestyle="--")
    ax_run.set(title="Requests", ylabel="requests")
    ax_kv.set(title="KV cache (scraped from /metrics)", ylabel="% of blocks", xlabel="seconds since the first request")
    for ax in (ax_run, ax_kv):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    for ax in (ax_tok, ax_run, ax_kv):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def comparison(runs: dict[str, tuple[list[RequestRecord], float, float]], path: Path) -> Path:
    """runs: label -> (records, start, window_s). TTFT CDF and output tokens/s over time."""
    fig, (ax_ttft, ax_tok) = plt.subplots(1, 2, figsize=(11, 4))
    for label, (records, start, window_s) in runs.items():
        ttft, _ = _latencies(records).get(OVERALL, ([], []))
        _cdf(ax_ttft, ttft, label)
        t, rate = throughput_series(records, start, _bin_seconds(window_s))
        ax_tok.step(t, rate, where="mid", label=label)
    ax_ttft.set(title="Time to first token (all scenarios)", xlabel="seconds", ylabel="fraction of requests",
                xscale="log")
    ax_tok.set(title="Output tokens/s", xlabel="seconds since the first request", ylabel="tokens/s")
    for ax in (ax_ttft, ax_tok):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def slot_timelines(timelines: dict[str, SlotTimeline], path: Path, max_steps: int = 240) -> Path:
    """Slot x engine step for each mode (loadtest/slots.py): one colour per request, white where
    the slot is idle, a dot where the slot computed a prefill chunk. A window of ``max_steps``
    steps from the middle of the run (the whole run is thousands of steps)."""
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 2.6 * len(timelines)), squeeze=False)
    palette = plt.get_cmap("tab20")
    for ax, (label, timeline) in zip(axes[:, 0], timelines.items()):
        steps = timeline.request.shape[1]
        start = max(0, steps // 2 - max_steps // 2)
        window = timeline.request[:, start:start + max_steps]
        image = np.ones(window.shape + (3,))
        busy = window >= 0
        image[busy] = np.asarray([palette(i % 20)[:3] for i in window[busy]])
        ax.imshow(image, aspect="auto", interpolation="nearest",
                  extent=(start - 0.5, start + window.shape[1] - 0.5, window.shape[0] - 0.5, -0.5))
        slots, cols = np.nonzero(timeline.prefill[:, start:start + max_steps])
        ax.scatter(cols + start, slots, s=4, c="black", marker=".", label="prefill chunk")
        ax.set_title(f"{label}: slot occupancy {timeline.occupancy:.0%} over the whole run "
                     f"({timeline.request.shape[0]} slots, {steps} steps)", fontsize=10)
        ax.set_ylabel("slot")
        ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("engine step (white: slot idle)")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
