"""LLM serving metrics from the raw records. Definitions (docs/loadtest.md repeats them):

- Latencies start at the request's *scheduled* send time (open loop: a late send counts).
- TTFT: first token-carrying response - scheduled time.
- ITL: every gap between consecutive tokens. A response carrying k tokens after a gap g
  contributes k gaps of g/k (it held k tokens back that long); the first response's extra
  tokens contribute gaps of 0. So a request with n tokens has n - 1 gaps, summing to
  (last token - first token).
- TPOT: (end-to-end latency - TTFT) / (tokens - 1), for completed requests with >= 2 tokens.
- E2E: final response - scheduled time, for completed requests.
- Cancelled requests count for TTFT, ITL and tokens, not for TPOT/E2E or goodput (their end
  is the client's choice). Interrupted ones (still running when the drain ran out) count
  for nothing. Failed ones count against goodput.
- Throughput and goodput divide by the run window: first scheduled send to last end.
- A request is good when it completed and met every SLO; attainment = good / (completed +
  failed); goodput = good / window.
Percentiles are numpy's linear interpolation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from loadtest.profiles import SCENARIOS, SLO
from loadtest.records import CANCELLED, FAILED, INTERRUPTED, OK, RequestRecord

OVERALL = "overall"


@dataclass
class Percentiles:
    count: int = 0
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None
    mean: float | None = None

    @classmethod
    def of(cls, values: list[float]) -> "Percentiles":
        if not values:
            return cls()
        arr = np.asarray(values, dtype=float)
        p50, p90, p99 = (float(v) for v in np.percentile(arr, [50, 90, 99]))
        return cls(len(values), p50, p90, p99, float(arr.max()), float(arr.mean()))


@dataclass
class RequestMetrics:
    ttft: float | None
    itl: list[float]
    tpot: float | None
    e2e: float | None


def token_times(record: RequestRecord) -> list[float]:
    """Arrival time of every token (a k-token response gives k equal times)."""
    return [t for t, n in record.responses for _ in range(int(n))]


def request_metrics(record: RequestRecord) -> RequestMetrics:
    carrying = [(t, int(n)) for t, n in record.responses if n > 0]
    ttft = carrying[0][0] - record.scheduled_at if carrying else None
    itl: list[float] = []
    if carrying:
        itl += [0.0] * (carrying[0][1] - 1)
        for (prev, _), (t, n) in zip(carrying, carrying[1:]):
            itl += [(t - prev) / n] * n
    completed = record.outcome == OK and record.end_at is not None
    e2e = record.end_at - record.scheduled_at if completed else None
    tokens = record.output_tokens
    tpot = (e2e - ttft) / (tokens - 1) if completed and ttft is not None and tokens >= 2 else None
    return RequestMetrics(ttft, itl, tpot, e2e)


def is_good(metrics: RequestMetrics, record: RequestRecord, slo: SLO) -> bool:
    return (record.outcome == OK and metrics.ttft is not None and metrics.ttft <= slo.ttft_s
            and (metrics.tpot is None or metrics.tpot <= slo.tpot_s)
            and (slo.e2e_s is None or (metrics.e2e is not None and metrics.e2e <= slo.e2e_s)))


@dataclass
class GroupStats:
    name: str
    requests: int = 0            # ok + failed + cancelled
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: Percentiles = field(default_factory=Percentiles)
    itl: Percentiles = field(default_factory=Percentiles)
    tpot: Percentiles = field(default_factory=Percentiles)
    e2e: Percentiles = field(default_factory=Percentiles)
    request_throughput: float = 0.0   # completed requests / s
    output_throughput: float = 0.0    # output tokens / s
    good: int = 0
    goodput: float = 0.0              # good requests / s
    attainment: float | None = None   # good / (completed + failed)

    @property
    def cached_fraction(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


def run_window(records: list[RequestRecord]) -> tuple[float, float]:
    counted = [r for r in records if r.outcome != INTERRUPTED]
    if not counted:
        return 0.0, 0.0
    start = min(r.scheduled_at for r in counted)
    end = max(max([r.end_at or 0.0] + [t for t, _ in r.responses]) for r in counted)
    return start, max(end, start)


def group_stats(name: str, records: list[RequestRecord], slo: SLO, window_s: float) -> GroupStats:
    stats = GroupStats(name)
    ttft: list[float] = []
    itl: list[float] = []
    tpot: list[float] = []
    e2e: list[float] = []
    for record in records:
        if record.outcome == INTERRUPTED:
            continue
        stats.requests += 1
        stats.completed += record.outcome == OK
        stats.failed += record.outcome == FAILED
        stats.cancelled += record.outcome == CANCELLED
        stats.prompt_tokens += record.prompt_tokens or 0
        stats.cached_tokens += record.cached_tokens or 0
        stats.output_tokens += record.output_tokens
        m = request_metrics(record)
        if m.ttft is not None:
            ttft.append(m.ttft)
        itl += m.itl
        if m.tpot is not None:
            tpot.append(m.tpot)
        if m.e2e is not None:
            e2e.append(m.e2e)
        stats.good += is_good(m, record, slo)
    stats.ttft, stats.itl, stats.tpot, stats.e2e = (Percentiles.of(v) for v in (ttft, itl, tpot, e2e))
    if window_s > 0:
        stats.request_throughput = stats.completed / window_s
        stats.output_throughput = stats.output_tokens / window_s
        stats.goodput = stats.good / window_s
    judged = stats.completed + stats.failed
    stats.attainment = stats.good / judged if judged else None
    return stats


def row_order(names: set[str]) -> list[str]:
    """Scenario order of profiles.py (priority classes after their scenario), then the rest."""
    order = {name: i for i, name in enumerate(SCENARIOS)}
    return sorted(names, key=lambda n: (order.get(n.split(":")[0], len(order)), n))


@dataclass
class Summary:
    window_s: float
    start: float
    end: float
    interrupted: int
    slo: SLO
    rows: list[GroupStats]

    @property
    def overall(self) -> GroupStats:
        return self.rows[-1]

    def row(self, name: str) -> GroupStats | None:
        return next((r for r in self.rows if r.name == name), None)

    @property
    def passed(self) -> bool:
        """No failure, at least one request completed, and enough of them met the SLO (a run
        that completed nothing proves nothing, so it does not pass)."""
        overall = self.overall
        return (overall.failed == 0 and overall.attainment is not None
                and overall.attainment >= self.slo.min_attainment)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["passed"] = self.passed
        return data


def summarize(records: list[RequestRecord], slo: SLO) -> Summary:
    start, end = run_window(records)
    window = end - start
    names = row_order({r.name for r in records if r.outcome != INTERRUPTED})
    rows = [group_stats(n, [r for r in records if r.name == n], slo, window) for n in names]
    rows.append(group_stats(OVERALL, records, slo, window))
    return Summary(window, start, end, sum(r.outcome == INTERRUPTED for r in records), slo, rows)


def throughput_series(records: list[RequestRecord], start: float, bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens/s in bins of ``bin_s`` seconds since ``start`` (bin centres, rates)."""
    times = np.array([t for r in records if r.outcome != INTERRUPTED for t in token_times(r)]) - start
    if times.size == 0:
        return np.zeros(0), np.zeros(0)
    edges = np.arange(0.0, times.max() + bin_s, bin_s)
    counts, edges = np.histogram(times, bins=edges)
    return (edges[:-1] + edges[1:]) / 2, counts / bin_s


def in_flight_series(records: list[RequestRecord], start: float, step_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Requests in flight on the client side (sent, not yet ended) sampled every ``step_s``."""
    spans = [(r.sent_at - start, (r.end_at or r.sent_at) - start) for r in records]
    if not spans:
        return np.zeros(0), np.zeros(0)
    t = np.arange(0.0, max(e for _, e in spans) + step_s, step_s)
    return t, np.array([sum(s <= x < e for s, e in spans) for x in t])
