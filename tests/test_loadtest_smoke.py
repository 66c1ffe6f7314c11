"""Smoke run of the Locust load test against the real tritonserver: every scenario, a few
users, the `smoke` profile (tiny lengths). Checks that what the load test counts is what the
server did: no failures, every stream ended with its final response, token counts equal the
server's, cancelled requests counted as cancelled (on both sides), KV cache back to idle."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from loadtest.profiles import PROFILES, SCENARIOS
from loadtest.records import CANCELLED, OK, read_records
from loadtest.runner import LoadOptions, run_load
from loadtest.server_metrics import scrape, value, wait_until_idle
from server.launch import TritonServer, free_ports
from tests.conftest import FIXED_BUDGET_PARAMS

pytestmark = pytest.mark.server

SMOKE_SECONDS = 12     # the seeded interleaving covers every scenario within its first dozen requests


def counters(url: str) -> dict[str, float]:
    metrics = scrape(url)
    return {"length": value(metrics, "llm_request_finished_total", finish_reason="length") or 0.0,
            "cancelled": value(metrics, "llm_request_finished_total", finish_reason="cancelled") or 0.0,
            "generated": value(metrics, "llm_generation_tokens_total") or 0.0,
            "kv_used": value(metrics, "llm_kv_blocks_used") or 0.0}


def test_smoke_load_test_against_the_real_server(model_dir: Path, tmp_path: Path) -> None:
    profile = PROFILES["smoke"]
    with TritonServer(*free_ports(3), params={**profile.server_params, **FIXED_BUDGET_PARAMS},
                      log_file=tmp_path / "server.log") as server:
        idle = wait_until_idle(server.metrics_url)
        before = counters(server.metrics_url)
        started = time.monotonic()
        result = run_load(LoadOptions(profile="smoke", host=server.grpc_url, metrics_url=server.metrics_url,
                                      server="existing", duration_s=SMOKE_SECONDS, run_dir=tmp_path / "run"))
        elapsed = time.monotonic() - started
        wait_until_idle(server.metrics_url, idle_kv_used=idle["kv_used"] or 0.0)
        time.sleep(0.3)   # the server pushes its counters every 100 ms
        after = counters(server.metrics_url)

    records = read_records(result.run_dir / "records.jsonl")
    summary = result.summary
    assert elapsed < SMOKE_SECONDS + 40, f"smoke run took {elapsed:.0f}s"
    assert {r.scenario for r in records} == set(SCENARIOS), "a scenario was never sent"
    assert all(r.outcome in (OK, CANCELLED) for r in records), [(r.request_id, r.outcome, r.error) for r in records
                                                               if r.outcome not in (OK, CANCELLED)]
    assert summary.overall.failed == 0 and summary.interrupted == 0 and summary.passed

    ok = [r for r in records if r.outcome == OK]
    cancelled = [r for r in records if r.outcome == CANCELLED]
    assert ok and cancelled and all(r.scenario == "cancel" for r in cancelled)
    assert all(r.scenario != "cancel" for r in ok)
    for r in ok:   # every stream ended with Triton's final response; lengths are exactly as asked
        assert r.final_response and r.finish_reason == "length", r
        assert r.output_tokens == r.max_tokens and r.prompt_tokens == r.expected_prompt_tokens, r
        assert r.end_at is not None and r.end_at >= r.responses[-1][0]
    for r in cancelled:
        assert r.cancel_after is not None and r.cancel_after <= r.output_tokens < r.max_tokens

    # The server agrees: the same number of requests finished by length and by cancellation,
    # and it generated every token the client received (plus, for a cancelled request, the
    # few it produced before the cancellation reached it).
    assert after["length"] - before["length"] == len(ok)
    assert after["cancelled"] - before["cancelled"] == len(cancelled)
    received = sum(r.output_tokens for r in records)
    generated = after["generated"] - before["generated"]
    assert received <= generated <= received + sum(r.max_tokens - r.output_tokens for r in cancelled)
    assert generated == received or cancelled

    # KV cache back to its idle value; the report says so and shows cached and cancelled requests.
    assert after["kv_used"] == idle["kv_used"] and result.back_to_idle and result.exit_code == 0
    assert summary.row("shared-prefix").cached_tokens > 0
    assert summary.row("cancel").cancelled == len(cancelled) and summary.row("cancel").failed == 0

    # Locust saw one request event per request (its final stats), none failed.
    entries = json.loads((result.run_dir / "locust_stats.json").read_text())
    assert sum(e["num_requests"] for e in entries) == len(records)
    assert sum(e["num_failures"] for e in entries) == 0
    assert {e["name"] for e in entries} == {r.name for r in records}
    report = (result.run_dir / "report.md").read_text()
    assert "Result: **PASS**" in report and "back to idle" in report
    assert (result.run_dir / "latency_cdf.png").exists() and (result.run_dir / "timeline.png").exists()
