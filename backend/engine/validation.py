"""Submission-time checks of a prompt against the engine's fixed limits.

Pure with respect to engine state (only the tokenizer and immutable limits), so the
serving layer can run it on its own thread, with its own tokenizer instance, and reject
bad requests before they ever reach the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from backend.core.kv_cache_utils import cdiv
from backend.errors import InvalidRequestError
from backend.lora.adapter import LoRAAdapter
from backend.lora.registry import LoRARegistry
from backend.sample.bad_words import BadWords, tokenize_bad_words
from backend.sample.grammar import check_grammar
from backend.sampling_params import (MAX_BAD_WORDS_SEQUENCES, MAX_BAD_WORDS_TOKENS, MAX_LOGIT_BIAS_TOKENS,
                                     MAX_SAMPLING_JSON_BYTES, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                                     MAX_STOP_TOKEN_IDS, SamplingParams)
from backend.structured_outputs import MAX_GRAMMAR_CHARS

Prompt = str | Sequence[int]

# A text prompt is bounded in bytes before it is tokenized (tokenizing megabytes on the
# submitting thread would stall every other submission): this many bytes per token of
# max_model_len, which no real text of max_model_len tokens reaches.
MAX_PROMPT_BYTES_PER_TOKEN = 32


@dataclass(frozen=True)
class ValidatedPrompt:
    prompt_token_ids: list[int]
    max_tokens: int            # SamplingParams.max_tokens, or what is left of the context when None
    lora: LoRAAdapter | None = None   # SamplingParams.lora_name, resolved (and loaded)
    bad_words: BadWords | None = None   # SamplingParams.bad_words, tokenized and indexed


@dataclass
class RequestValidator:
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    loras: LoRARegistry | None = None

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
        if params.min_tokens > max_tokens:
            raise InvalidRequestError("min_tokens", f"must be <= max_tokens ({max_tokens}), got {params.min_tokens}")
        for name, token_ids in (("stop_token_ids", params.stop_token_ids),
                                ("allowed_token_ids", params.allowed_token_ids or ()),
                                ("logit_bias", params.logit_bias or {})):     # a bias's keys are its ids
            if any(t >= self.vocab_size for t in token_ids):
                raise InvalidRequestError(name, f"token ids must be in [0, {self.vocab_size})")
        bad_words = self.bad_words(params)
        if params.grammar_spec is not None:   # parse only (no vocabulary): compiling is the engine's
            check_grammar(params.grammar_spec)
        lora = None
        if params.lora_name is not None:
            if self.loras is None:
                raise InvalidRequestError("lora_name", "this engine serves no LoRA adapters")
            lora = self.loras.resolve(params.lora_name)
        return ValidatedPrompt(ids, max_tokens, lora, bad_words)

    def bad_words(self, params: SamplingParams) -> BadWords | None:
        """``params.bad_words`` tokenized and indexed. The token sequences are kept on ``params``
        (its one write), so that the engine's own validation of the same request, and of its
        n > 1 children (copies of it), does not tokenize the words again on its thread."""
        if not params.bad_words:
            return None
        words = tuple(params.bad_words)
        if params.tokenized_bad_words is None or params.tokenized_bad_words[0] != words:
            params.tokenized_bad_words = (words, tokenize_bad_words(self.tokenizer, words))
        sequences = params.tokenized_bad_words[1]
        if any(t >= self.vocab_size for s in sequences for t in s):
            raise InvalidRequestError("bad_words", f"tokenize to ids beyond the model's vocabulary ({self.vocab_size})")
        return BadWords(sequences)

    def describe_limits(self) -> str:
        """The request bounds, for the server's start-up log (the README lists the same)."""
        return (f"request limits: prompt <= {self.max_model_len - 1} tokens and <= {self.max_prompt_bytes} bytes; "
                f"prompt + max_tokens <= {self.max_model_len} tokens (max_model_len) and <= "
                f"{self.num_kv_blocks * self.block_size} (the whole KV cache); stop <= {MAX_STOP_STRINGS} strings "
                f"of <= {MAX_STOP_STRING_CHARS} chars; stop_token_ids <= {MAX_STOP_TOKEN_IDS}; "
                f"sampling_parameters JSON <= {MAX_SAMPLING_JSON_BYTES} bytes; structured-output schema, regex, "
                f"grammar or choices <= {MAX_GRAMMAR_CHARS} chars; logit_bias <= {MAX_LOGIT_BIAS_TOKENS} entries; "
                f"bad_words <= {MAX_BAD_WORDS_SEQUENCES} token sequences of <= {MAX_BAD_WORDS_TOKENS} tokens in all")

    @property
    def max_prompt_bytes(self) -> int:
        return MAX_PROMPT_BYTES_PER_TOKEN * self.max_model_len

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            if len(prompt) > self.max_prompt_bytes:   # cheap first: a character is >= 1 byte
                raise InvalidRequestError("prompt", f"is longer than {self.max_prompt_bytes} bytes")
            try:
                encoded = prompt.encode("utf-8")
            except UnicodeEncodeError as exc:   # lone surrogates, e.g. from a JSON "\ud800" escape
                raise InvalidRequestError("prompt", f"is not valid Unicode ({exc.reason} at {exc.start})") from None
            if len(encoded) > self.max_prompt_bytes:
                raise InvalidRequestError("prompt", f"is longer than {self.max_prompt_bytes} bytes")
            ids = self.tokenizer(prompt).input_ids
            # A tokenizer may know added tokens the embedding has no row for.
            if ids and max(ids) >= self.vocab_size:
                raise InvalidRequestError("prompt", f"tokenizes to ids beyond the model's vocabulary ({self.vocab_size})")
        else:
            if len(prompt) >= self.max_model_len:
                raise InvalidRequestError("prompt", f"has {len(prompt)} token ids; max_model_len is "
                                                    f"{self.max_model_len}, leaving no room to generate")
            ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InvalidRequestError("prompt", "token ids must be integers")
            if any(t < 0 or t >= self.vocab_size for t in ids):
                raise InvalidRequestError("prompt", f"token ids must be in [0, {self.vocab_size})")
        if not ids:
            raise InvalidRequestError("prompt", "must not be empty")
        return ids
