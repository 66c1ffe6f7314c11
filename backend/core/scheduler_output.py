"""What the scheduler decided for one step: the engine core runs it and reports back."""

from __future__ import annotations

from dataclasses import dataclass, field

from backend.core.request import Request
from backend.core.step_cost import ZERO, Features


@dataclass
class SchedulerOutput:
    # request_id -> number of tokens to compute this step, in batch order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # request_id -> draft tokens scheduled after its last token (counted in num_scheduled_tokens)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # What the step computes, as the cost model sees it (backend/core/step_cost.py), and the
    # model's prediction of its time (None without a cost model).
    features: Features = ZERO
    predicted_seconds: float | None = None

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
