"""Gemma 3 text (``model_type`` gemma3_text, backend/model/gemma.py): greedy tokens equal
transformers' float32 on a tiny random ``Gemma3ForCausalLM`` saved with ``save_pretrained`` (the
SmolLM2 tokenizer reused): 6 layers, 5 windowed (16 keys, local RoPE base) to 1 global (linear
RoPE scaling), query_pre_attn_scalar != head_dim, random (1 + w) norms, a final logit soft-cap;
prompts of 1-160 tokens (past the window) by default, in chunked prefill, with preemptions,
over prefix hits and through the Triton kernels. The soft-capped logprobs equal transformers';
the norm equals transformers' bit for bit in float32 and bfloat16; config.json read in both
its transformers 5 (RoPE per layer type) and 4 (rope_local_base_freq, sliding_window_pattern)
forms; ``load_format=dummy`` loads; LoRA adapters equal peft's; unserved settings refused by
name; bfloat16 agreement held above a floor. Gemma 2 (the same module): tests/test_gemma2.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from backend import Engine, EngineConfig, SamplingParams
from backend.model.architecture import ModelArchitecture
from tests.conftest import FIXED_BUDGET, hf_greedy
from tests.test_hf_equality import assert_same_tokens
from tests.tiny_models import (assert_served_like_the_engine, bfloat16_agreement, compositions, prefix_hit_greedy,
                               randomize_gemma_norms, run_greedy, save_tiny_model, speculative_greedy)

NEW_TOKENS = 16
WINDOW = 16
HIDDEN = 64
QUERY_PRE_ATTN_SCALAR = 24          # head_dim is 32: the scale is not head_dim ** -0.5
SOFTCAP = 10.0                      # small enough to move the logprobs visibly
GLOBAL_ROPE = {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0}
LOCAL_ROPE = {"rope_type": "default", "rope_theta": 10_000.0}


def tiny_config(**overrides):
    from transformers import Gemma3TextConfig

    settings = dict(vocab_size=49152, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=6,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                    query_pre_attn_scalar=QUERY_PRE_ATTN_SCALAR, sliding_window=WINDOW, max_position_embeddings=1024,
                    rms_norm_eps=1e-6, final_logit_softcapping=SOFTCAP, eos_token_id=2, bos_token_id=1, pad_token_id=0,
                    rope_parameters={"full_attention": dict(GLOBAL_ROPE), "sliding_attention": dict(LOCAL_ROPE)},
                    # Wide logits: random models at the usual 0.02 are near-uniform, so greedy
                    # argmax would hinge on float rounding rather than on the computation.
                    initializer_range=0.25)
    return Gemma3TextConfig(**{**settings, **overrides})


def make_tiny_gemma3(folder: Path, tokenizer_dir: Path, seed: int = 30, **overrides):
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(tiny_config(**overrides)).float().eval()
    randomize_gemma_norms(model)
    return save_tiny_model(model, folder, tokenizer_dir)


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory, tokenizer_dir: Path):
    folder = tmp_path_factory.mktemp("gemma3")
    return folder, make_tiny_gemma3(folder, tokenizer_dir)


@pytest.fixture(scope="module")
def prompts(prose_ids: list[int]) -> list[list[int]]:
    return [prose_ids[3 * i + 4: 3 * i + 4 + n] for i, n in enumerate([1, 7, 15, 16, 17, 40, 90, 160])]


@pytest.fixture(scope="module")
def reference(tiny_gemma3, prompts) -> list[list[int]]:
    return hf_greedy(tiny_gemma3[1], prompts, NEW_TOKENS)


def run(folder: Path, prompts: list[list[int]], new_tokens: int = NEW_TOKENS, **config) -> tuple[Engine, list]:
    return run_greedy(folder, prompts, new_tokens, **config)


def test_architecture_reads_the_family(tiny_gemma3) -> None:
    arch = ModelArchitecture.from_folder(tiny_gemma3[0])
    assert arch.model_type == "gemma3_text" and arch.qk_norm and arch.tie_word_embeddings
    assert arch.layer_windows == (WINDOW,) * 5 + (None,) and arch.release_window is None
    assert arch.hidden_act == "gelu_pytorch_tanh" and arch.norm_weight_offset == 1.0
    assert arch.embedding_multiplier == HIDDEN ** 0.5
    assert arch.attention_scale == QUERY_PRE_ATTN_SCALAR ** -0.5
    assert arch.final_logit_softcapping == SOFTCAP
    assert (arch.rope_theta, arch.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert arch.rope_scaling["rope_type"] == "linear" and arch.rope_scaling["factor"] == 4.0


def test_config_of_transformers_4_reads_the_same(tmp_path: Path) -> None:
    """Gemma 3's checkpoints on the Hub (written by transformers 4): rope_theta + rope_scaling
    for the global layers, rope_local_base_freq for the local ones, sliding_window_pattern
    instead of layer_types, no tie_word_embeddings (tied by default)."""
    config = {"model_type": "gemma3_text", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 16,
              "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
              "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 32, "rope_theta": 1000000,
              "rope_local_base_freq": 10000, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
              "sliding_window": 512, "sliding_window_pattern": 6, "final_logit_softcapping": None,
              "attn_logit_softcapping": None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    arch = ModelArchitecture.from_folder(tmp_path)
    assert arch.layer_windows == (512,) * 5 + (None,) + (512,) * 2
    assert (arch.rope_theta, arch.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert arch.tie_word_embeddings and arch.final_logit_softcapping is None and arch.attention_scale == 32 ** -0.5
    # Nothing but the shape: transformers' Gemma 3 defaults (bases 1e6 and 1e4, pattern 6).
    bare = {k: config[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                   "num_hidden_layers", "num_attention_heads", "sliding_window")}
    (tmp_path / "config.json").write_text(json.dumps(bare))
    arch = ModelArchitecture.from_folder(tmp_path)
    assert arch.layer_windows == (512,) * 5 + (None,) + (512,) * 2
    assert (arch.rope_theta, arch.local_rope_theta, arch.rope_scaling) == (1_000_000.0, 10_000.0, None)
    assert arch.hidden_act == "gelu_pytorch_tanh" and arch.tie_word_embeddings


def test_the_rope_of_each_layer_kind_is_transformers(tiny_gemma3) -> None:
    """cos/sin of the global layers (rope_theta, linear scaling) and of the local ones (their
    own base) equal transformers' per layer type."""
    from backend.model.loader import load_model

    folder, hf_model = tiny_gemma3
    model = load_model(folder, ModelArchitecture.from_folder(folder), torch.float32, torch.device("cpu"))
    positions = torch.arange(300)
    x = torch.zeros(1, dtype=torch.float32)
    ours = {"full_attention": model.rope_cos_sin(positions, torch.float32),
            "sliding_attention": model.local_rope_cos_sin(positions, torch.float32)}
    with torch.no_grad():
        for kind, (cos, sin) in ours.items():
            hf_cos, hf_sin = hf_model.model.rotary_emb(x, positions.unsqueeze(0), kind)
            assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0]), kind
    assert not torch.equal(ours["full_attention"][0], ours["sliding_attention"][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_equals_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from backend.model.gemma import GemmaRMSNorm

    torch.manual_seed(0)
    for shape in ((37, 64), (37, 8, 64)):
        theirs = Gemma3RMSNorm(64, eps=1e-6).to(dtype)
        ours = GemmaRMSNorm(64, 1e-6, 1.0).to(dtype)
        with torch.no_grad():
            theirs.weight.uniform_(-0.5, 2.0)
            ours.weight.copy_(theirs.weight)
        x = (torch.randn(shape) * 3).to(dtype)
        assert torch.equal(ours(x), theirs(x)), (dtype, shape)


def test_mlp_is_transformers_geglu(tiny_gemma3) -> None:
    """Our fused gate|up GeGLU against transformers' Gemma3MLP of the same layer: the tanh
    GELU (exact GELU differs by ~1e-4 here, beyond the tolerance; greedy tokens cannot tell)."""
    from backend.model.loader import load_model

    folder, hf_model = tiny_gemma3
    model = load_model(folder, ModelArchitecture.from_folder(folder), torch.float32, torch.device("cpu"))
    x = torch.randn(29, HIDDEN, generator=torch.Generator().manual_seed(1)) * 2
    with torch.no_grad():
        theirs = hf_model.model.layers[2].mlp(x)
        ours = model.model.layers[2].mlp(x)
        inter = model.arch.intermediate_size
        gate_up = model.model.layers[2].mlp.gate_up_proj(x)
        erf = model.model.layers[2].mlp.down_proj(torch.nn.functional.gelu(gate_up[:, :inter]) * gate_up[:, inter:])
    torch.testing.assert_close(ours, theirs, atol=2e-6, rtol=2e-6)
    assert (erf - theirs).abs().max() > 1e-5


# The global layer keeps every block: 60 of them preempt.
COMPOSITIONS = compositions(preemption_blocks=60)


@pytest.mark.parametrize("composition", sorted(COMPOSITIONS))
def test_greedy_matches_transformers(tiny_gemma3, prompts, reference, composition: str) -> None:
    engine, ours = run(tiny_gemma3[0], prompts, **COMPOSITIONS[composition])
    assert_same_tokens(ours, reference)
    if composition == "preemption":
        assert engine.scheduler.num_preemptions > 0, "the composition preempted nobody"


def test_prefix_hits_match_transformers(tiny_gemma3, prose_ids: list[int]) -> None:
    shared = [prose_ids[:40] + prose_ids[700 + 9 * i: 700 + 9 * i + 2 + 3 * i] for i in range(5)]
    expected = hf_greedy(tiny_gemma3[1], shared, NEW_TOKENS)
    assert_same_tokens(prefix_hit_greedy(tiny_gemma3[0], shared, 40, NEW_TOKENS, block_size=8, num_kv_blocks=256),
                       expected)


def test_triton_kernels_match_transformers(tiny_gemma3, prompts) -> None:
    """Attention through the Triton kernels (the interpreter on CPU), windows included; short
    prompts: the interpreter's time grows with the tokens."""
    short = [p for p in prompts if len(p) <= 40]
    expected = hf_greedy(tiny_gemma3[1], short, 8)
    _, ours = run(tiny_gemma3[0], short, 8, attention_backend="triton", block_size=8, num_kv_blocks=128,
                  **FIXED_BUDGET)
    assert_same_tokens(ours, expected)


def test_logprobs_carry_the_final_softcap(tiny_gemma3, prose_ids: list[int]) -> None:
    """Greedy tokens cannot see the soft-cap (tanh is monotonic); the logprobs can."""
    folder, hf_model = tiny_gemma3
    prompt = prose_ids[10:60]
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", block_size=16, num_kv_blocks=64, **FIXED_BUDGET))
    out = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0]
    ours = out.logprobs[0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, -1]
    capped = torch.log_softmax(logits, -1)
    uncapped = torch.log_softmax(SOFTCAP * torch.atanh(logits / SOFTCAP), -1)
    top = capped.topk(5).indices.tolist()
    assert list(ours)[:1] == top[:1] and set(ours) == set(top)
    for token, entry in ours.items():
        assert entry.logprob == pytest.approx(float(capped[token]), abs=1e-4)
    assert max(abs(float(uncapped[t] - capped[t])) for t in top) > 0.05, "the cap did not move the logprobs"


def test_fused_ops_and_the_c_layer_loop_decline(tiny_gemma3) -> None:
    from backend.model.cpu_decoder import unsupported_reason
    from backend.model.loader import load_model

    folder = tiny_gemma3[0]
    model = load_model(folder, ModelArchitecture.from_folder(folder), torch.float32, torch.device("cpu"),
                       attention_backend="cpu", fused_layer_ops=True)
    assert model.fused_layer_ops is None and model.cpu_decoder is None
    assert "Gemma-style layers" in unsupported_reason(model)


def test_dummy_weights_load(tiny_gemma3) -> None:
    from backend.model.loader import load_model

    folder = tiny_gemma3[0]
    model = load_model(folder, ModelArchitecture.from_folder(folder), torch.float32, torch.device("cpu"),
                       load_format="dummy")
    norm = model.model.layers[0].post_feedforward_layernorm
    assert torch.equal(norm.weight, torch.zeros(HIDDEN))       # a scale of 1 + 0
    _, ours = run(folder, [[1, 2, 3]], 4, load_format="dummy", block_size=16, num_kv_blocks=32, **FIXED_BUDGET)
    assert len(ours[0]) == 4


def test_lora_adapters_match_peft(tiny_gemma3, prose_ids: list[int], tmp_path: Path) -> None:
    """q/k/v/o and gate/up/down adapters (PEFT's names, as on Llama) through the Gemma layers."""
    from backend.lora.synthetic import MODULES, model_with_adapters
    from tests.test_lora import FAST, peft_in_order, run_mixed

    base, hf_model = tiny_gemma3
    folder = model_with_adapters(base, tmp_path / "with-adapters",
                                 {"g-a": (8, 16, MODULES, 6), "g-b": (4, 4, ("q_proj", "down_proj"), 7)})
    requests = [("g-a", prose_ids[:40]), (None, prose_ids[5:30]), ("g-b", prose_ids[50:110]),
                ("g-a", prose_ids[200:215])]
    expected = peft_in_order(hf_model, folder, requests)
    engine = Engine(EngineConfig(model=str(folder), **FAST, block_size=16, num_kv_blocks=128,
                                 max_num_batched_tokens=32, max_num_seqs=8))
    ours = run_mixed(engine, requests)
    assert ours == expected
    base = hf_greedy(hf_model, [requests[0][1]], len(ours[0]))[0]
    assert ours[0][:len(base)] != base, "the adapter changed nothing"


def test_unserved_settings_are_refused_by_name(tmp_path: Path) -> None:
    base = {"model_type": "gemma3_text", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 16,
            "num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 32, "sliding_window": 16}
    for extra, message in (({"hidden_activation": "gelu"}, "unsupported hidden_act 'gelu'"),
                           ({"use_bidirectional_attention": True}, "unsupported use_bidirectional_attention"),
                           ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1e4}}},
                            "unsupported rope_type 'linear' for the sliding-window layers")):
        (tmp_path / "config.json").write_text(json.dumps({**base, **extra}))
        with pytest.raises(ValueError, match=message):
            ModelArchitecture.from_folder(tmp_path)
    # Gemma's activation is refused to the Llama families, as any but SiLU.
    (tmp_path / "config.json").write_text(json.dumps({**base, "model_type": "llama", "hidden_act": "gelu_pytorch_tanh"}))
    with pytest.raises(ValueError, match="unsupported hidden_act 'gelu_pytorch_tanh'"):
        ModelArchitecture.from_folder(tmp_path)


# Measured on the 2-core Intel Xeon (AVX512_BF16, no AMX), 12 prompts of 1-430 tokens, 24 greedy
# tokens: the engine in bfloat16 agreed with transformers float32 for a mean 0.521 of the tokens
# before the first divergence (our bfloat16 linear kernels; 0.60 with cpu_linear=torch);
# transformers' own bfloat16 model for 0.747. A wrong value diverges at the first token (0).
BF16_AGREEMENT_FLOOR = 0.30


def test_bfloat16_agreement_above_floor(tiny_gemma3, prose_ids: list[int]) -> None:
    shares = bfloat16_agreement(tiny_gemma3[0], tiny_gemma3[1], prose_ids)
    print(f"gemma3_text: bfloat16 agreement {sum(shares) / len(shares):.3f}")
    assert sum(shares) / len(shares) >= BF16_AGREEMENT_FLOOR, shares


def test_speculative_drafts_match_transformers(tiny_gemma3, prompts, reference) -> None:
    assert_same_tokens(speculative_greedy(tiny_gemma3[0], prompts, NEW_TOKENS, block_size=16, num_kv_blocks=256),
                       reference)


@pytest.mark.server
def test_served_by_the_real_server(tiny_gemma3, tokenizer, prose_ids: list[int], tmp_path: Path) -> None:
    assert_served_like_the_engine(tiny_gemma3[0], tokenizer, prose_ids, tmp_path)
