"""Per-step outputs: deltas and the cumulative views (token_ids, text, logprobs) agree at
every step, and an output read after later steps still shows its own step (the views
are read lazily from append-only state, not copied)."""

from __future__ import annotations

from pathlib import Path

from backend import Engine, EngineConfig, SamplingParams


def test_cumulative_views_are_per_step_snapshots(model_dir: Path, prose_ids: list[int]) -> None:
    engine = Engine(EngineConfig(model=str(model_dir), num_kv_blocks=256))
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
