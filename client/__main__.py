"""Command line: stream a completion from the Triton-served model.

    python -m client "Why is static batching slow?" --max-tokens 64 [--temperature 0.7]
                     [--no-stream] [--http] [--chat] [--url HOST:PORT] [--prefix-key KEY]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from client.llm_client import DEFAULT_GRPC_URL, DEFAULT_HTTP_URL, LLMClient, LLMError, http_generate_stream

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"


def apply_chat_template(prompt: str, tokenizer_dir: Path) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-stream", action="store_true", help="print the completion when it is done")
    parser.add_argument("--http", action="store_true", help="use HTTP generate_stream instead of gRPC")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--tokenizer-dir", type=Path, default=DEFAULT_TOKENIZER_DIR)
    parser.add_argument("--url", default=None, help=f"server address (gRPC {DEFAULT_GRPC_URL}, HTTP {DEFAULT_HTTP_URL})")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--prefix-key", default=None,
                        help="x-prefix-key for the cluster's proxy: requests with the same key go to the same replica")
    args = parser.parse_args(argv)

    prompt = apply_chat_template(args.prompt, args.tokenizer_dir) if args.chat else args.prompt
    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p}
    if args.seed is not None:
        sampling["seed"] = args.seed
    try:
        if args.http:
            chunks = http_generate_stream(prompt, url=args.url or DEFAULT_HTTP_URL, model=args.model,
                                          prefix_key=args.prefix_key, **sampling)
        else:
            chunks = LLMClient(args.url or DEFAULT_GRPC_URL, args.model).stream(prompt, prefix_key=args.prefix_key,
                                                                                **sampling)
        pieces, final = [], None
        for chunk in chunks:
            pieces.append(chunk.text)
            if not args.no_stream:
                print(chunk.text, end="", flush=True)
            final = chunk
        if args.no_stream:
            print("".join(pieces), end="")
        print()
        if final is not None:
            print(f"[finish_reason={final.finish_reason} input_tokens={final.num_input_tokens} "
                  f"cached_tokens={final.num_cached_tokens}]", file=sys.stderr)
    except LLMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
