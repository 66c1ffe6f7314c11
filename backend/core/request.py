"""One generation request and its life cycle inside the engine.

The engine's whole scheduling state of a request is ``num_computed_tokens`` (tokens
whose K/V are in the cache) against ``token_ids`` (prompt + generated so far).
Prefill chunks, decodes, prefix hits and resumption after preemption all follow
the same rule: catch the counter up with the token list.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from backend.outputs import FinishReason, Logprob
from backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from backend.lora.adapter import LoRAAdapter
    from backend.sample.bad_words import BadWords
    from backend.sample.constraints import TokenConstraint


class PendingConstraint(Protocol):
    """A constraint still being built off the engine thread (a grammar compiling). Its request
    waits in the queue, holding no blocks, until ``done()``; ``result()`` is the constraint,
    or raises why there is none (InvalidRequestError: the request is at fault)."""

    def done(self) -> bool: ...

    def result(self) -> "TokenConstraint": ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"            # failed inside a step; RequestOutput.finish_message says why

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)

    @property
    def finish_reason(self) -> FinishReason | None:
        return FinishReason(self.value) if self.is_finished else None

    @classmethod
    def finished_with(cls, reason: FinishReason) -> "RequestStatus":
        return cls(reason.value)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_seq: int                      # global submission order; breaks priority ties
    arrival_time: float
    max_tokens: int                       # resolved against max_model_len at submission
    eos_token_ids: frozenset[int]
    token_ids: list[int] = field(init=False)   # prompt + output, the list the counter catches up with
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (None until first admitted)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    generator: torch.Generator | None = None   # per-request RNG when a seed is given
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0       # sum of the generated tokens' logprobs (when logprobs are asked)
    # prompt_logprobs asked: one entry per prompt position, filled as the prefill computes them
    # (position 0, which nothing predicts, stays None); None when not asked.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Block-hash extra keys (backend/core/kv_cache_utils.py): what besides the tokens decides
    # whether a cached block may be reused by this request.
    lora_id: int | None = None
    lora: "LoRAAdapter | None" = None      # the adapter itself (lora_id is its id), held while the request lives
    # What the next token may be (allowed_token_ids, a grammar); None: anything.
    constraint: "TokenConstraint | None" = None
    # The constraint while it is built; the scheduler installs it before admission.
    pending_constraint: PendingConstraint | None = None
    # The token sequences bad_words bans, indexed (backend/sample/bad_words.py); None: none.
    bad_words: "BadWords | None" = None
    # async_scheduling: tokens sampled by steps launched on the device whose values the host
    # has not read yet (not in token_ids; backend/engine/overlap.py).
    num_pending_tokens: int = 0
    overlappable: bool = False            # async_scheduling: known to need nothing of its last token on the host

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def cache_salt(self) -> str | None:
        return self.sampling_params.cache_salt

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def constraint_complete(self) -> bool:
        """The constraint allows nothing more (a grammar accepted its end-of-sequence token):
        the request ends with "stop", even under ignore_eos."""
        return self.constraint is not None and self.constraint.is_complete()

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.constraint is not None:
            self.constraint.advance(token_id)
