"""Per-request sampling parameters (vLLM-compatible names and defaults)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from backend.errors import InvalidRequestError

# Below this temperature sampling is greedy (argmax), as in vLLM.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_SEED = 2**63  # torch.Generator seeds are signed 64-bit


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(float(value)))


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

    def __post_init__(self) -> None:
        # JSON clients send null for "none" (OpenAI style); a single stop string is allowed too.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self._validate()

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from a JSON-like dict; unknown keys are an error, not silently ignored."""
        if not isinstance(values, dict):
            raise InvalidRequestError("sampling_parameters", "must be a JSON object")
        unknown = sorted(set(values) - cls.field_names())
        if unknown:
            raise InvalidRequestError(", ".join(unknown), f"unknown sampling parameter(s) (allowed: "
                                                           f"{', '.join(sorted(cls.field_names()))})")
        return cls(**values)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def _validate(self) -> None:
        def fail(name: str, allowed: str) -> None:
            raise InvalidRequestError(name, f"must be {allowed}, got {getattr(self, name)!r}")

        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "an integer >= 1")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            fail("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if not _is_number(self.temperature) or self.temperature < 0:
            fail("temperature", "a number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            fail("top_k", "an integer >= 1, or 0 / -1 to disable")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "a number in [0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            fail("seed", "an integer in [0, 2**63) or null")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "a non-empty string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of integers >= 0")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", "a boolean")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", "a number > 0")
        if not _is_number(self.presence_penalty) or not -2 <= self.presence_penalty <= 2:
            fail("presence_penalty", "a number in [-2, 2]")
        if not _is_number(self.frequency_penalty) or not -2 <= self.frequency_penalty <= 2:
            fail("frequency_penalty", "a number in [-2, 2]")
        if not _is_int(self.priority):
            fail("priority", "an integer")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            fail("logprobs", "an integer in [0, 20] or null")
