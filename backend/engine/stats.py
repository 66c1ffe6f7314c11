"""What the engine reports about itself: a statistics snapshot, and one step's record."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StepRecord:
    """One step as the loop's step trace and metrics see it."""
    measured_s: float                  # Engine.step, schedule to outputs
    predicted_s: float | None          # the cost model's prediction (None without one)
    prediction_error: float | None     # |predicted - measured| / measured
    # request id -> (tokens computed, whether they were prompt tokens); filled only when the
    # step trace is on (EngineConfig.step_trace_path).
    rows: dict[str, tuple[int, bool]]


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_cached: int            # blocks registered in the prefix cache (in use or revivable)
    kv_usage: float                  # fraction of blocks referenced by live requests
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    num_steps: int
    prompt_tokens_total: int         # prompt tokens computed (prefill work, after cache hits)
    generation_tokens_total: int     # tokens generated
    # Whole prompts (prefix-cache hits included) of the requests that produced a first token,
    # each counted once then: vLLM's prompt_tokens_total.
    started_prompt_tokens_total: int = 0
    # Speculative decoding: drafts verified, drafts accepted, tokens emitted by steps that had
    # drafts (accepted + one each), and how many (request, step) verifications there were.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    spec_verifications: int = 0
    health_error: str | None = None  # why the engine is unhealthy (Engine.health_error); None = healthy
    # LoRA: requests per adapter name, running and waiting, and how many adapters may run at once
    lora_running: dict[str, int] = field(default_factory=dict)
    lora_waiting: dict[str, int] = field(default_factory=dict)
    max_loras: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / drafted (0 before any draft)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per request and step that verified drafts (1 = no draft accepted)."""
        return self.spec_emitted_tokens / self.spec_verifications if self.spec_verifications else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "spec_acceptance_rate": self.spec_acceptance_rate,
                "spec_mean_accepted_length": self.spec_mean_accepted_length}


def count_loras(requests: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora is not None:
            counts[request.lora.name] = counts.get(request.lora.name, 0) + 1
    return counts
