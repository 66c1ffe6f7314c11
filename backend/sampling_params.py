"""Per-request sampling parameters (vLLM-compatible names and defaults)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from backend.errors import InvalidRequestError, is_encodable, show
from backend.structured_outputs import (GUIDE, GUIDE_TYPE, STRUCTURED_OUTPUTS, GrammarSpec, parse_guided_decoding,
                                        parse_structured_outputs)

# Below this temperature sampling is greedy (argmax), as in vLLM.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_SEED = 2**63  # torch.Generator seeds are signed 64-bit
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1
INTERNAL = "internal"   # field metadata key: set by the engine, never sent by a client

# Request size limits: what a request may carry before it reaches the engine. Named on server
# start-up and in the README; requests beyond them get INVALID_ARG naming the field.
MAX_SAMPLING_JSON_BYTES = 16 * 1024    # the sampling_parameters JSON text
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TEMPERATURE = 100.0                # beyond this every distribution is uniform to float32 anyway
MAX_REPETITION_PENALTY = 100.0
MAX_TOP_K = 2**31 - 1                  # values >= the vocabulary size mean "disabled"
MAX_N = 64                             # completions per request (each one is a request in the queue)
MAX_LOGPROBS = 20                      # top-n of logprobs and prompt_logprobs (vLLM's default bound)
MAX_CACHE_SALT_CHARS = 256
MAX_ALLOWED_TOKEN_IDS = 65536
MAX_LOGIT_BIAS = 100.0                 # |bias|: vLLM clamps biases into [-100, 100] (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 1024           # logit_bias entries (vLLM's MAX_NUM_LOGIT_BIAS_TOKENS)
MAX_BAD_WORDS_SEQUENCES = 128          # bad_words' token sequences after tokenizing (vLLM's MAX_NUM_BAD_WORDS)
MAX_BAD_WORDS_TOKENS = 1024            # and their tokens in all (vLLM's MAX_BAD_WORDS_TOTAL_TOKENS)


_INTEGER_TEXT = re.compile(r"[+-]?\d+")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX


def _is_number(value: Any) -> bool:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:   # an int too large for a float
        return False


def _normalized_logit_bias(value: Any) -> dict[int, float] | None:
    """``logit_bias`` with int keys (JSON's are strings) and each bias clamped into
    [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as vLLM takes it; ids are checked against the vocabulary
    at validation (backend/engine/validation.py)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError("logit_bias", f"must be an object {{token id: bias}} or null, got {show(value)}")
    if len(value) > MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequestError("logit_bias", f"has {len(value)} entries; at most {MAX_LOGIT_BIAS_TOKENS} are allowed")
    biases: dict[int, float] = {}
    for key, bias in value.items():
        token = key
        # Digits beyond int64's 19 are out of range anyway (and int() refuses > 4300 of them).
        if isinstance(key, str) and len(key) <= 32 and _INTEGER_TEXT.fullmatch(key.strip()):
            token = int(key.strip())
        if not _is_int(token) or token < 0:
            raise InvalidRequestError("logit_bias", f"keys must be token ids (integers >= 0), got {show(key)}")
        if not _is_number(bias):
            raise InvalidRequestError("logit_bias", f"biases must be finite numbers, got {show(bias)} "
                                                    f"for token {token}")
        biases[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(bias)))
    return biases


@dataclass
class SamplingParams:
    max_tokens: int | None = 16          # None: until the context (max_model_len) is full
    min_tokens: int = 0                  # EOS / stop tokens are masked until this many tokens exist
    temperature: float = 1.0             # 0 = greedy
    top_p: float = 1.0                   # in (0, 1]
    top_k: int = 0                       # 0 or -1 = disabled
    min_p: float = 0.0                   # in [0, 1]
    seed: int | None = None              # per-request generator: same seed + prompt = same text
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = 1.0      # > 0; 1 = off (HF semantics, prompt + output tokens)
    presence_penalty: float = 0.0        # [-2, 2] (OpenAI semantics, output tokens)
    frequency_penalty: float = 0.0       # [-2, 2]
    priority: int = 0                    # lower value is served first (scheduling_policy="priority")
    logprobs: int | None = None          # top-n logprobs per generated token (0 = sampled token only)
    # top-n logprobs at each prompt position (0 = the prompt token's only; vLLM's prompt_logprobs):
    # computed from the raw logits of the prefill, so such a request reads nothing from the prefix cache
    prompt_logprobs: int | None = None
    # n completions of one prompt (backend/engine/parallel_sampling.py). best_of is accepted
    # only as 1 or null (Triton's OpenAI frontend sends it for completions; vLLM V1 removed it).
    n: int = 1
    best_of: int | None = None
    # false: this request never gets speculative drafts (when the engine has speculative_method set)
    speculative: bool = True
    # Prefix-cache isolation: requests share cached blocks only when their salts are equal
    # (vLLM's cache_salt); e.g. one salt per tenant.
    cache_salt: str | None = None
    # A LoRA adapter of the model folder's multi_lora.json (the vLLM backend's key); None: the base model.
    lora_name: str | None = None
    # Only these token ids may be generated (vLLM's allowed_token_ids); None: any.
    allowed_token_ids: list[int] | None = None
    # {token id: bias} added to the logits before sampling (OpenAI's and vLLM's logit_bias; JSON
    # keys are strings of ints). Stored with int keys and biases clamped into +-MAX_LOGIT_BIAS.
    logit_bias: dict[int, float] | None = None
    # Words the output must not contain (vLLM's bad_words: backend/sample/bad_words.py).
    bad_words: list[str] = field(default_factory=list)
    # true: a stop string that ends the output stays in its text (and so does a stop token's text).
    include_stop_str_in_output: bool = False
    # Structured outputs (backend/structured_outputs.py): the output must match a JSON schema,
    # regex, choice list or grammar. Triton's vLLM backend form (an object, or a JSON string of
    # one), or the TensorRT-LLM backend's guide type + guide; ``grammar_spec`` is the result.
    structured_outputs: dict[str, Any] | str | None = None
    guided_decoding_guide_type: str | None = None
    guided_decoding_guide: str | None = None
    # Not a request key (INTERNAL): (bad_words, their token sequences), filled in by the first
    # validation (backend/engine/validation.py), which has the tokenizer. A field, so that
    # dataclasses.replace (the n > 1 children) keeps it and words are tokenized once per request;
    # the words are kept to tell when a replace changed them.
    tokenized_bad_words: tuple[tuple[str, ...], tuple[tuple[int, ...], ...]] | None = field(
        default=None, repr=False, compare=False, metadata={INTERNAL: True})

    def __post_init__(self) -> None:
        # JSON clients send null for "none" (OpenAI style); a single stop string is allowed too.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.bad_words is None:
            self.bad_words = []
        self._validate()

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """The request keys (internal fields are not)."""
        return frozenset(f.name for f in dataclasses.fields(cls) if not f.metadata.get(INTERNAL))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-like dict; unknown keys are an error, not silently ignored."""
        if not isinstance(values, dict):
            raise InvalidRequestError("sampling_parameters", "must be a JSON object")
        unknown = sorted(str(key) for key in set(values) - cls.field_names())
        if unknown:
            # Keys are echoed escaped (json.dumps turns NUL into \u0000) and truncated.
            names = ", ".join(json.dumps(key)[1:-1][:40] for key in unknown[:5]) + (", ..." if len(unknown) > 5 else "")
            raise InvalidRequestError(names, f"unknown sampling parameter(s) (allowed: "
                                             f"{', '.join(sorted(cls.field_names()))})")
        return cls(**values)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def _validate(self) -> None:
        """Type and range of every field (ints within int64, floats finite), so that nothing
        a client sends can fail later inside a step; numbers are stored as floats after."""
        def fail(name: str, allowed: str) -> None:
            raise InvalidRequestError(name, f"must be {allowed}, got {show(getattr(self, name))}")

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            fail("temperature", f"a number in [0, {MAX_TEMPERATURE:g}]")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            fail("top_k", f"an integer in [1, {MAX_TOP_K}], or 0 / -1 to disable")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "a number in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            fail("seed", "an integer in [0, 2**63) or null")
        if (not isinstance(self.stop, list) or len(self.stop) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop)):
            fail("stop", f"a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings "
                         f"of at most {MAX_STOP_STRING_CHARS} characters")
        if any(not s.isascii() and not is_encodable(s) for s in self.stop):
            fail("stop", "valid Unicode (no lone surrogates)")
        if (not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
                or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids)):
            fail("stop_token_ids", f"a list of at most {MAX_STOP_TOKEN_IDS} integers >= 0")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", "a boolean")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            fail("repetition_penalty", f"a number in (0, {MAX_REPETITION_PENALTY:g}]")
        if not _is_number(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            fail("presence_penalty", "a number in [-2, 2]")
        if not _is_number(self.frequency_penalty) or not -2 <= self.frequency_penalty <= 2:
            fail("frequency_penalty", "a number in [-2, 2]")
        if not _is_int(self.priority):
            fail("priority", "an integer in [-2**63, 2**63)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                fail(name, f"an integer in [0, {MAX_LOGPROBS}] or null")
        if not isinstance(self.speculative, bool):
            fail("speculative", "a boolean")
        for name in ("lora_name", "cache_salt"):   # names a client picks: short, non-empty text
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_CACHE_SALT_CHARS
                                      or not is_encodable(value)):
                fail(name, f"a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters or null")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS
                or not all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)):
            fail("allowed_token_ids", f"a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} integers >= 0, or null")
        self.logit_bias = _normalized_logit_bias(self.logit_bias)
        # Each word is at least one token sequence; their text is bounded like a grammar's
        # (MAX_SAMPLING_JSON_BYTES), so that the in-process API cannot send more than a client.
        if (not isinstance(self.bad_words, list)
                or not all(isinstance(w, str) and w and is_encodable(w) for w in self.bad_words)):
            fail("bad_words", f"a list of at most {MAX_BAD_WORDS_SEQUENCES} non-empty strings")
        self.bad_words = list(dict.fromkeys(self.bad_words))   # duplicates dropped, as vLLM does
        if (len(self.bad_words) > MAX_BAD_WORDS_SEQUENCES
                or sum(len(w) for w in self.bad_words) > MAX_SAMPLING_JSON_BYTES):
            fail("bad_words", f"a list of at most {MAX_BAD_WORDS_SEQUENCES} non-empty strings of at most "
                              f"{MAX_SAMPLING_JSON_BYTES} characters in all")
        if not isinstance(self.include_stop_str_in_output, bool):
            fail("include_stop_str_in_output", "a boolean")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            fail("n", f"an integer in [1, {MAX_N}]")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of != 1):
            fail("best_of", "1 or null (best_of is not supported, as in vLLM V1: use n and rank the outputs)")
        self._grammar_spec = self._parse_grammar_spec()
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            setattr(self, name, float(getattr(self, name)))

    @property
    def grammar_spec(self) -> GrammarSpec | None:
        """The structured-output constraint, from whichever form the request used."""
        return self._grammar_spec

    def _parse_grammar_spec(self) -> GrammarSpec | None:
        alias = parse_guided_decoding(self.guided_decoding_guide_type, self.guided_decoding_guide)
        if self.structured_outputs is None:
            spec = alias
        elif alias is not None:
            raise InvalidRequestError(STRUCTURED_OUTPUTS, f"cannot be combined with {GUIDE_TYPE} / {GUIDE}")
        else:
            spec = parse_structured_outputs(self.structured_outputs)
        if spec is not None and self.allowed_token_ids is not None:
            raise InvalidRequestError(spec.field, "cannot be combined with allowed_token_ids")
        return spec
