"""What the engine reports per request per step."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, Sequence


class FinishReason(enum.StrEnum):
    """Why a request ended; the value is what clients see (vLLM's names)."""
    STOP = "stop"          # EOS, a stop token id or a stop string
    LENGTH = "length"      # max_tokens, or the context (max_model_len) is full
    ABORT = "abort"        # cancelled by the client, or cut short by a server drain
    ERROR = "error"        # failed inside an engine step; finish_message says why


@dataclass(frozen=True)
class Logprob:
    """One token's entry in a position's logprobs (vLLM's fields)."""
    logprob: float          # of the model's raw distribution (before penalties and temperature)
    rank: int               # 1 = the most likely token at that position
    decoded_token: str = ""  # the token's text on its own


def logprob_entry(token: int, logprob: float, rank: int, top_ids: Sequence[int] = (),
                  top_logprobs: Sequence[float] = ()) -> dict[int, Logprob]:
    """One position's logprobs in vLLM's form: the top-n (``top_ids`` with ``top_logprobs``,
    ranked 1..n), then ``token`` (the sampled or prompt token) with its own rank."""
    entry = {t: Logprob(value, r) for r, (t, value) in enumerate(zip(top_ids, top_logprobs), 1)}
    entry[token] = Logprob(logprob, rank)
    return entry


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]            # generated this step (the delta)
    new_text: str                       # text released this step (the delta)
    finish_reason: FinishReason | None  # None while running
    num_prompt_tokens: int
    num_cached_tokens: int              # prompt tokens served from the prefix cache
    num_output_tokens: int              # generated so far, this step's included
    new_logprobs: list[dict[int, Logprob]] | None = None  # per new token, when asked
    cumulative_logprob: float | None = None              # sum over the generated tokens, when logprobs are asked
    # prompt_logprobs asked: per prompt position (None at 0), in every output once the prompt is
    # computed (the request's own list: nothing is copied)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    stop_reason: str | int | None = None                 # the stop string or token id that ended it
    finish_message: str | None = None                    # why, for "error" and server-side "abort"
    # For "error": set when the request itself was at fault (e.g. its grammar did not compile),
    # so that it reaches the client as an invalid request, not as a failed step.
    error: Exception | None = None
    # The cumulative views (token_ids, text, logprobs) are read on demand from the request's
    # append-only lists and the detokenizer's text, up to this step's lengths: copying them
    # into every step's output would cost O(length) per token, O(n^2) over a generation.
    _all_token_ids: list[int] = field(default_factory=list, repr=False, compare=False)
    _detokenizer: Any = field(default=None, repr=False, compare=False)
    _text_length: int = 0
    _all_logprobs: list[dict[int, Logprob]] | None = field(default=None, repr=False, compare=False)

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
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        """Per generated token, when asked."""
        return None if self._all_logprobs is None else self._all_logprobs[:self.num_output_tokens]

    def merged_with(self, later: "RequestOutput") -> "RequestOutput":
        """This delta followed by ``later`` (the same request's next output) as one output:
        a sender that fell behind sends one response instead of several round trips."""
        if later.request_id != self.request_id:
            raise ValueError("only outputs of the same request can be merged")
        logprobs = None
        if self.new_logprobs is not None or later.new_logprobs is not None:
            logprobs = (self.new_logprobs or []) + (later.new_logprobs or [])
        return replace(later, new_token_ids=self.new_token_ids + later.new_token_ids,
                       new_text=self.new_text + later.new_text, new_logprobs=logprobs)
