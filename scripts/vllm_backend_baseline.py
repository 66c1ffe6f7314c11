"""The baseline of Triton's vLLM backend's accuracy test (ci/L0_backend_vllm/accuracy_test),
made with transformers on our model instead of with vLLM on OPT-125m, and the comparison that
test means to make.

    python scripts/vllm_backend_baseline.py PATH/TO/accuracy_test.py [--compare 127.0.0.1:8001]

Writes ``vllm_baseline_output.pkl`` and ``vllm_structured_baseline_output.pkl`` next to the
test, in its format: ``(prompt + text).encode()`` per prompt, greedy, vLLM's default of 16
tokens. The structured prompt is decoded greedily under the same choice grammar (xgrammar's
logits processor for transformers). The test's own check compares ``list.sort()`` results,
which are always None (docs/vllm_backend_compat.md), so ``--compare`` sends the same requests
to the server and compares the texts for real.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pickle
import sys
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as grpcclient
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "smollm2-135m-instruct"
MAX_TOKENS = 16   # vLLM's default max_tokens, which the test relies on


def load_test_module(path: Path):
    sys.path.insert(0, str(path.parent.parent.parent / "common"))   # its test_util import
    spec = importlib.util.spec_from_file_location("accuracy_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def greedy(model, tokenizer, prompt: str, logits_processor=None) -> str:
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                             logits_processor=logits_processor)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def choice_processor(tokenizer, vocab_size: int, choices: list[str]):
    import xgrammar as xgr

    from backend.sample.grammar import tokenizer_info          # the server's own grammar pieces
    from backend.structured_outputs import choice_grammar

    compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size, [tokenizer.eos_token_id]))
    return xgr.contrib.hf.LogitsProcessor(compiler.compile_grammar(choice_grammar(choices, "choice")))


def server_outputs(url: str, prompts: list[str], sampling: dict) -> list[bytes]:
    results: list = []
    with grpcclient.InferenceServerClient(url) as client:
        client.start_stream(lambda result, error: results.append(error or result))
        for i, prompt in enumerate(prompts):
            inputs = [grpcclient.InferInput("text_input", [1], "BYTES"), grpcclient.InferInput("stream", [1], "BOOL"),
                      grpcclient.InferInput("sampling_parameters", [1], "BYTES")]
            inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
            inputs[1].set_data_from_numpy(np.array([False]))
            inputs[2].set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
            client.async_stream_infer("llm", inputs=inputs, request_id=str(i))
        client.stop_stream()
    by_id = {r.get_response().id: r.as_numpy("text_output")[0] for r in results}
    return [by_id[str(i)] for i in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test_file", type=Path)
    parser.add_argument("--compare", metavar="GRPC_URL", help="compare the server's outputs with the baseline")
    args = parser.parse_args()
    test = load_test_module(args.test_file.resolve())
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    choices = ["Positive", "Negative"]    # the choice test_structured_outputs sends
    plain = [(p + greedy(model, tokenizer, p)).encode() for p in test.PROMPTS]
    structured = [(p + greedy(model, tokenizer, p, [choice_processor(tokenizer, model.config.vocab_size, choices)]))
                  .encode() for p in test.STRUCTURED_PROMPTS]
    folder = args.test_file.resolve().parent
    with open(folder / "vllm_baseline_output.pkl", "wb") as f:
        pickle.dump(plain, f)
    with open(folder / "vllm_structured_baseline_output.pkl", "wb") as f:
        pickle.dump(structured, f)
    print(f"baseline (transformers, greedy, {MAX_TOKENS} tokens): {plain + structured}")
    if args.compare:
        sampling = dict(test.SAMPLING_PARAMETERS)
        sampling.pop("structured_outputs", None)
        got = server_outputs(args.compare, test.PROMPTS, sampling)
        got_structured = server_outputs(args.compare, test.STRUCTURED_PROMPTS,
                                        {**sampling, "structured_outputs": json.dumps({"choice": choices})})
        same = sum(a == b for a, b in zip(plain + structured, got + got_structured))
        print(f"server vs transformers: {same}/{len(plain) + len(structured)} identical")
        for expected, actual in zip(plain + structured, got + got_structured):
            if expected != actual:
                print(f"  expected {expected!r}\n  got      {actual!r}")
        sys.exit(0 if same == len(plain) + len(structured) else 1)


if __name__ == "__main__":
    main()
