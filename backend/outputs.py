"""What the engine reports per request per step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]            # generated this step (the delta)
    new_text: str                       # text released this step (the delta)
    token_ids: list[int]                # everything generated so far
    text: str                           # everything released so far
    finish_reason: str | None           # None while running; "stop", "length" or "abort"
    num_prompt_tokens: int
    num_cached_tokens: int              # prompt tokens served from the prefix cache
    new_logprobs: list[dict[int, float]] | None = None   # per new token, when asked
    logprobs: list[dict[int, float]] | None = None       # per generated token, when asked
    stop_reason: str | int | None = field(default=None)  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
