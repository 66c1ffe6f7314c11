"""Per-step outputs: deltas and the cumulative views (token_ids, text, logprobs) agree at
every step, and an output read after later steps still shows its own step (the views
are read lazily from append-only state, not copied)."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend import Engine, EngineConfig, SamplingParams
from tests.conftest import FIXED_BUDGET


def test_cumulative_views_are_per_step_snapshots(model_dir: Path, prose_ids: list[int]) -> None:
    engine = Engine(EngineConfig(model=str(model_dir), **FIXED_BUDGET, num_kv_blocks=256))
    params = [SamplingParams(max_tokens=40, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=40, temperature=0.0, stop=[" the"]),   # truncated by a stop string
              SamplingParams(max_tokens=25, temperature=0.8, seed=7)]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", prose_ids[20 * i: 20 * i + 30], p)
    history: dict[str, list] = {f"r{i}": [] for i in range(len(params))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            history[out.request_id].append(out)
    for request_id, outputs in history.items():
        final = outputs[-1]
        assert final.finished
        ids: list[int] = []
        text = ""
        for step, out in enumerate(outputs):            # read after the whole generation
            ids += out.new_token_ids
            text += out.new_text
            assert out.token_ids == ids, f"{request_id} step {step}"
            assert out.num_output_tokens == len(ids)
            assert out.text == text, f"{request_id} step {step}: {out.text!r} != {text!r}"
            if out.new_logprobs is not None:
                assert out.logprobs == final.logprobs[:len(ids)]
                assert len(out.logprobs) == len(ids)
        assert final.token_ids == ids and final.text == text
    assert history["r1"][-1].stop_reason == " the"
    assert " the" not in history["r1"][-1].text
    assert history["r0"][-1].logprobs is not None and history["r1"][-1].logprobs is None


def test_merged_outputs_equal_the_deltas_in_sequence(model_dir: Path, prose_ids: list[int]) -> None:
    """A sender that fell behind merges a stream's queued deltas: the merge of any run of
    consecutive outputs carries their concatenated deltas and the last one's state."""
    engine = Engine(EngineConfig(model=str(model_dir), **FIXED_BUDGET, num_kv_blocks=64))
    engine.add_request("a", prose_ids[:20], SamplingParams(max_tokens=12, temperature=0.0, logprobs=1))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    merged = outputs[2]
    for out in outputs[3:]:
        merged = merged.merged_with(out)
    assert merged.new_token_ids == sum((o.new_token_ids for o in outputs[2:]), [])
    assert merged.new_text == "".join(o.new_text for o in outputs[2:])
    assert merged.new_logprobs == sum((o.new_logprobs for o in outputs[2:]), [])
    assert merged.finished and merged.finish_reason == "length"
    assert merged.num_output_tokens == 12 and merged.token_ids == outputs[-1].token_ids
    assert merged.text == outputs[-1].text
    other = Engine(EngineConfig(model=str(model_dir), **FIXED_BUDGET, num_kv_blocks=64)).generate([prose_ids[:5]])[0]
    with pytest.raises(ValueError):
        outputs[0].merged_with(other)
