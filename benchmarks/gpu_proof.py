"""The GPU proof in one device call: the GPU tests, the real server on the GPU, the decode floor.

Stages (``--stages``, in the order given; each one appends to the JSON as it ends, so a call cut
off at its limit keeps what finished):

  serve:<shape>   the real tritonserver (nvidia-pytriton's binary, ``server.launch``) with the
                  engine on the device over a dummy-weight model of that shape (config.json from
                  ``benchmarks.decode_roofline.SHAPES``, the SmolLM2 tokenizer), driven through
                  HTTP generate_stream by ``benchmarks.serving``: workloads A and B at each
                  concurrency of the plan with ``batching=continuous``, then the seeds' mixed
                  workload M with ``batching=continuous`` and ``batching=static``. Per server: its
                  start-up (seconds to ready, the ``llm:`` lines: KV cache sized from free memory,
                  CUDA graphs captured) and its drain at stop; per run: the serving summary and
                  the GPU's utilisation sampled by nvidia-smi while it ran.
  tests           pytest over the GPU test files (kernels, layer ops, the Triton engine with CUDA
                  graphs, LoRA, structured outputs, speculative, step failures) on tiny random
                  models; the tests that need the SmolLM2 checkpoint (not carried) are reported
                  skipped (``LLM_TESTS_WITHOUT_CHECKPOINT=1``). Outcome per test in the JSON.
  roofline        ``benchmarks.decode_roofline``: one engine decode step against its
                  bytes / bandwidth floor, 1B and 8B shapes, CUDA graphs.

    python -m benchmarks.gpu_proof --out DIR                          # on a GPU (gpu_proof.sh wraps it)
    python -m benchmarks.gpu_proof --out DIR --plan rehearsal         # anywhere: tiny shape on the CPU

The rehearsal plan runs every stage on this machine's CPU with the tiny shape, a few requests and
one quick test file, so the script that reaches the device has run end to end
(tests/test_gpu_proof.py runs it in ``make test``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.decode_roofline import SHAPES
from benchmarks.serving import Server, Workload, make_workload, no_nan, run_workload

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")

# The served shapes: decode_roofline's, and for the CPU rehearsal a tiny one with Llama 3's
# vocabulary (ids past the tokenizer's, and prompt ids up to the workloads' 40,000).
SERVED_SHAPES = {**SHAPES, "tiny-llama3-vocab": {**SHAPES["tiny"], "vocab_size": 128256}}

GPU_TEST_FILES = ("tests/test_kernels.py", "tests/test_layer_ops.py", "tests/test_triton_engine.py",
                  "tests/test_lora_kernels.py", "tests/test_lora.py", "tests/test_structured_outputs.py",
                  "tests/test_speculative.py", "tests/test_step_failures.py")


@dataclass(frozen=True)
class Plan:
    """What one call runs: the served loads and engine parameters, the tests, the roofline."""
    device: str                                   # engine parameter device=
    dtype: str
    engine: dict[str, str]                        # engine parameters every served model gets
    loads: tuple[tuple[str, int], ...]            # (workload, concurrency) served with batching=continuous
    mixed_concurrency: tuple[int, ...]            # workload M, continuous and static, at each of these
    requests_per_stream: dict[str, int]           # workload -> requests per concurrent stream
    test_files: tuple[str, ...]
    test_args: tuple[str, ...]
    roofline_args: tuple[str, ...]
    request_timeout_s: float = 120.0


PLANS = {
    "gpu": Plan(device="cuda", dtype="bfloat16",
                # A GPU step takes thousands of tokens for little more than a decode's time.
                engine={"max_num_seqs": "256", "max_num_batched_tokens": "2048", "max_model_len": "16384"},
                loads=tuple((w, c) for w in ("A", "B") for c in (16, 64, 256)),
                mixed_concurrency=(64, 256),
                # M: a finite closed loop ends with its longest requests alone; 8 (4) per stream
                # keep that drain a small part of a continuous run.
                requests_per_stream={"A": 4, "B": 4, "M": 8},
                test_files=GPU_TEST_FILES, test_args=("-n", "8"),
                roofline_args=("--shapes", "llama-1b,llama-8b", "--batches", "1,8,64,256", "--graphs-only",
                               "--overlap")),
    "rehearsal": Plan(device="cpu", dtype="float32",
                      engine={"max_num_seqs": "8", "max_num_batched_tokens": "256", "max_model_len": "12288",
                              "itl_target_ms": "0", "num_kv_blocks": "2048"},
                      loads=(("A", 4),), mixed_concurrency=(4,), requests_per_stream={"A": 2, "B": 2, "M": 2},
                      test_files=("tests/test_gpu_proof.py",), test_args=("-k", "static_step_ratio"),
                      roofline_args=("--smoke", "--overlap"), request_timeout_s=300.0),
}


def static_step_ratio(workload: Workload, concurrency: int) -> float:
    """Decode steps static batching needs over those continuous batching needs for this
    workload's outputs, batches of ``concurrency`` in request order: each static batch runs as
    many steps as its longest output, a continuous batch keeps every slot busy. The speed-up
    continuous batching would show if a step cost the same whatever its batch size (near enough
    on a GPU, where a decode step reads the weights once for the whole batch)."""
    outputs = [r.output_len for r in workload.requests]
    static = sum(max(outputs[i:i + concurrency]) for i in range(0, len(outputs), concurrency))
    return static / (sum(outputs) / concurrency)


class GpuSampler:
    """nvidia-smi's utilisation.gpu (% of time a kernel ran), memory used and SM clock, sampled
    every 100 ms while a run lasts. Empty without nvidia-smi (the CPU rehearsal)."""

    QUERY = "utilization.gpu,memory.used,clocks.sm,power.draw"

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float, float, float]] = []
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> "GpuSampler":
        if shutil.which("nvidia-smi"):
            self._process = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                              "-lms", "100"], stdout=subprocess.PIPE, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            fields = [number(x) for x in line.split(",")]
            if len(fields) == 4 and fields[0] == fields[0]:     # a utilisation reading (not NaN)
                self.samples.append((time.monotonic(), *fields))

    def __exit__(self, *exc: object) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {"samples": 0, "note": "no nvidia-smi" if self._process is None else "no samples"}
        util = sorted(s[1] for s in self.samples)
        mean = lambda i: sum(s[i] for s in self.samples) / len(self.samples)  # noqa: E731 - NaN where N/A
        return no_nan({"samples": len(self.samples), "util_mean_pct": sum(util) / len(util),
                       "util_p50_pct": util[len(util) // 2], "memory_used_max_mib": max(s[2] for s in self.samples),
                       "sm_clock_mean_mhz": mean(3), "power_mean_w": mean(4)})


def number(text: str) -> float:
    """A field of nvidia-smi's CSV, NaN where it says [N/A] or the like."""
    try:
        return float(text)
    except ValueError:
        return float("nan")


@dataclass
class Record:
    """The JSON this call writes: rewritten whole after every stage and run."""
    path: Path
    data: dict[str, Any] = field(default_factory=dict)

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)


def environment(plan_name: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"plan": plan_name, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "commit": os.environ.get("GIT_COMMIT") or git_commit(), "python": platform.python_version(),
                           "torch": torch.__version__, "host_cpu": cpu_model(), "host_cores": os.cpu_count()}
    for module in ("triton", "transformers", "numpy", "xgrammar"):
        try:
            env[module] = __import__(module).__version__
        except Exception as exc:   # noqa: BLE001 - recorded, not fatal
            env[module] = f"unavailable: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, device_memory_gib=props.total_memory / 2**30, sms=props.multi_processor_count)
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True)
        env["nvidia_smi"] = smi.stdout.strip()
    else:
        env["device"] = "cpu"
    return env


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here: set GIT_COMMIT)"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "unknown")
    except OSError:
        return "unknown"


# ----------------------------------------------------------------------------- serve
def dummy_model_folder(shape: str, work: Path) -> Path:
    """config.json of ``shape`` and the SmolLM2 tokenizer: a model folder for load_format=dummy.
    The Llama shapes keep Llama 3's vocabulary (128,256 rows of embedding and LM head); random
    weights can sample ids past the tokenizer's 49,152, which detokenize to nothing."""
    folder = work / f"model-{shape}"
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(model_type="llama", architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, rope_theta=500000.0,
                  max_position_embeddings=131072, initializer_range=0.02, bos_token_id=1, eos_token_id=2,
                  torch_dtype="bfloat16", **SERVED_SHAPES[shape])
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (TOKENIZER_DIR / name).is_file():
            shutil.copy(TOKENIZER_DIR / name, folder / name)
    return folder


def served_runs(plan: Plan) -> list[tuple[str, str, int]]:
    """(batching, workload, concurrency) in the order they run, continuous first."""
    runs = [("continuous", w, c) for w, c in plan.loads]
    runs += [("continuous", "M", c) for c in plan.mixed_concurrency]
    runs += [("static", "M", c) for c in plan.mixed_concurrency]
    return runs


def serve_stage(shape: str, plan: Plan, work: Path, record: Record, deadline: float,
                spy_runs: dict[tuple[str, int], bool] | None = None, spy_seconds: float = 10.0,
                label: str = "") -> None:
    from server.launch import TritonServer, free_ports

    spy_runs = spy_runs or {}
    folder = dummy_model_folder(shape, work)
    stage: dict[str, Any] = record.data.setdefault("served", {}).setdefault(shape + label, {"servers": [], "runs": []})
    runs = served_runs(plan)
    for batching in dict.fromkeys(b for b, _, _ in runs):
        params = {"model": str(folder), "load_format": "dummy", "device": plan.device, "dtype": plan.dtype,
                  "batching": batching, **plan.engine}
        log = work / f"server-{shape}{label}-{batching}.log"
        server_entry: dict[str, Any] = {"batching": batching, "params": params, "log": log.name}
        stage["servers"].append(server_entry)
        if time.monotonic() > deadline:
            server_entry["skipped"] = "out of time"
            record.save()
            continue
        started = time.monotonic()
        server = TritonServer(*free_ports(3), params=params, log_file=log)
        try:
            server.start(timeout=300)
        except Exception as exc:   # noqa: BLE001 - recorded; the other stages still run
            server_entry.update(error=f"start failed: {exc}", startup_log=llm_lines(log), log_tail=tail(log))
            record.save()
            continue
        server_entry.update(ready_s=time.monotonic() - started, startup_log=llm_lines(log))
        print(f"[serve {shape} {batching}] ready in {server_entry['ready_s']:.1f} s", flush=True)
        record.save()
        try:
            for run_batching, name, concurrency in runs:
                if run_batching != batching:
                    continue
                entry = {"batching": batching, "workload": name, "concurrency": concurrency}
                stage["runs"].append(entry)
                if time.monotonic() > deadline:
                    entry["skipped"] = "out of time"
                    continue
                workload = make_workload(name, plan.requests_per_stream[name] * concurrency, seed=0)
                target = Server(f"ours-{shape}-{batching}", "triton", "127.0.0.1", server.http_port, "llm")
                spy = StubProfile(work / f"spy-{shape}-{batching}-{name}{concurrency}.txt", spy_seconds,
                                  gil_only=spy_runs[(name, concurrency)]) \
                    if (name, concurrency) in spy_runs else contextlib.nullcontext()
                with GpuSampler() as gpu, spy:
                    summary = run_workload(target, workload, concurrency, plan.request_timeout_s)
                if isinstance(spy, StubProfile):
                    entry["stub_profile"] = spy.summary()
                summary.requests = []     # the per-request rows stay out of this file
                entry.update(num_requests=len(workload.requests), summary=no_nan(asdict(summary)), gpu=gpu.summary())
                util = entry["gpu"].get("util_mean_pct")
                if name == "M":
                    entry["static_step_ratio"] = static_step_ratio(workload, concurrency)
                print(f"[serve {shape} {batching}] {name} x{concurrency}: {summary.output_tok_s:.0f} tok/s "
                      f"(saturated {summary.saturated_tok_s:.0f}), {summary.completed} ok / {summary.failed} failed, "
                      f"GPU util {'-' if util is None else f'{util:.0f}%'}", flush=True)
                record.save()
        finally:
            stop_started = time.monotonic()
            server.stop()
            server_entry["stop_s"] = time.monotonic() - stop_started
            server_entry["drain_log"] = [line for line in tail(log, 60) if "drain" in line.lower()]
            record.save()
    stage["mixed"] = mixed_ratios(stage["runs"])
    record.save()


def mixed_ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Continuous over static output tok/s on workload M, per concurrency, beside each mode's
    GPU utilisation and the step ratio slot arithmetic predicts."""
    rows = []
    by_key = {(r["batching"], r["concurrency"]): r for r in runs if r.get("workload") == "M" and "summary" in r}
    for (batching, concurrency), cont in sorted(by_key.items()):
        static = by_key.get(("static", concurrency))
        if batching != "continuous" or static is None:
            continue
        c, s = cont["summary"], static["summary"]
        ratio = lambda key: c[key] / s[key] if c.get(key) and s.get(key) else None  # noqa: E731
        rows.append({"concurrency": concurrency, "continuous_tok_s": c["output_tok_s"], "static_tok_s": s["output_tok_s"],
                     "ratio": ratio("output_tok_s"), "saturated_ratio": ratio("saturated_tok_s"),
                     "static_step_ratio": cont.get("static_step_ratio"),
                     "gpu_util_continuous_pct": cont["gpu"].get("util_mean_pct"),
                     "gpu_util_static_pct": static["gpu"].get("util_mean_pct")})
    return rows


def llm_lines(log: Path) -> list[str]:
    """The model's own start-up lines (``llm: ...``) from the server log."""
    try:
        return [line.rstrip() for line in log.read_text(errors="replace").splitlines() if line.startswith("llm: ")]
    except OSError:
        return []


def tail(log: Path, lines: int = 40) -> list[str]:
    try:
        return log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


class StubProfile:
    """py-spy sampling the model stub (engine loop, sender, metrics, poller threads) for the
    first ``seconds`` of a run: where the host's time goes when the GPU waits on it."""

    def __init__(self, out: Path, seconds: float, gil_only: bool = False) -> None:
        self.out, self.seconds, self.gil_only = out, seconds, gil_only
        self.process: subprocess.Popen | None = None
        self.error = ""

    def __enter__(self) -> "StubProfile":
        spy = shutil.which("py-spy")
        pids = subprocess.run(["pgrep", "-f", "triton_python_backend_stub"], capture_output=True, text=True).stdout.split()
        if spy is None or not pids:
            self.error = "no py-spy" if spy is None else "no stub process"
            return self
        self.process = subprocess.Popen([spy, "record", "-p", pids[0], "-d", f"{self.seconds:g}", "-r", "200", "-f", "raw",
                                         "--threads", "--nonblocking", "-o", str(self.out),
                                         *(["--gil"] if self.gil_only else [])],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            try:
                _, err = self.process.communicate(timeout=self.seconds + 30)
                self.error = err.strip()[-300:] if self.process.returncode else ""
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.error = "py-spy did not finish"

    def summary(self, top: int = 40) -> dict[str, Any]:
        """Active samples per thread, and the frames holding the most of them (inclusive and
        where the sample was taken)."""
        if not self.out.is_file():
            return {"error": self.error or "no profile written"}
        threads: dict[str, int] = {}
        inclusive: dict[str, int] = {}
        leaf: dict[str, int] = {}
        for line in self.out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            frames, n = stack.split(";"), int(count)
            thread = re.sub(r"^thread \(\d+\): ", "", frames[0])
            threads[thread] = threads.get(thread, 0) + n
            for frame in dict.fromkeys(f"{thread}: {f}" for f in frames[1:]):
                inclusive[frame] = inclusive.get(frame, 0) + n
            leaf[f"{thread}: {frames[-1]}"] = leaf.get(f"{thread}: {frames[-1]}", 0) + n
        best = lambda d: dict(sorted(d.items(), key=lambda kv: -kv[1])[:top])  # noqa: E731
        return {"seconds": self.seconds, "rate_hz": 200, "gil_only": self.gil_only, "threads": threads, "inclusive": best(inclusive),
                "leaf": best(leaf), "error": self.error}


def run_until(cmd: list[str], deadline: float, env: dict[str, str] | None = None) -> tuple[int | None, str, float]:
    """(exit code or None when cut at the deadline, stdout + stderr, seconds) of a command given
    until the call's deadline (at least 30 s)."""
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=max(30.0, deadline - time.monotonic()))
        return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return None, f"timed out after {exc.timeout:.0f} s\n{partial}", time.monotonic() - started


# ----------------------------------------------------------------------------- tests
def tests_stage(plan: Plan, work: Path, record: Record, deadline: float) -> None:
    junit = work / "junit.xml"
    env = dict(os.environ, LLM_TESTS_WITHOUT_CHECKPOINT="1")
    # gpu_proof.sh: the tests on the image's python and numpy, the server on the pack's numpy.
    python = os.environ.get("GPU_PROOF_TEST_PYTHON") or sys.executable
    if os.environ.get("GPU_PROOF_TEST_PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["GPU_PROOF_TEST_PYTHONPATH"]
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           *plan.test_args, *plan.test_files]
    exit_code, output, seconds = run_until(cmd, deadline, env)
    (work / "pytest.log").write_text(output)
    outcome = {"command": " ".join(cmd[2:]), "exit_code": exit_code, "seconds": seconds,
               "summary_line": next((l for l in reversed(output.splitlines()) if " in " in l), ""),
               **junit_outcomes(junit)}
    record.data["tests"] = outcome
    record.save()
    print(f"[tests] exit {exit_code}: {outcome['counts']} in {outcome['seconds']:.0f} s", flush=True)


def junit_outcomes(junit: Path) -> dict[str, Any]:
    """Per test: passed / failed / error / skipped, seconds, and the message of a non-pass."""
    if not junit.is_file():
        return {"counts": {}, "tests": []}
    tests = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            child = case.find(kind)
            if child is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                message = (child.get("message") or child.text or "")[:400]
                break
        tests.append({"id": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), **({"message": message} if message else {})})
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {"counts": counts, "tests": tests}


# ----------------------------------------------------------------------------- roofline
def roofline_stage(plan: Plan, work: Path, record: Record, deadline: float) -> None:
    out = work / "roofline.json"
    cmd = [sys.executable, "-m", "benchmarks.decode_roofline", *plan.roofline_args, "--json", str(out)]
    exit_code, output, seconds = run_until(cmd, deadline)
    record.data["roofline"] = {"command": " ".join(cmd[2:]), "exit_code": exit_code, "seconds": seconds,
                               "results": json.loads(out.read_text()) if out.is_file() else None,
                               "output_tail": output.splitlines()[-30:]}
    record.save()
    print(f"[roofline] exit {exit_code} in {seconds:.0f} s", flush=True)


# ----------------------------------------------------------------------------- profile
def profile_stage(plan: Plan, work: Path, record: Record, deadline: float) -> None:
    """Where a 1B decode step's time goes at batch 64 (benchmarks.gpu_decode_profile): GPU only."""
    cmd = [sys.executable, "-m", "benchmarks.gpu_decode_profile", "--shape", "llama-1b", "--batches", "64"]
    exit_code, output, seconds = run_until(cmd, deadline)
    (work / "profile.log").write_text(output)
    record.data["profile"] = {"command": " ".join(cmd[2:]), "exit_code": exit_code, "seconds": seconds,
                              "output": output.splitlines()[-120:]}
    record.save()
    print(f"[profile] exit {exit_code} in {seconds:.0f} s", flush=True)


# ----------------------------------------------------------------------------- main
def parse_load(text: str) -> tuple[str, int]:
    """WORKLOAD:CONCURRENCY"""
    workload, _, concurrency = text.partition(":")
    return workload, int(concurrency)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON")
    parser.add_argument("--work", type=Path, default=None, help="folder for the logs, models and test output "
                        "(default OUT/work)")
    parser.add_argument("--plan", choices=sorted(PLANS), default="gpu")
    parser.add_argument("--stages", default="serve:llama-1b,tests,roofline",
                        help="comma-separated, in order: serve:<shape>, tests, roofline, profile")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="start nothing new after this many seconds (what has begun finishes)")
    parser.add_argument("--json-name", default="gpu_proof.json")
    parser.add_argument("--loads", help="override the plan's continuous loads: WORKLOAD:CONCURRENCY,...")
    parser.add_argument("--mixed-concurrency", help="override the plan's workload-M concurrencies: N,... ('' none)")
    parser.add_argument("--requests-per-stream", help="override per workload: WORKLOAD=N,...")
    parser.add_argument("--spy", help="WORKLOAD:CONCURRENCY[:gil],...: py-spy samples the model stub's active "
                        "threads (or only the one holding the GIL) during those runs")
    parser.add_argument("--spy-seconds", type=float, default=10.0)
    parser.add_argument("--engine", default="", help="KEY=VALUE,...: engine parameters added to the plan's "
                        "(e.g. cuda_graph_mixed_steps=true)")
    parser.add_argument("--label", default="", help="suffix of this call's served entries (two configurations "
                        "of one shape in one JSON)")
    args = parser.parse_args(argv)
    plan = PLANS[args.plan]
    if args.loads is not None:
        plan = dataclasses.replace(plan, loads=tuple(parse_load(x) for x in args.loads.split(",") if x))
    if args.mixed_concurrency is not None:
        plan = dataclasses.replace(plan, mixed_concurrency=tuple(int(x) for x in args.mixed_concurrency.split(",") if x))
    if args.requests_per_stream:
        per_stream = dict(plan.requests_per_stream)
        per_stream.update({k: int(v) for k, v in (x.split("=") for x in args.requests_per_stream.split(","))})
        plan = dataclasses.replace(plan, requests_per_stream=per_stream)
    if args.engine:
        plan = dataclasses.replace(plan, engine={**plan.engine, **dict(x.split("=", 1) for x in args.engine.split(","))})
    spy_runs = {parse_load(":".join(x.split(":")[:2])): x.endswith(":gil") for x in (args.spy or "").split(",") if x}
    deadline = time.monotonic() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    record = Record(args.out / args.json_name)
    if record.path.is_file():       # a later call adds to the same file
        record.data = json.loads(record.path.read_text())
    record.data.setdefault("calls", []).append({"stages": args.stages, **environment(args.plan), "plan": asdict(plan)})
    record.save()
    for stage in args.stages.split(","):
        name, _, shape = stage.partition(":")
        try:
            if name == "serve":
                serve_stage(shape, plan, work, record, deadline, spy_runs, args.spy_seconds, args.label)
            elif name == "tests":
                tests_stage(plan, work, record, deadline)
            elif name == "roofline":
                roofline_stage(plan, work, record, deadline)
            elif name == "profile":
                profile_stage(plan, work, record, deadline)
            else:
                raise SystemExit(f"unknown stage {stage!r}")
        except Exception as exc:   # noqa: BLE001 - one stage's failure must not lose the others
            record.data.setdefault("stage_errors", []).append({"stage": stage, "error": repr(exc)})
            record.save()
            print(f"[{stage}] failed: {exc!r}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
