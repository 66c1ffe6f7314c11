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


def test_config_restates_no_engine_default() -> None:
    """EngineConfig is the one source of defaults: config.pbtxt may only set engine fields,
    and only to values other than their defaults."""
    params = pbtxt_parameters(CONFIG.read_text())
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(params) <= fields
    default = EngineConfig()
    for key, value in params.items():
        assert getattr(EngineConfig.from_dict({key: value}), key) != getattr(default, key), key


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
    config = EngineConfig.from_dict(params)
    assert config.batching == "static" and config.max_waiting_requests == 8
    # Setting a key twice replaces it rather than adding a second line.
    again = repository_with_params({"batching": "continuous"}, tmp_path / "again")
    assert pbtxt_parameters((again / "llm" / "config.pbtxt").read_text()) == {"batching": "continuous"}
    assert CONFIG.read_text() == original
    with pytest.raises(ValueError):
        repository_with_params({"no_such_key": "1"}, tmp_path / "other")


def test_renamed_keys_still_configure_the_engine(tmp_path: Path) -> None:
    """A config.pbtxt or --param written for an earlier release keeps working: cpu_fused_ops
    is fused_layer_ops now."""
    params = pbtxt_parameters((repository_with_params({"cpu_fused_ops": "false"}, tmp_path) / "llm"
                               / "config.pbtxt").read_text())
    assert EngineConfig.from_dict(params).fused_layer_ops is False
    assert EngineConfig.from_dict({"cpu_fused_ops": "true"}).fused_layer_ops is True
