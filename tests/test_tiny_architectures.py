"""Greedy equality with transformers for tiny random-weight qwen2 (qkv bias, untied lm_head)
and qwen3 (q/k norm, tied embeddings) models, built here from a config: no download."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from backend import Engine, EngineConfig, SamplingParams
from tests.conftest import hf_greedy
from tests.tiny_models import save_tiny_model

MAX_NEW_TOKENS = 20


def make_tiny_model(kind: str, folder: Path, tokenizer_dir: Path):
    """kind: qwen2, qwen3, or llama (8 query heads of 64 sharing one KV head, 2 layers: few
    kernel programs, so that Triton's interpreter stays fast)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1,
                  # Wide logits: random models at the usual 0.02 are near-uniform, so greedy
                  # argmax would hinge on float rounding rather than on the computation.
                  initializer_range=0.25)
    if kind == "llama":
        common.update(hidden_size=512, intermediate_size=768, num_hidden_layers=2, num_key_value_heads=1)
        config, cls = LlamaConfig(tie_word_embeddings=True, rope_theta=10000.0, **common), LlamaForCausalLM
    elif kind == "qwen2":
        config, cls = Qwen2Config(tie_word_embeddings=False, rope_theta=10000.0, **common), Qwen2ForCausalLM
    else:
        config, cls = Qwen3Config(tie_word_embeddings=True, head_dim=32, rope_theta=1000000.0, **common), Qwen3ForCausalLM
    torch.manual_seed({"qwen2": 0, "qwen3": 1, "llama": 2}[kind])
    model = cls(config).float().eval()
    with torch.no_grad():  # transformers initialises biases to 0 and norms to 1: make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    return save_tiny_model(model, folder, tokenizer_dir)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_tiny_model_matches_transformers(kind: str, tmp_path: Path, tokenizer_dir: Path, prose_ids: list[int]) -> None:
    hf_model = make_tiny_model(kind, tmp_path, tokenizer_dir)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == kind
    if kind == "qwen2":
        assert "lm_head.weight" in _tensor_names(tmp_path)
    prompts = [prose_ids[3 * i: 3 * i + n] for i, n in enumerate([1, 2, 5, 11, 16, 17, 40, 90, 160, 300])]
    reference = hf_greedy(hf_model, prompts, MAX_NEW_TOKENS)
    for engine_config in (dict(block_size=16, num_kv_blocks=256),
                          dict(block_size=4, num_kv_blocks=120, max_num_batched_tokens=32, max_num_seqs=4)):
        engine = Engine(EngineConfig(model=str(tmp_path), **engine_config))
        outputs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
        for i, (out, ref) in enumerate(zip(outputs, reference, strict=True)):
            assert out.token_ids == ref, f"{kind} {engine_config} prompt {i}: {out.token_ids} != {ref}"
        engine.check_invariants()


def _tensor_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_the_registry_names_every_family_and_refuses_the_rest(tmp_path: Path) -> None:
    from backend.model.architecture import ModelArchitecture
    from backend.model.registry import FAMILIES, family_of

    for model_type, family in FAMILIES.items():
        assert family.model_type == model_type and callable(family.model_class())
    config = {"model_type": "deepseek_v3", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported model_type 'deepseek_v3' \(supported: \('llama'"):
        ModelArchitecture.from_folder(tmp_path)
    # A family's switches reach the architecture: qwen2's q/k/v biases, qwen3's q/k norms,
    # mistral's window capping the context.
    for model_type, expect in (("qwen2", dict(qkv_bias=True, qk_norm=False)),
                               ("qwen3", dict(qkv_bias=False, qk_norm=True)),
                               ("llama", dict(qkv_bias=False, qk_norm=False))):
        (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
        arch = ModelArchitecture.from_folder(tmp_path)
        assert (arch.qkv_bias, arch.qk_norm) == (expect["qkv_bias"], expect["qk_norm"]), model_type
        assert family_of(model_type).model_type == model_type
    # mistral's window on every layer; qwen2's on the layers its layer_types name (as
    # transformers reads them); no window, no windowed layer.
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mistral", "sliding_window": 64,
                                                       "max_position_embeddings": 4096}))
    arch = ModelArchitecture.from_folder(tmp_path)
    assert (arch.max_position_embeddings, arch.layer_windows, arch.release_window) == (4096, (64,), 64)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3, "model_type": "qwen2",
                                                       "sliding_window": 32, "layer_types": [
                                                           "full_attention", "sliding_attention",
                                                           "sliding_attention"]}))
    arch = ModelArchitecture.from_folder(tmp_path)
    assert (arch.layer_windows, arch.release_window) == ((None, 32, 32), None)
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen2", "sliding_window": 32}))
    assert ModelArchitecture.from_folder(tmp_path).layer_windows == (None,)
