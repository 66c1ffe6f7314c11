"""The load-test report's metrics against values computed by hand on a small synthetic raw log,
plus the pieces the numbers depend on (prompt lengths, seeded workload, interleaving)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from loadtest.analysis import request_metrics, summarize
from loadtest.compare import comparison_table
from loadtest.profiles import PROFILES, SCENARIOS, SLO, LogNormal, Uniform
from loadtest.records import CANCELLED, FAILED, INTERRUPTED, OK, RequestRecord, read_records
from loadtest.report import table, write_report
from loadtest.workload import Arrivals, WeightedInterleave, Workload

T0 = 1_000.0


def record(rid: str, name: str, scheduled: float, responses: list[tuple[float, int]], end: float | None,
           outcome: str = OK, sent: float | None = None, prompt: int = 10, cached: int = 0,
           error: str | None = None) -> RequestRecord:
    return RequestRecord(request_id=rid, scenario=name.split(":")[0], name=name, user=1, scheduled_at=T0 + scheduled,
                         sent_at=T0 + (scheduled if sent is None else sent), expected_prompt_tokens=prompt,
                         max_tokens=sum(n for _, n in responses) or 1,
                         responses=[[T0 + t, n] for t, n in responses], end_at=None if end is None else T0 + end,
                         outcome=outcome, finish_reason="length" if outcome == OK else None,
                         final_response=outcome == OK, prompt_tokens=prompt, cached_tokens=cached, error=error)


# The synthetic log (times in seconds after T0):
#   a  chat  scheduled 0.0: tokens at 0.5, 0.7, 1.0 (one each), final at 1.0
#        TTFT 0.5; ITL 0.2, 0.3; E2E 1.0; TPOT (1.0 - 0.5) / 2 = 0.25
#   b  chat  scheduled 1.0, sent late at 1.5 (open loop): responses 2.0 (2 tokens), 2.6 (1), 3.0 (2); final 3.2
#        TTFT 1.0 (from the scheduled time); ITL 0 (2nd token of the first response),
#        0.6, 0.2, 0.2 (0.4 spread over 2 tokens); E2E 2.2; TPOT (2.2 - 1.0) / 4 = 0.3
#   c  rag   scheduled 0.5: tokens at 3.5, 3.6; final at 4.0; prompt 100, 64 cached
#        TTFT 3.0; ITL 0.1; E2E 3.5; TPOT (3.5 - 3.0) / 1 = 0.5
#   d  cancel scheduled 2.0: tokens at 2.25, 2.5, then cancelled at 2.6
#        TTFT 0.25; ITL 0.25; no E2E, no TPOT
#   e  chat  scheduled 3.0: error at 3.5, no token
#   f  chat  scheduled 4.0: interrupted at 6.0 after a token at 5.0: counts for nothing
SYNTHETIC = [
    record("a", "chat", 0.0, [(0.5, 1), (0.7, 1), (1.0, 1)], 1.0),
    record("b", "chat", 1.0, [(2.0, 2), (2.6, 1), (3.0, 2)], 3.2, sent=1.5),
    record("c", "rag", 0.5, [(3.5, 1), (3.6, 1)], 4.0, prompt=100, cached=64),
    record("d", "cancel", 2.0, [(2.25, 1), (2.5, 1)], 2.6, outcome=CANCELLED),
    record("e", "chat", 3.0, [], 3.5, outcome=FAILED, error="[StatusCode.INTERNAL] boom"),
    record("f", "chat", 4.0, [(5.0, 1)], 6.0, outcome=INTERRUPTED),
]
SLO_TEST = SLO(ttft_s=0.8, tpot_s=0.4, min_attainment=0.5)


def test_per_request_metrics_by_hand() -> None:
    a, b, c, d, e, _ = (request_metrics(r) for r in SYNTHETIC)
    assert a.ttft == pytest.approx(0.5) and a.itl == pytest.approx([0.2, 0.3])
    assert a.e2e == pytest.approx(1.0) and a.tpot == pytest.approx(0.25)
    assert b.ttft == pytest.approx(1.0) and b.itl == pytest.approx([0.0, 0.6, 0.2, 0.2])
    assert b.e2e == pytest.approx(2.2) and b.tpot == pytest.approx(0.3)
    assert c.ttft == pytest.approx(3.0) and c.itl == pytest.approx([0.1]) and c.tpot == pytest.approx(0.5)
    assert d.ttft == pytest.approx(0.25) and d.itl == pytest.approx([0.25]) and d.e2e is None and d.tpot is None
    assert e.ttft is None and e.itl == [] and e.e2e is None


def test_summary_by_hand() -> None:
    s = summarize(SYNTHETIC, SLO_TEST)
    # Window: first scheduled send (0.0) to the last response of a counted request (c's final, 4.0).
    assert s.window_s == pytest.approx(4.0) and s.interrupted == 1
    assert [r.name for r in s.rows] == ["chat", "rag", "cancel", "overall"]
    chat, rag, cancel, overall = s.rows

    assert (chat.requests, chat.completed, chat.failed, chat.cancelled) == (3, 2, 1, 0)
    assert chat.ttft.count == 2 and chat.ttft.p50 == pytest.approx(0.75)        # median of 0.5, 1.0
    assert chat.ttft.p90 == pytest.approx(0.95) and chat.ttft.max == pytest.approx(1.0)  # 0.5 + 0.9 * 0.5
    # chat ITL: 0.2, 0.3, 0.0, 0.6, 0.2, 0.2 -> sorted 0, .2, .2, .2, .3, .6; p50 = 0.2, p90 = .3 + .5 * .3
    assert chat.itl.count == 6 and chat.itl.p50 == pytest.approx(0.2) and chat.itl.p90 == pytest.approx(0.45)
    assert chat.itl.p99 == pytest.approx(0.3 + 0.95 * 0.3) and chat.itl.max == pytest.approx(0.6)
    assert chat.tpot.p50 == pytest.approx(0.275) and chat.e2e.p50 == pytest.approx(1.6)
    assert chat.output_tokens == 8 and chat.output_throughput == pytest.approx(8 / 4.0)
    assert chat.request_throughput == pytest.approx(2 / 4.0)
    # Good = completed and TTFT <= 0.8 and TPOT <= 0.4: only a. Failed e counts against it.
    assert chat.good == 1 and chat.attainment == pytest.approx(1 / 3) and chat.goodput == pytest.approx(0.25)

    assert rag.cached_fraction == pytest.approx(0.64) and rag.good == 0   # TTFT 3.0 misses
    assert cancel.cancelled == 1 and cancel.failed == 0 and cancel.attainment is None
    assert cancel.ttft.p50 == pytest.approx(0.25) and cancel.tpot.count == 0

    assert overall.requests == 5 and overall.output_tokens == 12
    assert overall.ttft.count == 4 and overall.ttft.p50 == pytest.approx(0.75)     # .25 .5 1.0 3.0
    assert overall.itl.count == 8 and overall.tpot.count == 3 and overall.tpot.p50 == pytest.approx(0.3)
    assert overall.e2e.p99 == pytest.approx(2.2 + 0.98 * 1.3)                         # 1.0 2.2 3.5
    assert overall.attainment == pytest.approx(1 / 4)
    assert not s.passed   # a failed request fails the run


def test_passing_run_and_slo_miss() -> None:
    ok_only = [r for r in SYNTHETIC if r.request_id in ("a", "b", "d")]
    assert summarize(ok_only, SLO(ttft_s=2.0, tpot_s=0.4, min_attainment=1.0)).passed
    missed = summarize(ok_only, SLO(ttft_s=0.8, tpot_s=0.4, min_attainment=0.9))   # b's TTFT is 1.0
    assert missed.overall.attainment == pytest.approx(0.5) and not missed.passed
    cancelled_only = [r for r in SYNTHETIC if r.outcome == "cancelled"]
    assert cancelled_only, "the synthetic log has a cancelled request"
    assert not summarize(cancelled_only, SLO(ttft_s=9.0, tpot_s=9.0)).passed   # nothing completed: no verdict
    assert not summarize([], SLO(ttft_s=9.0, tpot_s=9.0)).passed


def test_report_files_and_table(tmp_path: Path) -> None:
    with open(tmp_path / "records.jsonl", "w") as f:
        for r in SYNTHETIC:
            f.write(r.to_json() + "\n")
    assert [r.request_id for r in read_records(tmp_path / "records.jsonl")] == list("abcdef")
    summary = write_report(tmp_path, SLO_TEST)
    text = (tmp_path / "report.md").read_text()
    assert "| chat | 3 | 1 | 0 |" in text and "0.75 / 0.95" in text and "**FAIL**: 1 failed requests" in text
    assert (tmp_path / "latency_cdf.png").stat().st_size > 1000 and (tmp_path / "timeline.png").stat().st_size > 1000
    assert json.loads((tmp_path / "summary.json").read_text())["rows"][-1]["output_tokens"] == 12
    assert "| **overall** | 5 |" in table(summary)
    assert "| output tokens/s | 3 | 3 | 1.00x |" in comparison_table({"continuous": summary, "static": summary})


def test_report_says_where_the_slow_steps_cpu_time_went(tmp_path: Path) -> None:
    with open(tmp_path / "records.jsonl", "w") as f:
        for r in SYNTHETIC:
            f.write(r.to_json() + "\n")

    def traced(measured: float, waiting: float) -> dict:
        return {"step": 0, "t": 0.0, "ms": measured, "engine_ms": measured, "predicted_ms": 100.0, "sys_ms": 1.0,
                "steal_ms": 0, "threads_ms": [[measured, waiting], [measured - 5, 0.0]], "rows": [["a", 1, False]]}
    with open(tmp_path / "steps.jsonl", "w") as f:
        for step in (traced(100.0, 1.0), traced(99.0, 1.0), traced(130.0, 25.0)):
            f.write(json.dumps(step) + "\n")
    write_report(tmp_path, SLO_TEST)
    text = (tmp_path / "report.md").read_text()
    assert "the 1 steps that ran 1.05x their prediction or more against the other 2" in text
    assert "| compute threads waiting for a core | 25 ms | 1 ms |" in text
    assert "| stolen by the hypervisor | 0 ms | 0 ms |" in text


# ---- what the numbers rest on ----------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(model_dir: Path):
    from loadtest.prompts import PromptFactory

    return PromptFactory.for_model(model_dir)


def test_prompts_have_exact_token_lengths(prompts, tokenizer) -> None:
    rng = np.random.default_rng(1)
    for n in (1, 2, 17, 300, 2048):
        text = prompts.text(n, rng)
        assert len(tokenizer(text).input_ids) == n     # the served model's own tokenizer agrees
    prefix, question = prompts.text(64, rng), prompts.text(5, rng)
    joined = tokenizer(prompts.join(prefix, question)).input_ids
    assert joined[:64] == tokenizer(prefix).input_ids and len(joined) == 69   # the prefix tokens are shared


def test_workload_is_seeded_and_fits_the_context(prompts) -> None:
    scenarios = PROFILES["full"].scenarios()
    a, b = Workload(scenarios, prompts, 3, 8192), Workload(scenarios, prompts, 3, 8192)
    for name in scenarios:
        assert a.next(name) == b.next(name)
    assert Workload(scenarios, prompts, 4, 8192).next("chat") != Workload(scenarios, prompts, 3, 8192).next("chat")
    small = Workload(scenarios, prompts, 0, 1024)
    for _ in range(10):
        spec = small.next("rag")
        assert spec.prompt_tokens + spec.max_tokens <= 1024 and prompts.count(spec.prompt) == spec.prompt_tokens
    for spec in [small.next("shared-prefix") for _ in range(8)] + [small.next("long-generation") for _ in range(8)]:
        assert spec.prompt_tokens + spec.max_tokens <= 1024 and spec.max_tokens >= 1
    full = Workload(scenarios, prompts, 0, 8192).next("shared-prefix")
    assert full.group is not None and full.prompt_tokens == 2048 + 128
    cancel = small.next("cancel")
    assert cancel.cancel_after is not None and 1 <= cancel.cancel_after < cancel.max_tokens
    classes = {small.next("priority").name for _ in range(20)}
    assert classes == {"priority:premium", "priority:bulk"}


def test_chat_lengths_are_sharegpt_like() -> None:
    rng = np.random.default_rng(0)
    chat = SCENARIOS["chat"]
    prompts = np.array([chat.prompt.sample(rng) for _ in range(20000)])
    outputs = np.array([chat.output.sample(rng) for _ in range(20000)])
    assert prompts.min() >= 4 and prompts.max() <= 1024 and 140 <= prompts.mean() <= 175
    assert 300 <= outputs.mean() <= 360 and np.percentile(outputs, 99) > 4 * np.median(outputs)   # long tail
    assert Uniform(1024, 4096).scaled(1 / 8) == Uniform(128, 512)
    assert LogNormal(160, 1.0, 4, 1024).scaled(1 / 32).low == 1


def test_interleave_covers_every_scenario_early_and_respects_weights() -> None:
    weights = PROFILES["cpu"].weights
    mix = WeightedInterleave(weights)
    picks = [mix.next() for _ in range(100)]
    assert set(picks[:20]) == set(weights)
    assert {n: picks.count(n) for n in weights} == weights
    again = WeightedInterleave(PROFILES["cpu"].weights)
    assert [again.next() for _ in range(100)] == picks            # deterministic


def test_open_loop_arrivals_are_poisson_and_seeded() -> None:
    arrivals = Arrivals(rate=4.0, seed=0)
    times = [arrivals.next_time(0.0) for _ in range(4000)]
    gaps = np.diff([0.0] + times)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05) and gaps.std() == pytest.approx(0.25, rel=0.1)
    same_seed = Arrivals(rate=4.0, seed=0)
    assert [same_seed.next_time(0.0) for _ in range(50)] == times[:50]
    other_seed = Arrivals(rate=4.0, seed=1)
    assert [other_seed.next_time(0.0) for _ in range(50)] != times[:50]
    assert Arrivals(None, 0).next_time(12.5) == 12.5            # closed loop: send now
