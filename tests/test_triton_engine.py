"""The engine's greedy-equality checks again, with the Triton attention path forced on.

On CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so the
model is a tiny random Llama (2 layers, 8 query heads of 64 sharing one KV head) built here
from a config; transformers on the same weights is the oracle. Also checks the padded
decode batches that CUDA graphs replay (run eagerly here: ``DecodeGraphs(capture=False)``).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from backend import Engine, EngineConfig, SamplingParams
from backend.worker.cuda_graphs import DecodeGraphs, MixedGraphs, capture_sizes, collector_paused, mixed_token_sizes
from tests.conftest import hf_greedy
from tests.test_hf_equality import CONFIGS, assert_same_tokens, mixed_prompts, run_engine  # noqa: F401 (fixture)
from tests.test_tiny_architectures import make_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer_dir: Path):
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf_model = make_tiny_model("llama", folder, tokenizer_dir)
    return folder, hf_model


# The interpreter's time grows with the prompt tokens (one program per query block and head):
# the mixed prompts up to 150 tokens (9 of 12, 400 tokens in all) and a 96-token shared prefix
# keep every batch kind while a test takes ~15-25 s instead of ~40 s on a 2-core AVX2 CPU.
MAX_PROMPT_TOKENS = 150
SHARED_PREFIX_TOKENS = 96
# Decode steps are most of the interpreter's time (~0.45 s a step of 9 sequences against
# ~1 s for the whole 400-token prefill, on one core of the AVX2 EPYC): 12 new tokens.
TRITON_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def prompts(mixed_prompts) -> list[list[int]]:
    return [p for p in mixed_prompts if len(p) <= MAX_PROMPT_TOKENS]


@pytest.fixture(scope="module")
def shared_prompts(prose_ids: list[int]) -> list[list[int]]:
    prefix = prose_ids[:SHARED_PREFIX_TOKENS]
    return [prefix + prose_ids[500 + 13 * i: 500 + 13 * i + 5 + 9 * i] for i in range(8)]


@pytest.fixture(scope="module")
def reference(tiny_llama, prompts) -> list[list[int]]:
    return hf_greedy(tiny_llama[1], prompts, TRITON_NEW_TOKENS)


@pytest.fixture(scope="module")
def shared_reference(tiny_llama, shared_prompts) -> list[list[int]]:
    return hf_greedy(tiny_llama[1], shared_prompts, TRITON_NEW_TOKENS)


def triton_config(folder: Path, **overrides) -> EngineConfig:
    # Fixed token budget: step times under the Triton interpreter say nothing about a GPU, and
    # these tests are about the kernels, not chunk sizing (tests/test_chunk_scheduling.py).
    # float32, the oracle's dtype: on CUDA dtype=auto means bfloat16, whose rounding changes
    # greedy tokens after a dozen steps (seen on an H200).
    return EngineConfig(model=str(folder), attention_backend="triton",
                        **{"itl_target_ms": 0.0, "dtype": "float32", **overrides})


# The configs that hand the kernels different batches: 4-token blocks, chunks over cached
# context beside decodes, whole prompts in one launch. Block size 16 with chunks and decodes is
# test_padded_decode_batches_match[triton]; the priority and static configs change which
# requests share a step, not what a step looks like to a kernel (test_hf_equality.py runs them
# on the CPU kernels). The interpreter takes 35-45 s a config on a 2-core AVX2 CPU.
TRITON_CONFIGS = ("block4", "chunked_small_budget", "no_chunking")


@pytest.mark.parametrize("name", TRITON_CONFIGS)
def test_triton_greedy_matches_transformers(name: str, tiny_llama, prompts, reference) -> None:
    engine, ours = run_engine(triton_config(tiny_llama[0], **CONFIGS[name]), prompts, TRITON_NEW_TOKENS)
    assert engine.runner.attention_backend == "triton"
    assert engine.runner.model.fused_layer_ops == "triton"    # norms, RoPE and the cache write too
    assert_same_tokens(ours, reference)


def test_triton_preemption_keeps_tokens_exact(tiny_llama, prompts, reference) -> None:
    # 16 blocks of 16 tokens for 9 requests of 400 prompt tokens and 108 generated.
    engine, ours = run_engine(triton_config(tiny_llama[0], block_size=16, num_kv_blocks=16,
                                            max_num_batched_tokens=64), prompts, TRITON_NEW_TOKENS)
    assert engine.stats().num_preemptions > 0
    assert_same_tokens(ours, reference)


def test_triton_prefix_hits(tiny_llama, shared_prompts, shared_reference) -> None:
    # Block size 32 and a 40-token budget: prefix hits (3 blocks), then chunks over the cached prefix.
    engine, ours = run_engine(triton_config(tiny_llama[0], block_size=32, num_kv_blocks=256,
                                            max_num_batched_tokens=40, max_num_seqs=6), shared_prompts,
                              TRITON_NEW_TOKENS)
    assert engine.stats().prefix_cache_hit_tokens > 0
    assert_same_tokens(ours, shared_reference)


def eager_engine_for_graphs(tiny_llama, backend: str) -> tuple[Engine, bool]:
    """An engine whose graphs a test makes itself, and whether they capture (on CUDA with the
    Triton kernels only: the reference attention syncs with the host, which a graph cannot
    hold). Fixed token budget: the steps must be the same whatever the machine's speed, so
    that some step has a size the graphs pad."""
    engine = Engine(EngineConfig(model=str(tiny_llama[0]), attention_backend=backend, block_size=16,
                                 num_kv_blocks=512, max_num_seqs=16, max_num_batched_tokens=128, itl_target_ms=0.0,
                                 dtype="float32", enforce_eager=True))
    assert engine.runner.decode_graphs is None and engine.runner.mixed_graphs is None
    return engine, engine.runner.device.type == "cuda" and backend == "triton"


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_padded_decode_batches_match(backend: str, tiny_llama, prompts, reference) -> None:
    """Decode steps padded to the CUDA-graph batch sizes (dummy rows with slot -1) change
    nothing: same tokens, and the padding writes no KV (invariants and no leaks hold)."""
    engine, capture = eager_engine_for_graphs(tiny_llama, backend)
    runner = engine.runner
    runner.decode_graphs = DecodeGraphs(runner.model, runner.buffers, runner.kv_caches, capture_sizes(16), runner.max_model_len,
                                       capture=capture)
    padded_steps = 0
    original_run = runner.decode_graphs.run

    def counting_run(num_seqs: int):
        nonlocal padded_steps
        padded_steps += num_seqs not in runner.decode_graphs.batch_sizes
        return original_run(num_seqs)

    runner.decode_graphs.run = counting_run
    outputs = engine.generate(prompts, SamplingParams(max_tokens=TRITON_NEW_TOKENS, temperature=0.0))
    assert padded_steps > 0, "no decode step was padded"
    assert_same_tokens([o.token_ids for o in outputs], reference)
    engine.check_invariants()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_padded_mixed_steps_match(backend: str, tiny_llama, prompts, reference) -> None:
    """Steps with prefill chunks padded to the mixed-step graphs' token counts (an extra
    sequence of dummy tokens with slot -1, empty sequences after it, every sequence row of
    the buffers in the launch) change nothing: same tokens, no KV written by the padding."""
    engine, capture = eager_engine_for_graphs(tiny_llama, backend)
    runner = engine.runner
    graphs = MixedGraphs(runner.model, runner.buffers, runner.kv_caches, mixed_token_sizes(runner.max_tokens),
                         runner.max_logits_rows(), runner.max_model_len, capture=capture)
    runner.mixed_graphs = graphs
    padded_steps = 0
    original_run = graphs.run

    def counting_run(num_tokens: int, num_seqs: int, num_logits: int):
        nonlocal padded_steps
        padded_steps += num_tokens not in graphs.token_sizes
        before = [key.clone() for key, _ in runner.kv_caches]
        logits = original_run(num_tokens, num_seqs, num_logits)
        # Only the step's own slots were written: the padding tokens wrote nothing.
        written = set(runner.buffers.slot_mapping[:num_tokens].tolist()) - {-1}
        for old, (key, _) in zip(before, runner.kv_caches):
            differs = (old != key) & ~(old.isnan() & key.isnan())
            assert set(differs.flatten(2).any(-1).flatten().nonzero().flatten().tolist()) <= written
        return logits

    graphs.run = counting_run
    outputs = engine.generate(prompts, SamplingParams(max_tokens=TRITON_NEW_TOKENS, temperature=0.0))
    assert padded_steps > 0, "no step was padded"
    assert_same_tokens([o.token_ids for o in outputs], reference)
    engine.check_invariants()


def test_mixed_token_sizes_pad_to_at_most_twice() -> None:
    assert mixed_token_sizes(128) == [16, 32, 64, 128]
    assert mixed_token_sizes(2048)[-2:] == [1024, 2048]
    assert mixed_token_sizes(100) == [16, 32, 64, 100]
    for tokens in range(16, 2049):
        size = next(s for s in mixed_token_sizes(2048) if s >= tokens)
        assert size < 2 * tokens


def test_separate_device_buffers_copy_only_what_is_read(tiny_llama, prompts, reference) -> None:
    """The CUDA layout of step inputs (host buffers copied into separate device buffers,
    block tables only up to the columns in use), with the "device" on CPU and its buffers
    poisoned: a read of anything not copied this step would break the tokens or raise."""
    from backend.worker.model_runner import StepBuffers

    engine = Engine(EngineConfig(model=str(tiny_llama[0]), block_size=16, num_kv_blocks=512, max_num_seqs=16,
                                 max_num_batched_tokens=64, dtype="float32", enforce_eager=True))
    runner = engine.runner
    device_buffers = StepBuffers.allocate(runner.max_tokens, runner.max_seqs, runner.max_blocks_per_seq,
                                          runner.device)
    for tensor in vars(device_buffers).values():
        tensor.fill_(10**6)                     # out of range for every field
    runner.buffers = device_buffers
    runner.decode_graphs = DecodeGraphs(runner.model, runner.buffers, runner.kv_caches, capture_sizes(16), runner.max_model_len,
                                       capture=False)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=TRITON_NEW_TOKENS, temperature=0.0))
    assert_same_tokens([o.token_ids for o in outputs], reference)
    assert (device_buffers.block_tables == 10**6).any(), "columns past the sequences' blocks were copied"
    engine.check_invariants()


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


class _Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    freed: list[str] = []

    def __init__(self, name: str) -> None:
        self.name, self.me = name, self

    def __del__(self) -> None:
        _Cycle.freed.append(self.name)


def test_collector_paused_frees_cycles_first_then_none_until_restored() -> None:
    """What graph capture relies on (an earlier engine's CUDAGraphs freed mid-capture once
    invalidated one): garbage from before is collected on entry, garbage made inside waits."""
    _Cycle.freed.clear()
    assert gc.isenabled()
    _Cycle("before")
    with collector_paused():
        assert _Cycle.freed == ["before"] and not gc.isenabled()
        for i in range(20_000):              # far past generation 0's threshold
            _Cycle(f"inside-{i}")
        assert _Cycle.freed == ["before"]
    assert gc.isenabled()
    gc.collect()
    assert len(_Cycle.freed) == 20_001
    gc.disable()                             # a caller that had it off keeps it off
    try:
        with pytest.raises(RuntimeError):
            with collector_paused():
                raise RuntimeError
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch, tiny_llama) -> None:
    import kernels

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        kernels.resolve_backend("triton", __import__("torch").device("cpu"))
    assert kernels.resolve_backend("auto", __import__("torch").device("cpu")) == "cpu"


def test_async_scheduling_with_separate_device_buffers(tiny_llama, prompts, reference) -> None:
    """async_scheduling's inputs in the CUDA layout: the pending tokens' rows go over with the
    step's other inputs into separate (poisoned) device buffers and are filled there from the
    step before's tokens; greedy tokens stay transformers'. On a GPU the decode graphs read
    them (the engine captures its own)."""
    from backend.worker.model_runner import StepBuffers

    engine = Engine(EngineConfig(model=str(tiny_llama[0]), block_size=16, num_kv_blocks=512, max_num_seqs=16,
                                 max_num_batched_tokens=64, dtype="float32", itl_target_ms=0.0,
                                 async_scheduling=True))
    runner = engine.runner
    if runner.device.type == "cpu":
        runner.buffers = StepBuffers.allocate(runner.max_tokens, runner.max_seqs, runner.max_blocks_per_seq,
                                              runner.device)
        for tensor in vars(runner.buffers).values():
            tensor.fill_(10**6)
    outputs = engine.generate(prompts, SamplingParams(max_tokens=TRITON_NEW_TOKENS, temperature=0.0))
    assert_same_tokens([o.token_ids for o in outputs], reference)
    assert engine.num_overlapped_steps > 0
    engine.check_invariants()


def test_an_overlapped_launch_never_waits_for_the_device(tiny_llama, prompts) -> None:
    """On a GPU: launching a step (packing, the forward or its graph, choosing the tokens,
    queuing their copy) makes no call that waits for the device, so it runs while the step
    before computes. torch's sync debug mode turns any such call into an error."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("NOT RUN: needs a CUDA device (a CPU step is synchronous by nature)")
    engine = Engine(triton_config(tiny_llama[0], async_scheduling=True, max_num_seqs=16))
    for i, prompt in enumerate(prompts[:6]):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=TRITON_NEW_TOKENS, temperature=0.0,
                                                          ignore_eos=True))
    real_launch, launches, errors = engine._launch, [], []

    def launch(sched):
        # The engine would run a launch that raised again synchronously: keep what it raised.
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_launch(sched)
        except Exception as exc:
            errors.append(exc)
            raise
        finally:
            torch.cuda.set_sync_debug_mode("default")
            launches.append(len(sched.requests))

    engine._launch = launch
    while engine.has_unfinished_requests():
        engine.step()
    assert not errors, errors[0]
    assert engine.num_overlapped_steps > 0 and launches
    engine.check_invariants()
