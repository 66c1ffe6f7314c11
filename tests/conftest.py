"""Shared fixtures: the converted SmolLM2 folder, prompts, and Hugging Face reference outputs."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

# pytest-xdist workers (`make test` runs the tests that start no server on one worker per core):
# each is pinned to a core of its own before torch starts its threads, so that its engines and
# torch run one thread and the workers do not take cores from each other.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and hasattr(os, "sched_setaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {_cores[int(_WORKER.removeprefix("gw")) % len(_cores)]})

import pytest  # noqa: E402 - after the pinning
import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter; the flag is read when a kernel
# module is imported, so it must be set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One step-cost calibration cache for the run (backend/worker/timing_cache.py), made by the
# first pytest process (xdist's controller, or the only one) and shared by its workers, the
# in-process engines and the servers the tests start (they inherit the environment): each
# machine/config is timed once per run, never read from an earlier run.
if "LLM_TEST_STEP_COST_CACHE" not in os.environ:
    os.environ["LLM_TEST_STEP_COST_CACHE"] = tempfile.mkdtemp(prefix="llm-step-cost-")
    atexit.register(shutil.rmtree, os.environ["LLM_TEST_STEP_COST_CACHE"], True)
os.environ["LLM_STEP_COST_CACHE"] = os.environ["LLM_TEST_STEP_COST_CACHE"]
# Likewise one folder for the run's transformers references that modules on different workers
# share (``hf_greedy_shared``).
if "LLM_TEST_REFERENCES" not in os.environ:
    os.environ["LLM_TEST_REFERENCES"] = tempfile.mkdtemp(prefix="llm-test-references-")
    atexit.register(shutil.rmtree, os.environ["LLM_TEST_REFERENCES"], True)

REPO_ROOT = Path(__file__).resolve().parents[1]

# The modules that take longest on one core of the 2-core AVX2 EPYC (Zen 3), longest first
# (worker-seconds in `make test`'s no-server phase, 2026-11-27). `make test` hands xdist the modules in collection
# order (--no-loadscope-reorder), and this order puts these first: xdist's own order (by number
# of tests) left one-test modules of a minute or more (the compile check, bf16 agreement) to the
# end of one worker while the other had finished. The rest follow in their usual order.
LONGEST_MODULES_FIRST = (
    "test_hf_equality.py",          # ~230
    "test_benchmark_scripts.py",    # ~150
    "test_lora.py",                 # ~105
    "test_kernels_compile.py",      # ~85
    "test_bf16_agreement.py",       # ~70
    "test_triton_engine.py",        # ~65
    "test_kernels.py",              # ~60
    "test_speculative.py",          # ~35
    "test_structured_outputs.py",   # ~35
)


@pytest.hookimpl(tryfirst=True)     # before `-m` deselects: the no-server run sees every test
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # `make test` collects the server tests only from the files that say "pytest.mark.server"
    # (Makefile, SERVER_TEST_FILES): a server test marked another way would never run.
    server_paths = {item.path for item in items if item.get_closest_marker("server")}
    for path in server_paths:       # each file read once, not once per test
        if "pytest.mark.server" not in path.read_text():
            raise pytest.UsageError(f"{path.name}: mark server tests with pytest.mark.server (Makefile)")
    rank = {name: i for i, name in enumerate(LONGEST_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))    # stable: the rest keep their order


MODEL_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"

# Deterministic English prose; prompts of exact token lengths are sliced from its tokens.
_PROSE = (
    "Continuous batching lets requests join and leave the running batch at every step. "
    "A paged key-value cache stores attention state in fixed-size blocks, like virtual memory, "
    "so that no request reserves memory for a length it may never reach. When many users share "
    "a long system prompt, the blocks holding it are computed once and reused by reference. "
    "The scheduler chunks long prompts so that decoding requests are never starved, and when "
    "memory runs out it preempts the newest request and recomputes it later. "
    "In the old days a server collected a batch, ran it to completion, and only then looked at "
    "the queue again; the longest request held everybody else hostage. "
)


# The GPU run (benchmarks/gpu_proof.py) carries the model folder without its weights (517 MB do
# not fit a device call) and sets this: the tests that need the checkpoint are then reported
# as skipped, with this reason, instead of failing. `make test` never sets it.
WITHOUT_CHECKPOINT = os.environ.get("LLM_TESTS_WITHOUT_CHECKPOINT") == "1"


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The converted SmolLM2 checkpoint (weights included)."""
    weights = MODEL_DIR / "model.safetensors"
    if not weights.is_file() or weights.stat().st_size == 0:
        if WITHOUT_CHECKPOINT:
            pytest.skip("needs the SmolLM2 checkpoint (not carried: LLM_TESTS_WITHOUT_CHECKPOINT=1)")
        pytest.fail(f"{MODEL_DIR} is missing: run `make model` (make test does it)")
    return MODEL_DIR


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """The SmolLM2 folder for its tokenizer alone: tiny random models reuse it."""
    if not (MODEL_DIR / "tokenizer.json").is_file():
        pytest.fail(f"{MODEL_DIR} is missing: run `make model` (make test does it)")
    return MODEL_DIR


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def prose_ids(tokenizer) -> list[int]:
    ids: list[int] = []
    while len(ids) < 2000:
        ids += tokenizer(_PROSE * 4).input_ids
    return ids


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding effects)."""
    outs = []
    with torch.no_grad():
        for ids in prompts:
            generated = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                       attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            outs.append(generated[0, len(ids):].tolist())
    return outs


def hf_greedy_shared(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """``hf_greedy``, computed once per test run for these prompts: the first worker to ask
    computes it under a file lock and writes it to the run's folder, a worker asking later
    waits and reads it. (The float32 references of the mixed prompts take ~30 s on one core
    and two modules, often on different workers, compare against them.) Never read across
    runs: the folder is the run's own."""
    from filelock import FileLock

    key = hashlib.sha256(json.dumps([str(model.config._name_or_path), str(model.dtype), prompts,
                                     max_new_tokens]).encode()).hexdigest()[:24]
    path = Path(os.environ["LLM_TEST_REFERENCES"]) / f"{key}.json"
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            return json.loads(path.read_text())
        outputs = hf_greedy(model, prompts, max_new_tokens)
        path.write_text(json.dumps(outputs))
        return outputs


@pytest.fixture(scope="session")
def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session", autouse=True)
def auto_dtype_is_float32():
    """The oracle is transformers in float32, so in-process engines with ``dtype=auto`` run
    float32 on every machine: the dtype rule sees this CPU without its native-bfloat16 flags
    (on one that has them it would pick bfloat16). Tests of the rule itself hand
    ``auto_dtype`` the feature sets they mean; server tests pass ``dtype=float32``."""
    from backend.model.cpu_features import CpuFeatures, detect
    from backend.worker import model_runner

    without_bf16 = CpuFeatures(detect().flags - {"avx512_bf16", "amx_bf16"})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_runner, "detect", lambda: without_bf16)
        yield


@pytest.fixture
def fp16_matmuls_off():
    """Our bfloat16 kernel's float16 version off for the test (the threshold restored after). It
    is a process-wide switch that a bfloat16 engine started earlier in this worker may have left
    on (the start-up timing turns it on where it wins), and the kernel tests that call the library
    directly hold the other versions to their own, tighter, error bounds."""
    from backend.model.cpu_linear import bf16_fp16_rows, use_bf16_fp16_rows

    before = bf16_fp16_rows()
    use_bf16_fp16_rows(0)
    yield
    use_bf16_fp16_rows(before)


@pytest.fixture
def prefill_bf16_own():
    """The build's own bfloat16 prefill function for the test (the selection restored after). The
    selection is process-wide, a bfloat16 engine started earlier in this worker may have left the
    float16 one selected (the start-up timing selects it where it wins), and the kernel tests that
    call the library directly hold the build's own functions to their own, tighter, error bounds."""
    from kernels import cpu_native

    before = cpu_native.selected_prefill_bf16_kernel()
    cpu_native.select_prefill_bf16_kernel("dp")
    yield
    cpu_native.select_prefill_bf16_kernel(before)


# For an engine or server test that is not about prefill chunk sizes: a fixed token budget
# instead of chunks sized to the ITL target, so that its configuration is not calibrated at
# start-up (8-15 s on the 2-core AVX2 EPYC, Zen 3, for each configuration first seen in a run).
# The calibrated path keeps its own tests: test_hf_equality's block16, preemption and
# shared-prefix configs (token-exact against transformers), test_timing_cache, and the session
# server below, the chaos soak's and the cluster's replicas, which keep the default.
FIXED_BUDGET = dict(itl_target_ms=0.0)
FIXED_BUDGET_PARAMS = {key: f"{value:g}" for key, value in FIXED_BUDGET.items()}   # as server parameters


@pytest.fixture(scope="session")
def server(tmp_path_factory, model_dir: Path):
    """The real tritonserver with the llm model, shared by the server tests of a session.
    Speculative decoding is on, as a user would turn it on: it must change no output (greedy
    and seeded outputs are compared with an engine without it). Drafts up to running batches of
    32 (the default is 4), so that tests send their drafted samples as one request of n > 4."""
    from server.launch import TritonServer, free_ports

    log = tmp_path_factory.mktemp("triton") / "server.log"
    srv = TritonServer(*free_ports(3), params={"speculative_method": "ngram", "dtype": "float32",
                                               "speculative_max_batch_size": "32"},
                       log_file=log)
    srv.start(timeout=300)
    yield srv
    srv.stop()
