"""The model folder's tokenizer and end-of-sequence ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backend.model.registry import FAMILIES


# Model types whose tokenizer, when tokenizer_config.json names the generic class, is exactly
# tokenizer.json: AutoTokenizer would pick TokenizersBackend for them too (transformers keeps a
# list of model types whose Hub tokenizer class it overrides; tests/test_detokenizer.py checks
# that none of these is on it and that both paths tokenize alike). The registry says which.
PLAIN_TOKENIZER_MODEL_TYPES = frozenset(t for t, family in FAMILIES.items() if family.plain_tokenizer)
_GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def loads_tokenizer_directly(folder: str) -> bool:
    """Whether ``load_tokenizer`` can skip AutoTokenizer: a plain tokenizer.json of a model type
    AutoTokenizer would not remap, and no custom code."""
    root = Path(folder)
    try:
        tokenizer_config = json.loads((root / "tokenizer_config.json").read_text())
        model_type = json.loads((root / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return (tokenizer_config.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES
            and "auto_map" not in tokenizer_config and model_type in PLAIN_TOKENIZER_MODEL_TYPES
            and (root / "tokenizer.json").is_file())


def load_tokenizer(folder: str) -> Any:
    """The folder's tokenizer, as AutoTokenizer loads it. AutoTokenizer first resolves the
    model's config class, which imports most of transformers: a large part of every server
    start, against a small fraction of it for loading tokenizer.json directly where that is
    what AutoTokenizer would do anyway."""
    if loads_tokenizer_directly(folder):
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def eos_token_ids(folder: str, tokenizer: Any) -> frozenset[int]:
    path = Path(folder) / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])
