"""Tiny random Hugging Face models for the family tests: saved with ``save_pretrained`` beside the
SmolLM2 tokenizer (no model hub), and run through the engine greedily."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from backend import Engine, EngineConfig, SamplingParams
from tests.conftest import FIXED_BUDGET, hf_greedy

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# The bfloat16 agreement prompts: the HF-equality lengths (tests/test_bf16_agreement.py measures
# SmolLM2 on the same shape of run).
AGREEMENT_PROMPT_LENGTHS = (1, 2, 5, 11, 17, 33, 64, 100, 150, 220, 300, 430)


def compositions(preemption_blocks: int = 64) -> dict[str, dict]:
    """The engine configurations every family's greedy tokens are checked under: the default;
    every prompt above 24 tokens prefilled in chunks beside other requests' decodes; fewer KV
    blocks (``preemption_blocks`` of 4 tokens) than the batch needs at once, so running requests
    are preempted and recomputed."""
    return {
        "default": dict(block_size=16, num_kv_blocks=256),
        "chunked": dict(block_size=4, num_kv_blocks=512, max_num_batched_tokens=24, max_num_seqs=8, **FIXED_BUDGET),
        "preemption": dict(block_size=4, num_kv_blocks=preemption_blocks, max_num_batched_tokens=64, max_num_seqs=8,
                           **FIXED_BUDGET),
    }


def save_tiny_model(model, folder: Path, tokenizer_dir: Path):
    """``model``'s folder as a user would point the server at it: safetensors, config.json, the
    SmolLM2 tokenizer and a generation config naming its EOS. Returns ``model``."""
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return model


def randomize_gemma_norms(model) -> None:
    """transformers initialises Gemma's norm weights w to 0 (a scale of 1): make them matter. The
    branches' outputs (post-attention / post-feedforward norms) scaled 3-6x: at 1x the embedding
    (times sqrt(hidden)) dominates the residual stream, and the tied head then predicts the
    input token, over and over, whatever the layers do."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".post_" in name:
                param.uniform_(2.0, 5.0)
            elif "norm" in name:
                param.uniform_(-0.5, 0.5)


def run_greedy(folder: Path, prompts: list[list[int]], new_tokens: int, dtype: str = "float32",
               **config) -> tuple[Engine, list[list[int]]]:
    """The engine's greedy tokens for ``prompts``, after checking its block accounting and that
    every KV block came back."""
    engine = Engine(EngineConfig(model=str(folder), dtype=dtype, **config))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0))
    engine.check_invariants()
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, "KV blocks leaked"
    return engine, [o.token_ids for o in outputs]


class RepeatLastToken:
    """A drafter that proposes the last token k times: most drafts are rejected, some accepted
    (random models repeat themselves), and every verification step runs the layers over
    several positions of a request at once."""

    def propose(self, token_ids: list[int], max_drafts: int | None = None) -> list[int]:
        return [token_ids[-1]] * min(3, 3 if max_drafts is None else max_drafts)


def speculative_greedy(folder: Path, prompts: list[list[int]], new_tokens: int, **config) -> list[list[int]]:
    """Greedy tokens with speculative decoding on (drafts from ``RepeatLastToken``), after
    checking that drafts were verified and that every KV block came back."""
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", speculative_method="ngram",
                                 num_speculative_tokens=3, speculative_max_batch_size=64, itl_target_ms=0.0,
                                 **config))
    engine.scheduler.proposer = RepeatLastToken()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0))
    engine.check_invariants()
    stats = engine.stats()
    assert stats.spec_draft_tokens > 0, "no draft was verified"
    assert stats.kv_blocks_free == stats.kv_blocks_total, "KV blocks leaked"
    return [o.token_ids for o in outputs]


def prefix_hit_greedy(folder: Path, prompts: list[list[int]], shared_tokens: int, new_tokens: int,
                      **config) -> list[list[int]]:
    """Greedy tokens of ``prompts`` (all starting with the same ``shared_tokens``), the first run
    alone so that the others hit its cached blocks: every whole block of the shared part (checked)."""
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", itl_target_ms=0.0, **config))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    outputs = engine.generate(prompts[:1], params) + engine.generate(prompts[1:], params)
    block_size = engine.config.block_size
    assert engine.stats().prefix_cache_hit_tokens >= (len(prompts) - 1) * (shared_tokens // block_size) * block_size
    engine.check_invariants()
    return [o.token_ids for o in outputs]


def assert_served_like_the_engine(folder: Path, tokenizer, prose_ids: list[int], log_dir: Path) -> None:
    """``--param model=<folder>``: six concurrent streams over one gRPC connection and an HTTP
    generate_stream get the engine's greedy text."""
    from client import NO_RETRY, LLMClient, http_generate_stream
    from server.launch import TritonServer, free_ports
    from tests.conftest import FIXED_BUDGET_PARAMS

    prompts = [tokenizer.decode(prose_ids[9 * i: 9 * i + 8 + 6 * i]) for i in range(6)]
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", block_size=16, num_kv_blocks=128,
                                 itl_target_ms=0.0))
    expected = [o.text for o in engine.generate(prompts, SamplingParams(**greedy))]
    with TritonServer(*free_ports(3), params={"model": str(folder), "dtype": "float32", **FIXED_BUDGET_PARAMS},
                      log_file=log_dir / "server.log") as server:
        client = LLMClient(server.grpc_url, retry=NO_RETRY)
        texts: dict[str, str] = {}
        ids = [f"family-{i}" for i in range(len(prompts))]
        for chunk in client.stream_many(prompts, greedy, request_ids=ids):
            assert not isinstance(chunk, tuple), f"request failed: {chunk}"
            texts[chunk.request_id] = texts.get(chunk.request_id, "") + chunk.text
        assert [texts[i] for i in ids] == expected
        http_text = "".join(c.text for c in http_generate_stream(prompts[-1], url=server.http_url, retry=NO_RETRY,
                                                                 **greedy))
        assert http_text == expected[-1]


def bfloat16_agreement(folder: Path, hf_model, prose_ids: list[int]) -> list[float]:
    """Per prompt, the share of 24 greedy tokens the engine in bfloat16 produces identical to
    ``hf_model`` (float32) before the first divergence (``benchmarks.precision_agreement``)."""
    from benchmarks.precision_agreement import prefix_share

    prompts = [prose_ids[7 * i + 1: 7 * i + 1 + n] for i, n in enumerate(AGREEMENT_PROMPT_LENGTHS)]
    reference = hf_greedy(hf_model, prompts, 24)
    _, ours = run_greedy(folder, prompts, 24, dtype="bfloat16", block_size=16, num_kv_blocks=512, **FIXED_BUDGET)
    return [prefix_share(a, b) for a, b in zip(ours, reference)]
