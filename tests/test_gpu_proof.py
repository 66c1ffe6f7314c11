"""The GPU proof script (benchmarks/gpu_proof.py) rehearsed on the CPU: what reaches the device
machine has run end to end here, served runs, tests stage and roofline alike."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_proof import mixed_ratios, static_step_ratio
from benchmarks.serving import Request, Workload, make_workload

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_static_step_ratio_counts_each_batch_at_its_longest_output() -> None:
    outputs = [10, 100, 10, 10, 50, 50, 50, 50]
    workload = Workload("x", [Request([1], n) for n in outputs])
    # Batches of 4: 100 + 50 steps static; 330 tokens over 4 slots continuous.
    assert static_step_ratio(workload, 4) == pytest.approx(150 / (330 / 4))
    assert static_step_ratio(workload, 1) == pytest.approx(1.0)


def test_mixed_workload_is_heavy_tailed_within_the_seeds_ranges() -> None:
    workload = make_workload("M", 2048, seed=0)
    prompts = [len(r.prompt) for r in workload.requests]
    outputs = [r.output_len for r in workload.requests]
    assert 10 <= min(prompts) and max(prompts) <= 8192 and 5 <= min(outputs) and max(outputs) <= 2048
    assert sorted(outputs)[len(outputs) // 2] < sum(outputs) / len(outputs)   # median under the mean
    assert static_step_ratio(workload, 64) > 5    # what static batching gives away on it
    assert make_workload("M", 16, seed=0) == make_workload("M", 16, seed=0)


def test_mixed_ratios_pair_each_concurrency() -> None:
    def run(batching: str, concurrency: int, tok_s: float) -> dict:
        return {"batching": batching, "workload": "M", "concurrency": concurrency, "static_step_ratio": 9.0,
                "summary": {"output_tok_s": tok_s, "saturated_tok_s": tok_s * 2}, "gpu": {"util_mean_pct": 50.0}}

    rows = mixed_ratios([run("continuous", 64, 1000.0), run("static", 64, 100.0), run("continuous", 256, 10.0),
                         {"batching": "static", "workload": "M", "concurrency": 256, "skipped": "out of time"}])
    assert [(r["concurrency"], r["ratio"], r["saturated_ratio"]) for r in rows] == [(64, 10.0, 10.0)]


@pytest.mark.server
def test_rehearsal_runs_every_stage_on_the_cpu(tmp_path: Path) -> None:
    """The device script's three stages in their CPU form: the real tritonserver with a dummy
    tiny model (continuous and static), one pytest run recorded per test, the roofline smoke."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_proof", "--plan", "rehearsal", "--out", str(out),
                           "--stages", "serve:tiny-llama3-vocab,tests,roofline"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((out / "gpu_proof.json").read_text())
    assert "stage_errors" not in record, record["stage_errors"]
    assert record["calls"][0]["device"] == "cpu"

    served = record["served"]["tiny-llama3-vocab"]
    assert [s["batching"] for s in served["servers"]] == ["continuous", "static"]
    for server in served["servers"]:
        assert server["ready_s"] > 0
        assert any(line.startswith("llm: KV cache: 2048 blocks") for line in server["startup_log"]), server
    assert len(served["runs"]) == 3
    for run in served["runs"]:
        summary = run["summary"]
        assert (summary["completed"], summary["failed"]) == (run["num_requests"], 0), summary["errors"]
        assert summary["output_tokens"] > 0
    [mixed] = served["mixed"]
    assert mixed["concurrency"] == 4 and mixed["ratio"] > 0 and mixed["static_step_ratio"] >= 1

    tests = record["tests"]
    assert tests["exit_code"] == 0 and tests["counts"] == {"passed": 1}, tests
    assert tests["tests"][0]["id"].endswith("test_static_step_ratio_counts_each_batch_at_its_longest_output")

    roofline = record["roofline"]
    assert roofline["exit_code"] == 0, roofline["output_tail"]
    assert {r["batch"] for r in roofline["results"]["results"]} == {1, 4}
