"""What the engine reports per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]            # generated this step (the delta)
    new_text: str                       # text released this step (the delta)
    finish_reason: str | None           # None while running; "stop", "length" or "abort"
    num_prompt_tokens: int
    num_cached_tokens: int              # prompt tokens served from the prefix cache
    num_output_tokens: int              # generated so far, this step's included
    new_logprobs: list[dict[int, float]] | None = None   # per new token, when asked
    stop_reason: str | int | None = None                 # the stop string or token id that ended it
    # The cumulative views (token_ids, text, logprobs) are read on demand from the request's
    # append-only lists and the detokenizer's text, up to this step's lengths: copying them
    # into every step's output would cost O(length) per token, O(n^2) over a generation.
    _all_token_ids: list[int] = field(default_factory=list, repr=False, compare=False)
    _detokenizer: Any = field(default=None, repr=False, compare=False)
    _text_length: int = 0
    _all_logprobs: list[dict[int, float]] | None = field(default=None, repr=False, compare=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def token_ids(self) -> list[int]:
        """Everything generated so far."""
        start = self.num_prompt_tokens
        return self._all_token_ids[start:start + self.num_output_tokens]

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._detokenizer.text[:self._text_length] if self._detokenizer is not None else ""

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        """Per generated token, when asked."""
        return None if self._all_logprobs is None else self._all_logprobs[:self.num_output_tokens]
