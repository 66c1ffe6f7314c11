"""The benchmark scripts run end to end, so they cannot rot between runs: the GPU ones in
their --smoke mode (tiny shapes; on CPU the kernels run in Triton's interpreter), the CPU
matmul comparison on two row counts. Their figures are meaningless here; the real ones are
in docs/benchmarks.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_native

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module,args,expect", [("benchmarks.kernels", [], "mixed step"),
                                                ("benchmarks.decode_roofline", ["--overlap"], "overlapped")])
def test_benchmark_smoke(module: str, args: list[str], expect: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", module, "--smoke", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert expect in done.stdout
    assert "device:" in done.stdout


def test_cpu_linear_benchmark_runs() -> None:
    """The CPU matmul comparison (docs/benchmarks.md) runs every path on the model's shapes."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # --against HEAD: a commit's kernel beside this tree's (built from the commit's files; in a
    # clean checkout the same files, so the build this run has made already).
    done = subprocess.run([sys.executable, "-m", "benchmarks.cpu_linear", "--rows", "1,7", "--rounds", "1",
                           "--against", "HEAD"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| native ms | onednn ms | torch ms | this ms | HEAD ms | native speed-up over onednn | this speed-up " \
           "over HEAD |" in done.stdout
    assert done.stdout.count("x |") == 4      # both speed-ups per row count


def test_cpu_linear_spread_runs() -> None:
    """--spread: the step timed repeatedly per path, one row of percentiles per path."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "benchmarks.cpu_linear", "--rows", "3", "--paths", "native,torch",
                           "--spread", "4"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| rows | path | median ms | p90 ms | p99 ms | largest ms | p99 / median |" in done.stdout
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 3 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["native", "torch"]


def test_host_overhead_benchmark_runs(tmp_path: Path) -> None:
    """The host work per step around a tiny model's forward, at two batch sizes."""
    out = tmp_path / "host.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.host_overhead", "--batches", "2,5", "--steps", "3",
                           "--rounds", "2", "--json", str(out)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    medians = json.loads(out.read_text())["medians"]
    assert set(medians) == {"2", "5"}
    for median in medians.values():
        assert 0 < median["forward_ms"] < median["step_ms"] and median["host_ms"] > 0


def test_silu_and_mul_benchmark_runs() -> None:
    """The fused SiLU x up against the torch ops: the op alone and alternating decode steps."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "benchmarks.silu_and_mul", "--dtypes", "bfloat16", "--batch", "2",
                           "--rounds", "2", "--steps", "1"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("| bfloat16 |") == 3      # two op rows (decode rows, 512) and one step row


def test_greedy_argmax_benchmark_runs() -> None:
    """The C argmax against torch.argmax: the op alone at three row counts and alternating steps."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "benchmarks.greedy_argmax", "--batch", "2", "--rounds", "2",
                           "--steps", "1"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("x |") == 3, done.stdout      # rows 1, 2 and 64
    assert "| median of 2 rounds |" in done.stdout, done.stdout


def test_cpu_decoder_benchmark_runs() -> None:
    """The layers as one C call against the Python loop: a decode and a prefill row per dtype."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "benchmarks.cpu_decoder", "--dtypes", "bfloat16", "--batch", "2",
                           "--prompt", "40", "--rounds", "2", "--steps", "1"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("| bfloat16 |") == 2 and done.stdout.count("x |") == 2, done.stdout


def test_sampling_draw_benchmark_runs() -> None:
    """The sampled-decode comparison of the two draws runs both and restores the engine's."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.sampling_draw", "--streams", "2", "--max-tokens", "4",
                           "--rounds", "1"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert set(result["output_tok_s"]) == {"inverse_cdf", "exponential_race"} and result["ratio_of_medians"] > 0


def test_speculative_benchmark_runs(tmp_path: Path) -> None:
    """The speculation off/on comparison (docs/benchmarks.md) runs and checks equal outputs."""
    out = tmp_path / "spec.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.speculative", "--rounds", "1", "--max-tokens", "16",
                           "--workloads", "edit", "--json", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "edit :" in done.stdout
    result = json.loads(out.read_text())["results"]["edit"]
    assert result["on"]["tokens"] == result["off"]["tokens"] and result["on"]["drafted"] > 0


def test_structured_outputs_benchmark_runs(tmp_path: Path) -> None:
    """The schema vs no-schema comparison (docs/structured_outputs.md) runs end to end."""
    out = tmp_path / "structured.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.structured_outputs", "--requests", "2", "--rounds", "1",
                           "--max-tokens", "16", "--json", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for result in json.loads(out.read_text())["results"].values():
        if "not_parsing_by_finish_reason" not in result:
            continue
        # Every output that is not JSON is accounted for by its finish reason, and none of
        # them ended by the grammar's EOS (an output the grammar ends is a whole document).
        not_parsing = result["not_parsing_by_finish_reason"]
        assert sum(not_parsing.values()) == result["outputs"] - result["valid_json"]
        assert "stop" not in not_parsing, not_parsing
        assert sum(result["finish_reasons"].values()) == result["outputs"]


def test_decode_breakdown_benchmark_runs(tmp_path: Path) -> None:
    """The per-op-family decode step split (docs/benchmarks.md) runs for both dtypes."""
    out = tmp_path / "breakdown.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.decode_breakdown", "--batch", "2", "--min-context", "20",
                           "--max-context", "40", "--steps", "1", "--rounds", "1", "--json", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| float32 |" in done.stdout and "| bfloat16 |" in done.stdout
    assert json.loads(out.read_text())


def test_lora_benchmark_runs(tmp_path: Path) -> None:
    """The multi-LoRA vs base comparison (docs/lora.md) runs and writes its figures."""
    out = tmp_path / "lora.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.lora_throughput", "--streams", "4", "--adapters", "2",
                           "--rank", "4", "--max-tokens", "8", "--repeats", "1", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["best_output_tok_s"]) == {"base", "2 adapters"} and result["lora_vs_base"] > 0
    assert result["delta_qkv_decode_batch"]["speedup"] > 0


def test_prefill_roofline_benchmark_runs(tmp_path: Path) -> None:
    """The prefill-against-roofline table (docs/benchmarks.md) runs in both dtypes, and counts
    SmolLM2-135M's FLOPs as by hand: per token and layer 576 x 960 (q, k, v) + 576 x 576 (o) +
    576 x 3072 (gate, up) + 1536 x 576 (down) multiply-adds; causal attention over 32 tokens
    sees 32 x 33 / 2 keys, QK^T and PV for 9 heads of 64. The prompt attention asked for (SDPA
    here; the other benchmark tests run the default) is the one each row ran."""
    out = tmp_path / "prefill.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.prefill_roofline", "--tokens", "32", "--rounds", "1",
                           "--peak-iters", "100000", "--prefill-attention", "sdpa", "--json", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["flops"]["projections"] == 2 * 32 * 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)
    assert result["flops"]["attention"] == 2 * 2 * 9 * 64 * (32 * 33 // 2) * 30
    assert [(row["dtype"], row["prefill_attention"]) for row in result["rows"]] == [
        ("float32", "sdpa"), ("bfloat16", "sdpa")]
    assert all(row["gflops"] > 0 and row["step_ms"] > 0 for row in result["rows"])
    assert result["peak_gflops"]["float32"] > 0


def test_cpu_attention_benchmark_runs() -> None:
    """The attention comparison (docs/benchmarks.md) runs both builds in both dtypes, names the
    function the engine's build runs, and the two builds' outputs agree."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.cpu_attention", "--seqs", "3", "--context", "40",
                           "--layers", "2", "--prompt", "40", "--rounds", "1"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| torch.")]
    assert [(row[0].strip(), row[1].split()[0]) for row in rows] == [
        ("torch.float32", "decode"), ("torch.float32", "prefill"), ("torch.bfloat16", "decode"),
        ("torch.bfloat16", "prefill")]
    assert all(row[2].strip() in ("generic", "avx2", "avx512-bf16") for row in rows)
    assert all(float(row[8]) < 1e-2 for row in rows), done.stdout


def test_cpu_attention_benchmark_against_a_revision() -> None:
    """``--against REV`` builds the kernels as that commit had them and compares in one process
    (the before / after figures of docs/benchmarks.md): the column is named after the revision
    and both builds' outputs agree."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.cpu_attention", "--seqs", "3", "--context", "40",
                           "--layers", "2", "--prompt", "40", "--rounds", "1", "--dtypes", "bfloat16",
                           "--against", "HEAD"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| HEAD ms |" in done.stdout, done.stdout
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| torch.")]
    assert len(rows) == 2 and all(float(row[8]) < 1e-2 for row in rows), done.stdout


def test_cpu_attention_benchmark_against_torch_sdpa() -> None:
    """``--sdpa`` adds, per dtype, a prefill row for torch's scaled_dot_product_attention on the same
    prompt, and its output matches ours (a wrong gather, transpose or GQA mapping would not)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.cpu_attention", "--seqs", "3", "--context", "40",
                           "--layers", "1", "--prompt", "37", "--rounds", "1", "--sdpa"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if "torch SDPA" in line]
    assert [row[0].strip() for row in rows] == ["torch.float32", "torch.bfloat16"], done.stdout
    assert float(rows[0][8]) < 1e-5 and float(rows[1][8]) < 3e-2, done.stdout


def test_prefill_precision_benchmark_runs(tmp_path: Path) -> None:
    """The precision sweep (docs/benchmarks.md, "Float16 prompt attention") writes both sweeps
    for every function built here; the float32-FMA function stays within bfloat16's rounding
    at every width."""
    out = tmp_path / "precision.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.prefill_precision", "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 and "did not build" in done.stderr:
        pytest.skip("NOT RUN: the C kernels did not build here")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["wide_scores"]) == 5 and len(result["query_outlier"]) == 6
    rows = [*result["wide_scores"].values(), *result["query_outlier"].values()]
    library = cpu_native.load()
    built = {"fma": bool(library.prefill_attention_bf16_fma_built()),
             "fp16": bool(library.prefill_attention_bf16_fp16_built())}
    assert all(set(row) == {k for k, has in built.items() if has} for row in rows), result
    assert all(row["fma"] < 1e-2 for row in rows if "fma" in row), result


def test_detokenizer_speed_benchmark_runs() -> None:
    """Both detokenizer paths over the three id sequences (docs/benchmarks.md, host work)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.detokenizer_speed", "--repeats", "1"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "us/token" not in line]
    assert [row.split(" | ")[0] for row in rows] == ["| random ids < 1024", "| random ids, whole vocabulary",
                                                     "| README text"]
