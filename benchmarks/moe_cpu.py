"""A mixture-of-experts model against a dense one of the same active parameters, on this CPU.

Writes two dummy-weight model folders (config.json + the SmolLM2 tokenizer, for
``load_format=dummy`` here and ``--load-format dummy`` in vLLM):

- ``moe``: Qwen3-MoE, hidden 1024, 16 layers, 32 experts of 512, top-4 (0.9 B parameters,
  0.16 B active a token);
- ``dense``: Qwen3 with the same attention and an MLP of 4 x 512 = 2048: the MoE's active
  parameters.

and times the engine on each, offline: ``--batch`` prompts of ``--prompt`` tokens decoding
``--tokens`` tokens each (greedy, ignore_eos), best of ``--rounds``, alternating. An MoE decode
step reads the experts its rows chose: with a batch of 16 rows x 4 experts out of 32, most
experts every step, so its step costs more than its active parameters' unless the batch is 1.

    python -m benchmarks.moe_cpu --out /tmp/moe-shapes [--json PATH]       # folders + timing
    python -m benchmarks.moe_cpu --out /tmp/moe-shapes --folders-only     # for the served runs

The served side by side with vLLM (docs/benchmarks.md, "Mixture of experts on CPU") uses the
folders: benchmarks/side_by_side.sh with ``VLLM_MODEL`` and ``VLLM_ARGS="--load-format dummy"``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from benchmarks.serving import cpu_info

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / "models" / "smollm2-135m-instruct"
COMMON = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
              vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=4096,
              initializer_range=0.02, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
SHAPES = {
    "moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], intermediate_size=2048,
                moe_intermediate_size=512, num_experts=32, num_experts_per_tok=4, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[], **COMMON),
    "dense": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], intermediate_size=2048, **COMMON),
}


def write_folders(out: Path) -> dict[str, Path]:
    folders = {}
    for name, config in SHAPES.items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=1))
        for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (TOKENIZER_DIR / file).is_file():
                shutil.copy(TOKENIZER_DIR / file, folder / file)
        folders[name] = folder
    return folders


def parameters(config: dict) -> tuple[int, int]:
    """(all, active per token) parameters of the decoder layers and the embedding."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    attention = h * (q + 2 * kv) + q * h
    if "num_experts" in config:
        expert = 3 * h * config["moe_intermediate_size"]
        ffn_all, ffn_active = config["num_experts"] * expert + h * config["num_experts"], \
            config["num_experts_per_tok"] * expert + h * config["num_experts"]
    else:
        ffn_all = ffn_active = 3 * h * config["intermediate_size"]
    embedding = config["vocab_size"] * h
    return layers * (attention + ffn_all) + embedding, layers * (attention + ffn_active) + embedding


def time_decode(folder: Path, batch: int, prompt: int, tokens: int, dtype: str) -> float:
    """Output tokens per second of ``batch`` requests decoding ``tokens`` tokens each."""
    from backend import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(model=str(folder), load_format="dummy", dtype=dtype, max_num_seqs=batch,
                                 num_kv_blocks=batch * ((prompt + tokens) // 16 + 2), itl_target_ms=0.0))
    prompts = [[1000 + (i * 7 + t) % 40000 for t in range(prompt)] for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))   # warm-up
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()                                   # the prompts, untimed
    start, produced = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the two model folders")
    parser.add_argument("--folders-only", action="store_true")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    folders = write_folders(args.out)
    print({name: str(folder) for name, folder in folders.items()})
    if args.folders_only:
        return
    results: dict[str, dict] = {name: {"tok_s": []} for name in folders}
    for _ in range(args.rounds):
        for name, folder in folders.items():
            results[name]["tok_s"].append(time_decode(folder, args.batch, args.prompt, args.tokens, args.dtype))
            print(f"{name}: {results[name]['tok_s'][-1]:.1f} tok/s", flush=True)
    for name, entry in results.items():
        total, active = parameters(SHAPES[name])
        entry.update(best_tok_s=max(entry["tok_s"]), params_total=total, params_active=active)
    ratio = results["moe"]["best_tok_s"] / results["dense"]["best_tok_s"]
    print(f"moe / dense decode tok/s: {ratio:.2f} (active parameters {results['moe']['params_active'] / 1e6:.0f} M "
          f"vs {results['dense']['params_active'] / 1e6:.0f} M; total {results['moe']['params_total'] / 1e6:.0f} M)")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_info(), "batch": args.batch, "prompt": args.prompt,
                                         "tokens": args.tokens, "dtype": args.dtype, "shapes": SHAPES,
                                         "results": results, "moe_over_dense": ratio}, indent=1))


if __name__ == "__main__":
    main()
