"""n > 1 (backend/engine/parallel_sampling.py): children equal the single requests with
seed + i, the prompt's blocks are computed once, cancellation ends every child and frees its
blocks, the children count against the queue limit; and through the real server, the
vLLM backend's response shape (one element per completion)."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest

from backend import Engine, EngineConfig, InvalidRequestError, QueueFullError, SamplingParams
from backend.engine.loop import EngineLoop
from backend.engine.parallel_sampling import ParallelOutput, child_params
from tests.grpc_requests import stream_request, vllm_inputs
from tests.conftest import FIXED_BUDGET


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), **FIXED_BUDGET, num_kv_blocks=512, max_num_seqs=16,
                               max_waiting_requests=12))


def run(loop: EngineLoop, request_id: str, prompt, params: SamplingParams, timeout: float = 120) -> list:
    outputs: queue.Queue = queue.Queue()
    loop.submit(request_id, prompt, params, outputs.put)
    items = []
    while True:
        item = outputs.get(timeout=timeout)
        items.append(item)
        if isinstance(item, BaseException) or item.finished:
            return items


def test_child_i_equals_the_single_request_with_seed_plus_i(engine: Engine, prose_ids: list[int]) -> None:
    prompt = prose_ids[:40]
    params = SamplingParams(n=4, seed=1234, temperature=1.0, top_p=0.9, max_tokens=24)
    singles = engine.generate([prompt] * 4, [child_params(params, i) for i in range(4)])
    loop = EngineLoop(engine).start()
    try:
        items = run(loop, "parent", prompt, params)
    finally:
        loop.stop()
    final = items[-1]
    assert isinstance(final, ParallelOutput) and final.finished and len(final.outputs) == 4
    for i, (child, single) in enumerate(zip(final.outputs, singles)):
        assert child.token_ids == single.token_ids, f"child {i}"
        assert child.text == single.text and child.finish_reason == single.finish_reason
    # Streamed deltas of each child concatenate to its text.
    for i in range(4):
        assert "".join(item.outputs[i].new_text for item in items) == final.outputs[i].text
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1   # different seeds, different samples
    engine.check_invariants()


def test_the_prompts_full_blocks_are_computed_once(engine: Engine, prose_ids: list[int]) -> None:
    prompt = prose_ids[100:100 + 300]           # 18.75 blocks of 16: not block-aligned
    engine.kv_cache.reset_prefix_cache()
    before = engine.stats().prompt_tokens_total
    loop = EngineLoop(engine).start()
    try:
        run(loop, "eight", prompt, SamplingParams(n=8, seed=0, temperature=0.8, max_tokens=4))
    finally:
        loop.stop()
    computed = engine.stats().prompt_tokens_total - before
    block_size = engine.config.block_size
    assert computed <= len(prompt) + 8 * block_size, computed
    assert computed < 2 * len(prompt)
    engine.check_invariants()


def test_cancelling_the_parent_ends_every_child_and_frees_its_blocks(engine: Engine, prose_ids: list[int]) -> None:
    loop = EngineLoop(engine).start()
    outputs: queue.Queue = queue.Queue()
    try:
        loop.submit("cancel-me", prose_ids[:30], SamplingParams(n=5, max_tokens=400, ignore_eos=True), outputs.put)
        first = outputs.get(timeout=60)
        assert isinstance(first, ParallelOutput) and not first.finished
        loop.abort("cancel-me")
        while True:
            item = outputs.get(timeout=60)
            if item.finished:
                break
        assert {c.finish_reason for c in item.outputs} == {"abort"}
        assert loop.wait_idle(10)
    finally:
        loop.stop()
    engine.check_invariants()
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.pool.num_blocks


def test_children_count_against_the_queue_limit_and_best_of_is_refused(engine: Engine) -> None:
    loop = EngineLoop(engine)      # not started: nothing drains the inbox
    loop.submit("fills", "Hello", SamplingParams(n=10, max_tokens=4), lambda item: None)
    with pytest.raises(QueueFullError):
        loop.submit("too-many", "Hello", SamplingParams(n=3, max_tokens=4), lambda item: None)
    loop.submit("fits", "Hello", SamplingParams(n=2, max_tokens=4), lambda item: None)
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams(n=2, best_of=3)
    with pytest.raises(InvalidRequestError, match="n: "):
        SamplingParams(n=0)


# ---- through the real server ----------------------------------------------------------------
def stream_infer(server, sampling: dict, stream: bool, **flags: bool) -> list:
    responses = stream_request(server, vllm_inputs("Write a haiku about paged attention.", stream, sampling, **flags))
    assert all(error is None for _, error in responses), responses[-1][1]
    return [result for result, _ in responses]


@pytest.mark.server
@pytest.mark.parametrize("stream", [True, False])
def test_server_returns_n_completions_per_response(server, stream: bool) -> None:
    # min_tokens: a child whose first draw is EOS would have no text to compare.
    sampling = {"n": 3, "seed": 5, "temperature": 1.0, "max_tokens": 12, "min_tokens": 2}
    results = stream_infer(server, sampling, stream, exclude_input_in_output=True, return_finish_reason=True,
                           return_num_output_tokens=True)
    assert all(r.as_numpy("text_output").shape == (3,) for r in results)
    texts = ["".join(r.as_numpy("text_output")[i].decode() for r in results) for i in range(3)]
    counts = [sum(int(r.as_numpy("num_output_tokens")[i]) for r in results) for i in range(3)]
    finals = [reason.decode() for reason in results[-1].as_numpy("finish_reason")]
    assert all(reason in ("stop", "length") for reason in finals)
    assert all(0 < count <= 12 for count in counts) and all(texts)
    # Child i is the single request with seed + i.
    for i in range(3):
        single = stream_infer(server, {**sampling, "n": 1, "seed": 5 + i}, False, exclude_input_in_output=True)
        assert single[-1].as_numpy("text_output")[0].decode() == texts[i]
