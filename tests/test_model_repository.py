"""The Triton model repository stays in sync with the engine's single source of defaults."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from backend import EngineConfig
from server.launch import MODEL_REPOSITORY, repository_with_params

CONFIG = MODEL_REPOSITORY / "llm" / "config.pbtxt"


def pbtxt_parameters(text: str) -> dict[str, str]:
    return dict(re.findall(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', text))


def test_every_engine_field_is_a_parameter_with_the_same_default() -> None:
    params = pbtxt_parameters(CONFIG.read_text())
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(params) == fields
    assert EngineConfig.from_dict(params) == EngineConfig()


def test_config_is_decoupled_and_vllm_compatible() -> None:
    text = CONFIG.read_text()
    assert re.search(r"model_transaction_policy\s*\{\s*decoupled:\s*true", text)
    for name in ("text_input", "input_ids", "stream", "sampling_parameters", "exclude_input_in_output",
                 "return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                 "return_num_cached_tokens", "return_logprobs", "text_output", "finish_reason",
                 "num_input_tokens", "num_output_tokens", "num_cached_tokens", "logprobs"):
        assert f'name: "{name}"' in text


def test_param_overrides_touch_only_a_copy(tmp_path: Path) -> None:
    original = CONFIG.read_text()
    copy = repository_with_params({"batching": "static", "max_waiting_requests": "8"}, tmp_path)
    params = pbtxt_parameters((copy / "llm" / "config.pbtxt").read_text())
    assert params["batching"] == "static" and params["max_waiting_requests"] == "8"
    assert CONFIG.read_text() == original
    with pytest.raises(ValueError):
        repository_with_params({"no_such_key": "1"}, tmp_path / "other")
