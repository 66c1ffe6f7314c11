"""Submission-time checks of a prompt against the engine's fixed limits.

Pure with respect to engine state (only the tokenizer and immutable limits), so the
serving layer can run it on its own thread, with its own tokenizer instance, and reject
bad requests before they ever reach the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from backend.errors import InvalidRequestError
from backend.kv_cache_manager import cdiv
from backend.sampling_params import SamplingParams

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class ValidatedPrompt:
    prompt_token_ids: list[int]
    max_tokens: int            # SamplingParams.max_tokens, or what is left of the context when None


@dataclass
class RequestValidator:
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int

    def validate(self, prompt: Prompt, params: SamplingParams) -> ValidatedPrompt:
        ids = self.tokenize(prompt)
        if params.max_tokens is None:
            max_tokens = self.max_model_len - len(ids)
            if max_tokens < 1:
                raise InvalidRequestError("prompt", f"has {len(ids)} tokens; max_model_len is "
                                                    f"{self.max_model_len}, leaving no room to generate")
        else:
            max_tokens = params.max_tokens
            if len(ids) + max_tokens > self.max_model_len:
                raise InvalidRequestError("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) "
                                                        f"exceeds max_model_len ({self.max_model_len})")
        blocks_needed = cdiv(len(ids) + max_tokens, self.block_size)
        if blocks_needed > self.num_kv_blocks:
            raise InvalidRequestError("max_tokens", f"prompt + max_tokens needs {blocks_needed} KV blocks, "
                                                    f"the whole cache has {self.num_kv_blocks}")
        return ValidatedPrompt(ids, max_tokens)

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            ids = self.tokenizer(prompt).input_ids
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequestError("prompt", "token ids must be integers")
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise InvalidRequestError("prompt", f"token ids must be in [0, {self.vocab_size})")
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        return ids
