"""Phi-3 (``model_type`` phi3): greedy tokens equal transformers' float32 on tiny random models
saved with ``save_pretrained`` (the SmolLM2 tokenizer reused), with plain RoPE and with
LongRoPE (short factors not all 1, attention factor != 1), by default, in chunked prefill, with
preemptions and through the Triton kernels; ``load_format=dummy`` loads. LongRoPE picks its factors per
position: the cos/sin rows past ``original_max_position_embeddings`` are transformers' long
ones, those before it the short ones. Partial rotary is refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from backend import Engine, EngineConfig, SamplingParams
from backend.model.architecture import ModelArchitecture
from tests.conftest import FIXED_BUDGET, hf_greedy
from tests.test_hf_equality import assert_same_tokens
from tests.tiny_models import (assert_served_like_the_engine, compositions, prefix_hit_greedy, run_greedy,
                               save_tiny_model, speculative_greedy)

NEW_TOKENS = 16
HEAD_DIM = 16
# LongRoPE: the model's pretraining length, its served length (attention factor
# sqrt(1 + ln 4 / ln 256) = 1.118), and factors per frequency (head_dim / 2 of them).
ORIGINAL_MAX = 256
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0,
                short_factor=[1.0 + 0.25 * i for i in range(HEAD_DIM // 2)],
                long_factor=[2.0 + 5.0 * i for i in range(HEAD_DIM // 2)])


def make_tiny_phi3(kind: str, folder: Path, tokenizer_dir: Path):
    """kind: ``default`` (plain RoPE, untied head) or ``longrope`` (LongRoPE, tied head)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    common = dict(vocab_size=49152, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                  eos_token_id=2, bos_token_id=1, pad_token_id=0, sliding_window=None,
                  # Wide logits: random models at the usual 0.02 are near-uniform, so greedy
                  # argmax would hinge on float rounding rather than on the computation.
                  initializer_range=0.25)
    if kind == "default":
        config = Phi3Config(tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0),
                            **common)
    else:
        config = Phi3Config(tie_word_embeddings=True, original_max_position_embeddings=ORIGINAL_MAX,
                            rope_parameters=dict(LONGROPE), **common)
    torch.manual_seed({"default": 20, "longrope": 21}[kind])
    model = Phi3ForCausalLM(config).float().eval()
    with torch.no_grad():   # transformers initialises norms to 1: make them matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return save_tiny_model(model, folder, tokenizer_dir)


@pytest.fixture(scope="module", params=["default", "longrope"])
def tiny_phi3(request, tmp_path_factory, tokenizer_dir: Path):
    folder = tmp_path_factory.mktemp(f"phi3-{request.param}")
    return request.param, folder, make_tiny_phi3(request.param, folder, tokenizer_dir)


@pytest.fixture(scope="module")
def prompts(prose_ids: list[int]) -> list[list[int]]:
    # 1-160 tokens: with NEW_TOKENS, every position stays below ORIGINAL_MAX (short factors).
    return [prose_ids[5 * i + 3: 5 * i + 3 + n] for i, n in enumerate([1, 3, 9, 17, 33, 64, 120, 160])]


@pytest.fixture(scope="module")
def reference(tiny_phi3, prompts) -> list[list[int]]:
    return hf_greedy(tiny_phi3[2], prompts, NEW_TOKENS)


def run(folder: Path, prompts: list[list[int]], new_tokens: int = NEW_TOKENS, **config) -> tuple[Engine, list]:
    return run_greedy(folder, prompts, new_tokens, **config)


def test_checkpoint_is_fused_as_ours_and_the_architecture_reads_it(tiny_phi3) -> None:
    from safetensors import safe_open

    kind, folder, _ = tiny_phi3
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= names
    assert not any("q_proj" in n or "gate_proj" in n for n in names)
    arch = ModelArchitecture.from_folder(folder)
    assert (arch.model_type, arch.head_dim, arch.num_kv_heads) == ("phi3", HEAD_DIM, 2)
    if kind == "default":
        assert arch.rope_scaling is None and not arch.tie_word_embeddings
    else:
        scaling = arch.rope_scaling
        assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == ORIGINAL_MAX
        assert scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(ORIGINAL_MAX)))
        assert arch.tie_word_embeddings


COMPOSITIONS = compositions()


@pytest.mark.parametrize("composition", sorted(COMPOSITIONS))
def test_greedy_matches_transformers(tiny_phi3, prompts, reference, composition: str) -> None:
    engine, ours = run(tiny_phi3[1], prompts, **COMPOSITIONS[composition])
    assert_same_tokens(ours, reference)
    if composition == "preemption":
        assert engine.scheduler.num_preemptions > 0, "the composition preempted nobody"


def test_triton_kernels_match_transformers(tiny_phi3, prompts) -> None:
    """Attention and the fused RoPE/cache-write through the Triton kernels (the interpreter on
    CPU), short prompts: the interpreter's time grows with the tokens."""
    short = [p for p in prompts if len(p) <= 33]
    expected = hf_greedy(tiny_phi3[2], short, 8)
    _, ours = run(tiny_phi3[1], short, 8, attention_backend="triton", block_size=16, num_kv_blocks=128, **FIXED_BUDGET)
    assert_same_tokens(ours, expected)


def test_dummy_weights_load(tiny_phi3) -> None:
    _, ours = run(tiny_phi3[1], [[1, 2, 3]], 4, load_format="dummy", block_size=16, num_kv_blocks=32, **FIXED_BUDGET)
    assert len(ours[0]) == 4


def test_longrope_uses_the_long_factors_from_original_max_on(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Per position: the rows of positions below ORIGINAL_MAX are transformers' short-factor
    cos/sin (what it computes for a sequence that stays below), the rows from it on are its
    long-factor ones (what it computes, for every position, once a sequence passes it). Both
    carry the attention factor."""
    from backend.model.loader import load_model

    hf_model = make_tiny_phi3("longrope", tmp_path, tokenizer_dir)
    arch = ModelArchitecture.from_folder(tmp_path)
    model = load_model(tmp_path, arch, torch.float32, torch.device("cpu"))
    positions = torch.arange(ORIGINAL_MAX + 64)
    cos, sin = model.rope_cos_sin(positions, torch.float32)
    x = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        short_cos, short_sin = hf_model.model.rotary_emb(x, positions[:ORIGINAL_MAX].unsqueeze(0))
        long_cos, long_sin = hf_model.model.rotary_emb(x, positions.unsqueeze(0))
    assert torch.equal(cos[:ORIGINAL_MAX], short_cos[0]) and torch.equal(sin[:ORIGINAL_MAX], short_sin[0])
    assert torch.equal(cos[ORIGINAL_MAX:], long_cos[0, ORIGINAL_MAX:])
    assert torch.equal(sin[ORIGINAL_MAX:], long_sin[0, ORIGINAL_MAX:])
    # The two sets differ (the test would hold nothing otherwise), and the attention factor is in.
    assert not torch.allclose(long_cos[0, :ORIGINAL_MAX], short_cos[0])
    factor = arch.rope_scaling["attention_factor"]
    assert factor > 1.1 and torch.allclose(cos[0], torch.full_like(cos[0], factor))
    # An engine serves past the threshold (there the tokens may differ from transformers',
    # which rotates the whole sequence, cached keys included, with the long factors).
    engine = Engine(EngineConfig(model=str(tmp_path), dtype="float32", block_size=16, num_kv_blocks=64,
                                 **FIXED_BUDGET))
    prompt = [(7 * i) % 30000 + 5 for i in range(ORIGINAL_MAX - 4)]
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 12
    engine.check_invariants()


def _config(**overrides) -> dict:
    return {"model_type": "phi3", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 4096, **overrides}


def test_longrope_settings_as_transformers_reads_them(tmp_path: Path) -> None:
    factors = dict(short_factor=[1.0] * 8, long_factor=[2.0] * 8)
    cases = [
        # The old name, the top-level original length (Phi-3's), the default attention factor.
        (_config(original_max_position_embeddings=1024, rope_scaling={"type": "su", **factors}),
         1024, math.sqrt(1 + math.log(4) / math.log(1024))),
        # A given attention factor wins; the top-level original length over the nested one.
        (_config(original_max_position_embeddings=2048,
                 rope_parameters={"rope_type": "longrope", "attention_factor": 1.5,
                                  "original_max_position_embeddings": 512, **factors}), 2048, 1.5),
        # A given factor replaces max / original; no scaling at factor 1.
        (_config(rope_parameters={"rope_type": "longrope", "factor": 1.0, "original_max_position_embeddings": 1024,
                                  **factors}), 1024, 1.0),
    ]
    for config, original, attention_factor in cases:
        (tmp_path / "config.json").write_text(json.dumps(config))
        scaling = ModelArchitecture.from_folder(tmp_path).rope_scaling
        assert scaling["rope_type"] == "longrope"
        assert scaling["original_max_position_embeddings"] == original
        assert scaling["attention_factor"] == pytest.approx(attention_factor)
    (tmp_path / "config.json").write_text(json.dumps(_config(rope_parameters={"rope_type": "longrope",
                                                                               "short_factor": [1.0] * 4,
                                                                               "long_factor": [1.0] * 8})))
    with pytest.raises(ValueError, match="short_factor must list head_dim / 2 = 8 factors"):
        ModelArchitecture.from_folder(tmp_path)


def test_partial_rotary_is_refused_by_name(tmp_path: Path) -> None:
    """Phi-4-mini (model_type phi3) rotates 0.75 of each head; our RoPE rotates whole heads."""
    for config in (_config(partial_rotary_factor=0.75),
                   _config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.75})):
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match="unsupported partial_rotary_factor 0.75"):
            ModelArchitecture.from_folder(tmp_path)


def test_sliding_window_handled_as_mistral(tmp_path: Path) -> None:
    """Phi-3's sliding_window applies to every layer, as Mistral's: the architecture reads it
    the same way (whatever the mechanism: a capped context or per-layer windows)."""
    archs = {}
    for model_type in ("phi3", "mistral"):
        (tmp_path / "config.json").write_text(json.dumps(_config(model_type=model_type, sliding_window=2047)))
        archs[model_type] = ModelArchitecture.from_folder(tmp_path)
    phi3, mistral = archs["phi3"], archs["mistral"]
    assert phi3.max_position_embeddings == mistral.max_position_embeddings
    assert getattr(phi3, "layer_windows", None) == getattr(mistral, "layer_windows", None)
    assert phi3.max_position_embeddings == 2047 or getattr(phi3, "layer_windows", None) == (2047, 2047)


def test_speculative_drafts_match_transformers(tiny_phi3, prompts, reference) -> None:
    assert_same_tokens(speculative_greedy(tiny_phi3[1], prompts, NEW_TOKENS, block_size=16, num_kv_blocks=256),
                       reference)


@pytest.mark.server
def test_served_by_the_real_server(tiny_phi3, tokenizer, prose_ids: list[int], tmp_path: Path) -> None:
    assert_served_like_the_engine(tiny_phi3[1], tokenizer, prose_ids, tmp_path)


def test_prefix_hits_match_transformers(tiny_phi3, prose_ids: list[int]) -> None:
    shared = [prose_ids[:48] + prose_ids[600 + 11 * i: 600 + 11 * i + 3 + 5 * i] for i in range(5)]
    expected = hf_greedy(tiny_phi3[2], shared, NEW_TOKENS)
    assert_same_tokens(prefix_hit_greedy(tiny_phi3[1], shared, 48, NEW_TOKENS, block_size=16, num_kv_blocks=256),
                       expected)
