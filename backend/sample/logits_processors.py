"""Logits processors: each changes the rows of a step's logits that its requests need changed,
before anything is sampled. The sampler runs them as a list, in order.

A processor is stateless across steps. ``prepare`` looks at the step's requests once (when the
step's ``SamplingMetadata`` is built) and returns what ``apply`` needs, or None when no row
of the step is affected, so a step without penalties, min_tokens or constraints costs
nothing here. ``apply`` works in place on float32 logits that the sampler has already copied.

Rows: request i owns ``rows[i]``, its first row followed by one row per speculative draft.
Penalties and min_tokens depend on the tokens before the row, which for draft rows include
drafts not yet verified; requests they apply to therefore take no drafts
(``blocks_drafts``) and have one row. The others treat every row as a row of its own: a logit
bias is the same for every row, bad words are checked against each row's own history (the
drafts before it included), and a token mask is the same for every row
(``allowed_token_ids``) or is computed per row by the request's constraint; so requests with
them may take drafts.

The order is vLLM's where it matters: logit_bias before the penalties (a repetition penalty
divides or multiplies the biased logit). Bans and masks set -inf, which the others keep.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch

from backend.core.request import Request
from backend.sample.bad_words import generated_tail
from backend.sample.constraints import mask_logits_, new_bitmask
from backend.sample.metadata import SamplingBatch, to_device


class LogitsProcessor(abc.ABC):
    # True when the processor's effect on a row depends on the tokens right before it, so
    # that a draft row (which follows unverified drafts) would be processed wrongly.
    blocks_drafts: bool = False
    # True when the processor reads the request's generated tokens (or state advanced by them):
    # a step launched before the last token reached the host (async_scheduling) cannot run it.
    reads_history: bool = True

    @abc.abstractmethod
    def applies_to(self, request: Request) -> bool:
        """Whether this request's next row is changed by this processor."""

    @abc.abstractmethod
    def prepare(self, batch: SamplingBatch, vocab_size: int, device: torch.device) -> Any | None:
        """Per-step state for ``apply``; None when no row of the step is affected."""

    @abc.abstractmethod
    def apply(self, logits: torch.Tensor, state: Any) -> None:
        """Change ``logits`` ([rows, vocab] float32) in place."""


# ---- 1. logit_bias --------------------------------------------------------------------------------
class LogitBiasProcessor(LogitsProcessor):
    """OpenAI's ``logit_bias``: each listed token's bias is added to its logit, on every row of
    the request."""

    reads_history = False

    def applies_to(self, request: Request) -> bool:
        return bool(request.sampling_params.logit_bias)

    def prepare(self, batch: SamplingBatch, vocab_size: int, device: torch.device,
                ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        row_index: list[int] = []
        token_index: list[int] = []
        biases: list[float] = []
        for request, request_rows in zip(batch.requests, batch.rows):
            if not self.applies_to(request):
                continue
            bias = request.sampling_params.logit_bias
            for row in request_rows:
                row_index += [row] * len(bias)
                token_index += bias.keys()
                biases += bias.values()
        if not row_index:
            return None
        # to_device: this processor runs in steps launched ahead (async_scheduling), which a
        # copy from pageable memory would make wait for the device.
        return ((to_device(row_index, torch.int64, device), to_device(token_index, torch.int64, device)),
                to_device(biases, torch.float32, device))

    def apply(self, logits: torch.Tensor, state: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        index, biases = state
        logits.index_put_(index, biases, accumulate=True)


# ---- 2. penalties -----------------------------------------------------------------------------
@dataclass
class _PenaltyRow:
    row: int
    repetition: float
    presence: float
    frequency: float
    seen: torch.Tensor | None       # prompt + output token ids (repetition penalty)
    outputs: torch.Tensor | None    # output token ids (presence / frequency penalties)


class PenaltiesProcessor(LogitsProcessor):
    """Repetition penalty (transformers' semantics: over prompt and output tokens, positive
    logits divided, negative multiplied), then presence and frequency penalties (OpenAI's:
    over output tokens, subtracted)."""
    blocks_drafts = True

    def applies_to(self, request: Request) -> bool:
        p = request.sampling_params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    def prepare(self, batch: SamplingBatch, vocab_size: int, device: torch.device) -> list[_PenaltyRow] | None:
        state = []
        for request, request_rows in zip(batch.requests, batch.rows):
            if not self.applies_to(request):
                continue
            p = request.sampling_params
            seen = (torch.tensor(sorted(set(request.token_ids)), dtype=torch.int64, device=device)
                    if p.repetition_penalty != 1.0 else None)
            outputs = (torch.tensor(request.output_token_ids, dtype=torch.int64, device=device)
                       if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and request.num_output_tokens
                       else None)
            state.append(_PenaltyRow(request_rows[0], p.repetition_penalty, p.presence_penalty,
                                     p.frequency_penalty, seen, outputs))
        return state or None

    def apply(self, logits: torch.Tensor, state: list[_PenaltyRow]) -> None:
        vocab = logits.shape[-1]
        for entry in state:
            row = logits[entry.row]
            if entry.seen is not None:
                values = row[entry.seen]
                row[entry.seen] = torch.where(values > 0, values / entry.repetition, values * entry.repetition)
            if entry.outputs is not None:
                counts = torch.bincount(entry.outputs, minlength=vocab)[:vocab].to(row.dtype)
                row -= entry.frequency * counts + entry.presence * (counts > 0).to(row.dtype)


class TokenBanProcessor(LogitsProcessor):
    """A processor whose state is the (row, token) cells it sets to -inf (``banned_cells``)."""

    @staticmethod
    def banned_cells(row_index: list[int], token_index: list[int], device: torch.device,
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, tokens) index tensors of the logits to ban, or None for none."""
        if not row_index:
            return None
        return (torch.tensor(row_index, dtype=torch.int64, device=device),
                torch.tensor(token_index, dtype=torch.int64, device=device))

    def apply(self, logits: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        logits[state] = float("-inf")


# ---- 3. min_tokens: stop-id suppression ---------------------------------------------------------
class MinTokensProcessor(TokenBanProcessor):
    """Until a request has ``min_tokens`` output tokens, its EOS ids (unless ``ignore_eos``)
    and its ``stop_token_ids`` cannot be sampled. Not for a request whose constraint decides
    where it ends (a grammar): banning the EOS that a complete grammar needs would leave it
    no token at all, so the grammar wins."""
    blocks_drafts = True

    def applies_to(self, request: Request) -> bool:
        if request.constraint is not None and request.constraint.decides_end:
            return False
        return request.num_output_tokens < request.sampling_params.min_tokens

    def prepare(self, batch: SamplingBatch, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        row_index: list[int] = []
        token_index: list[int] = []
        for request, request_rows in zip(batch.requests, batch.rows):
            if not self.applies_to(request):
                continue
            p = request.sampling_params
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(request.eos_token_ids))
            banned_ids = sorted(t for t in banned if t < vocab_size)
            row_index += [request_rows[0]] * len(banned_ids)
            token_index += banned_ids
        return self.banned_cells(row_index, token_index, device)


# ---- 4. bad_words --------------------------------------------------------------------------------
class BadWordsProcessor(TokenBanProcessor):
    """vLLM's ``bad_words`` (backend/sample/bad_words.py): in each row, the last token of every
    banned sequence whose other tokens end the row's history becomes -inf. A row's history is
    the request's generated tokens followed, for draft row j, by drafts 0..j-1: the row is
    processed as it would be in a step of its own once those drafts are accepted, so a draft
    that would complete a bad word can never equal the sample at its position. n > 1 children
    are requests of their own, each with its own history."""

    def applies_to(self, request: Request) -> bool:
        return request.bad_words is not None

    def prepare(self, batch: SamplingBatch, vocab_size: int, device: torch.device,
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        row_index: list[int] = []
        token_index: list[int] = []
        for request, request_rows, drafts in zip(batch.requests, batch.rows, batch.drafts):
            bad_words = request.bad_words
            if bad_words is None:
                continue
            generated = generated_tail(request.token_ids, request.num_prompt_tokens, bad_words.context)
            for j, row in enumerate(request_rows):
                banned = bad_words.banned(generated + drafts[:j])
                row_index += [row] * len(banned)
                token_index += banned
        return self.banned_cells(row_index, token_index, device)


# ---- 5. token masks: allowed_token_ids, grammars ----------------------------------------------
@dataclass
class TokenMask:
    """The step's packed token masks: bitmask row r masks logits row r. Only the rows of
    constrained requests are filled and applied; the other rows stay unused."""
    spans: list[tuple[int, int]]   # [start, stop) runs of constrained logits rows
    bitmask: torch.Tensor          # int32 [rows of the step, ceil(vocab / 32)]

    @property
    def rows(self) -> list[int]:
        return [row for start, stop in self.spans for row in range(start, stop)]


class AllowedTokensProcessor(LogitsProcessor):
    """Rows whose request constrains its next token (``Request.constraint``: a fixed set of
    allowed ids, or a grammar) keep only the allowed tokens; every other logit becomes -inf.
    The constraint writes one packed bitmask row (xgrammar's layout: 32 tokens per int32,
    bit set = allowed) per logits row, the draft rows included, so a draft the constraint
    rejects can never equal the sample at its position and is never accepted."""

    def applies_to(self, request: Request) -> bool:
        return request.constraint is not None

    def prepare(self, batch: SamplingBatch, vocab_size: int, device: torch.device) -> TokenMask | None:
        constrained = [i for i, r in enumerate(batch.requests) if self.applies_to(r)]
        if not constrained:
            return None
        bitmask = new_bitmask(batch.num_rows, vocab_size)
        spans: list[tuple[int, int]] = []
        for i in constrained:
            rows = batch.rows[i]
            batch.requests[i].constraint.fill_bitmask(bitmask[rows.start:rows.stop], batch.drafts[i])
            if spans and spans[-1][1] == rows.start:         # adjacent requests: one run
                spans[-1] = (spans[-1][0], rows.stop)
            else:
                spans.append((rows.start, rows.stop))
        return TokenMask(spans, bitmask.to(device))

    def apply(self, logits: torch.Tensor, state: TokenMask) -> None:
        for start, stop in state.spans:
            mask_logits_(logits[start:stop], state.bitmask[start:stop])


def default_processors() -> list[LogitsProcessor]:
    """The engine's processors, in the order they run."""
    return [LogitBiasProcessor(), PenaltiesProcessor(), MinTokensProcessor(), BadWordsProcessor(),
            AllowedTokensProcessor()]


_DRAFT_BLOCKING = [p for p in default_processors() if p.blocks_drafts]


def blocks_drafts(request: Request) -> bool:
    """A processor whose effect depends on the tokens before a row applies to this request's
    next row: it takes no speculative drafts this step."""
    return any(p.applies_to(request) for p in _DRAFT_BLOCKING)
