"""Scrape the server's Prometheus endpoint: one-off reads and a sampler that records the
engine gauges over a run (for the running-requests and KV-cache plots and the idle check).

Behind a proxy (server/cluster.py) the "URL" is a comma-separated list, one per replica: a
sample then holds the cluster's sums (KV usage as used / total blocks over all replicas) and,
under ``replicas``, each replica's own row (the load-test report's cluster view).

Plain ``threading`` and ``urllib``: inside Locust both are gevent-patched, so the sampler is a
greenlet there and a thread anywhere else.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

# Sample field -> Prometheus family (our model's labels are dropped: one model per server).
FAMILIES = {
    "running": "llm_num_requests_running",
    "waiting": "llm_num_requests_waiting",
    "kv_used": "llm_kv_blocks_used",
    "kv_total": "llm_kv_blocks_total",
    "kv_usage": "llm_kv_cache_usage_ratio",
    "kv_cached": "llm_kv_blocks_cached",
    "generation_tokens": "llm_generation_tokens_total",
    "prompt_tokens": "llm_prompt_tokens_total",
    "prefix_hit_tokens": "llm_prefix_cache_hit_tokens_total",
    "prefix_queried_tokens": "llm_prefix_cache_queried_tokens_total",
    "preemptions": "llm_num_preemptions_total",
    "finished_requests": "llm_request_finished_total",
    "spec_draft_tokens": "llm_spec_decode_draft_tokens_total",
    "spec_accepted_tokens": "llm_spec_decode_accepted_tokens_total",
    "spec_emitted_tokens": "llm_spec_decode_emitted_tokens_total",
    "spec_verifications": "llm_spec_decode_verifications_total",
}


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}, for our llm_* and nv_trt_llm_* families."""
    values = {}
    for line in text.splitlines():
        if line.startswith(("llm_", "nv_trt_llm_")):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return parse_prometheus(response.read().decode())


def value(metrics: dict[str, float], family: str, **labels: str) -> float | None:
    """Sum of the family's series whose labels include ``labels`` (None if absent)."""
    found = [v for key, v in metrics.items()
             if key.split("{")[0] == family and all(f'{k}="{val}"' in key for k, val in labels.items())]
    return sum(found) if found else None


def metrics_urls(urls: str) -> list[str]:
    return [u.strip() for u in urls.split(",") if u.strip()]


def sample_one(url: str) -> dict[str, float | None]:
    metrics = scrape(url)
    row: dict[str, float | None] = {"t": time.time()}
    row.update({field: value(metrics, family) for field, family in FAMILIES.items()})
    return row


def sample(urls: str) -> dict:
    """One row of gauges and counters: a single server's, or a cluster's sums with each
    replica's row under ``replicas`` (keyed by metrics URL)."""
    rows = {url: sample_one(url) for url in metrics_urls(urls)}
    if len(rows) == 1:
        return next(iter(rows.values()))
    total: dict = {"t": time.time()}
    for field in FAMILIES:
        present = [r[field] for r in rows.values() if r[field] is not None]
        total[field] = sum(present) if present else None
    if total["kv_used"] is not None and total["kv_total"]:
        total["kv_usage"] = total["kv_used"] / total["kv_total"]
    total["replicas"] = rows
    return total


def wait_until_idle(url: str, idle_kv_used: float = 0.0, timeout: float = 10.0) -> dict[str, float | None]:
    """Poll until nothing runs or waits and the KV-used gauge is back at ``idle_kv_used``;
    returns the last sample (the caller checks it)."""
    deadline = time.monotonic() + timeout
    while True:
        row = sample(url)
        idle = row["running"] == 0 and row["waiting"] == 0 and row["kv_used"] == idle_kv_used
        if idle or time.monotonic() > deadline:
            return row
        time.sleep(0.2)


class MetricsSampler:
    """Appends one JSON line of gauges every ``interval`` seconds until stopped."""

    def __init__(self, url: str, path: Path, interval: float = 1.0) -> None:
        self.url, self.path, self.interval = url, path, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)

    def start(self) -> "MetricsSampler":
        self._thread.start()
        return self

    def _run(self) -> None:
        with open(self.path, "a", encoding="utf-8") as out:
            while True:
                try:
                    out.write(json.dumps(sample(self.url)) + "\n")
                    out.flush()
                except OSError:
                    pass   # a missed scrape is a gap in a plot, not a failed run
                if self._stop.wait(self.interval):
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def read_samples(path: Path) -> list[dict[str, float | None]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
